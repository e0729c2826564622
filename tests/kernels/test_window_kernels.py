"""The Triton prefill and decode kernels with a sliding window (chapter 12) against the torch
backend's windowed attention (nanovllm/layers/torch_attention.py), under the Triton
interpreter on CPU (or on a GPU where there is one).

Windows of 1 (each query sees itself only), shorter than a key tile, across tiles and
blocks, and longer than every sequence (the same as no window). Unused cache slots are NaN,
so a key read outside its sequence shows up. Also: the engine's triton backend with a window
(tiny Mistral) against its torch backend, and YaRN's attention factor reaching the fused
RoPE kernel. The in-process/fresh-process dance is the one of test_prefill_kernel.py.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
from test_models_new import MISTRAL_ENGINE, _tiny_hf_model  # noqa: E402
from test_prefill_kernel import DEVICE, IN_PROCESS, in_process, make_case  # noqa: E402

from nanovllm.kernels.decode_attention import decode_attention  # noqa: E402
from nanovllm.kernels.prefill_attention import prefill_attention  # noqa: E402

# (q_len, kv_len): a whole prompt, a chunk after a prefix, decode rows, a long prefix
SEQS = [(37, 37), (23, 71), (1, 50), (5, 90), (40, 56)]
WINDOWS = [1, 7, 33, 200]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


def _reference(case, window):
    """float64 attention with the causal and the window mask, written out (the torch
    backend's ``windowed_attention`` is a graded assignment, so it is not the yardstick)."""
    cu, lens = case["cu_seqlens_q"].tolist(), case["seq_lens_k"].tolist()
    q_all, tables = case["q"], case["block_tables"]
    block_size, group = case["k_cache"].shape[1], q_all.shape[1] // case["k_cache"].shape[2]
    out = []
    for b in range(len(lens)):
        pos = torch.arange(lens[b], device=q_all.device)
        blocks, rows = tables[b, pos // block_size].long(), pos % block_size
        k = case["k_cache"][blocks, rows].double().repeat_interleave(group, dim=1)
        v = case["v_cache"][blocks, rows].double().repeat_interleave(group, dim=1)
        q = q_all[cu[b]:cu[b + 1]].double()
        q_pos = lens[b] - len(q) + torch.arange(len(q), device=q.device)
        visible = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
        scores = torch.einsum("qhd,khd->hqk", q, k) * case["scale"]
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v))
    return torch.cat(out)


def _check(out, ref, dtype):
    assert torch.isfinite(out).all(), "a masked or padded key leaked in"
    err = ((out.double() - ref.to(out.device)).norm() / ref.norm()).item()
    assert err < TOLERANCE[dtype], err


@in_process
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_prefill_kernel_window(window, dtype):
    case = make_case(SEQS, 4, 2, 32, 16, dtype)
    out = prefill_attention(**case, window=window)
    _check(out, _reference(case, window), dtype)


@in_process
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_window(window, num_splits):
    seqs = [(1, n) for n in (1, 17, 50, 90)]
    case = make_case(seqs, 4, 2, 32, 16, torch.float32)
    out = decode_attention(case["q"], case["k_cache"], case["v_cache"], case["seq_lens_k"],
                           case["block_tables"], case["scale"], num_splits, window=window)
    _check(out, _reference(case, window), torch.float32)


@in_process
def test_window_off_is_the_plain_kernel_and_bad_windows_are_refused():
    case = make_case(SEQS, 4, 2, 32, 16, torch.float32)
    assert torch.equal(prefill_attention(**case), prefill_attention(**case, window=None))
    with pytest.raises(ValueError, match="window"):
        prefill_attention(**case, window=0)
    with pytest.raises(ValueError, match="window"):
        decode_attention(case["q"][:1], case["k_cache"], case["v_cache"],
                         case["seq_lens_k"][:1], case["block_tables"][:1], 1.0, window=0)


@pytest.mark.skipif(IN_PROCESS, reason="the cases run in this process")
def test_cases_in_fresh_process():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


@in_process
@pytest.mark.assignment(*MISTRAL_ENGINE, "05.decode_kernel")  # one split: no merge kernel
def test_engine_triton_backend_with_a_window_matches_torch(tmp_path):
    """Mistral's window through the attention layer and the triton backend (mixed steps)."""
    from nanovllm import LLM, SamplingParams

    _tiny_hf_model("MistralForCausalLM", tmp_path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 30, 47)]
    params = SamplingParams(temperature=0, max_tokens=6)
    outs = {}
    for backend in ("torch", "triton"):
        # float32: bf16 rounding differs between the backends; num_kv_blocks: two engines
        llm = LLM(tmp_path, block_size=16, max_num_batched_tokens=32, num_kv_blocks=64,
                  dtype="float32", attention_backend=backend, enforce_eager=True)
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["triton"] == outs["torch"]


@in_process
def test_fused_rope_kernel_applies_yarn_attention_factor():
    """The Triton RoPE kernel reads the tables, so YaRN's factor reaches it (chapter 12)."""
    from nanovllm.kernels.rope import qk_norm_rope_
    from nanovllm.layers.rotary import RotaryEmbedding

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    rope = RotaryEmbedding(32, 256, 1e4, scaling).to(DEVICE)
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, tokens = 4, 2, 9
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * 32, generator=gen).to(DEVICE)
    positions = torch.randint(0, 256, (tokens,), generator=gen).to(DEVICE)
    q, k, _ = qkv.split([heads * 32, kv_heads * 32, kv_heads * 32], dim=-1)
    q_ref, k_ref = rope(positions, q.reshape(tokens, heads, 32), k.reshape(tokens, kv_heads, 32))
    qk_norm_rope_(qkv, positions, rope.cos, rope.sin, heads, kv_heads, 32)
    torch.testing.assert_close(qkv[:, : heads * 32].reshape(tokens, heads, 32), q_ref)
    torch.testing.assert_close(
        qkv[:, heads * 32 : (heads + kv_heads) * 32].reshape(tokens, kv_heads, 32), k_ref)
