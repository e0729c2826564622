"""Prompts to token ids, on worker threads (chapter 10).

Tokenizing is the one piece of a request's work that grows with the client's input, and
on the event loop it would stall every connection while it runs: ``/health``, other
requests' streams. So ``PromptEncoder`` runs the tokenizer and the chat template on a
small pool of threads and awaits them. Hugging Face's fast tokenizer encodes in Rust
without the GIL; a chat template is Python, which the interpreter interleaves with the
event loop every few milliseconds. A prompt is checked against the context before
tokenizing (its characters, ``caps.py``) and after (``fits``: its tokens).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from nanovllm.serve.caps import check_chars
from nanovllm.serve.errors import bad_request

TOKENIZER_THREADS = 4
T = TypeVar("T")


class PromptEncoder:
    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="nanovllm-tokenize")

    async def off_loop(self, work: Callable[[], T]) -> T:
        """``work()`` on a worker thread; the event loop serves others meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, work)

    async def encode(self, prompt: str | list[int], param: str = "prompt",
                     special: bool = True) -> list[int]:
        """A prompt's token ids (token ids pass through: the engine checks their range)."""
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise bad_request("This model has no tokenizer: send token ids as the prompt.",
                              param)
        if not prompt:
            raise bad_request("The prompt is empty.", param)
        check_chars(prompt, self.max_model_len, param)
        return await self.off_loop(
            lambda: self.tokenizer.encode(prompt, add_special_tokens=special))

    async def encode_chat(self, conversation: list[dict[str, str]]) -> list[int]:
        """A conversation through the model's chat template, then the tokenizer."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("This model has no chat template; use /v1/completions.")
        check_chars("".join(m["content"] for m in conversation), self.max_model_len,
                    "messages")

        def render() -> str:
            try:
                return self.tokenizer.apply_chat_template(
                    conversation, add_generation_prompt=True, tokenize=False)
            except Exception as err:  # e.g. a template that insists roles alternate
                raise bad_request(f"The chat template refused the messages: {err}",
                                  "messages") from None

        text = await self.off_loop(render)
        # the template holds any start-of-text token already (as LLM.chat)
        return await self.encode(text, "messages", special=False)

    def fits(self, ids: list[int], param: str) -> list[int]:
        """``ids``, if they leave room in the context for a completion; else a 400."""
        if len(ids) >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {len(ids)} tokens, which leaves no room for a completion.",
                param, "context_length_exceeded",
            )
        return ids
