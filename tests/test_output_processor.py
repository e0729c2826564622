"""One request-id allocator (``RequestIds``), one output processor for both front ends
(``OutputProcessor``: ``LLM`` and ``AsyncEngine``), one place that builds a detokenizer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_isolation import all_blocks_free, greedy, run_in_threads, run_to_end
from test_scheduler import PROMPTS, make_llm, make_tiny_llama, one_torch_thread  # noqa: F401

import nanovllm
from nanovllm import SamplingParams
from nanovllm.detokenizer import IncrementalDetokenizer
from nanovllm.engine.async_engine import AsyncEngine
from nanovllm.engine.input_processor import RequestIds
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.engine.sequence import SequenceStatus


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-outproc"), tokenizer_dir=smollm2_dir)


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir, num_kv_blocks=64)


def request(llm, request_id=None, n=1):
    """A validated request's samples, not yet claimed."""
    return llm.engine.make_sequences(PROMPTS[3], SamplingParams(n=n), request_id)


def finish(seqs) -> None:
    for seq in seqs:
        seq.status = SequenceStatus.FINISHED


# -- RequestIds ----------------------------------------------------------------------------
def test_generated_ids_step_around_user_ids_and_user_ids_in_use_are_refused(llm):
    ids = RequestIds()
    assert [ids.claim(request(llm, str(k))) for k in range(3)] == ["0", "1", "2"]
    generated = [ids.claim(request(llm)) for _ in range(3)]
    assert generated == ["3", "4", "5"]  # the next numbers not in use
    with pytest.raises(ValueError, match="request id '1' is already in use"):
        ids.claim(request(llm, "1"))
    with pytest.raises(ValueError, match="request id '4' is already in use"):
        ids.claim(request(llm, "4"))  # a generated id is in use like any other


def test_samples_claim_their_ids_with_their_request(llm):
    ids = RequestIds()
    request(llm)  # (a placeholder id, Sequence's own number, is never "0" below)
    seqs = request(llm, None, n=3)
    request_id = ids.claim(seqs)
    assert request_id == "0"  # generated, as for one sample
    assert [s.parent_id for s in seqs] == [request_id] * 3
    assert [s.request_id for s in seqs] == [f"{i}_{request_id}" for i in range(3)]
    with pytest.raises(ValueError, match=f"'1_{request_id}' is already in use"):
        ids.claim(request(llm, f"1_{request_id}"))  # would share the engine's key
    ids.claim(request(llm, "0_7"))
    with pytest.raises(ValueError, match="'0_7' is already in use"):
        ids.claim(request(llm, "7", n=2))
    assert ids.claim(request(llm, None, n=2)) not in ("7", request_id)
    with pytest.raises(ValueError, match="every sample"):
        ids.claim(request(llm, None, n=2)[1:])  # one sample alone cannot get an id


def test_claiming_again_changes_nothing(llm):
    ids = RequestIds()
    seqs = request(llm, None, n=2)
    request_id = ids.claim(seqs, held=True)
    assert ids.claim(seqs) == ids.claim(seqs[1:]) == request_id  # (add_sequence per sample)
    assert [s.request_id for s in seqs] == [f"0_{request_id}", f"1_{request_id}"]


def test_an_id_is_free_once_its_request_has_ended_for_its_reader(llm):
    ids = RequestIds()
    direct, held = request(llm, "direct"), request(llm, "held", n=2)
    ids.claim(direct)
    ids.claim(held, held=True)
    finish(direct)
    finish(held)
    ids.claim(request(llm, "direct"))  # the engine holds none of its samples any more
    with pytest.raises(ValueError, match="'held' is already in use"):
        ids.claim(request(llm, "held"))  # its reader has not had the final output yet
    ids.release("held")
    ids.claim(request(llm, "held", n=2))
    ids.release("direct")  # not held: the engine's claim stays
    with pytest.raises(ValueError, match="'direct' is already in use"):
        ids.claim(request(llm, "direct"))


def test_many_threads_get_distinct_ids(llm):
    ids, got = RequestIds(), [[] for _ in range(8)]
    seqs = [request(llm) for _ in range(8 * 100)]

    def work(k):
        got[k] = [ids.claim(s) for s in seqs[k::8]]

    assert run_in_threads(work, 8) == []
    assert len({i for g in got for i in g}) == 800


def test_ended_claims_are_forgotten(llm):
    ids = RequestIds()
    for _ in range(1000):
        seqs = request(llm)
        ids.claim(seqs)
        finish(seqs)
    assert len(ids._claims) < 200  # pruned as the table grows, not kept forever


# -- the engine and both front ends --------------------------------------------------------
def test_a_user_id_is_reusable_once_its_request_finished(llm):
    engine = llm.engine
    engine.add_request("again", PROMPTS[2], greedy(3))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("again", PROMPTS[2], greedy(3))
    seq = engine.make_sequence(PROMPTS[2], greedy(3))
    engine.add_sequence(seq)  # claims a generated id
    with pytest.raises(ValueError, match="added already"):
        engine.add_sequence(seq)
    run_to_end(llm, {})
    assert engine.add_request("again", PROMPTS[2], greedy(3)) == "again"
    run_to_end(llm, {})
    assert all_blocks_free(llm)


def test_both_front_ends_use_one_output_processor(model_dir, monkeypatch):
    """``LLM.generate`` and ``AsyncEngine`` each feed an ``OutputProcessor`` and agree,
    n > 1, logprobs and stop strings included; afterwards no request and no id is held."""
    users = []
    process = OutputProcessor.process_outputs

    def spy(self, outputs):
        users.append(self)
        return process(self, outputs)

    monkeypatch.setattr(OutputProcessor, "process_outputs", spy)
    llm = make_llm(model_dir, num_kv_blocks=64)
    params = [SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=6, logprobs=1),
              SamplingParams(temperature=0, max_tokens=12, stop=["e"], ignore_eos=True)]
    prompts = ["alpha beta gamma", "river mountain engine"]
    expected = llm.generate(prompts, params, use_tqdm=False)
    assert {type(u) for u in users} == {OutputProcessor} and users[-1] is llm._outputs
    users.clear()
    with AsyncEngine(llm.engine) as engine:
        got = [engine.submit(p, sp, request_id=str(i)).result(30)
               for i, (p, sp) in enumerate(zip(prompts, params))]
        assert users and all(u is engine._outputs for u in users)
        assert not engine._outputs.has_unfinished_requests()
        # the ids are released: the same ids again
        assert engine.submit(prompts[1], params[1], request_id="1").result(30).text == got[1].text
    for want, have in zip(expected, got):
        assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in have.outputs] == [
            (c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in want.outputs
        ]
        for c, w in zip(have.outputs, want.outputs):  # (batched differently: float noise)
            assert [list(p) for p in c.logprobs or ()] == [list(p) for p in w.logprobs or ()]
            assert [lp.logprob for p in c.logprobs or () for lp in p.values()] == pytest.approx(
                [lp.logprob for p in w.logprobs or () for lp in p.values()], abs=1e-4)
    assert expected[1].outputs[0].stop_reason == "e"
    assert not llm._outputs.has_unfinished_requests() and all_blocks_free(llm)


def test_an_interrupted_generate_leaves_no_request_and_no_id(llm, monkeypatch):
    step = llm.engine.step
    calls = []

    def interrupted():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, n=2), use_tqdm=False)
    monkeypatch.undo()
    assert not llm._outputs.has_unfinished_requests() and all_blocks_free(llm)
    assert not any(c.in_use for c in llm.engine.input_processor.request_ids._claims.values())
    assert len(llm.generate(PROMPTS[:2], greedy(2), use_tqdm=False)) == 2


# -- the detokenizer ------------------------------------------------------------------------
def test_the_detokenizer_is_built_from_sampling_params_in_one_place():
    params = SamplingParams(stop=["ab", "c"], include_stop_str_in_output=True,
                            skip_special_tokens=False, min_tokens=4)
    detokenizer = IncrementalDetokenizer.for_params("tokenizer", params)
    assert (detokenizer.tokenizer, detokenizer.stop, detokenizer.include_stop_str_in_output,
            detokenizer.skip_special_tokens, detokenizer.min_tokens) == (
        "tokenizer", ("ab", "c"), True, False, 4)
    package = Path(nanovllm.__file__).parent
    builders = [
        f"{path.relative_to(package)}:{node.lineno}"
        for path in package.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", None)) == "IncrementalDetokenizer"
    ]
    assert builders == []  # every other module calls IncrementalDetokenizer.for_params
