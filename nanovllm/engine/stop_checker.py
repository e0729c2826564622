"""When a request ends: EOS, stop tokens, stop strings and its length limit (chapters 01, 06).

``reached_length`` is the one length predicate: for a new token, and for the token still in
flight (async scheduling, chapter 11).
"""

from __future__ import annotations

from nanovllm.detokenizer import IncrementalDetokenizer
from nanovllm.engine.sequence import Sequence


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int | None) -> None:
        """``tokenizer`` None: no stop strings; ``max_model_len`` None: no limit but
        ``max_tokens``."""
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def reached_length(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq`` with ``num_tokens`` tokens has all it may have: ``max_tokens``
        outputs, or ``max_model_len`` tokens in all."""
        return (num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens
                or (self.max_model_len is not None and num_tokens >= self.max_model_len))

    def check(self, seq: Sequence, token: int, length: int) -> tuple | None:
        """``(finish_reason, stop_reason)`` if ``seq`` ends at ``token``, its ``length``-th
        token; else None. EOS and stop tokens first, then stop strings, then length."""
        params = seq.params
        # Before min_tokens nothing stops it (EOS and stop ids are banned from sampling then).
        may_stop = length - seq.num_prompt_tokens >= params.min_tokens
        if may_stop and not params.ignore_eos and token in self.eos_token_ids:
            return "stop", None
        if may_stop and token in params.stop_token_ids:
            return "stop", token
        if params.stop and self.tokenizer is not None:
            if seq.detokenizer is None:  # only requests with stop strings need text here
                seq.detokenizer = IncrementalDetokenizer.for_params(self.tokenizer, params)
            seq.detokenizer.push([token])
            if seq.detokenizer.stop_reason is not None:
                return "stop", seq.detokenizer.stop_reason
        if self.reached_length(seq, length):
            return "length", None
        return None
