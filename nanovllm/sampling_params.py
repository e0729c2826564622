"""How one request wants its tokens chosen and when it should stop (chapter 01).

Field names follow vLLM's ``SamplingParams`` so that what readers learn here transfers.
Every field is validated on construction: a bad value raises ``ValueError`` naming the
field, the value and what is allowed, before the request ever reaches the engine, where
it could only fail (or, worse, quietly produce garbage) in the middle of a batch that
other requests share. The checks are a table of rules, ``(field, test, what is allowed)``,
written with the predicates of ``nanovllm/validation.py``, which ``EngineConfig`` (chapter 00),
``ModelConfig`` and the server's config use too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nanovllm.structured_output.params import StructuredOutputsParams
from nanovllm.validation import (
    Rule,
    check_fields,
    is_bool,
    is_finite,
    is_int,
    is_number,
    is_optional_str,
    is_positive_int,
    is_seed,
    optional,
)

# Below this a temperature is treated as 0, i.e. greedy (vLLM's _SAMPLING_EPS): dividing
# logits by, say, 1e-38 overflows to inf and the softmax turns into NaN.
SAMPLING_EPS = 1e-5
# The sampler applies top_p in float32; smaller values would round to 0 there and drop every
# token. Raised to this they still keep exactly the most likely token, as intended.
_FP32_TINY = 2.0**-126
# At most this many logprobs per token (vLLM's default max_logprobs, OpenAI's top_logprobs).
MAX_LOGPROBS = 20
# A logit bias is clamped to this, as OpenAI and vLLM do: +-100 already forces or bans a token.
MAX_LOGIT_BIAS = 100.0
# top_k travels to the device as a float32 and then an int64; beyond this no vocabulary
# reaches and the conversion could overflow.
MAX_TOP_K = 2**31 - 1


def _seconds(x: object) -> bool:
    """None, or a duration > 0 that a float holds (inf allowed: "no hurry"); 10**400 would
    overflow the float arithmetic of PriorityPolicy and fail a whole engine step."""
    return x is None or (is_number(x) and x > 0 and (isinstance(x, float) or is_finite(x)))


def _token_ids(x: object) -> bool:
    return isinstance(x, list) and all(is_int(t) and t >= 0 for t in x)


def _stop_strings(x: object) -> bool:
    return isinstance(x, list) and all(isinstance(s, str) and s for s in x)


def _optional_count(limit: int) -> Callable[[Any], bool]:
    return lambda x: x is None or (is_int(x) and 0 <= x <= limit)


def _penalty(x: object) -> bool:
    return is_finite(x) and -2 <= x <= 2


def _logit_bias(x: object) -> bool:
    return x is None or (
        isinstance(x, dict) and all(is_int(k) and k >= 0 and is_finite(v) for k, v in x.items())
    )


def _allowed(x: object) -> bool:
    return x is None or (isinstance(x, list) and len(x) > 0 and _token_ids(x))


def _bad_words(x: object) -> bool:
    return x is None or _stop_strings(x)


_RULES: tuple[Rule, ...] = (
    ("n", is_positive_int, "an int >= 1"),
    ("temperature", lambda x: is_finite(x) and x >= 0, "a finite number >= 0 (0 = greedy)"),
    ("top_k", lambda x: is_int(x) and (x == -1 or 1 <= x <= MAX_TOP_K),
     f"-1 (off) or an int in [1, {MAX_TOP_K}]"),
    ("top_p", lambda x: is_number(x) and 0 < x <= 1, "a number in (0, 1] (1 = off)"),
    ("min_p", lambda x: is_number(x) and 0 <= x <= 1, "a number in [0, 1] (0 = off)"),
    ("seed", optional(is_seed), "None or an int in [-2**63, 2**64 - 1]"),
    ("max_tokens", is_positive_int, "an int >= 1"),
    ("ignore_eos", is_bool, "a bool"),
    ("stop_token_ids", _token_ids, "a token id (int >= 0) or a list of them"),
    ("stop", _stop_strings, "a non-empty string or a list of them"),
    ("include_stop_str_in_output", is_bool, "a bool"),
    ("skip_special_tokens", is_bool, "a bool"),
    ("min_tokens", is_int, "an int"),  # its range depends on max_tokens: checked below
    ("logprobs", _optional_count(MAX_LOGPROBS), f"None or an int in [0, {MAX_LOGPROBS}]"),
    ("prompt_logprobs", _optional_count(MAX_LOGPROBS), f"None or an int in [0, {MAX_LOGPROBS}]"),
    ("presence_penalty", _penalty, "a number in [-2, 2] (0 = off)"),
    ("frequency_penalty", _penalty, "a number in [-2, 2] (0 = off)"),
    ("repetition_penalty", lambda x: is_finite(x) and x > 0, "a number > 0 (1 = off)"),
    ("logit_bias", _logit_bias, "None or a dict {token id: finite number}"),
    ("allowed_token_ids", _allowed, "None or a non-empty list of token ids"),
    ("bad_words", _bad_words, "None or a list of non-empty strings"),
    ("deadline", _seconds, "None or seconds > 0 (inf allowed)"),
    ("user", is_optional_str, "None or a string"),
    ("request_class", is_optional_str, "None or a string"),
    ("structured_outputs", optional(lambda x: isinstance(x, StructuredOutputsParams)),
     "None or a StructuredOutputsParams"),
)


@dataclass
class SamplingParams:
    """Per-request decoding settings.

    ``temperature == 0`` means greedy decoding; temperatures below ``SAMPLING_EPS`` (1e-5)
    are set to 0 on construction, as vLLM treats them. ``top_k = -1`` and ``top_p = 1``
    disable those filters; ``min_p = 0`` disables min-p. A ``seed`` makes the request's
    random choices reproducible regardless of what else is in the batch.

    ``stop_token_ids`` and ``stop`` end the request when a listed token or string is
    produced; a single id or string stands for a one-element list. As in vLLM, the text
    of a matched stop string is cut from the output unless ``include_stop_str_in_output``,
    and special tokens are left out of the text when ``skip_special_tokens``.

    vLLM's other request-level settings (``nanovllm/layers/logits_processors.py`` has the
    formulas and the order): ``n`` samples of the prompt (each a ``CompletionOutput``; with
    a seed, sample i uses seed + i); ``logprobs=k``, the chosen token's log-probability and
    rank plus the k most likely, per generated token, and ``prompt_logprobs=k`` the same per
    prompt token (from the model's raw distribution unless the engine's ``logprobs_mode``
    says otherwise); ``repetition_penalty`` (over prompt and output, > 1 discourages),
    ``presence_penalty`` and ``frequency_penalty`` (OpenAI's, over the output);
    ``min_tokens``, before which EOS, stop token ids and stop strings do not end the
    request; ``logit_bias`` ({token id: bias}, clamped to +-100), ``allowed_token_ids`` and
    ``bad_words`` (never generated, as spelled or after a space).

    ``structured_outputs`` constrains the output to a JSON schema, a regex, a choice or a
    grammar (``StructuredOutputsParams``, chapter 15): every token is sampled from those the
    constraint allows, and the request ends with "stop" when the constraint is complete.

    The last three fields only steer scheduling (``nanovllm.engine.policies``, chapter 06):
    ``deadline`` for ``"priority"``, ``user`` for ``"fair"`` and ``request_class`` for
    ``"mixed"``; they never change which tokens are chosen. A request's ``priority`` is not
    a sampling setting: as in vLLM it is passed with the request
    (``LLM.generate(..., priority=[...])``, ``LLMEngine.add_request(..., priority=)``).
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
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1  # samples of the prompt, each its own CompletionOutput
    min_tokens: int = 0  # no EOS or stop token id before this many tokens
    logprobs: int | None = None  # per generated token: its logprob, rank and the top k
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    deadline: float | None = None  # latency target, seconds after arrival (chapter 06)
    user: str | None = None  # tenant, for scheduler_policy="fair"
    request_class: str | None = None  # e.g. "interactive" / "batch", for "mixed"
    structured_outputs: StructuredOutputsParams | None = None  # chapter 15

    def __post_init__(self) -> None:
        # One id or string stands for a list of one; copies, so the caller's list can change.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple | list):
            self.stop = list(self.stop)
        if is_int(self.stop_token_ids):
            self.stop_token_ids = [self.stop_token_ids]
        elif isinstance(self.stop_token_ids, tuple | list):
            self.stop_token_ids = list(self.stop_token_ids)
        for name in ("allowed_token_ids", "bad_words"):  # copies, as for stop above
            if isinstance(getattr(self, name), tuple | list):
                setattr(self, name, list(getattr(self, name)))
        if isinstance(self.logit_bias, dict):
            self.logit_bias = dict(self.logit_bias)
        check_fields(self, _RULES)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens must be in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        if self.logit_bias:
            clamp = lambda v: min(max(float(v), -MAX_LOGIT_BIAS), MAX_LOGIT_BIAS)  # noqa: E731
            self.logit_bias = {int(k): clamp(v) for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        self.temperature = 0.0 if self.temperature < SAMPLING_EPS else float(self.temperature)
        self.top_p = max(float(self.top_p), _FP32_TINY)
        self.min_p = float(self.min_p)
        self.deadline = None if self.deadline is None else float(self.deadline)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
