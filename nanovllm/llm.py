"""``LLM``: the offline API, shaped like vLLM's (chapter 00).

llm = LLM(path)
outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
print(outputs[0].text)
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from nanovllm.config import EngineConfig
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """An inference engine for one model folder; ``**options`` are ``EngineConfig`` fields."""

    def __init__(self, model: str, **options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(str(model), **options))
        self.tokenizer = self.engine.tokenizer
        self.config = self.engine.config

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for all prompts together; outputs come in prompt order.

        ``prompts`` is a string, a list of token ids, or a list of either.
        ``sampling_params`` is one ``SamplingParams`` for all prompts or one per prompt.
        Every prompt is validated before any is submitted: one bad prompt raises
        ``ValueError`` and nothing runs.
        """
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        seqs = [self.engine.make_sequence(p, sp) for p, sp in zip(prompts, params)]
        for seq in seqs:
            self.engine.add_sequence(seq)
        bar = tqdm(total=len(seqs), desc="Generating", disable=not use_tqdm, unit="req")
        with bar:
            while any(not s.is_finished for s in seqs):
                finished = [s for s in self.engine.step() if s.is_finished]
                bar.update(len(finished))
        return [self.engine.output(s) for s in seqs]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
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
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        for out, text in zip(outputs, texts):
            out.prompt = text
        return outputs


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    if isinstance(prompts[0], int):
        return [prompts]
    return prompts


def _as_params_list(
    params: SamplingParams | Seq[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params
