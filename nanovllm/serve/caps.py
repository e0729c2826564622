"""Caps on what one request may ask for, checked before any tokenizing (chapter 10).

A request's cost is decided by a few of its fields: how many prompts and samples, how long
each prompt, how many stop strings and bad words (each one tokenized and matched at every
step), how many logit biases. Each has a cap here, checked on the parsed body before the
tokenizer or the engine sees it, so an oversized request costs a 400, not seconds of the
server's time. (The body's size is capped before it is read, ``body.py``; sequences per
request by the queue's capacity, ``admission.py``.)

A prompt's characters are capped relative to the context: no tokenizer packs more than
``MAX_CHARS_PER_TOKEN`` characters into a token on ordinary text, so a longer prompt
cannot fit in ``max_model_len`` tokens and is refused untokenized.
"""

from __future__ import annotations

from nanovllm.serve.errors import bad_request
from nanovllm.serve.protocol import SamplingFields

MAX_N = 128  # completions per prompt, as OpenAI allows
MAX_STOP = 16  # stop strings
MAX_BAD_WORDS = 128
MAX_WORD_CHARS = 1000  # characters in one stop string or bad word
MAX_LOGIT_BIAS = 300  # entries
MAX_CHARS_PER_TOKEN = 16


def check_fields(body: SamplingFields, max_model_len: int, max_tokens: int | None) -> None:
    """400 when a field asks for more than one request may; ``max_tokens`` is the request's
    completion limit (None: up to the context)."""
    if body.n > MAX_N:
        raise bad_request(f"n must be at most {MAX_N}.", "n")
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    for name, words, most in (("stop", stop, MAX_STOP),
                              ("bad_words", body.bad_words or [], MAX_BAD_WORDS)):
        if len(words) > most:
            raise bad_request(f"'{name}' has {len(words)} entries; at most {most} are allowed.",
                              name)
        if any(len(word) > MAX_WORD_CHARS for word in words):
            raise bad_request(f"Each entry of '{name}' must be at most {MAX_WORD_CHARS} "
                              "characters long.", name)
    if body.logit_bias is not None and len(body.logit_bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' has {len(body.logit_bias)} entries; at most "
                          f"{MAX_LOGIT_BIAS} are allowed.", "logit_bias")
    if max_tokens is not None and max_tokens >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens; max_tokens "
            f"{max_tokens} leaves no room for a prompt.", "max_tokens", "context_length_exceeded",
        )


def check_chars(text: str, max_model_len: int, param: str) -> None:
    """400 when ``text`` is too long to fit in the context, before tokenizing it."""
    most = MAX_CHARS_PER_TOKEN * max_model_len
    if len(text) > most:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{len(text)} characters, more than such a context can hold ({most}).",
            param, "context_length_exceeded",
        )
