"""Scheduling never changes what is generated: chunked prefill, preemption and every policy
give the same greedy tokens as an unconstrained run; and the engine's metrics add up.

Uses a tiny random Llama (2 layers, hidden 64) whose greedy outputs differ from prompt to
prompt, so that a token landing in the wrong sequence or position would show.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from course_ids import ENGINE

from nanovllm import LLM, SamplingParams
from nanovllm.engine.metrics import TimelineRecorder, latency_summary
from nanovllm.engine.policies import MixedPolicy, PriorityPolicy

VOCAB = 49152  # SmolLM2's, so its tokenizer can be copied in when text is wanted


def make_tiny_llama(path: Path, tokenizer_dir: Path | None = None, seed: int = 0) -> Path:
    """Write a tiny Llama folder with random weights scaled for diverse greedy outputs
    (``load_format="dummy"``'s small weights make every prompt produce the same token)."""
    from safetensors.torch import save_file

    hidden, inter, heads, kv_heads, layers = 64, 128, 4, 2, 2
    head_dim = hidden // heads
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape, std=0.15: torch.randn(*shape, generator=gen) * std  # noqa: E731
    weights = {
        "model.embed_tokens.weight": rand(VOCAB, hidden, std=1.0),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(VOCAB, hidden, std=0.5),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json") if tokenizer_dir else ():
        shutil.copy(Path(tokenizer_dir) / name, path / name)
    return path


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny matmuls run ~10x faster without OpenMP threads fighting over 2 shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


rng = random.Random(0)
PROMPTS = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 2, 5, 16, 17, 33, 47, 64)]


PRIORITIES = [i % 3 for i in range(len(PROMPTS))]  # for scheduler_policy="priority"


def _params(max_tokens: int) -> list[SamplingParams]:
    users, classes = ["alice", "bob", "bob", "bob"], ["interactive", "batch"]
    return [
        SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            ignore_eos=True,
            user=users[i % 4],
            request_class=classes[i % 2],
        )
        for i in range(len(PROMPTS))
    ]


def make_llm(path, **options) -> LLM:
    llm = LLM(path, **options)
    # Work-around: the KV cache is allocated with torch.empty and the torch backend's
    # batched decode reads the unwritten padding slots (masked, but 0 * NaN = NaN), so
    # stale NaNs in reused memory turn outputs into token 0. Zeroing makes tests exact.
    llm.engine.runner.kv_cache.zero_()
    return llm


def _generate(path, max_tokens=12, **options):
    llm = make_llm(path, num_kv_blocks=options.pop("num_kv_blocks", 256), **options)
    outs = llm.generate(PROMPTS, _params(max_tokens), use_tqdm=False, priority=PRIORITIES)
    return llm, [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny):
    return {n: _generate(tiny, n, enable_chunked_prefill=False)[1] for n in (12, 24)}


@pytest.mark.assignment(*ENGINE)
@pytest.mark.parametrize("budget", [1, 3, 16, 61])
def test_chunked_prefill_equals_unchunked(tiny, reference, budget):
    llm, ours = _generate(tiny, max_num_batched_tokens=budget)
    assert ours == reference[12]
    assert max(s.num_prefill_tokens + s.num_decode_tokens for s in llm.engine.stats.steps) <= budget


def test_unchunked_prefill_rejects_requests_larger_than_a_step(tiny):
    llm = make_llm(tiny, num_kv_blocks=64, enable_chunked_prefill=False, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        llm.generate(PROMPTS[-1], SamplingParams(max_tokens=4), use_tqdm=False)


def shortest_prompt_first(seqs, now):
    return sorted(seqs, key=lambda s: (s.num_prompt_tokens, s.seq_id))


POLICIES = {
    "fcfs": lambda: "fcfs",
    "priority": PriorityPolicy,
    "fair": lambda: "fair",
    "mixed": lambda: MixedPolicy({"interactive": 0.5, "batch": 0.5}),
    "custom": lambda: shortest_prompt_first,
}


@pytest.mark.assignment(*ENGINE, "06.preempt")
@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize(
    "policy",
    [  # only the "fair" runs call FairPolicy.order
        pytest.param(p, marks=pytest.mark.assignment("06.fair_order")) if p == "fair" else p
        for p in POLICIES
    ],
)
def test_preempted_equals_unpreempted(tiny, reference, policy, prefix_caching):
    # 12 blocks of 16 tokens hold one request of up to 88 tokens, not eight at once.
    llm, ours = _generate(
        tiny,
        24,
        num_kv_blocks=12,
        max_num_batched_tokens=40,
        scheduler_policy=POLICIES[policy](),
        enable_prefix_caching=prefix_caching,
    )
    assert llm.engine.scheduler.num_preemptions > 0
    assert ours == reference[24]


def test_request_and_step_metrics_add_up(tiny):
    llm = make_llm(tiny, num_kv_blocks=256, max_num_batched_tokens=32, enable_prefix_caching=False)
    assert llm.engine.timeline is None  # off unless asked for
    llm.engine.timeline = TimelineRecorder()
    outs = llm.generate(PROMPTS, _params(12), use_tqdm=False, priority=PRIORITIES)
    for out in outs:
        m = out.metrics
        assert m.num_output_tokens == len(out.token_ids) == 12 and m.num_preemptions == 0
        assert 0 <= m.queue_time <= m.time_to_first_token <= m.e2e_latency
        assert m.time_per_output_token > 0
    steps = llm.engine.stats.to_records()
    assert sum(s["num_prefill_tokens"] for s in steps) == sum(map(len, PROMPTS))
    assert sum(s["num_decode_tokens"] for s in steps) == 11 * len(PROMPTS)  # 1st: prefill
    assert all(s["wall_time"] > 0 and 0 <= s["kv_usage"] <= 1 for s in steps)
    records = llm.engine.timeline.to_records()
    assert set(records[0]) == {"step", "request_id", "kind", "num_tokens", "start", "end"}
    for prompt, out in zip(PROMPTS, outs):
        mine = [r for r in records if r["request_id"] == out.request_id]
        assert sum(r["num_tokens"] for r in mine if r["kind"] == "prefill") == len(prompt)
        assert sum(r["kind"] == "decode" for r in mine) == 11
        assert [r["step"] for r in mine] == sorted(r["step"] for r in mine)
    summary = latency_summary(o.metrics for o in outs)
    assert summary["time_to_first_token"]["count"] == len(PROMPTS)
    assert summary["e2e_latency"]["p50"] <= summary["e2e_latency"]["p99"]


@pytest.mark.assignment(*ENGINE, "06.preempt")
def test_preemption_and_prefix_cache_metrics(tiny):
    llm = make_llm(tiny, num_kv_blocks=12, max_num_batched_tokens=40)
    outs = llm.generate(
        PROMPTS + [PROMPTS[-1]], _params(24) + _params(24)[:1], use_tqdm=False,
        priority=PRIORITIES + PRIORITIES[-1:],
    )
    stats = llm.engine.stats
    assert sum(o.metrics.num_preemptions for o in outs) == llm.engine.scheduler.num_preemptions
    assert stats.steps[-1].num_preemptions == llm.engine.scheduler.num_preemptions > 0
    assert outs[-1].metrics.num_cached_prompt_tokens > 0  # the repeated 64-token prompt
    assert stats.steps[-1].prefix_hit_rate > 0


def test_priority_reaches_the_engine(tiny):
    llm = make_llm(tiny, num_kv_blocks=64, scheduler_policy="priority", max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=2)
    outs = llm.generate(PROMPTS[:3], params, use_tqdm=False, priority=[2, 0, 1])
    order = sorted(range(3), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert order == [1, 2, 0]
