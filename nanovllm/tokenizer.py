"""The model's tokenizer, safe to share between threads (chapters 00 and 10).

Hugging Face's fast tokenizers are Rust objects that refuse concurrent use ("Already
borrowed") when one thread encodes while another encodes or decodes. The engine shares one
tokenizer between request submitters (encode), the engine thread (stop strings, final
texts) and stream consumers (incremental text), so ``Tokenizer`` serializes every call of
``encode``, ``decode``, ``__call__`` and ``apply_chat_template`` through one lock. Other
attributes (``eos_token_id``, ``convert_ids_to_tokens``, ...) are read from the wrapped
tokenizer as they are; ``tokenizer.hf`` is the wrapped tokenizer itself.
"""

from __future__ import annotations

import os
import threading
from typing import Any


class Tokenizer:
    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        self._lock = threading.Lock()

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        with self._lock:
            return self.hf.encode(text, **kwargs)

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        with self._lock:
            return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self.hf.apply_chat_template(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self.hf(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "hf":  # not set yet (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __len__(self) -> int:
        return len(self.hf)

    def __repr__(self) -> str:
        return f"Tokenizer({type(self.hf).__name__}, vocab={len(self.hf)})"


def load_tokenizer(path: str) -> Tokenizer | None:
    """The model folder's tokenizer, or None for a config-only folder (dummy weights)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any(os.path.exists(os.path.join(path, n)) for n in names):
        return None
    from transformers import AutoTokenizer

    # No "clean-up" of spaces before punctuation: it corrupts byte-level BPE text, and
    # transformers releases differ on whether they apply it (some warn on every decode).
    return Tokenizer(AutoTokenizer.from_pretrained(path, clean_up_tokenization_spaces=False))
