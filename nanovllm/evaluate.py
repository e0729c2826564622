"""Quality checks for an engine: perplexity and greedy agreement (used by chapter 08).

``perplexity`` scores texts with the engine's own prompt logprobs (chapter 01 explains
``SamplingParams.prompt_logprobs``): a single prefill per text, no sampling. It is the
number to compare between, say, a quantized engine and the full-precision one.
``greedy_agreement`` compares two engines' greedy outputs token by token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from nanovllm.inputs import parse_prompt
from nanovllm.llm import LLM
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

# One prefill: prompt_logprobs=0 reports each prompt token's own logprob (and no top-k).
_SCORE = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)


@dataclass
class PerplexityResult:
    perplexity: float  # exp(mean_nll)
    mean_nll: float  # nats per scored token, averaged over all texts' tokens together
    num_tokens: int  # tokens scored: every token of each text but its first
    per_text: list[float]  # each text's own perplexity


def perplexity(
    llm: LLM, texts: Sequence[str] | Sequence[Sequence[int]], use_tqdm: bool = False
) -> PerplexityResult:
    """Perplexity of ``llm`` on ``texts`` (strings, tokenized as ``generate`` would, or token
    ids): exp of the negative log-likelihood per token, token-weighted across texts. Token
    i >= 1 of a text is scored given tokens 0..i-1; the first token is given, not scored.
    Raises ``ValueError`` for a text of fewer than 2 tokens (before anything runs)."""
    if isinstance(texts, str) or not texts:
        raise ValueError("texts must be a non-empty list of strings or of token-id lists")
    prompts = [_tokenize(llm, t) for t in texts]
    for i, ids in enumerate(prompts):
        if len(ids) < 2:
            raise ValueError(f"text {i} has {len(ids)} token(s); perplexity needs at least 2")
    outputs = llm.generate(prompts, _SCORE, use_tqdm=use_tqdm)
    sums, counts = [], []
    for ids, out in zip(prompts, outputs):
        if out.error or out.prompt_logprobs is None or len(out.prompt_logprobs) != len(ids):
            raise RuntimeError(f"scoring request {out.request_id} failed: {out.error}")
        scored = out.prompt_logprobs[1:]  # position 0 is None: nothing predicts it
        sums.append(-math.fsum(pos[tok].logprob for pos, tok in zip(scored, ids[1:])))
        counts.append(len(ids) - 1)
    mean_nll = math.fsum(sums) / sum(counts)
    return PerplexityResult(
        perplexity=math.exp(mean_nll),
        mean_nll=mean_nll,
        num_tokens=sum(counts),
        per_text=[math.exp(s / n) for s, n in zip(sums, counts)],
    )


def _tokenize(llm: LLM, text: str | Sequence[int]) -> list[int]:
    """Token ids as ``generate`` makes them from a prompt (``tokenizer.encode`` for text)."""
    text, ids = parse_prompt(text)
    if text is not None and llm.tokenizer is None:
        raise ValueError("this model folder has no tokenizer; pass token ids instead")
    return llm.tokenizer.encode(text) if text is not None else ids


@dataclass
class AgreementResult:
    exact_match: float  # fraction of requests whose token ids are identical
    prefix_agreement: float  # mean over requests of common prefix / reference length
    token_agreement: float  # sum of common prefixes / sum of reference lengths
    first_divergence: list[int | None]  # per request: first differing position, None if equal


Tokens = RequestOutput | Sequence[int]


def greedy_agreement(reference: Sequence[Tokens], candidate: Sequence[Tokens]) -> AgreementResult:
    """How far ``candidate``'s outputs follow ``reference``'s (e.g. a quantized engine
    against the full-precision one, both greedy). Each item is a ``RequestOutput`` (its
    first sample) or a list of token ids; the two lists pair up request by request.

    For one request the *common prefix* is the number of leading positions where both
    agree. Once greedy decoding diverges the rest is conditioned on different text, so
    nothing after the first divergence counts. A reference of no tokens agrees fully
    with an empty candidate and not at all otherwise. A candidate longer than an
    otherwise equal reference has prefix agreement 1 but is not an exact match.
    """
    if len(reference) != len(candidate) or not reference:
        raise ValueError(
            f"need two equally long non-empty lists, got {len(reference)} and {len(candidate)}"
        )
    prefixes, lengths, divergence = [], [], []
    for ref, cand in zip(reference, candidate):
        ref, cand = _ids(ref), _ids(cand)
        common = next(
            (i for i, (a, b) in enumerate(zip(ref, cand)) if a != b), min(len(ref), len(cand))
        )
        prefixes.append(common)
        lengths.append(len(ref))
        divergence.append(None if ref == cand else common)
    ratios = [p / n if n else float(d is None) for p, n, d in zip(prefixes, lengths, divergence)]
    total = sum(lengths)
    return AgreementResult(
        exact_match=sum(d is None for d in divergence) / len(divergence),
        prefix_agreement=sum(ratios) / len(ratios),
        token_agreement=sum(prefixes) / total if total else sum(ratios) / len(ratios),
        first_divergence=divergence,
    )


def _ids(item: Tokens) -> list[int]:
    return list(item.token_ids if isinstance(item, RequestOutput) else item)
