"""Scheduling policies: who is served first when not everyone fits (chapter 06).

A policy ranks sequences, most important first. The scheduler admits waiting sequences
in that order and, when KV blocks run out, preempts running ones from the other end.
"""

from __future__ import annotations

from typing import Protocol

from nanovllm.engine.sequence import Sequence


class Policy(Protocol):
    def order(self, seqs: list[Sequence], now: float) -> list[Sequence]:
        """Return ``seqs`` sorted from most to least important."""
        ...


class FCFS:
    """First come, first served: earliest arrival first."""

    def order(self, seqs: list[Sequence], now: float) -> list[Sequence]:
        return sorted(seqs, key=lambda s: (s.metrics.arrival_time, s.seq_id))


POLICIES = {"fcfs": FCFS}


def get_policy(policy: str | Policy) -> Policy:
    if not isinstance(policy, str):
        if not callable(getattr(policy, "order", None)):
            raise ValueError("a custom scheduler_policy needs an order(seqs, now) method")
        return policy
    if policy not in POLICIES:
        raise ValueError(f"unknown scheduler_policy {policy!r}; choose from {sorted(POLICIES)}")
    return POLICIES[policy]()
