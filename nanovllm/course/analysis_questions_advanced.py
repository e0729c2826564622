"""The analysis questions of the advanced chapters, from speculative decoding to deployment
(the registry and the first half: :mod:`nanovllm.course.analysis_questions`; the second half:
:mod:`nanovllm.course.analysis_questions_late`)."""

from __future__ import annotations

from types import SimpleNamespace

from nanovllm.course import analysis_questions_late  # noqa: F401  (07-13 first: chapter order)
from nanovllm.course.analysis_questions import _gen, question


# -- 14: speculative decoding -----------------------------------------------------------------
@question("14.q1", """Prompt lookup (ngram_propose, k = 4, min_n = 1, max_n = 3) over the tokens
[7, 8, 9, 5, 6, 9, 7, 8, 9]: which token does it propose first?""", "token id")
def _first_proposal() -> float:
    from nanovllm.engine.spec_decode.ngram_proposer import ngram_propose

    return ngram_propose([7, 8, 9, 5, 6, 9, 7, 8, 9], 4, 1, 3)[0]


@question("14.q2", """A target distribution p = [0.6, 0.25, 0.1, 0.05] and a draft distribution
q = [0.2, 0.2, 0.3, 0.3] over four tokens: what fraction of the proposals drawn from q does
rejection sampling accept, in expectation (one proposal per step)?""", "fraction", 1e-3)
def _acceptance() -> float:
    import torch

    from nanovllm.engine.spec_decode.rejection_sampler import rejection_sample

    p, q = torch.tensor([0.6, 0.25, 0.1, 0.05]), torch.tensor([0.2, 0.2, 0.3, 0.3])
    grid = 1000  # every proposal d against uniforms (i + 1/2) / grid, weighted by q(d)
    drafts = torch.arange(4).repeat_interleave(grid)[:, None]
    uniforms = ((torch.arange(grid) + 0.5) / grid).repeat(4)[:, None]
    rows = len(drafts)
    accepted, _ = rejection_sample(p.expand(rows, 2, 4), drafts, torch.ones(rows,
                                   dtype=torch.long), q.expand(rows, 1, 4), uniforms)
    return float((accepted.view(4, grid).float().mean(dim=1) * q).sum())


@question("14.q3", """Prompt lookup (k = 4, min_n = 2, max_n = 3) in a step where three requests
decode, each having sampled token 2 after its prompt: A's prompt is [5, 2, 5, 2, 5] and B's
[10, 11, 12, 13] (max_tokens 16 each), C's [7, 2, 7] (max_tokens 3). How many tokens does
the verify step score in all?""", "tokens")
def _verify_tokens() -> float:
    from nanovllm.engine.block_manager import BlockManager
    from nanovllm.engine.scheduler import Scheduler
    from nanovllm.engine.scheduler_output import ModelRunnerOutput
    from nanovllm.engine.sequence import Sequence
    from nanovllm.engine.spec_decode.ngram_proposer import NgramProposer
    from nanovllm.engine.spec_decode.scheduling import attach_drafts, reserve_draft_slots
    from nanovllm.engine.stop_checker import StopChecker
    from nanovllm.sampling_params import SamplingParams

    config = SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=256,
                             enable_chunked_prefill=True, scheduler_policy="fcfs")
    sched = Scheduler(config, BlockManager(64, 4, False), StopChecker(None, set(), None))
    for prompt, max_tokens in (([5, 2, 5, 2, 5], 16), ([10, 11, 12, 13], 16), ([7, 2, 7], 3)):
        sched.add(Sequence(prompt, SamplingParams(max_tokens=max_tokens)))
    prefill = sched.schedule(now=0.0)
    sched.update_from_output(prefill, ModelRunnerOutput.constant(prefill, 2))
    step = sched.schedule(now=1.0)  # the three decodes
    budgets = reserve_draft_slots(sched, step, 4)
    attach_drafts(step, NgramProposer(4, 2, 3).propose(step.seqs, budgets))
    return step.num_tokens


# -- 15: structured output --------------------------------------------------------------------
@question("15.q1", """The number automaton number_dfa, -?[0-9]+(\\.[0-9]+)?, over a vocabulary
of EOS (id 0), the 12 single characters of "0123456789-." and all 144 two-character strings of them:
how many token ids does dfa_mask allow in state 2 (inside the integer part), EOS included?""",
          "tokens")
def _state_two_tokens() -> float:
    from nanovllm.structured_output.toy_dfa import dfa_mask, number_dfa

    chars = "0123456789-."
    vocab = ["<eos>", *chars, *(a + b for a in chars for b in chars)]
    return len(dfa_mask(number_dfa(), 2, vocab, eos_id=0))


@question("15.q2", """apply_token_bitmask on one row of 100 zero logits, its packed words
[-1, 255, -2^31, -1] (int32): how many of the 100 logits stay finite?""", "logits")
def _finite_logits() -> float:
    import torch

    from nanovllm.structured_output.masks import apply_token_bitmask

    words = torch.tensor([[-1, 255, -(2**31), -1]], dtype=torch.int32)
    out = apply_token_bitmask(torch.zeros(1, 100), words, torch.tensor([0]))
    return int(torch.isfinite(out).sum())


# -- 16: mixture of experts -------------------------------------------------------------------
@question("16.q1", """One token's router scores over eight experts are [1, 1, 1, 1, 0, 0, 0, 0];
route picks its top 2 without renormalization. What do its two weights sum to?""", "weight",
          1e-3)
def _kept_share() -> float:
    import torch

    from nanovllm.layers.router import route

    weights, _ = route(torch.tensor([[1.0] * 4 + [0.0] * 4]), 2, False)
    return float(weights.sum())


@question("16.q2", """Twelve tokens over six experts, k = 2: token t (0 to 11) picks expert t % 3
first and expert 3 + t % 2 second. With block size 8, how many padding (sentinel) entries
does the used part of moe_align_block_size's sorted_ids hold?""", "entries")
def _padding_entries() -> float:
    import torch

    from nanovllm.kernels.moe_align import moe_align_block_size

    ids = torch.tensor([[t % 3, 3 + t % 2] for t in range(12)])
    sorted_ids, _, used = moe_align_block_size(ids, 6, 8)
    return int((sorted_ids[: int(used)] == ids.numel()).sum())


@question("16.q3", """One MoE layer of Qwen3-30B-A3B's shape (128 experts, k = 8, hidden 2048,
expert width 768, bf16) at 32 tokens, routed by route over N(0, 1) router logits (torch seed
0): what is its arithmetic intensity, its FLOPs over the bytes it must read (the touched
experts' weights, each token's hidden row in and out, as nanovllm.benchmarks.moe counts
them)?""", "FLOP/byte", 1e-3)
def _moe_intensity() -> float:
    import torch

    from nanovllm.layers.router import route

    tokens, experts, k, hidden, inter, elem = 32, 128, 8, 2048, 768, 2
    _, ids = route(torch.randn(tokens, experts, generator=_gen()), k, True)
    touched = int(ids.unique().numel())
    flops = 2 * tokens * k * 3 * hidden * inter
    nbytes = touched * 3 * hidden * inter * elem + 2 * tokens * hidden * elem
    return flops / nbytes


# -- 17: deployment ---------------------------------------------------------------------------
@question("17.q1", """PrefixAwareRouter over 3 replicas (block size 4, slack 1), no request
finishing: tenant A's requests are A's 8-token system prompt plus 4 tokens of their own, B's
the same with B's prompt. They arrive A, B, A, A, A. Which replica (0, 1 or 2) does the fifth
get?""", "replica")
def _fifth_replica() -> float:
    from nanovllm.deploy.router import PrefixAwareRouter

    router = PrefixAwareRouter(3, block_size=4, capacity_blocks=64, slack=1)
    system = {"A": list(range(100, 108)), "B": list(range(200, 208))}
    chosen = [router.route(system[t] + list(range(300 + 10 * i, 304 + 10 * i)))
              for i, t in enumerate("ABAAA")]
    return chosen[-1]


def _curve():
    """One replica's (made-up) latency curve: TTFT and TPOT p90 and mean end-to-end latency
    at 1, 4 and 8 requests/s, saturating at 10."""
    from nanovllm.deploy.capacity import LatencyCurve

    return LatencyCurve([1.0, 4.0, 8.0], [0.05, 0.1, 0.3], [0.01, 0.02, 0.04], [1.0, 1.5, 3.0],
                        10.0)


@question("17.q2", """One replica's p90 TTFT is 50, 100 and 300 ms and its p90 TPOT 10, 20 and
40 ms at 1, 4 and 8 requests/s (saturating at 10; linear in between). With the SLO TTFT <= 200
ms and TPOT <= 25 ms, how many replicas does section 6's planner ask for at 107 requests/s?""",
          "replicas")
def _planned_replicas() -> float:
    from nanovllm.deploy.capacity import replicas_needed

    return replicas_needed([107.0], _curve().max_rate(0.2, 0.025))[0]


@question("17.q3", """The same replica's mean end-to-end latency is 1, 1.5 and 3 s at 1, 4 and
8 requests/s. By Little's law, how many requests does it hold at once at 6 requests/s?""",
          "requests", 1e-3)
def _in_flight() -> float:
    return _curve().in_flight(6.0)
