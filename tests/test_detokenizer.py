"""The incremental detokenizer (nanovllm/detokenizer.py) with SmolLM2's byte-level tokenizer:
its text equals a full decode however the ids arrive, and stop strings in any script cut
it exactly where a full decode would be cut."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from nanovllm.detokenizer import IncrementalDetokenizer
from nanovllm.engine.stream import RequestStream
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "中华人民共和国",
    "🚀🚀🚀",
    "héllo 🙂 wörld, 日本語 text\n\tend",
    "Mixed: 中华人民共和国 🚀 and ASCII; 👩‍👩‍👧 family, ñ, ß, Ω.",
    "combining: e\u0301 a\u0300 n\u0303 o\u0308\u0304",
    "<|im_start|>user\n你好 🚀<|im_end|>\n<|im_start|>assistant\nok<|endoftext|>",
]
STOP_TEXT = "The answer: 中华人民共和国 🚀🚀🚀 done. 中华人民共和国 again 🚀!"


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def chunkings(n: int, seed: int = 0) -> list[list[int]]:
    """Chunk sizes covering n tokens: one by one, all at once, and random sizes."""
    rng = random.Random(seed)
    out = [[1] * n, [n]]
    for _ in range(3):
        sizes, left = [], n
        while left:
            sizes.append(min(rng.randint(1, 5), left))
            left -= sizes[-1]
        out.append(sizes)
    return out


def feed(detok: IncrementalDetokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    pieces, i = [], 0
    for size in sizes:
        pieces.append(detok.push(ids[i : i + size]))
        i += size
    return pieces


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_a_full_decode(tok, text, skip):
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids, skip_special_tokens=skip)
    for sizes in chunkings(len(ids)):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        pieces = feed(detok, ids, sizes)
        assert "".join(pieces) == detok.text == full
        assert "\ufffd" not in "".join(pieces)  # half characters are held until complete
        assert detok.finish(full) == "" and detok.stop_reason is None


@pytest.mark.parametrize("skip", [True, False])
def test_a_character_split_by_a_special_token(tok, skip):
    ids = tok.encode("🚀", add_special_tokens=False)
    assert len(ids) == 3
    ids = ids[:2] + [tok.eos_token_id] + ids[2:]
    full = tok.decode(ids, skip_special_tokens=skip)  # skipped: the bytes join up again
    for sizes in chunkings(len(ids)):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        pieces = feed(detok, ids, sizes)
        assert detok.text == full and "".join(pieces) + detok.finish(full) == full


def test_output_ending_inside_a_character(tok):
    ids = tok.encode("a🚀🚀", add_special_tokens=False)[:-1]
    full = tok.decode(ids)
    assert full.endswith("\ufffd")
    detok = IncrementalDetokenizer(tok)
    assert "".join(feed(detok, ids, [1] * len(ids))) == "a🚀"  # the half character waits
    assert detok.text == full and detok.finish(full) == "\ufffd"


def check_stop(tok, ids, stop, include, sizes, skip=True) -> None:
    """Feed ids; the text must be the full decode cut at the first occurrence of stop."""
    full = tok.decode(ids, skip_special_tokens=skip)
    at = full.index(stop)
    expected = full[: at + len(stop)] if include else full[:at]
    detok = IncrementalDetokenizer(tok, [stop], include, skip)
    settled = ""
    for piece in feed(detok, ids, sizes):
        settled += piece
        if detok.stop_reason is None:
            assert len(settled) <= at  # never the start of the stop string the output cuts
    assert detok.stop_reason == stop
    assert settled == detok.text == expected
    assert detok.finish(expected) == ""
    assert detok.push(ids[:3]) == "" and detok.text == expected  # later tokens are ignored


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("length", [1, 2, 7, 12])
def test_stop_strings_matched_at_every_position(tok, length, include):
    ids = tok.encode(STOP_TEXT, add_special_tokens=False)
    for start in range(len(STOP_TEXT) - length + 1):
        stop = STOP_TEXT[start : start + length]
        for sizes in chunkings(len(ids), seed=start):
            check_stop(tok, ids, stop, include, sizes)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop", ["中华人民共和国", "🚀🚀🚀", "done.", "国 🚀"])
def test_stop_strings_in_any_script(tok, stop, include):
    ids = tok.encode(STOP_TEXT, add_special_tokens=False)
    for sizes in chunkings(len(ids)):
        check_stop(tok, ids, stop, include, sizes)


def test_stop_on_a_special_token_only_when_it_is_in_the_text(tok):
    ids = tok.encode(TEXTS[-1], add_special_tokens=False)
    check_stop(tok, ids, "<|im_end|>", False, [1] * len(ids), skip=False)
    detok = IncrementalDetokenizer(tok, ["<|im_end|>"], skip_special_tokens=True)
    feed(detok, ids, [1] * len(ids))
    assert detok.stop_reason is None and detok.text == tok.decode(ids, skip_special_tokens=True)


def test_the_stop_string_completed_first_wins(tok):
    ids = tok.encode("xx abcd yy xbcx", add_special_tokens=False)
    for sizes in chunkings(len(ids)):  # the same answer however many tokens a push brings
        detok = IncrementalDetokenizer(tok, ["abcd", "c", "xb"])
        feed(detok, ids, sizes)
        assert (detok.stop_reason, detok.text) == ("c", "xx ab")
        detok = IncrementalDetokenizer(tok, ["bc", "abc"], include_stop_str_in_output=True)
        feed(detok, ids, sizes)  # both end at the same character: the earlier start wins
        assert (detok.stop_reason, detok.text) == ("abc", "xx abc")


def test_hold_back_is_the_longest_stop_minus_one(tok):
    text = "plain ascii words that never contain the stop string at all"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, ["中华人民共和国", "x"])
    settled = ""
    for i, piece in enumerate(feed(detok, ids, [1] * len(ids))):
        settled += piece
        so_far = tok.decode(ids[: i + 1])
        assert so_far.startswith(settled) and len(so_far) - len(settled) == min(6, len(so_far))
    assert detok.text == text and detok.finish(text) == text[-6:]


def test_without_a_tokenizer_there_is_no_text():
    detok = IncrementalDetokenizer(None, ["a"])
    assert detok.push([1, 2, 3]) == "" and detok.text == "" and detok.stop_reason is None
    assert detok.finish("final") == "final"


def test_request_stream_passes_the_params(tok):
    ids = tok.encode("one 🚀 two 🚀 three", add_special_tokens=False)
    params = SamplingParams(stop=["🚀"], include_stop_str_in_output=True)
    stream = RequestStream("r", tok, params)
    final = RequestOutput("r", None, [], [CompletionOutput(0, "one 🚀", ids, "stop")], True)
    for t in ids:
        stream.push([t])
    stream.end(output=final)
    assert "".join(chunk.text for chunk in stream) == "one 🚀"


LETTERS = st.characters(categories=["Lu", "Ll", "Nd", "Zs"])
CJK = st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF)
EMOJI = st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF)
TEXT = st.text(st.one_of(LETTERS, CJK, EMOJI), min_size=1, max_size=40)
SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(text=TEXT, data=st.data(), include=st.booleans())
def test_any_text_any_stop_any_chunking(tok, text, data, include):
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    start = data.draw(st.integers(0, len(full) - 1))
    stop = full[start : data.draw(st.integers(start + 1, min(len(full), start + 8)))]
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)))
    assume("\ufffd" not in full)
    check_stop(tok, ids, stop, include, sizes)


@SETTINGS
@given(
    ids=st.lists(st.one_of(st.integers(0, 300), st.integers(0, 49151)), max_size=40),
    skip=st.booleans(),
)
def test_random_ids_even_invalid_utf8_decode_like_a_full_decode(tok, ids, skip):
    """Ids below 300 are special tokens and single bytes: broken UTF-8 of every kind."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces = [detok.push([t]) for t in ids]
    full = tok.decode(ids, skip_special_tokens=skip)
    assert detok.text == full and "".join(pieces) + detok.finish(full) == full


@pytest.mark.parametrize("min_tokens", [0, 1, 3, 6, 40])
def test_min_tokens_ignores_stops_that_end_before_it_in_any_chunking(tok, min_tokens):
    """A stop string counts only if it ends in the text of token number ``min_tokens`` or
    later: the same cut whether the tokens come one by one or all at once."""
    ids = tok.encode("a. b. c. d. e. f. g.", add_special_tokens=False)
    cuts = set()
    for chunks in ([[t] for t in ids], [ids], [ids[:2], ids[2:7], ids[7:]]):
        detokenizer = IncrementalDetokenizer(tok, ["."], min_tokens=min_tokens)
        for chunk in chunks:
            detokenizer.push(chunk)
        cuts.add((detokenizer.text, detokenizer.stop_reason))
    assert len(cuts) == 1
    text, reason = cuts.pop()
    reference = IncrementalDetokenizer(tok, ["."])
    for i, t in enumerate(ids):  # one by one, searching only from token min_tokens on
        if i + 1 >= min_tokens:
            reference.push([t])
        else:
            reference.stop = ()  # not yet searching...
            reference.push([t])
            reference.stop = (".",)  # ...then searching again
    assert (text, reason) == (reference.text, reference.stop_reason)
