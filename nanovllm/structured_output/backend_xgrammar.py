"""Constraints compiled against a tokenizer, and one matcher per sequence (chapter 15 §4).

xgrammar (the library vLLM and SGLang use) does the hard part: it turns a JSON schema, regex or
EBNF grammar into a pushdown automaton over *bytes*, and precomputes, for every automaton state,
which vocabulary tokens are allowed whatever the stack holds ("context-independent" tokens),
so that filling a step's token mask only checks the few tokens that depend on the stack.

``GrammarBackend`` is one per engine, made on its first constrained request
(``InputProcessor``): the tokenizer's vocabulary as xgrammar sees it (a scan of a fraction of a
second), its compiler, and a cache of compiled constraints keyed by
``StructuredOutputsParams.key()``, so a schema that a thousand requests share compiles once.
Compilation happens at submission, in the submitting thread: a schema, regex or grammar that
does not compile is a ``ValueError`` there, never an error inside a step.

``GrammarState`` is one sequence's matcher: its position in the automaton after the tokens
delivered so far. The scheduler's update path (``Scheduler._took_token``) is its one writer:
``accept`` with every delivered token, ``rollback`` for tokens taken back (speculative
decoding's rejected drafts). The model runner only reads it, filling the next step's mask.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from nanovllm.structured_output.masks import BITS
from nanovllm.structured_output.params import StructuredOutputsParams

CACHE_SIZE = 256  # compiled constraints kept per tokenizer (least recently used dropped)


class GrammarBackend:
    """Compiles constraints for one tokenizer and one vocabulary width (the logits')."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr  # imported on the first constrained request only (~2 s)

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=2)
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()  # any submitting thread may compile

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled constraint (an ``xgrammar.CompiledGrammar``), cached; ``ValueError``
        if xgrammar cannot compile it (a bad schema, regex or grammar)."""
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            compiled = self._compile(params)
        except (RuntimeError, ValueError, TypeError) as err:
            message = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
            raise ValueError(f"structured_outputs.{params.kind} does not compile: "
                             f"{message}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams) -> Any:
        # JSON is compact (json.dumps's layout) unless the request sets
        # disable_any_whitespace=False; regexes, choices and grammars say their own whitespace
        compiler, any_whitespace = self.compiler, not params.disable_any_whitespace
        if params.json is not None:
            return compiler.compile_json_schema(json.dumps(params.json),
                                                any_whitespace=any_whitespace)
        if params.json_object:
            # any JSON object: the schema {"type": "object"} (the builtin grammar would allow
            # any JSON value, and OpenAI's json_object means an object)
            return compiler.compile_json_schema('{"type": "object"}',
                                                any_whitespace=any_whitespace)
        if params.regex is not None:
            return compiler.compile_regex(params.regex)
        if params.choice is not None:
            # JSON string literals are EBNF string literals (quotes, backslashes, \n, \uXXXX)
            return compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(c) for c in params.choice))
        return compiler.compile_grammar(params.grammar)

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher for one sequence (each sample of ``n`` gets its own)."""
        return GrammarState(self._xgr.GrammarMatcher(self.compile(params)))


class GrammarState:
    """One sequence's place in its constraint's automaton."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> None:
        """Advance past ``token``; ``RuntimeError`` if the constraint forbids it (the mask
        allowed only permitted tokens, so this means a bug or an all-banned row: the
        request ends with "error", the engine goes on)."""
        if not self.matcher.accept_token(int(token)):
            raise RuntimeError(f"token {token} violates the request's structured_outputs "
                               "constraint")

    def rollback(self, num_tokens: int) -> None:
        """Take back the last ``num_tokens`` accepted tokens (xgrammar keeps the whole
        history: any number up to the tokens accepted)."""
        self.matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        """The constraint is complete and its stop token was accepted: the request ends."""
        return self.matcher.is_terminated()

    def only_stop_allowed(self, bitmask: torch.Tensor, row: int) -> bool:
        """Whether ``bitmask[row]``, this matcher's mask, allows nothing but stop tokens: the
        constraint is complete and cannot go on (asked of a complete matcher only: cheap)."""
        if self.matcher.is_terminated() or not self.matcher.is_completed():
            return False
        words = bitmask[row].numpy().view(np.uint32).copy()
        for token in self.matcher.stop_token_ids:
            if token < BITS * len(words):
                words[token // BITS] &= ~np.uint32(1 << (token % BITS))
        return not words.any()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 words; bit ``t % 32``
        of word ``t // 32`` set when token ``t`` is allowed). A terminated matcher has
        nothing left to allow; its row allows every token (the request ends this step)."""
        if self.matcher.is_terminated():
            bitmask[row].fill_(-1)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

