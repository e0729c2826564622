"""Chapter 15 without a model: the constraint's parameters, the packed-bitmask application
(assignment 15.apply_mask) against xgrammar's own kernel and a bit-by-bit reference, the toy
DFA's token mask (assignment 15.dfa_mask) against Python's ``re``, and the xgrammar backend's
compile errors, cache and rollback."""

from __future__ import annotations

import re

import pytest
import torch

from nanovllm import SamplingParams, StructuredOutputsParams
from nanovllm.structured_output.masks import apply_token_bitmask, bitmask_words
from nanovllm.structured_output.toy_dfa import DFA, dfa_mask, number_dfa

# -- the parameters --------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {}, {"json": {"type": "object"}, "regex": "a"}, {"choice": []}, {"choice": ["a", 1]},
    {"regex": ""}, {"grammar": 3}, {"json": "{not json"}, {"json": [1, 2]},
    {"json_object": "yes"}, {"regex": "a", "disable_any_whitespace": 1},
    {"json": {"type": "object"}, "disable_any_whitespace": "false"},
    {"json_object": True, "disable_any_whitespace": None},
])
def test_params_reject_anything_but_exactly_one_wellformed_constraint(kwargs):
    with pytest.raises(ValueError):
        StructuredOutputsParams(**kwargs)


def test_json_is_compact_by_default_and_the_switch_is_a_validated_bool():
    assert StructuredOutputsParams(json={"type": "object"}).disable_any_whitespace is True
    assert StructuredOutputsParams(json_object=True).disable_any_whitespace is True
    spaced = StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=False)
    assert spaced.key() != StructuredOutputsParams(json={"type": "object"}).key()  # two grammars
    with pytest.raises(ValueError, match="disable_any_whitespace must be a bool.*got 'no'"):
        StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace="no")


def test_params_normalise_and_key():
    a = StructuredOutputsParams(json='{"type": "object", "required": ["a"]}')
    b = StructuredOutputsParams(json={"required": ["a"], "type": "object"})
    assert a.json == b.json and a.key() == b.key() and a.kind == "json"
    assert StructuredOutputsParams(choice=("x", "y")).key() == ("choice", ("x", "y"), True)
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    assert params.structured_outputs.regex == "a+"


# -- 15.apply_mask ---------------------------------------------------------------------


def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Bit by bit, in Python: the slow, obvious version."""
    out = logits.clone()
    for i, r in enumerate(rows):
        for t in range(logits.shape[1]):
            word = int(bitmask[i, t // 32]) & 0xFFFFFFFF
            if not (word >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


def random_case(batch: int, vocab: int, rows: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), bitmask_words(vocab)),
                            dtype=torch.int32, generator=gen)
    return logits, bitmask


@pytest.mark.assignment("15.apply_mask")
@pytest.mark.parametrize("vocab", [32, 45, 100])
def test_apply_mask_matches_a_bit_by_bit_reference(vocab):
    rows = [3, 0]
    logits, bitmask = random_case(5, vocab, rows, seed=vocab)
    expected = reference_apply(logits, bitmask, rows)
    got = apply_token_bitmask(logits.clone(), bitmask, torch.tensor(rows))
    assert torch.equal(got, expected)


@pytest.mark.assignment("15.apply_mask")
def test_apply_mask_matches_xgrammars_kernel_and_leaves_other_rows_alone():
    xgr = pytest.importorskip("xgrammar")
    batch, vocab, rows = 6, 1000, [1, 4, 5]
    logits, bitmask = random_case(batch, vocab, rows, seed=0)
    full = torch.full((batch, bitmask_words(vocab)), -1, dtype=torch.int32)
    full[rows] = bitmask
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, full, indices=rows)
    got = logits.clone()
    assert apply_token_bitmask(got, bitmask, torch.tensor(rows)) is got  # in place
    assert torch.equal(got, expected)
    for r in (0, 2, 3):  # unconstrained rows: bit-identical
        assert torch.equal(got[r], logits[r])


@pytest.mark.assignment("15.apply_mask")
def test_apply_mask_edge_words_and_no_rows():
    vocab = 70  # 3 words, the last one part padding
    logits = torch.zeros(2, vocab)
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 0] = -2**31  # only the sign bit: token 31
    bitmask[0, 1] = 1  # token 32
    bitmask[0, 2] = -1  # tokens 64..69, and padding bits past the vocabulary
    got = apply_token_bitmask(logits.clone(), bitmask, torch.tensor([1]))
    allowed = torch.isfinite(got[1]).nonzero().flatten().tolist()
    assert allowed == [31, 32, 64, 65, 66, 67, 68, 69]
    assert torch.equal(got[0], logits[0])
    unchanged = apply_token_bitmask(logits.clone(), bitmask[:0], torch.tensor([], dtype=torch.long))
    assert torch.equal(unchanged, logits)


# -- 15.dfa_mask -----------------------------------------------------------------------

NUMBER = r"-?[0-9]+(\.[0-9]+)?"
VOCAB = ["<eos>", "-", "1", "12", "3.", ".5", ".", "-7", "0.25", "a", "1a", "", "--", "9.9.",
         "42", "-.", "..", "7"]


def viable(text: str) -> bool:
    """Whether ``text`` can still grow into a whole number: for this regex, adding at most
    one digit completes any viable prefix (independent of the DFA)."""
    return any(re.fullmatch(NUMBER, text + tail) for tail in ("", "0"))


def reach(dfa: DFA, text: str) -> int:
    state = dfa.walk(dfa.start, text)
    assert state is not None
    return state


@pytest.mark.assignment("15.dfa_mask")
@pytest.mark.parametrize("prefix", ["", "-", "12", "12.", "3.5"])
def test_dfa_mask_matches_pythons_re(prefix):
    dfa = number_dfa()
    allowed = dfa_mask(dfa, reach(dfa, prefix), VOCAB, eos_id=0)
    expected = {t for t, text in enumerate(VOCAB) if t and text and viable(prefix + text)}
    if re.fullmatch(NUMBER, prefix):
        expected.add(0)
    assert allowed == expected


@pytest.mark.assignment("15.dfa_mask")
def test_dfa_mask_eos_only_in_accepting_states_and_empty_tokens_never():
    dfa = number_dfa()
    for state in dfa.states:
        allowed = dfa_mask(dfa, state, VOCAB, eos_id=0)
        assert (0 in allowed) == (state in dfa.accepting)
        assert 11 not in allowed  # the empty token
    assert dfa_mask(dfa, 2, ["x", "y"], eos_id=5) == {5}  # (eos_id outside a tiny vocabulary)


@pytest.mark.assignment("15.dfa_mask")
def test_dfa_mask_on_another_automaton_whole_tokens_only():
    # (yes|no): a token must survive all its characters, not just the first
    dfa = DFA({0: {"y": 1, "n": 4}, 1: {"e": 2}, 2: {"s": 3}, 4: {"o": 3}}, accepting={3})
    vocab = ["</s>", "y", "ye", "yes", "yo", "no", "nope", "e", "s", "yess"]
    assert dfa_mask(dfa, 0, vocab, eos_id=0) == {1, 2, 3, 5}
    assert dfa_mask(dfa, 1, vocab, eos_id=0) == {7}
    assert dfa_mask(dfa, 3, vocab, eos_id=0) == {0}
    assert dfa.matches("yes") and not dfa.matches("ye")


# -- the xgrammar backend --------------------------------------------------------------


@pytest.fixture(scope="module")
def backend(smollm2_dir):
    pytest.importorskip("xgrammar")
    from nanovllm.structured_output.backend_xgrammar import GrammarBackend
    from nanovllm.tokenizer import load_tokenizer

    return GrammarBackend(load_tokenizer(str(smollm2_dir)).hf, 49152, {2})


@pytest.mark.parametrize("kwargs", [
    {"json": {"type": "objectx"}}, {"regex": "(ab"}, {"regex": "[a-"},
    {"grammar": "root ::= undefined_rule"}, {"grammar": "this is not ebnf"},
])
def test_backend_compile_errors_are_value_errors(backend, kwargs):
    with pytest.raises(ValueError, match="does not compile"):
        backend.compile(StructuredOutputsParams(**kwargs))


def test_backend_caches_compiled_constraints(backend):
    a = backend.compile(StructuredOutputsParams(json={"type": "object"}))
    b = backend.compile(StructuredOutputsParams(json='{"type": "object"}'))
    assert a is b
    assert backend.compile(StructuredOutputsParams(regex="a+")) is not a


def allowed_after(backend, params: StructuredOutputsParams, tokens: list[int]) -> set[int]:
    """The tokens the compiled constraint allows after ``tokens``, read bit by bit from the
    matcher's packed mask (not through ``apply_token_bitmask``: an assignment)."""
    state = backend.new_state(params)
    for token in tokens:
        state.accept(token)
    bitmask = torch.zeros(1, bitmask_words(49152), dtype=torch.int32)
    state.fill(bitmask, 0)
    words = bitmask[0].tolist()
    return {t for t in range(49152) if (words[t // 32] >> (t % 32)) & 1}


@pytest.mark.parametrize("kind", ["json", "json_object"])
def test_json_grammar_rejects_whitespace_by_default_and_allows_it_with_the_switch(
        backend, smollm2_dir, kind):
    from nanovllm.tokenizer import load_tokenizer

    tok = load_tokenizer(str(smollm2_dir))
    constraint = ({"json": {"type": "object", "properties": {"a": {"type": "integer"}},
                            "required": ["a"]}} if kind == "json" else {"json_object": True})
    spaces = [tok.encode(w, add_special_tokens=False) for w in ("\n", " ", "\t", "\n\n")]
    assert all(len(ids) == 1 for ids in spaces), spaces  # each one token of SmolLM2's
    spaces = {ids[0] for ids in spaces}
    colon, space = (tok.encode(c, add_special_tokens=False)[0] for c in (":", " "))
    for prefix in ("{", '{"a"', '{"a": 1'):  # after "{", after a key, after a value
        ids = tok.encode(prefix, add_special_tokens=False)
        compact = allowed_after(backend, StructuredOutputsParams(**constraint), ids)
        spaced = allowed_after(
            backend, StructuredOutputsParams(**constraint, disable_any_whitespace=False), ids)
        assert compact and not compact & spaces, (prefix, compact & spaces)
        assert spaces <= spaced, (prefix, spaces - spaced)
        assert compact < spaced  # the switch only adds: every compact output stays valid
    # the compact layout is json.dumps's: ": " after a key, so a bare ":" token first
    after_key = allowed_after(backend, StructuredOutputsParams(**constraint),
                              tok.encode('{"a"', add_special_tokens=False))
    assert colon in after_key and space not in after_key


def test_grammar_state_accepts_rejects_rolls_back_and_terminates(backend, smollm2_dir):
    from nanovllm.tokenizer import load_tokenizer

    yes = load_tokenizer(str(smollm2_dir)).encode("yes", add_special_tokens=False)
    state = backend.new_state(StructuredOutputsParams(choice=["yes", "no"]))
    bitmask = torch.zeros(1, bitmask_words(49152), dtype=torch.int32)
    state.fill(bitmask, 0)
    logits = apply_token_bitmask(torch.zeros(1, 49152), bitmask, torch.tensor([0]))
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert yes[0] in allowed and 2 not in allowed and len(allowed) < 50  # no EOS yet
    with pytest.raises(RuntimeError, match="violates"):
        state.accept(2)
    for token in yes:
        state.accept(token)
    state.rollback(len(yes))  # (speculative decoding's rejected drafts)
    for token in yes:
        state.accept(token)
    assert not state.is_terminated
    state.accept(2)  # EOS after a whole choice
    assert state.is_terminated
