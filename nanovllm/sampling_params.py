"""How one request wants its tokens chosen and when it should stop (chapter 01).

Field names follow vLLM's ``SamplingParams`` so that what readers learn here transfers.
Every field is validated on construction: a bad value raises ``ValueError`` naming the
field, before the request ever reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request decoding settings.

    ``temperature == 0`` means greedy decoding. ``top_k = -1`` and ``top_p = 1`` disable
    those filters; ``min_p = 0`` disables min-p. A ``seed`` makes the request's random
    choices reproducible regardless of what else is in the batch.

    The last four fields only steer scheduling (``nanovllm.engine.policies``, chapter 06):
    ``priority`` and ``deadline`` for ``"priority"``, ``user`` for ``"fair"`` and
    ``request_class`` for ``"mixed"``; they never change which tokens are chosen.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    priority: int = 0  # lower = more important, as in vLLM (scheduler_policy="priority")
    deadline: float | None = None  # latency target, seconds after arrival (chapter 06)
    user: str | None = None  # tenant, for scheduler_policy="fair"
    request_class: str | None = None  # e.g. "interactive" / "batch", for "mixed"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_token_ids = list(self.stop_token_ids)
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 or >= 1, got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
            (_is_int(self.priority), f"priority must be an integer, got {self.priority!r}"),
            (
                self.deadline is None or _is_positive_number(self.deadline),
                f"deadline must be None or seconds > 0, got {self.deadline!r}",
            ),
            (self.user is None or isinstance(self.user, str), "user must be a string or None"),
            (
                self.request_class is None or isinstance(self.request_class, str),
                "request_class must be a string or None",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_positive_number(x: object) -> bool:
    # `x == x` rejects NaN; inf is allowed (it means "no hurry")
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and x > 0
