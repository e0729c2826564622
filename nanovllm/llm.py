"""``LLM``: the offline API, shaped like vLLM's (chapter 00).

llm = LLM(path)
outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
print(outputs[0].text)
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from typing import Any

from tqdm.auto import tqdm

from nanovllm.config import EngineConfig
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.output_processor import OutputProcessor, RequestState
from nanovllm.engine.sequence import Sequence
from nanovllm.inputs import as_prompt_list
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

Message = dict[str, str]


class LLM:
    """An inference engine for one model folder; ``**options`` are ``EngineConfig`` fields."""

    def __init__(self, model: str, **options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(str(model), **options))
        self.tokenizer = self.engine.tokenizer
        self.config = self.engine.config
        self._turn = threading.Lock()  # one generate() at a time
        # the requests of the generate() running (under _turn)
        self._outputs = OutputProcessor(self.tokenizer, self.engine.input_processor.request_ids)

    def shutdown(self) -> None:
        """Give the GPU back now: the KV cache, CUDA graphs, weights and workspaces are
        freed (and handed back to the driver), and tensor-parallel workers stop. Using the
        engine afterwards raises ``EngineShutDownError``. In a notebook, call this (or ``del
        llm``, which frees the same once nothing else holds the engine) before building the
        next ``LLM``: ``llm = LLM(b)`` builds b while a still holds its memory. Idempotent.
        (No ``__del__``: an ``AsyncEngine`` may run this engine after the ``LLM`` is gone.)"""
        self.engine.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block (chapter 04), e.g. between two timed runs of the
        same prompts; False, changing nothing, while a request is unfinished."""
        return self.engine.reset_prefix_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for all prompts together; outputs come in prompt order.

        ``prompts`` is one prompt or a list of them, each in a shape of ``nanovllm.inputs``
        (text, token ids, a ``{"prompt": ...}`` or ``{"prompt_token_ids": ...}`` dict, a 1-D
        integer array). ``sampling_params`` is one ``SamplingParams`` for all prompts or one
        per prompt; ``priority`` one integer per prompt (lower first) for
        ``scheduler_policy="priority"``. Every prompt is validated before any is submitted:
        one bad prompt raises ``ValueError`` and nothing runs. A request that fails on its
        own comes back with ``finish_reason == "error"`` and the message in ``error``.

        Calls from several threads take turns: each waits for the one running (for many
        concurrent clients use ``AsyncEngine``, chapter 10). If the call is interrupted
        (Ctrl-C) or raises, its requests are aborted and their KV blocks freed first.
        """
        prompts = as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        priorities = _as_priority_list(priority, len(prompts))
        requests = [
            self.engine.make_sequences(p, sp, None, pr)
            for p, sp, pr in zip(prompts, params, priorities)
        ]
        with self._turn:
            return self._run(requests, use_tqdm)

    def _run(self, requests: list[list[Sequence]], use_tqdm: bool) -> list[RequestOutput]:
        states: list[RequestState] = []
        try:
            with _ctrl_c_between_steps() as check_interrupt:
                for samples in requests:  # a request's samples (SamplingParams.n)
                    states.append(self._outputs.add_request(samples))  # (claims its id)
                    for seq in samples:
                        self.engine.add_sequence(seq)
                bar = tqdm(total=len(states), desc="Generating", disable=not use_tqdm, unit="req")
                with bar:
                    while self._outputs.has_unfinished_requests():
                        for update in self._outputs.process_outputs(self.engine.step()):
                            bar.update(update.finished)
                        check_interrupt()
        except BaseException:  # Ctrl-C included: leave nothing of this call in the engine
            ids = [state.request_id for state in states]
            self.engine.abort_request(ids)
            self._outputs.abort(ids)
            raise
        return [state.output() for state in states]  # texts now: not between steps

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}``) or several, using
        the model's chat template."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use generate() instead")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not conversations:
            raise ValueError("no messages given")
        texts = [
            self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
            for c in conversations
        ]
        # The template already holds any start-of-text token: don't let encode add another.
        prompts = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm, priority)
        for out, text in zip(outputs, texts):
            out.prompt = text
        return outputs


@contextmanager
def _ctrl_c_between_steps() -> Iterator[Callable[[], None]]:
    """Let Ctrl-C (SIGINT) interrupt between engine steps, not inside one, where it could
    leave a block half allocated: the first press is held until the running step ends
    (the yielded check then raises ``KeyboardInterrupt``); a second press interrupts at
    once. Signal handlers belong to the main thread, so other threads change nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    pressed = []

    def on_sigint(signum, frame) -> None:
        if pressed:
            raise KeyboardInterrupt
        pressed.append(signum)

    def check() -> None:
        if pressed:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield check
    finally:
        # (None: a handler installed outside Python; the default is the closest we have)
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)


def _as_params_list(
    params: SamplingParams | Seq[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def _as_priority_list(priority: list[int] | None, n: int) -> list[int]:
    if priority is None:
        return [0] * n
    if isinstance(priority, (str, bytes)) or not hasattr(priority, "__len__") or len(priority) != n:
        raise ValueError(f"priority must be a list of one integer per prompt, got {priority!r}")
    return list(priority)
