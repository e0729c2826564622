"""What a request's output must look like: vLLM's ``StructuredOutputsParams`` (chapter 15).

Exactly one constraint per request: a JSON schema (``json``), any JSON object
(``json_object=True``), a regular expression (``regex``), one of a list of strings (``choice``)
or a grammar in xgrammar's EBNF (``grammar``). This module checks the *shape* of the request
(types, exactly one constraint, a schema that is JSON); whether the schema, regex or grammar
means something is the compiler's question, asked when the request is submitted
(``backend_xgrammar.GrammarBackend.compile``), still before it reaches the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One output constraint (vLLM's field names).

    ``json``: a JSON schema, as a dict or a JSON string; ``regex``: a pattern the whole output
    matches; ``choice``: a non-empty list of strings, the output is one of them; ``grammar``: an
    EBNF grammar (xgrammar's dialect, ``root ::= ...``); ``json_object``: any JSON object.

    ``disable_any_whitespace`` (vLLM's name; it shapes ``json`` and ``json_object`` only):
    ``True``, the default here, makes JSON compact: one line, laid out as ``json.dumps`` lays
    it out, ``{"a": 1, "b": [2, 3]}``, no other whitespace (xgrammar's ``any_whitespace=False``).
    ``False`` allows any whitespace between the JSON's elements: still valid JSON, but a
    small model may wander into newlines until ``max_tokens`` runs out (chapter 15 §7).
    vLLM's default is ``False``; ours is ``True``.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams takes exactly one of "
                             f"{', '.join(KINDS)}; got {given or 'none'}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a bool (True: "
                             "compact JSON, the default; False: any whitespace), got "
                             f"{self.disable_any_whitespace!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, tuple):
                self.choice = list(self.choice)
            if not (isinstance(self.choice, list) and self.choice
                    and all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
        if self.json is not None:
            self.json = _schema(self.json)

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``KINDS``."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """A hashable description of the constraint: the compile cache's key."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            value = json.dumps(value, sort_keys=True)
        elif kind == "choice":
            value = tuple(value)
        return kind, value, self.disable_any_whitespace


def _schema(value: Any) -> dict | bool:
    """A JSON schema as a Python value (a dict, or True/False, which JSON Schema allows)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"structured_outputs.json is not valid JSON: {err}") from None
    if not isinstance(value, dict | bool):
        raise ValueError("structured_outputs.json must be a JSON schema (an object), got "
                         f"{type(value).__name__}")
    return value
