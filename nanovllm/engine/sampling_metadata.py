"""One step's sampling inputs, built on the host from the requests' settings (chapter 01).

``SamplingInputs.build`` turns the sampled rows' ``SamplingParams`` and token histories into
the sampler's tensors (``SamplingTensors``) and, only when some row asks for them, the logits
processors' (``LogitsProcessingTensors``). Nothing waits for the device: a token still in flight
(async scheduling, chapter 11) is patched in on the device from the previous step's tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.layers.logits_processors import LogitsProcessingTensors
from nanovllm.layers.sampler import SamplingTensors

ToDevice = Callable[[list | np.ndarray, torch.dtype], torch.Tensor]


class SamplingInputs:
    """Builds each step's sampling tensors; keeps each seeded request's generator."""

    def __init__(self, vocab_size: int, device: torch.device, to_device: ToDevice) -> None:
        self.vocab_size, self.device, self.to_device = vocab_size, device, to_device
        self.eos_token_ids: set[int] = set()  # set by the engine: what min_tokens holds back
        self._generators: dict[int, torch.Generator] = {}
        self._prompts: dict[int, np.ndarray] = {}

    def release(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)
        self._prompts.pop(seq_id, None)

    def _prompt(self, seq: Sequence) -> np.ndarray:
        """The prompt as an array, made once: the repetition penalty reads it every step."""
        if seq.seq_id not in self._prompts:
            self._prompts[seq.seq_id] = np.array(seq.token_ids[: seq.num_prompt_tokens])
        return self._prompts[seq.seq_id]

    def build(self, seqs: list[Sequence], in_flight: tuple[torch.Tensor, dict[int, int]]
              ) -> tuple[SamplingTensors, LogitsProcessingTensors | None]:
        """``in_flight``: the previous step's sampled tokens (device) and each sequence's row
        in them, for tokens still shown as placeholders on the host."""
        return self._sampling(seqs), self._processing(seqs, in_flight)

    def _sampling(self, seqs: list[Sequence]) -> SamplingTensors:
        params = [s.params for s in seqs]
        any_filter = any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params)
        columns = [[p.temperature for p in params]]
        if any_filter:  # most steps need no filter tensors: skip building them
            columns += [[p.top_k if p.top_k > 0 else self.vocab_size for p in params],
                        [p.top_p for p in params], [p.min_p for p in params]]
        table = self.to_device(columns, torch.float32)
        return SamplingTensors(
            temperatures=table[0],
            top_k=table[1].long() if any_filter else None,
            top_p=table[2] if any_filter else None,
            min_p=table[3] if any_filter else None,
            generators=[self._generator(s) for s in seqs],
            all_greedy=all(p.temperature == 0 for p in params),
            any_filter=any_filter,
        )

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None:
            return None
        if seq.seq_id not in self._generators:
            gen = torch.Generator(device=self.device).manual_seed(seq.params.seed)
            self._generators[seq.seq_id] = gen
        return self._generators[seq.seq_id]

    def _processing(self, seqs: list[Sequence], in_flight) -> LogitsProcessingTensors | None:
        params = [s.params for s in seqs]
        penalties = [p.presence_penalty != 0 or p.frequency_penalty != 0
                     or p.repetition_penalty != 1 for p in params]
        sequences = [[w for w in s.bad_word_ids if len(w) > 1] for s in seqs]
        holds_back = [s.num_output_tokens < s.params.min_tokens for s in seqs]
        if not (any(penalties) or any(sequences) or any(holds_back)
                or any(s.bad_word_ids for s in seqs)
                or any(p.logit_bias or p.allowed_token_ids for p in params)):
            return None  # the common case: nothing to do
        t = LogitsProcessingTensors()
        if any(penalties) or any(sequences):
            t.output_ids, t.output_lens = self._outputs(seqs, penalties, sequences, in_flight)
        if any(penalties):
            t.prompt_ids = self._padded([self._prompt(s) if on else []
                                         for s, on in zip(seqs, penalties)])
            t.presence_penalty, t.frequency_penalty, t.repetition_penalty = self.to_device(
                [[p.presence_penalty for p in params], [p.frequency_penalty for p in params],
                 [p.repetition_penalty for p in params]], torch.float32)
        bias = [(r, tok, v) for r, p in enumerate(params)
                for tok, v in (p.logit_bias or {}).items()]
        if bias:
            rows, tokens, values = zip(*bias)
            t.bias = (*self._ids([rows, tokens]), self.to_device(values, torch.float32))
        allowed = [(r, tok) for r, p in enumerate(params) for tok in p.allowed_token_ids or ()]
        if allowed:
            t.allowed = tuple(self._ids(list(zip(*allowed))))
        banned = [(r, tok) for r, s in enumerate(seqs) for tok in self._banned(s, holds_back[r])]
        if banned:
            t.banned = tuple(self._ids(list(zip(*banned))))
        if any(sequences):
            t.bad_sequences = self._bad_sequences(sequences)
        return t

    def _banned(self, seq: Sequence, holds_back: bool) -> list[int]:
        """Tokens ``seq`` may not take now: one-token bad words, and while ``min_tokens``
        holds it back, EOS (unless ignored) and its stop token ids."""
        banned = [w[0] for w in seq.bad_word_ids if len(w) == 1]
        if holds_back:
            banned += seq.params.stop_token_ids
            banned += [] if seq.params.ignore_eos else sorted(self.eos_token_ids)
        return banned

    def _outputs(self, seqs, penalties, sequences, in_flight):
        """Generated tokens of the rows that need them ([B, Lo], padded with -1), with the
        in-flight placeholder patched in on the device, and their counts."""
        outputs = [s.output_token_ids if on or seq_words else []
                   for s, on, seq_words in zip(seqs, penalties, sequences)]
        ids = self._padded(outputs)
        tokens, rows_of = in_flight
        patches = [(r, len(out) - 1, rows_of[s.seq_id])
                   for r, (s, out) in enumerate(zip(seqs, outputs))
                   if out and out[-1] == PLACEHOLDER]
        if patches:
            rows, cols, sources = self._ids(list(zip(*patches)))
            ids[rows, cols] = tokens[sources]
        return ids, self._ids([[len(out) for out in outputs]])[0]

    def _bad_sequences(self, sequences: list[list[list[int]]]) -> tuple:
        rows, prefixes, lengths, last = [], [], [], []
        for r, words in enumerate(sequences):
            for w in words:
                rows.append(r), prefixes.append(w[:-1]), lengths.append(len(w) - 1)
                last.append(w[-1])
        width = max(lengths)
        right_aligned = [[-1] * (width - len(p)) + p for p in prefixes]
        prefix_ids = self.to_device(np.array(right_aligned, dtype=np.int64), torch.int64)
        rows, lengths, last = self._ids([rows, lengths, last])
        return rows, prefix_ids, lengths, last

    def _padded(self, rows: list) -> torch.Tensor:
        width = max(1, max(map(len, rows)))
        padded = np.full((len(rows), width), -1, dtype=np.int64)
        for r, ids in enumerate(rows):
            padded[r, : len(ids)] = ids
        return self.to_device(padded, torch.int64)

    def _ids(self, columns: list) -> torch.Tensor:
        return self.to_device(np.array(columns, dtype=np.int64), torch.int64)
