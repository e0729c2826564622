"""The analysis questions, the registry and the first half of the book's: predict a number,
then measure it (:mod:`nanovllm.course.analysis` asks, measures and grades them, and loads the
second half, :mod:`nanovllm.course.analysis_questions_late`).

Each ``measure`` computes its quantity with the package's own code, so in a student edition it
runs the student's regions (a wrong region usually measures a different number; a stub raises
``NotImplementedError("assignment CC.name")``). Every measure is deterministic, CPU-only, needs
no weights and runs in seconds. Imports stay inside the measures: asking a chapter's questions
loads nothing but this file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace


@dataclass(frozen=True)
class Question:
    id: str  # "CC.qN"
    text: str  # what to predict; never the answer
    unit: str
    tolerance: float  # |student's measured - grader's| allowed (rounding when recording)
    measure: Callable[[], float]

    @property
    def chapter(self) -> str:
        return self.id[:2]


QUESTIONS: dict[str, Question] = {}


def question(qid: str, text: str, unit: str, tolerance: float = 0.0):
    def register(measure: Callable[[], float]) -> Callable[[], float]:
        QUESTIONS[qid] = Question(qid, " ".join(text.split()), unit, tolerance, measure)
        return measure

    return register


def _gen(seed: int = 0):
    import torch

    return torch.Generator().manual_seed(seed)


# -- 01: the model and sampling ---------------------------------------------------------------
@question("01.q1", """A row of 1000 logits drawn from N(0, 2^2) (torch seed 0) is filtered with
top_p = 0.9 (top-k and min-p off). How many tokens keep a finite logit?""", "tokens")
def _top_p_survivors() -> float:
    import torch

    from nanovllm.layers.sampler import filter_logits

    logits = torch.randn(1, 1000, generator=_gen()) * 2
    kept = filter_logits(logits, torch.tensor([1000]), torch.tensor([0.9]), torch.tensor([0.0]))
    return int(torch.isfinite(kept).sum())


@question("01.q2", """2000 rows of the logits [2, 1, 0, -1] are sampled at temperature 1 in one
batch by Sampler(seed=0). How many rows pick token 0?""", "rows")
def _sampled_zeros() -> float:
    import torch

    from nanovllm.layers.sampler import Sampler, SamplingTensors

    rows = 2000
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(rows, 1)
    params = SamplingTensors(torch.ones(rows), None, None, None, [None] * rows, False, False)
    return int((Sampler(seed=0)(logits, params) == 0).sum())


@question("01.q3", """Rotate a query (seed 0, head_dim 64, theta 10000) to position 105 and a
key (seed 1) to position 100, then the same pair to positions 5 and 0. By how much do the two
dot products differ (absolute value)?""", "dot-product units", 1e-3)
def _rope_relative() -> float:
    import torch

    from nanovllm.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(64, 256, 10000.0)
    q, k = torch.randn(1, 1, 64, generator=_gen(0)), torch.randn(1, 1, 64, generator=_gen(1))
    dots = []
    for pq, pk in ((105, 100), (5, 0)):
        rq, _ = rope(torch.tensor([pq]), q, q)
        _, rk = rope(torch.tensor([pk]), k, k)
        dots.append(float((rq * rk).sum()))
    return abs(dots[0] - dots[1])


# -- 02: attention ----------------------------------------------------------------------------
def _visible_pairs(num_queries: int, num_keys: int) -> int:
    """(query, key) pairs attention lets through: with q = k = 0 every visible key gets the
    same weight and the values are one-hot rows, so each output is nonzero where it looked."""
    import torch

    from nanovllm.layers.torch_attention import causal_attention

    v = torch.eye(num_keys)[:, None, :]
    q = torch.zeros(num_queries, 1, num_keys)
    out = causal_attention(q, torch.zeros(num_keys, 1, num_keys), v, 1.0)
    return int((out.abs() > 1e-9).sum())


@question("02.q1", """Causal attention over a 64-token prompt: how many (query, key) pairs may
attend (are not masked)?""", "pairs")
def _prompt_pairs() -> float:
    return _visible_pairs(64, 64)


@question("02.q2", """A 16-token chunk whose 48 earlier tokens are already cached (16 queries over
64 keys): how many (query, key) pairs may attend?""", "pairs")
def _chunk_pairs() -> float:
    return _visible_pairs(16, 64)


# -- 03: the KV cache -------------------------------------------------------------------------
@question("03.q1", """How many bytes of KV cache does one token of SmolLM2-135M take in bf16
(all layers, keys and values)?""", "bytes")
def _kv_bytes_per_token() -> float:
    from pathlib import Path

    from nanovllm.models import ModelConfig

    config = Path(__file__).resolve().parents[1] / "configs" / "smollm2-135m"
    return ModelConfig.from_pretrained(config).kv_bytes_per_token(2)


@question("03.q2", """A 10-token prompt is stored with store_kv into a cache of block size 4, its
block table [5, 2, 7]. Which cache slot (block * 4 + offset) holds the key of token 9?""",
          "slot")
def _slot_of_token() -> float:
    import torch

    from nanovllm.layers.torch_attention import store_kv

    table, bs = [5, 2, 7], 4
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(10)])
    key = torch.arange(10.0)[:, None, None] + 1  # token p's key is p + 1
    k_cache, v_cache = torch.zeros(8, bs, 1, 1), torch.zeros(8, bs, 1, 1)
    store_kv(key, key.clone(), k_cache, v_cache, slots)
    return int((k_cache.flatten() == 10).nonzero()[0])


# -- 04: the block manager --------------------------------------------------------------------
def _shared_prompt_blocks(prefix_caching: bool, keep: bool = False):
    """Three 50-token prompts sharing 40 tokens, allocated at block size 16: the blocks held
    (``keep``: the block manager and the sequences instead)."""
    from nanovllm.engine.block_manager import BlockManager
    from nanovllm.engine.sequence import Sequence
    from nanovllm.sampling_params import SamplingParams

    bm = BlockManager(64, 16, prefix_caching)
    system, seqs = list(range(1000, 1040)), []
    for i in range(3):  # admitted one after another, as the scheduler would
        seq = Sequence(system + list(range(2000 + 10 * i, 2010 + 10 * i)), SamplingParams())
        cached = bm.cached_prefix(seq)
        assert bm.allocate(seq, seq.num_tokens - 16 * len(cached), cached)
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq, seq.num_computed_tokens)
        seqs.append(seq)
    return (bm, seqs) if keep else bm.num_blocks - bm.num_free_blocks


@question("04.q1", """Three requests share a 40-token system prompt and add 10 tokens of their own
(50 tokens each). At block size 16 with prefix caching on, how many KV blocks do they hold
together once all three prompts are allocated?""", "blocks")
def _blocks_cached() -> float:
    return _shared_prompt_blocks(True)


@question("04.q2", """The same three requests with prefix caching off: how many blocks?""",
          "blocks")
def _blocks_uncached() -> float:
    return _shared_prompt_blocks(False)


@question("04.q3", """One step packs a 5-token prefill chunk (block table [3]) and then, in batch
order, a decode at position 21 (block table [7, 9]), block size 16. What is the first entry of
the step's slot_mapping?""", "slot")
def _first_slot() -> float:
    from nanovllm.engine.sequence import Sequence
    from nanovllm.engine.step import pack_step
    from nanovllm.sampling_params import SamplingParams

    prefill = Sequence(list(range(5)), SamplingParams())
    prefill.block_table = [3]
    decode = Sequence(list(range(22)), SamplingParams())
    decode.block_table, decode.num_computed_tokens = [7, 9], 21
    return pack_step([prefill, decode], [5, 1], 16, {})["slot_mapping"][0]


# -- 05: the paged attention kernel -----------------------------------------------------------
@question("05.q1", """The split-KV heuristic (choose_num_splits) on an H200 (132 SMs): into how
many splits does it cut each sequence for a batch of 8 sequences, 4 KV heads, 512 keys?""",
          "splits")
def _num_splits() -> float:
    from nanovllm.kernels.split_kv import choose_num_splits

    return choose_num_splits(8, 4, 512, 132)


@question("05.q2", """The Triton decode kernel, 3 splits, on one sequence of 100 keys scattered
over blocks [6, 0, 4, 2, 5, 1, 3] of 16 slots, with q = k = 0 and value j = j (every channel):
what is the output's first channel?""", "value units", 1e-3)
def _uniform_decode() -> float:
    import torch

    from nanovllm.kernels.decode_attention import decode_attention

    table, bs, n = [6, 0, 4, 2, 5, 1, 3], 16, 100
    k_cache = torch.zeros(len(table), bs, 1, 16)
    v_cache = torch.zeros_like(k_cache)
    for p in range(n):
        v_cache[table[p // bs], p % bs] = p
    out = decode_attention(torch.zeros(1, 1, 16), k_cache, v_cache, torch.tensor([n],
                           dtype=torch.int32), torch.tensor([table], dtype=torch.int32), 0.25, 3)
    return float(out[0, 0, 0])


# -- 06: the scheduler ------------------------------------------------------------------------
def _simulate(prompts, max_tokens, budget=256, blocks=64, policy="fcfs", users=None,
              max_num_seqs=8, async_scheduling=False, eos=(), after_step=None):
    """Run the stand-alone scheduler over a stand-in model that always samples token 2 (EOS
    when ``eos`` holds it), as ``LLMEngine.step`` drives it (with async scheduling a step's
    tokens land one step later); ``after_step(sched)`` is called after each update. Returns
    (the scheduler, each step's batch)."""
    from nanovllm.engine.block_manager import BlockManager
    from nanovllm.engine.scheduler import Scheduler
    from nanovllm.engine.scheduler_output import ModelRunnerOutput
    from nanovllm.engine.sequence import Sequence
    from nanovllm.engine.stop_checker import StopChecker
    from nanovllm.sampling_params import SamplingParams

    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             enable_chunked_prefill=True, scheduler_policy=policy)
    sched = Scheduler(config, BlockManager(blocks, 4, False), StopChecker(None, set(eos), None))
    for i, n in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, user=users[i] if users else None)
        seq = Sequence(list(range(100 * i + 10, 100 * i + 10 + n)), params)
        seq.metrics.arrival_time = float(i)
        sched.add(seq)
    steps, in_flight = [], None
    while sched.has_unfinished() and len(steps) < 1000:
        batch = sched.schedule(now=100.0 + len(steps))
        launched = ModelRunnerOutput.constant(batch, 2) if batch.seqs else None
        landed = in_flight if async_scheduling else launched
        in_flight = launched
        sched.update_from_output(batch, landed)
        steps.append(batch)
        if after_step is not None:
            after_step(sched)
    return sched, steps


@question("06.q1", """Chunked prefill, max_num_batched_tokens = 64: prompts of 100, 30 and 10
tokens arrive together (max_tokens 4 each). How many tokens does step 3 schedule?""", "tokens")
def _step_three() -> float:
    return _simulate([100, 30, 10], 4, budget=64)[1][2].num_tokens


@question("06.q2", """Four requests with 16-token prompts generate 32 tokens each on a KV cache of
16 blocks of 4 tokens (budget 256, recompute preemption). How many preemptions happen?""",
          "preemptions")
def _preemptions() -> float:
    return _simulate([16] * 4, 32, blocks=16)[0].num_preemptions


@question("06.q3", """Fair policy, max_num_seqs 2: user A sends four requests, then user B one
(8-token prompts, max_tokens 4). In which step (counting from 1) is B's request first
scheduled?""", "step")
def _fair_turn() -> float:
    _, steps = _simulate([8] * 5, 4, policy="fair", users=["A"] * 4 + ["B"], max_num_seqs=2)
    return next(i + 1 for i, b in enumerate(steps) if any(s.user == "B" for s in b.seqs))
