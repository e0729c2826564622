"""Prompt-lookup proposals (chapter 14 §4): a request that repeats itself, code being edited,
a summary quoting its source, predicts its own next tokens from its history, for free.

``ngram_propose`` is the rule (assignment ``14.ngram_propose``); ``NgramProposer`` applies it
to each decoding request of a step, on the host, before the step is planned.
"""

from __future__ import annotations

import numpy as np

from nanovllm.engine.sequence import Sequence


def ngram_propose(token_ids: list[int] | np.ndarray, k: int, min_n: int,
                  max_n: int) -> list[int]:
    """Up to ``k`` tokens predicted by prompt lookup over ``token_ids`` (prompt + output).

    Handout (chapter 14 §4, assignment ``14.ngram_propose``). Find the longest ``n`` with
    ``max_n >= n >= min_n`` such that the last ``n`` tokens of ``token_ids`` (the suffix) also
    occur earlier, at a start ``i`` with ``i + n < len(token_ids)`` (an occurrence may overlap
    the suffix, but is not the suffix itself). Among the occurrences of that longest suffix
    take the most recent (the largest ``i``) and propose what followed it: exactly ``k``
    tokens, as a list of Python ints. The match says the text repeats with period
    ``p = len(token_ids) - n - i``, so proposal ``j`` is the token ``p`` places before it in
    the text continued by the proposals themselves: ``token_ids[i + n + j]`` while that
    exists, and proposal ``j - p`` after it (a run of one token proposes ``k`` more of it).
    Return ``[]`` when no ``n`` in the range matches, when ``len(token_ids) <= min_n`` or when
    ``k == 0``. A longer match always wins over a more recent shorter one. ``token_ids`` is a
    list or a 1-D NumPy array of ints and is not changed.

    This runs on the host for every decoding request of every step: work in NumPy over
    whole arrays (e.g. ``numpy.lib.stride_tricks.sliding_window_view``), not a Python loop
    over positions.
    """
    # >>> assignment 14.ngram_propose (6 points)
    tokens = np.asarray(token_ids)
    length = len(tokens)
    if k <= 0 or length <= min_n:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Windows that start at 0 .. length - n - 1: every occurrence but the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts):
            period = length - n - int(starts[-1])  # the most recent occurrence
            known = tokens[length - period :].tolist()  # what followed it, up to the end
            return [known[j % period] for j in range(k)]  # then periodically, by the match
    return []
    # <<< assignment 14.ngram_propose


class NgramProposer:
    """Proposes for each sequence from its own prompt and output (vLLM's ``"ngram"``)."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def release(self) -> None:
        """Nothing to give back: prompt lookup holds nothing on the device."""

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[list[int]]:
        """At most ``budgets[i]`` (<= k) proposed tokens for each of ``seqs``."""
        return [ngram_propose(seq.token_ids, min(b, self.k), self.min_n, self.max_n) if b > 0
                else [] for seq, b in zip(seqs, budgets)]
