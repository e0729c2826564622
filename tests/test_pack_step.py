"""``pack_step`` alone (assignment ``04.prepare``): a scheduled step's model inputs, checked
against an independent pure-Python layout.

The sequences are built by hand (token ids, block tables, computed counts), with no block
manager or model: decodes, chunks of a prompt that end mid-prompt or at its end, a
one-token chunk (which counts as a decode for the order), a preempted sequence computed
again, prompts asking for prompt logprobs, and decodes whose newest token is still in flight
(a placeholder, async scheduling).
The reference lays every new token out as a (row, sequence, position) triple and finds each
slot by walking the block table slot by slot, rather than by the formula.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.engine.step import INT_FIELDS, LONG_FIELDS, pack_step
from nanovllm.sampling_params import SamplingParams

pytestmark = pytest.mark.assignment("04.prepare")

BS = 4
KEYS = {*LONG_FIELDS, *INT_FIELDS, "sample_seqs", "logit_rows", "prompt_logprobs"}


def _seq(prompt: int, outputs: int, computed: int, table: list[int], prompt_logprobs=None,
         in_flight: bool = False) -> Sequence:
    seq = Sequence(list(range(100, 100 + prompt)),
                   SamplingParams(max_tokens=64, prompt_logprobs=prompt_logprobs))
    seq.token_ids += list(range(900, 900 + outputs))
    if in_flight:
        seq.token_ids[-1] = PLACEHOLDER
    seq.num_computed_tokens = computed
    seq.block_table = list(table)
    return seq


def reference(seqs, num_new_tokens, block_size, in_flight_rows) -> dict:
    rows = [i for i, n in enumerate(num_new_tokens) if n == 1]
    rows += [i for i, n in enumerate(num_new_tokens) if n != 1]
    tokens = [(r, i, p) for r, i in enumerate(rows)
              for p in range(seqs[i].num_computed_tokens,
                             seqs[i].num_computed_tokens + num_new_tokens[i])]

    def slot(seq, position):
        slots = [block * block_size + k for block in seq.block_table for k in range(block_size)]
        return slots[position]

    cu = [0]
    for i in rows:
        cu.append(cu[-1] + num_new_tokens[i])
    width = max(len(seqs[i].block_table) for i in rows)
    sampled = [k for k, (_, i, p) in enumerate(tokens) if p == seqs[i].num_tokens - 1]
    sample_seqs = [seqs[tokens[k][1]] for k in sampled]
    logit_rows = [-1] * len(seqs)
    for m, k in enumerate(sampled):
        logit_rows[tokens[k][1]] = m
    last = {r: k for k, (r, _, _) in enumerate(tokens)}  # each row's last token
    patches = [k for r, k in sorted(last.items()) if seqs[tokens[k][1]].token_ids[
        tokens[k][2]] == PLACEHOLDER]
    prompt_logprobs = []
    for r, i in enumerate(rows):
        k = seqs[i].params.prompt_logprobs
        scored = [p for (r2, _, p) in tokens if r2 == r and p + 1 < seqs[i].num_prompt_tokens]
        if k is not None and scored:
            prompt_logprobs.append((seqs[i], cu[r], scored, k))
    return {
        "input_ids": [seqs[i].token_ids[p] for _, i, p in tokens],
        "positions": [p for _, _, p in tokens],
        "slot_mapping": [slot(seqs[i], p) for _, i, p in tokens],
        "cu_seqlens_q": cu,
        "seq_lens_k": [seqs[i].num_computed_tokens + num_new_tokens[i] for i in rows],
        "block_tables": [seqs[i].block_table + [-1] * (width - len(seqs[i].block_table))
                         for i in rows],
        "sample_indices": sampled,
        "sample_seqs": sample_seqs,
        "logit_rows": logit_rows,
        "patch_targets": patches,
        "patch_sources": [in_flight_rows[seqs[tokens[k][1]].seq_id] for k in patches],
        "prompt_logprobs": prompt_logprobs,
    }


def _plain(packed: dict) -> dict:
    """Comparable values: arrays as lists, sequences by identity."""
    out = {}
    for key, value in packed.items():
        if key == "sample_seqs":
            out[key] = [id(s) for s in value]
        elif key == "prompt_logprobs":
            out[key] = [(id(s), first, list(pos), k) for s, first, pos, k in value]
        else:
            out[key] = np.asarray(value).tolist()
    return out


def check(seqs, num_new_tokens, in_flight_rows=None) -> dict:
    in_flight_rows = in_flight_rows or {}
    packed = pack_step(seqs, num_new_tokens, BS, in_flight_rows)
    assert set(packed) == KEYS
    got, expected = _plain(packed), _plain(reference(seqs, num_new_tokens, BS, in_flight_rows))
    for key in sorted(KEYS):
        assert got[key] == expected[key], key
    return packed


def test_a_hand_built_step():
    decode = _seq(6, 3, 8, [7, 2, 9])  # 9 tokens, the 9th new: slot 9 * 4 + 0
    chunk = _seq(10, 0, 0, [4, 11])  # a prompt's first 6 tokens: not sampled
    last_chunk = _seq(7, 0, 4, [5, 1], prompt_logprobs=2)  # positions 4..6, then sampled
    in_flight = _seq(5, 2, 6, [3, 8], in_flight=True)  # its 7th token is still on the device
    one = _seq(9, 0, 4, [6, 10, 12])  # a one-token prompt chunk: packed with the decodes
    recompute = _seq(5, 3, 0, [13, 14])  # preempted: its prompt and 1 output again, unsampled
    seqs = [chunk, decode, last_chunk, in_flight, one, recompute]
    packed = check(seqs, [6, 1, 3, 1, 1, 6], {in_flight.seq_id: 5})
    # rows: decode, in_flight, one (n == 1, batch order), then chunk, last_chunk
    assert packed["positions"] == [8, 6, 4, 0, 1, 2, 3, 4, 5, 4, 5, 6, 0, 1, 2, 3, 4, 5]
    assert list(packed["slot_mapping"][:3]) == [36, 34, 40]  # block 9 row 0; 8 row 2; 10 row 0
    assert packed["cu_seqlens_q"] == [0, 1, 2, 3, 9, 12, 18]
    assert packed["seq_lens_k"] == [9, 7, 5, 6, 7, 6]
    assert packed["sample_indices"] == [0, 1, 11]  # decode, in_flight, last_chunk's last
    assert packed["logit_rows"] == [-1, 0, 2, 1, -1, -1]
    assert packed["input_ids"][1] == PLACEHOLDER
    assert (packed["patch_targets"], packed["patch_sources"]) == ([1], [5])
    # last_chunk scores positions 4 and 5 (their next tokens are prompt tokens), not 6
    assert [(s, first, pos, k) for s, first, pos, k in packed["prompt_logprobs"]] == [
        (last_chunk, 9, [4, 5], 2)]
    assert np.asarray(packed["block_tables"]).tolist() == [
        [7, 2, 9], [3, 8, -1], [6, 10, 12], [4, 11, -1], [5, 1, -1], [13, 14, -1]]


def test_prompt_logprobs_rows_follow_the_chunks():
    """A prompt of 9 tokens asking for prompt logprobs, computed in chunks: each chunk scores
    its positions before the last prompt token; the decode after it scores nothing."""
    seen = []
    for start, n in [(0, 4), (4, 4), (8, 1)]:
        seq = _seq(9, 0, start, [3, 1, 4], prompt_logprobs=0)
        other = _seq(3, 1, 3, [2])  # a decode before it in the packed order
        packed = check([seq, other], [n, 1])
        seen += [pos for _, _, pos, _ in packed["prompt_logprobs"]]
        assert all(first == 1 for _, first, _, _ in packed["prompt_logprobs"])
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7]]  # position 8's next token is generated
    decode = _seq(9, 2, 10, [3, 1, 4], prompt_logprobs=5)
    assert check([decode], [1])["prompt_logprobs"] == []


def test_only_decodes_and_only_one_prefill():
    decodes = [_seq(3, k, 2 + k, [20 + k, 30 + k]) for k in range(1, 6)]
    packed = check(decodes, [1] * 5)
    assert packed["sample_indices"] == [0, 1, 2, 3, 4] and packed["logit_rows"] == [0, 1, 2, 3, 4]
    prompt = _seq(13, 0, 0, [9, 3, 6, 1])
    packed = check([prompt], [13])
    assert packed["slot_mapping"] == [36, 37, 38, 39, 12, 13, 14, 15, 24, 25, 26, 27, 4]
    assert packed["sample_indices"] == [12] and packed["patch_targets"] == []


@pytest.mark.parametrize("seed", range(4))
def test_random_steps_match_the_reference(seed):
    rng = random.Random(seed)
    for _ in range(50):
        free = rng.sample(range(2000), 2000)
        seqs, num_new, in_flight_rows = [], [], {}
        for _ in range(rng.randint(1, 12)):
            prompt = rng.randint(1, 40)
            k = rng.choice([None, None, 0, 3])
            kind = rng.random()
            if kind < 0.4:  # decoding, its newest token maybe still in flight
                outputs = rng.randint(1, 6)
                computed, n = prompt + outputs - 1, 1
            elif kind < 0.6:  # recomputed after a preemption: prompt and outputs, in chunks
                outputs = rng.randint(1, 6)
                computed = rng.randint(0, prompt + outputs - 1)
                n = rng.randint(1, prompt + outputs - computed)
            else:  # a chunk of the prompt
                outputs, computed = 0, rng.randint(0, prompt - 1)
                n = rng.randint(1, prompt - computed)
            table = [free.pop() for _ in range(-(-(computed + n) // BS))]
            seq = _seq(prompt, outputs, computed, table, k,
                       in_flight=kind < 0.4 and rng.random() < 0.5)
            if outputs and seq.token_ids[-1] == PLACEHOLDER:
                in_flight_rows[seq.seq_id] = rng.randint(0, 300)
            seqs.append(seq)
            num_new.append(n)
        check(seqs, num_new, in_flight_rows)
