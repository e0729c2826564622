"""Speculative decoding behind the server (chapter 14, ``nanovllm/serve/``): the server takes
``speculative_config`` from the command line (vLLM's JSON) and the YAML file, refuses a bad
one at start-up with a message and status 2, serves the same greedy text as without it, and
exports the proposal counters in ``/metrics`` from an engine core in another process too;
and one request whose proposals fail ends alone with "error", the others unharmed."""

from __future__ import annotations

import argparse
import re

import httpx
import pytest
from serve_helpers import make_tiny_chat_model, wait_until_idle
from test_scheduler import PROMPTS, make_llm, make_tiny_llama, one_torch_thread  # noqa: F401

from nanovllm import SamplingParams
from nanovllm.engine.async_engine import AsyncEngine
from nanovllm.serve import ServerThread, build_app
from nanovllm.serve.cli import add_serve_arguments, config_from_args, main

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
# A prompt (token ids) that repeats itself: prompt lookup finds proposals in it (the tiny
# random model's greedy answer proposes 4 tokens and has 1 accepted in 16).
REPEAT = [7, 8, 9, 10, 11, 12] * 5
BODY = {"model": "tiny", "prompt": REPEAT, "max_tokens": 16, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir):
    return make_tiny_chat_model(tmp_path_factory.mktemp("spec-serve") / "tiny", smollm2_dir)


@pytest.fixture(scope="module")
def reference_text(tiny):
    """The greedy completion without speculation."""
    llm = make_llm(tiny, num_kv_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return llm.generate([REPEAT], params, use_tqdm=False)[0].outputs[0].text


def serve_from_args(argv: list[str]) -> ServerThread:
    """What ``nanovllm serve`` builds for ``argv`` (``server.serve``), on a test thread."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = config_from_args(parser.parse_args(argv))
    engine = AsyncEngine.from_model(config.model, engine_process=config.engine_process,
                                    **config.engine_options())
    server = ServerThread(build_app(engine, config))
    server.engine = engine
    return server


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value in a Prometheus rendering (0 if absent)."""
    want = "".join(f',{k}="{v}"' for k, v in labels.items())
    pattern = rf'^{re.escape(name)}{{model_name="tiny"{re.escape(want)}}} (\S+)$'
    found = re.search(pattern, text, flags=re.M)
    return float(found.group(1)) if found else 0.0


def test_cli_speculation_in_an_engine_core_process(tiny, reference_text):
    server = serve_from_args([str(tiny), "--served-model-name", "tiny", "--option",
                              "num_kv_blocks=128", "--speculative-config", NGRAM])
    try:
        with server:
            before = httpx.get(f"{server.url}/metrics").text
            answer = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=120).json()
            assert answer["choices"][0]["text"] == reference_text
            wait_until_idle(server.engine)
            after = httpx.get(f"{server.url}/metrics").text
    finally:
        server.engine.shutdown(wait=False)
    name = "nanovllm:spec_decode_num_{}_total".format
    assert metric(before, name("draft_tokens")) == metric(before, name("accepted_tokens")) == 0
    drafts, proposed = metric(after, name("drafts")), metric(after, name("draft_tokens"))
    accepted = metric(after, name("accepted_tokens"))
    assert 0 < drafts <= proposed <= 3 * drafts and 0 < accepted <= proposed
    per_pos = [metric(after, name("accepted_tokens_per_pos"), position=str(j))
               for j in range(3)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert answer["usage"]["completion_tokens"] == 16


def test_yaml_speculation_in_the_server_process(tiny, reference_text, tmp_path):
    deployment = tmp_path / "deployment.yaml"
    deployment.write_text(f"model: {tiny}\nserved_model_name: tiny\nengine_process: false\n"
                          "engine: {num_kv_blocks: 128}\n"
                          "speculative_config: {method: ngram, num_speculative_tokens: 2, "
                          "prompt_lookup_min: 1}\n")
    server = serve_from_args(["--config", str(deployment)])
    try:
        with server:
            answer = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=120).json()
            speculator = server.engine.engine.speculator
    finally:
        server.engine.shutdown(wait=False)
    assert answer["choices"][0]["text"] == reference_text
    assert speculator.config.num_speculative_tokens == 2 and speculator.stats.num_drafts > 0


@pytest.mark.parametrize("source, message", [
    ("--speculative-config={\"method\": \"medusa\", \"num_speculative_tokens\": 2}",
     "speculative_config method is 'medusa'"),
    ("--speculative-config={\"method\": \"ngram\", \"num_speculative_tokens\": 0}",
     "num_speculative_tokens is 0; it must be an int >= 1"),
    ("yaml:speculative_config: {method: ngram, num_speculative_tokens: 2, lookahead: 3}",
     "unknown speculative_config key(s) ['lookahead']"),
    ("yaml:speculative_config: ngram", "speculative_config must be a dict"),
    # known only once the engine core has read the model (2 layers): still one clean line
    ("--speculative-config={\"method\": \"draft_layers\", \"num_layers\": 2, "
     "\"num_speculative_tokens\": 2}", "the model has 2 layers; the draft must use fewer"),
])
def test_a_bad_speculative_config_stops_start_up_cleanly(tiny, tmp_path, capsys, source,
                                                           message):
    argv = ["serve", str(tiny), "--option", "num_kv_blocks=64"]
    if source.startswith("yaml:"):
        (tmp_path / "bad.yaml").write_text(source[5:] + "\n")
        argv += ["--config", str(tmp_path / "bad.yaml")]
    else:
        argv.append(source)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_flag_that_is_not_json_is_refused(tiny, capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", str(tiny), "--speculative-config", "{method: ngram"])
    assert info.value.code == 2
    assert "--speculative-config: not JSON" in capsys.readouterr().err


# -- one request's proposals fail: it ends alone -----------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LOOKUP = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
          "prompt_lookup_max": 3}
LAYERS = {"method": "draft_layers", "num_layers": 1, "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-spec-fault"))


def doomed(seq) -> bool:
    """The faulty request, once it has a few output tokens (its fault comes mid-way)."""
    return seq.token_ids[: len(REPEAT)] == REPEAT and seq.num_tokens > len(REPEAT) + 2


def break_proposals(monkeypatch, llm, fault: str) -> None:
    """Make the faulty request's proposer raise, or propose a token beyond the vocabulary,
    or its inputs to the verify pass fail."""
    speculator, runner = llm.engine.speculator, llm.engine.runner
    if fault == "verify-inputs":
        sampling_inputs = runner._sampling_inputs
        monkeypatch.setattr(runner, "_sampling_inputs", lambda seqs: (
            sampling_inputs(seqs) if not any(map(doomed, seqs)) else 1 / 0))
        return
    propose = speculator.proposer.propose

    def faulty(seqs, budgets, *rest):
        out = propose(seqs, budgets, *rest)
        drafts = out[0] if rest else out
        for i, seq in enumerate(seqs):
            if doomed(seq) and budgets[i]:
                if fault == "raises":
                    raise RuntimeError("proposer broke")
                drafts[i] = [runner.model_config.vocab_size]
        return out

    monkeypatch.setattr(speculator.proposer, "propose", faulty)


@pytest.mark.parametrize("spec, fault, error", [
    (LOOKUP, "raises", "RuntimeError: proposer broke"),
    (LOOKUP, "out-of-vocabulary", "ValueError: the ngram proposer proposed"),
    (LAYERS, "raises", "RuntimeError: proposer broke"),
    (LOOKUP, "verify-inputs", "ZeroDivisionError"),
], ids=["ngram-raises", "ngram-bad-token", "draft-layers-raises", "verify-inputs"])
def test_a_failing_proposal_ends_its_request_alone(tiny_llama, monkeypatch, spec, fault,
                                                   error):
    prompts = [PROMPTS[0], REPEAT, PROMPTS[3]]  # the second one's proposals fail
    reference = make_llm(tiny_llama, num_kv_blocks=64).generate(prompts, GREEDY,
                                                                 use_tqdm=False)
    llm = make_llm(tiny_llama, num_kv_blocks=64, speculative_config=spec)
    break_proposals(monkeypatch, llm, fault)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i in (0, 2):
        assert outs[i].token_ids == reference[i].token_ids
        assert outs[i].outputs[0].finish_reason == "length"
    bad = outs[1].outputs[0]
    assert bad.finish_reason == "error" and error in outs[1].error
    assert bad.token_ids == reference[1].token_ids[: len(bad.token_ids)]  # right until then
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks
