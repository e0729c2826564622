"""Structured output through the OpenAI-compatible server (chapter 15), with the official
openai client and SmolLM2: ``response_format`` (json_schema, json_object) on both endpoints,
the client's ``parse`` with a pydantic model, vLLM's ``structured_outputs`` extra field
(choice, regex, grammar, json), streaming, and constraints that are 400s in OpenAI's shape."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from serve_helpers import running_server, wait_until_idle
from test_scheduler import one_torch_thread  # noqa: F401

from nanovllm.serve.response_format import ResponseFormat, StructuredOutputsFields, constraint

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "smollm2"
ASK = [{"role": "user", "content": "Give me a person as JSON with a name and an age."}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema",
                 "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def srv(smollm2_dir):
    with running_server(smollm2_dir, MODEL, engine_options={"num_kv_blocks": 128,
                                                             "max_model_len": 512}) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)


def test_chat_json_schema_and_pydantic_parse(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0,
                                         max_tokens=60, response_format=SCHEMA_FORMAT)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    parsed = parse(model=MODEL, messages=ASK, temperature=0, max_tokens=60,
                   response_format=Person)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_json_object_and_completions_json_schema(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0,
                                         max_tokens=60, response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    out = client.completions.create(model=MODEL, prompt="A person as JSON:", temperature=1.5,
                                    seed=4, n=2, max_tokens=60,
                                    extra_body={"response_format": SCHEMA_FORMAT})
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), PERSON)


def test_vllm_structured_outputs_extra_body(client):
    colors = ["red", "green", "blue"]
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a color."}], max_tokens=8,
        extra_body={"structured_outputs": {"choice": colors}})
    assert out.choices[0].message.content in colors
    out = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=12,
                                    extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{4}", out.choices[0].text)
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    out = client.completions.create(model=MODEL, prompt="Is the sky blue?", max_tokens=12,
                                    extra_body={"structured_outputs": {"grammar": grammar}})
    assert out.choices[0].text in ("The answer is yes.", "The answer is no.")
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=60, temperature=0,
        extra_body={"structured_outputs": {"json": PERSON}})
    text = out.choices[0].message.content
    assert text.startswith('{"name": "')  # compact by default: json.dumps's one-line layout
    assert text == json.dumps(json.loads(text), ensure_ascii=False)
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("given", [{}, {"disable_any_whitespace": True},
                                   {"disable_any_whitespace": False}])
def test_the_whitespace_switch_passes_through_to_the_engine(given):
    fields = StructuredOutputsFields.model_validate({"json": PERSON, **given})
    params = constraint(None, fields)
    assert params.disable_any_whitespace is given.get("disable_any_whitespace", True)
    for fmt in ({"type": "json_object"}, SCHEMA_FORMAT):  # OpenAI's response_format: compact
        assert constraint(ResponseFormat.model_validate(fmt), None).disable_any_whitespace


def test_streaming_json_schema(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0,
                                            max_tokens=60, response_format=SCHEMA_FORMAT,
                                            stream=True)
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"regex": "(unclosed"}},
    {"structured_outputs": {"json": {"type": "nonsense"}}},
    {"structured_outputs": {"grammar": "root ::= missing"}},
    {"structured_outputs": {"choice": []}},
    {"structured_outputs": {"regex": "a", "choice": ["a"]}},
    {"structured_outputs": {"json": PERSON, "disable_any_whitespace": "no"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
    {"response_format": {"type": "yaml"}},
    {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
])
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_bad_constraints_are_400s_in_openais_shape(srv, extra, endpoint):
    body = {"model": MODEL, "max_tokens": 4, **extra}
    body |= {"prompt": "hi"} if endpoint == "completions" else {"messages": ASK}
    r = httpx.post(f"{srv.url}/v1/{endpoint}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    wait_until_idle(srv.engine)
