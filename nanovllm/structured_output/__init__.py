"""Structured output: constrained decoding with JSON schemas, regexes, choices and grammars
(chapter 15).

``params`` is the request's constraint (vLLM's ``StructuredOutputsParams``),
``backend_xgrammar`` compiles it against the tokenizer and keeps each sequence's matcher,
``masks`` turns matchers into token masks on the logits, and ``toy_dfa`` is the chapter's
hand-built automaton.
"""

from nanovllm.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
