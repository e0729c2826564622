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
    priority: int = 0

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
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
