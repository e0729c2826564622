"""Speculative decoding (chapter 14): propose a few tokens cheaply, verify them all in one
target forward pass, keep the longest prefix that exact rejection sampling accepts.

``config.py`` reads vLLM's ``speculative_config``; ``ngram_proposer.py`` and
``draft_layers.py`` propose; ``rejection_sampler.py`` accepts or resamples; ``scheduling.py``
is the scheduler's half (draft slots, drafts into the batch, rollback of rejected tokens);
``speculator.py`` runs one speculative step for the engine and counts acceptance.
"""

from nanovllm.spec_decode.config import SpeculativeConfig, parse_speculative_config

__all__ = ["SpeculativeConfig", "parse_speculative_config"]
