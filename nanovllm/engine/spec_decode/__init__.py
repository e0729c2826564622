"""Speculative decoding (chapter 14): propose a few tokens cheaply, verify them all in one
target forward pass, keep the longest prefix that exact rejection sampling accepts.

``nanovllm/speculative_config.py`` reads vLLM's ``speculative_config`` (a leaf module, so
that ``EngineConfig`` can validate it without importing the engine); here,
``ngram_proposer.py``, ``draft_layers.py`` and ``draft_model.py`` propose,
``rejection_sampler.py`` accepts or resamples, ``scheduling.py`` is the scheduler's half
(slots for proposals, proposals into the step, rollback of rejected ones) and
``speculator.py`` runs one speculative step for the engine and counts acceptance.
"""
