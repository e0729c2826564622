"""W8A16 matmul: int8 weights, dequantized in registers (a Triton kernel; chapter 08 §4).

``y = x @ (w * scale[:, None]).T (+ bias)`` for ``x`` ``[M, K]`` (fp32, fp16 or bf16), int8
codes ``w`` ``[N, K]`` and float32 per-output-channel scales ``[N]``. The codes reach the
multiply as int8 and are widened to ``x``'s dtype in registers (exact: |code| <= 127); ``tl.dot``
accumulates in fp32 and the scale, constant along K, multiplies the accumulator once at the end.
``pick_config``: decode (M <= 16) is bandwidth bound, so narrow N tiles and split-K, whose fp32
partials are summed afterwards (a deterministic ``sum``, not atomics: a rerun gives the same
bits); prefill takes big tiles in a grouped launch order (``GROUP_M`` row tiles share weight
tiles while they sit in L2). The tiles are a first guess, not tuned on the H200 yet
(``python -m nanovllm.benchmarks.quantization --sweep-int8``). Under the Triton interpreter bf16
inputs are widened to fp32 before the dot, as the interpreter's bf16 math is wrong.
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import torch
import triton  # nanovllm/kernels/__init__.py explains a missing triton
import triton.language as tl

from nanovllm.kernels import check_launchable, interpreted_bf16, round_to

__all__ = ["Int8GemmConfig", "int8_gemm", "pick_config"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Int8GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _int8_gemm_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,  # K range of one split, a multiple of BLOCK_K
    stride_xm,
    stride_wn,
    stride_os,  # out: [SPLIT_K, M, N] (split-K workspace) or [M, N]
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (a GPU would use tf32 otherwise)
    DOT_IN_FP32: tl.constexpr,  # bf16 inputs under the interpreter, whose bf16 math is wrong
    INTERPRETED_BF16: tl.constexpr,  # rounds a bf16 store by hand (kernels/__init__.py)
):
    pid, split = tl.program_id(0), tl.program_id(1)
    # Grouped order: consecutive programs take GROUP_M row tiles of the same weight columns.
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k_start + rk)[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + (k_start + rk)[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        in_k = k + rk < k_end
        x = tl.load(x_ptrs, mask=(rm[:, None] < M) & in_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=in_k[:, None] & (rn[None, :] < N), other=0)
        if DOT_IN_FP32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)  # the dequantization
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    in_n = rn < N
    acc *= tl.load(scale_ptr + rn, mask=in_n, other=0.0)[None, :]
    if HAS_BIAS:  # added by the first split only: the splits are summed later
        # (split + rn * 0: a vector; a scalar bool in a mask trips the interpreter)
        bias = tl.load(bias_ptr + rn, mask=in_n & (split + rn * 0 == 0), other=0.0)
        acc += bias.to(tl.float32)[None, :]
    out = out_ptr + split * stride_os + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    mask = (rm[:, None] < M) & in_n[None, :]
    tl.store(out, round_to(acc, out_ptr.dtype.element_ty, INTERPRETED_BF16), mask=mask)


@cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small number exercises the same rule
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_config(m: int, n: int, k: int, num_sms: int) -> Int8GemmConfig:
    """Tile sizes for an ``[m, k] x [k, n]`` problem on a device with ``num_sms`` SMs."""
    if m <= 16:  # decode: bandwidth bound; aim for about two programs per SM
        cfg = Int8GemmConfig(16, 32, 128, num_warps=4, num_stages=4)
        tiles = triton.cdiv(n, cfg.block_n)
        k_steps = triton.cdiv(k, cfg.block_k)
        split = 1
        while tiles * split < 2 * num_sms and split * 2 <= min(k_steps, 8):
            split *= 2
        return cfg._replace(split_k=split)
    if m <= 64:
        return Int8GemmConfig(64, 64, 64, num_warps=4, num_stages=4)
    return Int8GemmConfig(128, 128, 64, num_warps=8, num_stages=3)


def int8_gemm(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
    config: Int8GemmConfig | None = None,
) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T + bias`` in ``x``'s dtype.

    ``x``: ``[M, K]`` fp32/fp16/bf16, last dimension contiguous (any row stride);
    ``weight``: int8 ``[N, K]``, last dimension contiguous; ``scale``: float32 ``[N]``;
    ``bias``: ``[N]`` or None. ``config`` overrides ``pick_config`` (tests, tuning).
    """
    m, k = x.shape
    n = weight.shape[0]
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be one of {DTYPES}, got {x.dtype}")
    if weight.dtype != torch.int8 or weight.shape != (n, k):
        raise ValueError(f"weight must be int8 [N, {k}], got {weight.dtype} {tuple(weight.shape)}")
    if scale.shape != (n,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"scale (and bias) must be [{n}]")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x's and weight's last dimensions must be contiguous")
    check_launchable(x, _int8_gemm_kernel)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or pick_config(m, n, k, _num_sms(x.device))
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
    split_k = triton.cdiv(k, k_per_split)  # (a short K may need fewer slices)
    target = out if split_k == 1 else torch.empty((split_k, m, n), device=x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split_k)
    _int8_gemm_kernel[grid](
        x, weight, scale.float().contiguous(),
        bias if bias is not None else scale,  # (not read without HAS_BIAS)
        target, m, n, k, k_per_split, x.stride(0), weight.stride(0),
        target.stride(0) if split_k > 1 else 0, target.stride(-2),
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=interpreted_bf16(x), INTERPRETED_BF16=interpreted_bf16(target),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split_k > 1:
        out.copy_(target.sum(dim=0))  # fixed order: the same bits on every run
    return out
