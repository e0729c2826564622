"""What the engine measures: per step, per request, and an optional timeline (chapters 06, 10).

Per request, ``RequestMetrics`` (``nanovllm/outputs.py``) and ``latency_summary`` over many;
per step, ``StepMetrics`` kept by ``EngineStats`` (a few attribute reads per step); and, when
switched on (``engine.timeline = TimelineRecorder()``), who ran which tokens in each step, for
a Gantt chart. All times are ``time.perf_counter()`` seconds.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, NamedTuple

from nanovllm.outputs import RequestMetrics

if TYPE_CHECKING:
    from nanovllm.engine.scheduler_output import SchedulerOutput


@dataclass
class StepMetrics:
    step: int
    start: float
    end: float
    num_seqs: int
    num_prefill_tokens: int  # prompt chunks, and recomputation after a preemption
    num_decode_tokens: int
    num_running: int  # after the step
    num_waiting: int
    kv_usage: float  # fraction of KV blocks in use after the step
    num_preemptions: int  # since the engine started
    prefix_hit_rate: float  # since the engine started
    # speculative decoding (chapter 14): requests that proposed, their proposals, the accepted
    # ones, and the accepted ones by position j (the (j+1)-th proposal of a request's step)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()

    @property
    def wall_time(self) -> float:
        return self.end - self.start


class EngineLoad(NamedTuple):
    """How busy an engine is: what a server's gauges show."""

    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_hit_rate: float


class EngineStats:
    """Per-step metrics of the last ``max_steps`` steps, and totals since the start."""

    def __init__(self, max_steps: int = 10_000) -> None:
        self.steps: deque[StepMetrics] = deque(maxlen=max_steps)
        self.reset()

    def record(self, step: StepMetrics) -> None:
        """Keep one step's numbers (the engine measures them; ``step.step`` is its index)."""
        self.steps.append(step)
        self.num_steps += 1
        self.num_prefill_tokens += step.num_prefill_tokens
        self.num_decode_tokens += step.num_decode_tokens
        self.num_drafts += step.num_drafts
        self.num_draft_tokens += step.num_draft_tokens
        self.num_accepted_tokens += step.num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos += [0] * (len(step.num_accepted_tokens_per_pos) - len(per_pos))
        for j, accepted in enumerate(step.num_accepted_tokens_per_pos):
            per_pos[j] += accepted

    def reset(self) -> None:
        """Forget every step so far (e.g. a warm-up before a measurement)."""
        self.steps.clear()
        self.num_steps = self.num_prefill_tokens = self.num_decode_tokens = 0
        # speculative decoding's totals (the server's counters read these)
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos: list[int] = []

    def summary(self) -> dict[str, float]:
        """Step counts and mean step times since the start (or the last ``reset``)."""
        steps = list(self.steps)
        decode_only = [s for s in steps if s.num_prefill_tokens == 0]
        mean_ms = lambda ss: 1e3 * sum(s.wall_time for s in ss) / max(len(ss), 1)  # noqa: E731
        return {
            "steps": self.num_steps,
            "decode_only_steps": len(decode_only),
            "mean_step_ms": mean_ms(steps),
            "mean_decode_step_ms": mean_ms(decode_only),
            "mean_decode_batch": sum(s.num_seqs for s in decode_only) / max(len(decode_only), 1),
        }

    def to_records(self) -> list[dict]:
        """The recorded steps as plain dicts (with ``wall_time``), oldest first."""
        steps = list(self.steps)  # a snapshot: the engine thread may be appending
        return [dict(asdict(s), wall_time=s.wall_time) for s in steps]


class TimelineRecorder:
    """Who ran what in every step: one entry per (step, request)."""

    def __init__(self) -> None:
        # (step, request_id, kind, num_tokens, start, end), kept as tuples: cheap to append
        self.entries: list[tuple[int, str, str, int, float, float]] = []

    def record(self, step: int, batch: SchedulerOutput, start: float, end: float) -> None:
        for seq, n, is_decode in zip(batch.seqs, batch.num_new_tokens, batch.is_decode):
            kind = "decode" if is_decode else "prefill"
            self.entries.append((step, seq.request_id, kind, n, start, end))

    def clear(self) -> None:
        self.entries.clear()

    def to_records(self, relative: bool = True) -> list[dict]:
        """Plain dicts ``{step, request_id, kind, num_tokens, start, end}``; with
        ``relative`` the times count from the first recorded step's start."""
        entries = list(self.entries)  # a snapshot: the engine thread may be appending
        t0 = entries[0][4] if relative and entries else 0.0
        keys = ("step", "request_id", "kind", "num_tokens")
        return [dict(zip(keys, e[:4]), start=e[4] - t0, end=e[5] - t0) for e in entries]


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default method)."""
    pos = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def latency_summary(metrics: Iterable[RequestMetrics],
                    percentiles: tuple[float, ...] = (50, 90, 99)) -> dict[str, dict[str, float]]:
    """Mean and percentiles (seconds) of queue time, TTFT, TPOT and e2e latency.

    Requests for which a figure is undefined (e.g. TPOT of a one-token answer) are left
    out of that figure; ``count`` says how many were used.
    """
    metrics = list(metrics)
    summary = {}
    for name in ("queue_time", "time_to_first_token", "time_per_output_token", "e2e_latency"):
        values = sorted(v for m in metrics if (v := getattr(m, name)) is not None)
        if not values:
            summary[name] = {"count": 0}
            continue
        row = {"count": len(values), "mean": sum(values) / len(values)}
        row.update({f"p{q:g}": _percentile(values, q) for q in percentiles})
        summary[name] = row
    return summary
