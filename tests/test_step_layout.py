"""The step plan's named layout (``engine/step.py``): what crosses to tensor-parallel workers.

``PackedArrays`` lays named arrays of one dtype end to end in one buffer (one copy to the
device) and finds each again by name, on the host or in the buffer's device copy; a worker
unpacks the pickled plan the same way. These tests check the round trip field by field,
that a buffer of the wrong length is refused, and that the plan ``ModelRunner.prepare``
builds names what each field holds.
"""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm import LLM, SamplingParams
from nanovllm.configs import config_path
from nanovllm.engine.scheduler_output import SchedulerOutput
from nanovllm.engine.step import PackedArrays

DTYPES = {np.int64: torch.int64, np.int32: torch.int32}


def _field(draw, dtype) -> np.ndarray:
    """A random 1-D or 2-D array, often empty (no patches, no samples, no sequences)."""
    low, high = np.iinfo(dtype).min, np.iinfo(dtype).max
    values = st.integers(int(low), int(high))
    if draw(st.booleans()):
        shape = (draw(st.integers(0, 9)),)
    else:
        shape = (draw(st.integers(0, 5)), draw(st.integers(0, 7)))
    flat = draw(st.lists(values, min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    return np.array(flat, dtype=dtype).reshape(shape)


@st.composite
def named_arrays(draw):
    dtype = draw(st.sampled_from(list(DTYPES)))
    names = draw(st.lists(st.from_regex(r"[a-z][a-z_]{0,11}", fullmatch=True),
                          max_size=7, unique=True))
    return dtype, {name: _field(draw, dtype) for name in names}


@settings(max_examples=200, deadline=None)
@given(named_arrays())
def test_every_field_comes_back_exactly(case):
    dtype, arrays = case
    packed = PackedArrays.pack(dtype, **arrays)
    assert packed.buffer.dtype == dtype and packed.buffer.ndim == 1
    assert packed.buffer.size == sum(a.size for a in arrays.values())
    assert list(packed.shapes) == list(arrays)  # the order given
    received = pickle.loads(pickle.dumps(packed))  # as a worker gets it
    device_copy = torch.as_tensor(packed.buffer.copy())  # as _materialize's copy
    for views in (packed.unpack(), received.unpack(), packed.unpack(device_copy)):
        assert list(views) == list(arrays)
        for name, expected in arrays.items():
            got = np.asarray(views[name])
            assert got.dtype == dtype and got.shape == expected.shape, name
            assert np.array_equal(got, expected), name


def test_fields_are_views_of_the_one_buffer():
    packed = PackedArrays.pack(np.int64, a=[1, 2], b=[[3, 4], [5, 6]], c=[])
    device_copy = torch.as_tensor(packed.buffer.copy())
    views = packed.unpack(device_copy)
    views["b"][1, 0] = 50
    assert device_copy.tolist() == [1, 2, 3, 4, 50, 6]
    assert views["c"].shape == (0,)


def test_lists_pack_like_arrays():
    packed = PackedArrays.pack(np.int32, ids=[7, 8, 9], none=[], table=np.full((2, 3), -1))
    assert packed.buffer.tolist() == [7, 8, 9, -1, -1, -1, -1, -1, -1]
    assert packed.shapes == {"ids": (3,), "none": (0,), "table": (2, 3)}


@pytest.mark.parametrize("cut", [-1, 1])
def test_a_buffer_of_the_wrong_length_is_refused(cut):
    packed = PackedArrays.pack(np.int64, input_ids=[1, 2, 3], block_tables=[[4, 5], [6, 7]])
    wrong = np.arange(packed.buffer.size + cut)
    with pytest.raises(ValueError, match=r"input_ids \[3\], block_tables \[2, 2\] \(7 values\)"):
        packed.unpack(wrong)
    with pytest.raises(ValueError, match="does not hold"):
        packed.unpack(torch.as_tensor(wrong))


def test_a_buffer_of_the_wrong_shape_or_a_field_of_three_dimensions_is_refused():
    packed = PackedArrays.pack(np.int64, a=[1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"shape \[2, 2\]"):
        packed.unpack(packed.buffer.reshape(2, 2))
    with pytest.raises(ValueError, match="'cube' has 3 dimensions"):
        PackedArrays.pack(np.int64, cube=np.zeros((1, 1, 1)))


# -- the plan ModelRunner.prepare builds -------------------------------------------------------
BS = 16
# what these tests reach: the runner's packing, and the block manager for the sequences' blocks
PREPARE = ("04.prepare", "04.allocate", "04.free")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tiny = {**json.loads((config_path("qwen3-0.6b") / "config.json").read_text()),
            "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "num_hidden_layers": 1,
            "vocab_size": 1024}
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    (folder / "config.json").write_text(json.dumps(tiny))
    return LLM(folder, load_format="dummy", device="cpu", num_kv_blocks=64,
               enable_prefix_caching=False).engine


def _sequence(engine, num_tokens: int, computed: int):
    seq = engine.make_sequence(list(range(3, 3 + num_tokens)), SamplingParams(max_tokens=4))
    assert engine.block_manager.allocate(seq, num_tokens)
    seq.num_computed_tokens = computed
    return seq


@pytest.mark.assignment(*PREPARE)
def test_prepare_names_each_field_and_a_worker_decodes_the_same_step(engine):
    chunk = _sequence(engine, 40, 0)  # a prompt's first 20 tokens: nothing sampled
    decode = _sequence(engine, 20, 19)
    prompt = _sequence(engine, 5, 0)
    step = engine.runner.prepare(SchedulerOutput([chunk, decode, prompt], [20, 1, 5]))
    plan = step.plan
    order = [(decode, 19, 20), (chunk, 0, 20), (prompt, 0, 5)]  # decodes first
    positions = [p for _, start, end in order for p in range(start, end)]
    longs = plan.longs.unpack()
    assert list(longs) == ["input_ids", "positions", "slot_mapping", "sample_indices",
                           "patch_targets", "patch_sources"]
    assert longs["input_ids"].tolist() == [s.token_ids[p] for s, a, b in order
                                           for p in range(a, b)]
    assert longs["positions"].tolist() == positions
    assert longs["slot_mapping"].tolist() == [
        s.block_table[p // BS] * BS + p % BS for s, a, b in order for p in range(a, b)]
    assert longs["sample_indices"].tolist() == [0, 25]  # the decode's row, the prompt's last
    assert longs["patch_targets"].size == longs["patch_sources"].size == 0
    ints = plan.ints.unpack()
    assert ints["cu_seqlens_q"].tolist() == [0, 1, 21, 26]
    assert ints["seq_lens_k"].tolist() == [20, 20, 5]
    assert ints["block_tables"].tolist() == [
        s.block_table + [-1] * (3 - len(s.block_table)) for s, _, _ in order]
    assert (plan.num_tokens, plan.num_seqs, plan.num_samples) == (26, 3, 2)
    assert not plan.has_patches and plan.num_decodes == 1 and plan.max_seqlen_q == 20
    assert step.logit_rows == [-1, 0, 1]

    # A worker unpickles the plan and materializes it: the same tensors as rank 0's.
    worker_longs, worker_meta = engine.runner._materialize(pickle.loads(pickle.dumps(plan)))
    assert torch.equal(worker_longs["input_ids"], step.input_ids)
    assert torch.equal(worker_longs["positions"], step.positions)
    assert torch.equal(worker_longs["sample_indices"], step.sample_indices)
    for name in ("slot_mapping", "cu_seqlens_q", "seq_lens_k", "block_tables"):
        assert torch.equal(getattr(worker_meta, name), getattr(step.meta, name)), name
    assert worker_meta.cu_seqlens_q_host == step.meta.cu_seqlens_q_host == [0, 1, 21, 26]
    assert worker_meta.max_seqlen_k == 20

    alone = engine.runner.prepare(SchedulerOutput([chunk], [20])).plan  # mid-prompt only
    assert alone.num_samples == 0 and alone.longs.unpack()["sample_indices"].size == 0
    for seq in (chunk, decode, prompt):
        engine.block_manager.free(seq)


@pytest.mark.assignment(*PREPARE)
def test_the_names_cost_the_message_little(engine):
    """What a worker receives is the two buffers and a few hundred bytes of names and
    shapes: no per-field arrays, whose pickled headers would grow every step's message."""
    seqs = [_sequence(engine, 17, 16) for _ in range(8)]
    plan = engine.runner.prepare(SchedulerOutput(seqs, [1] * 8)).plan
    payload = plan.longs.buffer.nbytes + plan.ints.buffer.nbytes
    assert len(pickle.dumps(("step", plan), protocol=pickle.HIGHEST_PROTOCOL)) < payload + 800
    for seq in seqs:
        engine.block_manager.free(seq)
