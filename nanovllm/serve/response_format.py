"""A request's output constraint in the OpenAI API (chapter 15).

Two ways to ask, both parsed as strictly as the rest of a request (``protocol.py``): OpenAI's
``response_format`` (``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``
or ``{"type": "json_object"}``) and vLLM's extra-body ``structured_outputs`` (``json``,
``regex``, ``choice``, ``grammar``, ``json_object``, and ``disable_any_whitespace``: JSON is
compact unless it is ``false``). ``constraint`` turns either into the
engine's ``StructuredOutputsParams``; a constraint that does not compile is a 400 when the
engine takes the request.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nanovllm.structured_output import StructuredOutputsParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # protocol.Strict's rules


class JsonSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema``; ``strict`` is accepted and always honoured
    (the output is constrained to the schema whatever it says)."""

    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsFields(_Strict):
    """vLLM's ``structured_outputs`` extra field: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # None: the engine's default (compact JSON)


def constraint(fmt: ResponseFormat | None, extra: StructuredOutputsFields | None
               ) -> StructuredOutputsParams | None:
    """The request's output constraint, from ``response_format`` or ``structured_outputs``
    (not both); ``ValueError`` (a 400) for one that is malformed."""
    if fmt is not None and fmt.type == "text":
        fmt = None
    if fmt is not None and extra is not None:
        raise ValueError("give either response_format or structured_outputs, not both")
    if extra is not None:
        layout = ({} if extra.disable_any_whitespace is None
                  else {"disable_any_whitespace": extra.disable_any_whitespace})
        return StructuredOutputsParams(
            json=extra.json_, regex=extra.regex, choice=extra.choice, grammar=extra.grammar,
            json_object=extra.json_object, **layout)
    if fmt is None:
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ValueError("response_format of type json_schema needs json_schema.schema")
    return StructuredOutputsParams(json=fmt.json_schema.schema_)
