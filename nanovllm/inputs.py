"""The shapes a prompt may take, as in vLLM (chapter 00).

A prompt is one of

- a string: ``"Hello"``, tokenized by the model's tokenizer;
- token ids: a list of ints, or a 1-D integer numpy array or torch tensor;
- ``{"prompt": "Hello"}`` (vLLM's ``TextPrompt``) or ``{"prompt_token_ids": [1, 2]}``
  (``TokensPrompt``).

Anything else raises ``ValueError`` here, before a request is made: a dict with other keys
is not read as text, and ``True`` is not a token id.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, Union

import numpy as np

Prompt = Union[str, list[int], dict[str, Any], np.ndarray, "torch.Tensor"]  # noqa: F821


def parse_prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    """``(text, None)`` for a text prompt, ``(None, token_ids)`` for token ids."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"], None
        if keys == {"prompt_token_ids"}:
            return None, _token_ids(prompt["prompt_token_ids"])
        raise ValueError(
            "a dict prompt must be {'prompt': str} or {'prompt_token_ids': [int, ...]}, "
            f"got keys {sorted(map(str, keys))}"
        )
    return None, _token_ids(prompt)


def _token_ids(ids: Any) -> list[int]:
    if _is_array(ids):
        if ids.ndim != 1 or not _integer_dtype(ids):
            raise ValueError(
                f"token ids must be a 1-D integer array, got shape {tuple(ids.shape)} "
                f"of {ids.dtype}"
            )
        return [int(t) for t in ids.tolist()]
    if isinstance(ids, (list, tuple)):
        if not all(_is_token(t) for t in ids):
            bad = next(t for t in ids if not _is_token(t))
            raise ValueError(f"token ids must be integers, got {bad!r}")
        return [int(t) for t in ids]
    raise ValueError(
        "a prompt must be a string, a list of token ids, a 1-D integer array, or a dict "
        f"with 'prompt' or 'prompt_token_ids'; got {type(ids).__name__}"
    )


def _is_token(t: Any) -> bool:
    # numbers.Integral covers numpy integers; a bool is an int to Python but not a token
    return isinstance(t, numbers.Integral) and not isinstance(t, (bool, np.bool_))


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or type(x).__name__ == "Tensor" and hasattr(x, "ndim")


def _integer_dtype(x: Any) -> bool:
    if isinstance(x, np.ndarray):
        return np.issubdtype(x.dtype, np.integer)
    return not x.dtype.is_floating_point and not x.dtype.is_complex and str(x.dtype) != "torch.bool"


def as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt or a sequence of prompts -> a non-empty list of prompts."""
    if isinstance(prompts, (str, dict)) or _is_array(prompts):
        return [prompts]
    if not isinstance(prompts, Sequence):
        kind = type(prompts).__name__
        raise ValueError(f"prompts must be a prompt or a list of prompts, got {kind}")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    if any(_is_token(p) for p in prompts):
        return [prompts]  # a single prompt of token ids (parse_prompt checks the rest)
    return prompts
