"""A regular expression as a tiny automaton, and its token mask over a toy vocabulary
(chapter 15 §2-3).

The chapter builds constrained decoding small before xgrammar does it at scale: a
deterministic finite automaton (DFA) over characters, written out by hand, and the question a
decoder asks every step, "which tokens may come next?", answered by walking each token's
characters through the DFA. Tokens span several characters, so a token is allowed only if
*all* its characters are: the vocabulary scan that makes real masks expensive.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DFA:
    """A deterministic automaton over characters. ``transitions[state]`` maps a *character
    class* (a string of characters that all lead to the same state, e.g. ``"0123456789"``) to
    the next state; a character no class of the state holds leads nowhere (the dead state).
    ``accepting``: the states where the text read so far is a whole match."""

    transitions: dict[int, dict[str, int]]
    accepting: set[int]
    start: int = 0
    _table: dict[int, dict[str, int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # one dict lookup per character: expand each class into its characters
        self._table = {state: {ch: nxt for chars, nxt in edges.items() for ch in chars}
                       for state, edges in self.transitions.items()}

    @property
    def states(self) -> list[int]:
        return sorted(set(self.transitions) | self.accepting | {self.start})

    def step(self, state: int, char: str) -> int | None:
        """The state after reading ``char`` in ``state``; None: no match can continue."""
        return self._table.get(state, {}).get(char)

    def walk(self, state: int, text: str) -> int | None:
        """The state after reading all of ``text`` from ``state``; None once it dies."""
        for char in text:
            state = self.step(state, char)
            if state is None:
                return None
        return state

    def matches(self, text: str) -> bool:
        """Whether all of ``text`` matches (from the start state, ending accepting)."""
        end = self.walk(self.start, text)
        return end is not None and end in self.accepting


def dfa_mask(dfa: DFA, state: int, vocab: list[str], eos_id: int) -> set[int]:
    """The token ids that may come next in ``state``.

    Handout (chapter 15 §3, assignment ``15.dfa_mask``). ``vocab[t]`` is token ``t``'s text,
    one or more characters, except ``vocab[eos_id]``, the end-of-sequence token (its text does
    not matter). A text token ``t`` is allowed when reading all of its characters from ``state``
    (``dfa.step``, one character at a time) never reaches the dead state (None): the output so
    far, plus that token, can still become a match. Being allowed says nothing about ending in
    an accepting state: a match may need more tokens. ``eos_id`` is allowed exactly when
    ``state`` is accepting (ending the output there leaves a whole match). A token whose
    text is empty (other than EOS) is never allowed: it would let the decoder stall forever.
    Return the allowed ids as a set (empty when nothing may follow).
    """
    # >>> assignment 15.dfa_mask (5 points)
    allowed = {eos_id} if state in dfa.accepting else set()
    for token, text in enumerate(vocab):
        if token == eos_id or not text:
            continue
        current = state
        for char in text:
            current = dfa.step(current, char)
            if current is None:
                break
        else:
            allowed.add(token)
    return allowed
    # <<< assignment 15.dfa_mask


def number_dfa() -> DFA:
    """The chapter's example, ``-?[0-9]+(\\.[0-9]+)?`` (a JSON-like number), by hand.

    States: 0 start, 1 after "-", 2 in the integer part (accepting), 3 after ".",
    4 in the fraction (accepting)."""
    digits = "0123456789"
    return DFA(
        transitions={0: {"-": 1, digits: 2}, 1: {digits: 2}, 2: {digits: 2, ".": 3},
                     3: {digits: 4}, 4: {digits: 4}},
        accepting={2, 4},
    )
