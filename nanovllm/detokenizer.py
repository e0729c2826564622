"""The engine's one detokenizer: token ids in, text and stop strings out (chapter 10).

A request's text grows one token at a time, and after every token the engine wants two
answers: what text is new (to stream it) and whether a stop string has appeared (to end
the request). Three facts shape the algorithm.

1. **A character can span several tokens.** Byte-level BPE (GPT-2, Llama 3, SmolLM2)
   works on UTF-8 bytes, and a rare character is several bytes: SmolLM2 spells "🚀" with
   three tokens, and the first two alone decode to U+FFFD, the replacement character.
   So text that ends in U+FFFD is not finished: it waits for the next token.
2. **Decoding all ids after every token costs O(n) per token, O(n^2) per request.** Each
   call decodes a short window instead: the tokens read by the previous call, as context
   (a token's text can depend on its neighbour: SentencePiece drops the leading space of
   the first token of a decode), then the new ones. The new text is
   ``decode(context + new)`` minus ``decode(context)``.
3. **Stop strings live in the text, not in the tokens.** "中华人民共和国" is twelve tokens,
   and a token can end in the middle of one of its characters, so the check compares
   strings. Only the new text can complete a match, so each stop string is searched from
   ``len(stop) - 1`` characters before the new text: the cost does not grow with the
   output. Until a stop matches, the last ``len(longest stop) - 1`` characters are *held
   back*: they could be the beginning of a stop string that the next token completes,
   and the output is cut before it (vLLM's rule; through it with
   ``include_stop_str_in_output``). Text handed out is *settled*: it never changes.

When several stop strings match, the one completed first wins (earliest end; on a tie
the earliest start, i.e. the longer one). That is the one a token-by-token engine meets
first, so the result does not depend on how many tokens each call brings. For a single
stop string it is simply its first occurrence.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanovllm.sampling_params import SamplingParams

INCOMPLETE = "\ufffd"  # what a decoder makes of the first bytes of an unfinished character


class IncrementalDetokenizer:
    """Text of a growing list of token ids, cut at the first stop string.

    ``tokenizer`` is anything with ``decode(ids, skip_special_tokens=...)`` (a Hugging
    Face tokenizer, or a thread-safe wrapper of one); with ``None`` there is no text and
    never a stop. The stop check sees exactly the text that is returned, so special
    tokens count in it only when ``skip_special_tokens`` is False.
    """

    def __init__(
        self,
        tokenizer: Any,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        # A stop string counts only once it ends in the text of token number min_tokens or
        # later (vLLM's rule: before that the request may not stop).
        self.min_tokens = min_tokens
        self._num_pushed = 0
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.stop_reason: str | None = None  # the stop string that matched
        self._hold_back = max(map(len, self.stop), default=1) - 1
        self._window: list[int] = []  # context tokens, then tokens whose text is unread
        self._num_context = 0
        self._context_text = ""  # decode(context tokens)
        self._settled: list[str] = []  # every piece push() returned
        self._held = ""  # read but not yet settled: it may begin a stop string

    @classmethod
    def for_params(cls, tokenizer: Any, params: SamplingParams) -> IncrementalDetokenizer:
        """The detokenizer of one sample of a request: its stop strings, ``min_tokens`` and
        text settings. The engine's stop check, the final output and the stream all build
        theirs here, so all three cut the text at the same place."""
        return cls(
            tokenizer, params.stop, params.include_stop_str_in_output,
            params.skip_special_tokens, params.min_tokens,
        )

    def push(self, token_ids: Iterable[int]) -> str:
        """Take new token ids; return the newly *settled* text: complete characters that
        can no longer be cut by a stop string. When a stop string matches, return the rest
        of the text up to the cut; every later push is ignored (returns "")."""
        token_ids = list(token_ids)
        if self.tokenizer is None or self.stop_reason is not None or not token_ids:
            return ""  # (an empty push must not slide the window: the context would be lost)
        unsearched = self.min_tokens - 1 - self._num_pushed  # tokens before stops count
        if 0 < unsearched < len(token_ids):  # as if pushed one by one: split at the boundary
            return self.push(token_ids[:unsearched]) + self.push(token_ids[unsearched:])
        self._num_pushed += len(token_ids)
        self._window += token_ids
        new = self._read_new_text()
        if not new:
            return ""
        self._held += new
        searching = self._num_pushed >= self.min_tokens
        cut = self._find_stop(len(self._held) - len(new)) if searching else None
        if cut is not None:
            self._held = self._held[:cut]  # settle everything up to the cut
        else:
            cut = max(len(self._held) - self._hold_back, 0)
        piece, self._held = self._held[:cut], self._held[cut:]
        self._settled.append(piece)
        return piece

    @property
    def text(self) -> str:
        """All output text so far, settled and held back, cut at the stop string; an
        unfinished last character shows as U+FFFD, as in a full decode. O(length): call
        it for the final output, not every step."""
        return "".join(self._settled) + self._held + self._unread_text()

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` after what push() returned (the final output is
        authoritative); "" if it does not extend the returned text."""
        settled = "".join(self._settled)
        return final_text[len(settled) :] if final_text.startswith(settled) else ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _read_new_text(self) -> str:
        """The text of the unread tokens, or "" while they end inside a character. On
        success the unread tokens become the next call's context."""
        text = self._decode(self._window)
        if text.endswith(INCOMPLETE):
            return ""  # the window grows until the next token completes the character
        new = text[len(self._context_text) :]
        self._window = self._window[self._num_context :]
        self._num_context = len(self._window)
        self._context_text = self._decode(self._window)
        return new

    def _unread_text(self) -> str:
        """Text of the tokens still waiting for the rest of a character."""
        if self._num_context == len(self._window):
            return ""
        return self._decode(self._window)[len(self._context_text) :]

    def _find_stop(self, new_from: int) -> int | None:
        """If a stop string ends in the new text of ``_held`` (from ``new_from`` on), set
        ``stop_reason`` and return where to cut ``_held``; else None."""
        best: tuple[int, int, str] | None = None  # (end, start, stop): the earliest end wins
        for stop in self.stop:
            start = self._held.find(stop, max(new_from - len(stop) + 1, 0))
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is None:
            return None
        end, start, self.stop_reason = best
        return end if self.include_stop_str_in_output else start
