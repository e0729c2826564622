"""Turning a request into sequences: every check a request gets before it may enter the
engine, and its request id (chapters 00, 01 and 10).

``InputProcessor`` reads only settings fixed at start-up, so any thread may call it: bad input
raises ``ValueError`` in the submitting thread, never inside a step. It fans a request with
``SamplingParams.n > 1`` out into its samples. ``RequestIds`` alone gives out request ids.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, replace

from nanovllm.config import EngineConfig
from nanovllm.engine.sequence import Sequence
from nanovllm.inputs import parse_prompt
from nanovllm.models import ModelConfig
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured_output.backend_xgrammar import GrammarBackend, GrammarState
from nanovllm.tokenizer import Tokenizer
from nanovllm.validation import is_int


class InputProcessor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 tokenizer: Tokenizer | None, eos_token_ids: set[int], kv_capacity: int) -> None:
        self.config, self.model_config, self.tokenizer = config, model_config, tokenizer
        self.eos_token_ids = eos_token_ids
        self.kv_capacity = kv_capacity  # tokens the whole KV cache holds
        self.request_ids = RequestIds()  # the engine's one id allocator
        self._grammars: GrammarBackend | None = None  # made on the first constrained request
        self._grammars_lock = threading.Lock()

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

    def make_sequence(self, prompt: object, params: SamplingParams, request_id: str | None = None,
                      priority: int = 0) -> Sequence:
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
            raise ValueError(f"prompt has {len(token_ids)} tokens but max_model_len is {limit}; "
                             "it must leave room for at least one new token")
        longest = min(len(token_ids) + params.max_tokens, limit)
        capacity = self.kv_capacity
        if longest > capacity:
            raise ValueError(f"a request of up to {longest} tokens cannot fit in the KV cache "
                             f"({capacity} tokens); raise the KV budget or lower max_tokens")
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and longest > budget:
            # unchunked, a (re)computed prefill must fit one step, or it would wait forever
            raise ValueError(f"a request of up to {longest} tokens exceeds "
                             f"max_num_batched_tokens ({budget}) and chunked prefill is off; "
                             "enable it or raise the budget")
        grammar = self.grammar_state(params)
        seq = Sequence(token_ids, params, request_id, text, int(priority))
        seq.bad_word_ids, seq.grammar = bad_word_ids, grammar
        return seq

    def grammar_state(self, params: SamplingParams) -> GrammarState | None:
        """A fresh matcher for a request with ``structured_outputs`` (chapter 15), else None.
        Its constraint compiles here (cached): one that does not is a ``ValueError`` now."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer; this model folder has none")
        with self._grammars_lock:
            if self._grammars is None:
                with self.tokenizer._lock:  # xgrammar reads the vocabulary of the shared one
                    self._grammars = GrammarBackend(self.tokenizer.hf,
                                                    self.model_config.vocab_size,
                                                    self.eos_token_ids)
        return self._grammars.new_state(params.structured_outputs)

    def _check_token_settings(self, params: SamplingParams) -> list[list[int]]:
        """Check the token ids ``params`` name against this model; return its bad words as
        token ids (each word, and the word after a space: vLLM's two spellings)."""
        vocab = self.model_config.vocab_size
        named = [*params.stop_token_ids, *(params.logit_bias or ())]
        named += params.allowed_token_ids or ()
        if any(t >= vocab for t in named):
            raise ValueError("stop_token_ids, logit_bias and allowed_token_ids must name token ids "
                             f"below the vocabulary size {vocab}")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer; this model folder has none")
        words = [self.tokenizer.encode(spelling, add_special_tokens=False)
                 for word in params.bad_words or ()
                 for spelling in dict.fromkeys((word, " " + word.lstrip()))]
        if params.allowed_token_ids:
            banned = {w[0] for w in words if len(w) == 1}
            if params.min_tokens:
                banned |= set(params.stop_token_ids)
                banned |= set() if params.ignore_eos else self.eos_token_ids
            if set(params.allowed_token_ids) <= banned:
                raise ValueError("every allowed_token_id is banned (bad_words or min_tokens)")
        return [w for w in words if w]

    def make_sequences(self, prompt: object, params: SamplingParams, request_id: str | None = None,
                       priority: int = 0) -> list[Sequence]:
        """Validate one request and make a sequence for each of its ``params.n`` samples
        (vLLM's parallel sampling). Sample i has id ``f"{i}_{request_id}"`` and, with a
        seed, seed + i; only sample 0 computes prompt logprobs. Admitted together, the
        samples share the prompt's KV blocks through the prefix cache: computed once.
        Without ``request_id`` the id is a placeholder until ``RequestIds.claim``."""
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
            seq.has_user_request_id = first.has_user_request_id
            seq.grammar = self.grammar_state(child)  # each sample walks its own automaton
            samples.append(seq)
        return samples


@dataclass
class _Claim:
    seqs: list[Sequence]  # the request's samples
    held: bool  # by a front end, until it releases the id

    @property
    def in_use(self) -> bool:
        return self.held or not all(s.is_finished for s in self.seqs)


class RequestIds:
    """The one allocator of request ids: every way into the engine claims here.

    A claimed id is in use until its request has ended for whoever reads it: a front end
    claims with ``held=True`` and releases the id once it has the final output; a request
    added to the engine directly frees it when all its samples have finished. A user's id in
    use raises ``ValueError``; a generated id is the next number not in use. A request of n > 1
    samples claims its samples' ids (``f"{i}_{id}"``) too. A lock guards the table."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._numbers = itertools.count()
        self._claims: dict[str, _Claim] = {}  # request and sample ids -> their claim
        self._prune_at = 64  # forget ended claims when the table reaches this size

    def claim(self, seqs: list[Sequence], held: bool = False) -> str:
        """Give the request whose samples are ``seqs`` (all of them) its id, write it into
        the sequences and mark it in use; returns the id. Claiming sequences that hold
        their claim already changes nothing (but ``held`` sticks)."""
        first = seqs[0]
        with self._lock:
            claim = self._claims.get(first.parent_id)
            if claim is not None and any(s is first for s in claim.seqs):
                claim.held |= held
                return first.parent_id
            if len(seqs) == 1 and first.request_id != first.parent_id:
                raise ValueError("claim every sample of a request together (add_request)")
            if first.has_user_request_id:
                request_id = first.parent_id
                taken = [k for k in _keys(request_id, len(seqs)) if self._in_use(k)]
                if taken:
                    raise ValueError(f"request id {taken[0]!r} is already in use")
            else:
                request_id = next(str(n) for n in self._numbers
                                  if not any(self._in_use(k) for k in _keys(str(n), len(seqs))))
                for seq in seqs:  # the samples' ids derive from the request's
                    seq.parent_id = request_id
                    seq.request_id = request_id if len(seqs) == 1 else f"{seq.index}_{request_id}"
            if len(self._claims) >= self._prune_at:
                self._claims = {k: c for k, c in self._claims.items() if c.in_use}
                self._prune_at = 2 * len(self._claims) + 64
            claim = _Claim(list(seqs), held)
            for key in _keys(request_id, len(seqs)):
                self._claims[key] = claim
        return request_id

    def release(self, request_id: str) -> None:
        """Free ``request_id``, claimed with ``held=True``: its final output is out, or the
        request was aborted or never reached the engine."""
        with self._lock:
            claim = self._claims.get(request_id)
            if claim is None or not claim.held:
                return
            for key in _keys(request_id, len(claim.seqs)):
                if self._claims.get(key) is claim:
                    del self._claims[key]

    def _in_use(self, key: str) -> bool:
        claim = self._claims.get(key)
        return claim is not None and claim.in_use


def _keys(request_id: str, num_samples: int) -> list[str]:
    """The ids a request occupies: its own and, with several samples, theirs."""
    if num_samples == 1:
        return [request_id]
    return [request_id, *(f"{i}_{request_id}" for i in range(num_samples))]
