"""Turning a request into sequences: every check a request gets before it may enter the
engine (chapters 00 and 01).

``InputProcessor`` reads only settings fixed at start-up (the config, the model's
vocabulary, the KV capacity), so any thread may call it: ``AsyncEngine`` validates in the
submitting thread, and bad input raises ``ValueError`` there, never inside a step. It also
fans a request with ``SamplingParams.n > 1`` out into its samples.
"""

from __future__ import annotations

from dataclasses import replace

from nanovllm.config import EngineConfig
from nanovllm.engine.sequence import Sequence
from nanovllm.inputs import parse_prompt
from nanovllm.models import ModelConfig
from nanovllm.sampling_params import SamplingParams
from nanovllm.tokenizer import Tokenizer
from nanovllm.validation import is_int


class InputProcessor:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        tokenizer: Tokenizer | None,
        eos_token_ids: set[int],
        kv_capacity: int,
    ) -> None:
        self.config, self.model_config, self.tokenizer = config, model_config, tokenizer
        self.eos_token_ids = eos_token_ids
        self.kv_capacity = kv_capacity  # tokens the whole KV cache holds

    def tokenize(self, prompt: object) -> tuple[str | None, list[int]]:
        """A prompt in any of the shapes of ``nanovllm.inputs`` -> (its text, its ids)."""
        text, token_ids = parse_prompt(prompt)
        if text is not None:
            if not text:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer; pass token ids instead")
            token_ids = self.tokenizer.encode(text)
        if not token_ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        if not all(0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return text, token_ids

    def make_sequence(
        self,
        prompt: object,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> Sequence:
        """Validate one request and wrap it in a Sequence (nothing enters the engine yet)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        if not is_int(priority):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        bad_word_ids = self._check_token_settings(params)
        text, token_ids = self.tokenize(prompt)
        limit = self.config.max_model_len
        if len(token_ids) >= limit:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens but max_model_len is {limit}; "
                "it must leave room for at least one new token"
            )
        longest = min(len(token_ids) + params.max_tokens, limit)
        capacity = self.kv_capacity
        if longest > capacity:
            raise ValueError(
                f"a request of up to {longest} tokens cannot fit in the KV cache "
                f"({capacity} tokens); raise the KV budget or lower max_tokens"
            )
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and longest > budget:
            # unchunked, a (re)computed prefill must fit one step, or it would wait forever
            raise ValueError(
                f"a request of up to {longest} tokens exceeds max_num_batched_tokens "
                f"({budget}) and chunked prefill is off; enable it or raise the budget"
            )
        seq = Sequence(token_ids, params, request_id, text, int(priority))
        seq.bad_word_ids = bad_word_ids
        return seq

    def _check_token_settings(self, params: SamplingParams) -> list[list[int]]:
        """Check the token ids ``params`` name against this model; return its bad words as
        token ids (each word, and the word after a space: vLLM's two spellings)."""
        vocab = self.model_config.vocab_size
        named = [*params.stop_token_ids, *(params.logit_bias or ())]
        named += params.allowed_token_ids or ()
        if any(t >= vocab for t in named):
            raise ValueError(
                f"stop_token_ids, logit_bias and allowed_token_ids must name token ids below "
                f"the vocabulary size {vocab}"
            )
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer; this model folder has none")
        words = [
            self.tokenizer.encode(spelling, add_special_tokens=False)
            for word in params.bad_words or ()
            for spelling in dict.fromkeys((word, " " + word.lstrip()))
        ]
        if params.allowed_token_ids:
            banned = {w[0] for w in words if len(w) == 1}
            if params.min_tokens:
                banned |= set(params.stop_token_ids)
                banned |= set() if params.ignore_eos else self.eos_token_ids
            if set(params.allowed_token_ids) <= banned:
                raise ValueError("every allowed_token_id is banned (bad_words or min_tokens)")
        return [w for w in words if w]

    def make_sequences(
        self,
        prompt: object,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> list[Sequence]:
        """Validate one request and make a sequence for each of its ``params.n`` samples
        (vLLM's parallel sampling). Sample i has id ``f"{i}_{request_id}"`` and, with a
        seed, seed + i; only sample 0 computes prompt logprobs. Admitted together, the
        samples share the prompt's KV blocks through the prefix cache: computed once."""
        first = self.make_sequence(prompt, params, request_id, priority)
        if params.n == 1:
            return [first]
        samples = []
        for i in range(params.n):
            # modulo 2**64, as a generator reads a seed: the largest seed too has n samples
            seed = None if params.seed is None else (params.seed + i) % 2**64
            prompt_logprobs = params.prompt_logprobs if i == 0 else None
            child = replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)
            seq = Sequence(first.token_ids, child, f"{i}_{first.request_id}", first.prompt,
                           first.priority)
            seq.parent_id, seq.index = first.request_id, i
            samples.append(seq)
        return samples
