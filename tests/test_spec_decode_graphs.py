"""Speculative steps through CUDA graphs (chapter 14 §5; the graphs: chapter 07): a verify
step replays the decode graphs with a row per token (``cuda_graphs.as_decode_rows``), and a
draft's one-token passes replay graphs of their own.

Capture and replay need a GPU (tests/gpu/spec_h200.sh compares graphs with eager there); on
a CPU the graphs' stand-in replays the recorded decode forward pass eagerly, over the same
static buffers and padded metadata a real replay reads. So the row expansion, the buckets and
the padding are what these tests check, with greedy tokens that must equal the engine's
without speculation."""

from __future__ import annotations

import pytest
import torch
from test_scheduler import PROMPTS, make_tiny_llama, one_torch_thread  # noqa: F401

from nanovllm import LLM, SamplingParams
from nanovllm.context import attention_metadata
from nanovllm.engine.cuda_graphs import DecodeGraphs, as_decode_rows, graph_rows
from nanovllm.engine.scheduler_output import SchedulerOutput

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
LAYERS = {"method": "draft_layers", "num_layers": 1, "num_speculative_tokens": 3}
REPEAT = [7, 8, 9, 10, 11, 12] * 5
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


class EagerReplay:
    """A captured graph's stand-in: the decode forward pass of its bucket, rerun on the static
    buffers with the metadata it was captured with."""

    def __init__(self, graphs: DecodeGraphs, bs: int) -> None:
        self.graphs, self.bs = graphs, bs

    def replay(self) -> None:
        g, bs = self.graphs, self.bs
        g.rows_replayed.append(bs)
        with attention_metadata(g._metadata(bs)):
            g.hidden[:bs] = g.model(g.inputs.input_ids[:bs], g.inputs.positions[:bs])


class CPUGraphs(DecodeGraphs):
    def _capture_all(self) -> None:
        self.rows_replayed: list[int] = []
        self.graphs = {bs: EagerReplay(self, bs) for bs in self.buckets}


def with_cpu_graphs(llm: LLM) -> tuple[CPUGraphs, CPUGraphs | None]:
    """Stand-ins for the target's graphs and, for a draft of layers or a draft model, the
    draft's own (its one-token passes)."""
    runner, proposer = llm.engine.runner, llm.engine.speculator.proposer
    max_blocks = -(-runner.config.max_model_len // runner.block_size)
    shape = (max_blocks, runner.block_size)
    runner.graphs = CPUGraphs(runner.model, graph_rows(runner.config), *shape,
                              runner.model_config.hidden_size, runner.device, runner.dtype)
    if not hasattr(proposer, "graphs"):
        return runner.graphs, None
    hidden = getattr(proposer, "model_config", runner.model_config).hidden_size
    proposer.graphs = CPUGraphs(proposer._hidden, runner.config.max_num_seqs, *shape, hidden,
                                runner.device, runner.dtype)
    return runner.graphs, proposer.graphs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-spec-graphs"))


@pytest.fixture(scope="module")
def reference(tiny):
    llm = LLM(tiny, num_kv_blocks=256)
    return [o.token_ids for o in llm.generate(PROMPTS + [REPEAT], GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("spec", ["ngram", "draft_layers", "draft_model"])
def test_verify_steps_replay_the_decode_graphs_exactly(tiny, reference, spec):
    spec = {"ngram": NGRAM, "draft_layers": LAYERS,
            "draft_model": {"model": str(tiny), "num_speculative_tokens": 3}}[spec]
    llm = LLM(tiny, num_kv_blocks=256, max_num_seqs=4, speculative_config=spec)
    graphs, draft_graphs = with_cpu_graphs(llm)
    assert graphs.buckets[-1] >= 4 * (3 + 1)  # room for four verify steps of k + 1 tokens
    outs = llm.generate(PROMPTS + [REPEAT], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    stats = llm.engine.speculator.stats
    assert stats.num_accepted_tokens > 0
    # Verify steps went through the graphs: replays of more rows than there are sequences.
    assert max(graphs.rows_replayed) > 4
    if draft_graphs is not None:  # and every draft pass through the draft's
        assert len(draft_graphs.rows_replayed) >= stats.num_steps
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_row_per_token_attends_like_the_packed_step(tiny):
    """The expanded metadata gives the hidden states of the packed causal pass (float32,
    CPU): for whole prompts from position 0 (one of a single token, a "decode"), then for
    the last 1, 4 and 3 tokens of the same sequences over their cached prefixes, as a verify
    step's rows sit."""
    llm = LLM(tiny, num_kv_blocks=64)
    runner, bm = llm.engine.runner, llm.engine.block_manager
    seqs = [llm.engine.make_sequence(p, GREEDY) for p in ([5], [3] * 9, [4, 2, 1, 8, 8, 6])]
    for seq in seqs:
        assert bm.allocate(seq, seq.num_tokens)
    for new in ([s.num_tokens for s in seqs], [1, 4, 3]):
        for seq, n in zip(seqs, new):
            seq.num_computed_tokens = seq.num_tokens - n
        step = runner.prepare(SchedulerOutput(seqs, list(new)))
        with attention_metadata(step.meta):
            packed = runner.model(step.input_ids, step.positions)
        rows = as_decode_rows(step.meta, step.positions)
        assert rows.num_decodes == sum(new) and rows.max_seqlen_q == 1
        assert rows.seq_lens_k_host == (step.positions + 1).tolist()
        with attention_metadata(rows):
            expanded = runner.model(step.input_ids, step.positions)
        torch.testing.assert_close(expanded, packed, rtol=1e-5, atol=1e-5)
