# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Chapter 08: worked solutions of the exercises (instructor only)
#
# One cell per exercise of `chapters/08_quantization.py`: the chapter's cell with its solution between
# `# BEGIN SOLUTION` and `# END SOLUTION` (the chapter has the stub there). Never shipped:
# editions and the book leave `chapters/solutions/` out; `tests/test_exercises.py` runs each
# cell against the chapter's check cell.

# %% tags=["solution"]
import torch


def quantize_groups(w: torch.Tensor, group: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization with one scale per `group` weights of a row: (codes, scales)."""
    # BEGIN SOLUTION
    qmax = 2 ** (bits - 1) - 1
    rows, cols = w.shape
    blocks = w.double().reshape(rows, cols // group, group)
    scales = blocks.abs().amax(dim=-1) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / safe[..., None]).clamp(-qmax, qmax)
    return codes.reshape(rows, cols), scales
    # END SOLUTION

# %% tags=["solution"]
import torch


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Nearest float8 e4m3 (fn) value of each element, as float64; saturates at +-448."""
    # BEGIN SOLUTION
    x = x.double().clamp(-448.0, 448.0)
    _, exponent = torch.frexp(x.abs())  # |x| = mantissa * 2**exponent, mantissa in [0.5, 1)
    e = (exponent - 1).clamp(min=-6)  # |x| in [2**e, 2**(e+1)); subnormals share e = -6
    step = torch.pow(2.0, (e - 3).double())
    return torch.round(x / step) * step  # torch.round: half to even
    # END SOLUTION

# %% tags=["solution"]
import torch


def int8_w8a8(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ w.T [in, out] with per-token int8 x, per-channel int8 w, int32 accumulation."""
    # BEGIN SOLUTION
    def quantize(a):
        scale = a.double().abs().amax(dim=1) / 127
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        return torch.round(a.double() / safe[:, None]).clamp(-127, 127).to(torch.int32), scale

    xq, sx = quantize(x)
    wq, sw = quantize(w)
    acc = (xq[:, None, :] * wq[None, :, :]).sum(dim=-1)  # int32 products and sum
    return acc.double() * sx[:, None] * sw[None, :]
    # END SOLUTION
