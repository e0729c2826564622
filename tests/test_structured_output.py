"""Structured output in the engine (chapter 15): every constrained output parses and validates,
greedy on SmolLM2 and sampled hot on a tiny random model (the constraint alone makes its output
valid); choices and regexes match; unconstrained neighbours are untouched; bad constraints are
ValueErrors at submission; length, n, seeds, logprobs, penalties, stop strings, preemption and
async scheduling keep working."""

from __future__ import annotations

import gc
import json
import re

import pytest
import torch
from serve_helpers import make_tiny_chat_model
from test_scheduler import make_llm

from nanovllm import LLM, SamplingParams, StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

EOS = 2  # SmolLM2's <|im_end|>
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {"item": {"enum": ["tea", "coffee", "juice"]},
                   "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1,
                                                        "maximum": 9}, "maxItems": 3},
                   "hot": {"type": "boolean"}},
    "required": ["item", "hot"], "additionalProperties": False,
}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                          "rank": {"type": "integer", "minimum": 1,
                                                   "maximum": 5}},
        "required": ["city"], "additionalProperties": False}
SCHEMAS = [PERSON, ORDER, CITY]
PHONE = r"\d{3}-\d{4}"
COLORS = ["red", "green", "blue"]


def chat(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)


def schema_params(schema, **kw) -> SamplingParams:
    """``compact=False`` lets the JSON carry any whitespace; the default is compact."""
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=kw.pop("compact", True))
    return SamplingParams(structured_outputs=so, max_tokens=kw.pop("max_tokens", 60), **kw)


def run(llm: LLM, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def check_json(output, schema) -> None:
    assert output.finish_reason == "stop", output.text
    jsonschema.validate(json.loads(output.text), schema)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Small matmuls run faster without OpenMP threads fighting over 2 shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    """A tiny random Llama with SmolLM2's tokenizer: random text, milliseconds per step."""
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), smollm2_dir)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    engine = make_llm(tiny_dir, num_kv_blocks=96, max_model_len=256, async_scheduling=False)
    yield engine
    del engine
    gc.collect()


@pytest.fixture(scope="module")
def prompt(tiny):
    return chat(tiny.engine.tokenizer, "A person as JSON.")


def test_smollm2_greedy_outputs_parse_validate_and_match(smollm2_dir):
    llm = LLM(smollm2_dir, num_kv_blocks=64, max_model_len=256)
    tok = llm.engine.tokenizer
    prompts = [chat(tok, "Describe one thing as JSON.")] * 3
    prompts += [chat(tok, "Name a color."), chat(tok, "Give me a phone number.")]
    # PERSON and ORDER compact (the default), CITY with any whitespace allowed
    params = [schema_params(s, temperature=0, compact=s is not CITY) for s in SCHEMAS] + [
        SamplingParams(temperature=0, max_tokens=8,
                       structured_outputs=StructuredOutputsParams(choice=COLORS)),
        SamplingParams(temperature=0, max_tokens=12,
                       structured_outputs=StructuredOutputsParams(regex=PHONE))]
    outputs = run(llm, prompts, params)
    for out, schema in zip(outputs, SCHEMAS):
        check_json(out.outputs[0], schema)
        if schema is not CITY:  # compact: exactly json.dumps's layout, one line
            text = out.outputs[0].text
            assert text == json.dumps(json.loads(text), ensure_ascii=False), text
    assert outputs[3].outputs[0].text in COLORS
    assert re.fullmatch(PHONE, outputs[4].outputs[0].text)


def test_every_hot_sample_parses_and_validates(tiny, prompt):
    hot = [schema_params(s, temperature=1.5, n=3, seed=7 + i)
           for i, s in enumerate(SCHEMAS)]
    hot.append(SamplingParams(temperature=1.5, n=3, max_tokens=60, structured_outputs=(
        StructuredOutputsParams(json_object=True, disable_any_whitespace=True))))
    outputs = run(tiny, [prompt] * 4, hot)
    for out, schema in zip(outputs, SCHEMAS + [{"type": "object"}]):
        assert len(out.outputs) == 3
        for sample in out.outputs:
            if schema == {"type": "object"} and sample.finish_reason == "length":
                continue  # any object: nothing bounds a random model's keys
            check_json(sample, schema)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mixed_batch_leaves_unconstrained_requests_untouched(tiny_dir, tiny, prompt,
                                                             async_scheduling):
    """Choice and regex outputs match; the unconstrained requests get the same tokens as
    without constrained neighbours."""
    prompts = [prompt, prompt, "The capital of France is", "Once upon a time"]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = run(tiny, prompts[2:], plain)
    choice = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=COLORS))
    regex = SamplingParams(temperature=1.0, seed=3, max_tokens=12,
                           structured_outputs=StructuredOutputsParams(regex=PHONE))
    engine = make_llm(tiny_dir, num_kv_blocks=96, max_model_len=256,
                      async_scheduling=async_scheduling)
    mixed = run(engine, prompts, [choice, regex, plain, plain])
    assert mixed[0].outputs[0].text in COLORS
    assert re.fullmatch(PHONE, mixed[1].outputs[0].text)
    assert [m.outputs[0].finish_reason for m in mixed[:2]] == ["stop", "stop"]
    for m, a in zip(mixed[2:], alone):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids


@pytest.mark.parametrize("constraint", [
    {"json": {"type": "nonsense"}}, {"regex": "(unclosed"}, {"grammar": "root ::= missing"},
])
def test_bad_constraints_are_value_errors_and_the_engine_goes_on(tiny, constraint):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match="does not compile"):
        run(tiny, ["hello", "world"], [SamplingParams(max_tokens=2), bad])
    assert not tiny.engine.has_unfinished_requests()
    assert len(run(tiny, "hello", SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


def test_no_tokenizer_no_constraint():
    from nanovllm.configs import config_path  # a config-only folder: dummy weights

    engine = LLM(config_path("smollm2-135m"), load_format="dummy", num_kv_blocks=8,
                 max_model_len=64)
    with pytest.raises(ValueError, match="tokenizer"):
        run(engine, [[1, 2, 3]], schema_params(PERSON))


def test_too_few_tokens_end_with_length_and_partial_text(tiny, prompt):
    out = run(tiny, prompt, schema_params(PERSON, temperature=0, max_tokens=4))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert out.text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_seeds_logprobs_penalties_and_stop_strings(tiny, prompt):
    seeded = schema_params(PERSON, temperature=1.2, seed=11, n=2, logprobs=2,
                           repetition_penalty=1.3, presence_penalty=0.5)
    first, again = run(tiny, prompt, seeded)[0], run(tiny, prompt, seeded)[0]
    assert first.outputs[0].token_ids != first.outputs[1].token_ids
    for a, b in zip(first.outputs, again.outputs):
        assert a.token_ids == b.token_ids
        check_json(a, PERSON)
        # the mask comes first: the chosen tokens' logprobs are the masked distribution's
        assert len(a.logprobs) == len(a.token_ids)
        for token, entry in zip(a.token_ids, a.logprobs):
            assert entry[token].logprob > float("-inf")
    stop = schema_params(PERSON, temperature=0, stop=['"age"'])
    out = run(tiny, prompt, stop)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == '"age"'
    assert out.text.startswith('{"name": "') and '"age"' not in out.text


def test_preemption_and_async_scheduling_keep_constrained_tokens(tiny_dir, tiny, prompt):
    """Recompute preemption under async scheduling gives the seeded constrained samples the
    tokens of a roomy synchronous run."""
    params = [schema_params(PERSON, temperature=1.0, seed=5, n=2),
              SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)]
    roomy = run(tiny, [prompt, prompt], params)
    small = make_llm(tiny_dir, num_kv_blocks=6, max_model_len=128, async_scheduling=True)
    tight = run(small, [prompt, prompt], params)
    assert small.engine.scheduler.num_preemptions > 0
    for r, t in zip(roomy, tight):
        assert [o.token_ids for o in r.outputs] == [o.token_ids for o in t.outputs]
    for sample in tight[0].outputs:
        check_json(sample, PERSON)
