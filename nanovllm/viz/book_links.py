"""Links inside the rendered book: what the prose's references point to (no Sphinx here).

The chapters refer to each other in prose: "chapter NN", "chapter NN §M", "§M.K", "section M.K",
"Figure N.M". nanovllm/viz/book_sphinx.py turns each mention in a chapter's markdown into a link
when the book is built (the notebooks stay as they are), to labels it gives the targets:
``ch04`` to a chapter's page, ``ch04-s3`` and ``ch04-s3-1`` to its numbered headings ("## 3.",
"### 3.1"), ``fig-4-2`` to the image above the caption "**Figure 4.2.** ..." (the caption that
nanovllm/viz/figures.py writes under every figure). This module finds the mentions and what
they point to, from the notebooks alone: a mention whose target does not exist (a section the
chapter lacks, a figure it does not have, a chapter not written yet) is *unresolved*, reported
as a build warning and left as plain text. It also reads book/glossary.md's ``{glossary}``, whose
terms link from their first use in each chapter.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

NUM = r"\d+(?:\.\d+)?"  # a section number: 3, 3.1 (never swallows a full stop)
SEP = r"\s*(?:–|-|,|\band\b|\bor\b|\bto\b|&)\s*"
MENTION = re.compile(
    rf"(?P<chap>\b[Cc]hapters?\s+\d\d(?:{SEP}\d\d)*"
    rf"(?:(?:['’]s)?\s*§\s*{NUM}|['’]s\s+sections?\s+{NUM})?)"
    rf"|(?P<sect>§\s*{NUM}(?:{SEP}§?\s*{NUM})*|\b[Ss]ections?\s+{NUM}(?:{SEP}{NUM})*)"
    rf"|(?P<fig>\bFigures?\s+\d+\.\d+(?:{SEP}\d+\.\d+)*)")
SECTION_TITLE = re.compile(r"(\d+(?:\.\d+)?)\.?\s")  # "3. Prefix caching", "3.1 Which ..."
HEADING = re.compile(r"^#{2,6}[ \t]+(\d+(?:\.\d+)?)\.?[ \t]", re.M)
CAPTION = re.compile(r"^\*\*Figure (\d+)\.(\d+)\.\*\*")
CAPTION_TEXT = re.compile(r"^Figure (\d+)\.(\d+)\.\s")  # the same, rendered


def chapter_label(number: str) -> str:
    return f"ch{number}"


def section_label(number: str, section: str) -> str:
    return f"ch{number}-s{section.replace('.', '-')}"


def figure_label(chapter: int, figure: int) -> str:
    return f"fig-{chapter}-{figure}"


def source(cell: dict) -> str:
    text = cell.get("source", "")
    return "".join(text) if isinstance(text, list) else text


@dataclass
class Chapter:
    """What links may point to in one chapter."""
    number: str  # "04"
    sections: set[str] = field(default_factory=set)  # "3", "3.1"
    figures: set[int] = field(default_factory=set)  # 1, 2 (Figure 4.1, 4.2)


def chapter_targets(number: str, notebook: dict) -> Chapter:
    """The numbered headings of a chapter's markdown and the figures its outputs caption."""
    chapter = Chapter(number)
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "markdown":
            chapter.sections |= set(HEADING.findall(source(cell)))
        for out in cell.get("outputs", []):
            caption = out.get("data", {}).get("text/markdown", "")
            match = CAPTION.match("".join(caption) if isinstance(caption, list) else caption)
            if match and int(match.group(1)) == int(number):
                chapter.figures.add(int(match.group(2)))
    return chapter


class Span(NamedTuple):
    start: int
    end: int
    label: str | None  # None: the target does not exist
    mention: str  # the whole mention, for the warning


class Mentions:
    """Finds the mentions in one page's text and the labels they point to."""

    def __init__(self, chapters: dict[str, Chapter], here: str | None):
        self.chapters = chapters  # by number, "04"
        self.here = here  # the chapter whose "§3" this is; None on the book's other pages

    def chapter(self, number: str) -> str | None:
        return chapter_label(number) if number in self.chapters else None

    def section(self, chapter: str | None, number: str) -> str | None:
        found = self.chapters.get(chapter or "")
        return section_label(chapter, number) if found and number in found.sections else None

    def figure(self, number: str) -> str | None:
        chapter, index = (int(x) for x in number.split("."))
        found = [c for c in self.chapters.values() if int(c.number) == chapter]
        return figure_label(chapter, index) if found and index in found[0].figures else None

    def _numbers(self, match: re.Match, skip: int, target: Callable) -> list[Span]:
        """One span for the whole mention when it names one target ("chapter 11 §3", "§4.4"),
        else one per number ("chapters 03–05", "sections 2.1 to 2.3", "§1 and §2")."""
        text, start = match.group(0), match.start()
        found = list(re.finditer(rf"(?:§\s*)?({NUM})", text[skip:]))
        labels = [target(m.group(1)) for m in found]
        if len(found) == 1:
            return [Span(start, match.end(), labels[0], text)]
        return [Span(start + skip + m.start(), start + skip + m.end(), label, text)
                for m, label in zip(found, labels)]

    def spans(self, text: str) -> list[Span]:
        out: list[Span] = []
        for match in MENTION.finditer(text):
            mention = match.group(0)
            if match.group("chap"):
                skip = re.match(r"[Cc]hapters?\s+", mention).end()
                section = re.search(rf"(?:§\s*|sections?\s+)({NUM})$", mention)
                if section:  # "chapter 11 §3": one target, the section
                    chapter = mention[skip:skip + 2]
                    out.append(Span(match.start(), match.end(),
                                    self.section(chapter, section.group(1)), mention))
                else:
                    out += self._numbers(match, skip, self.chapter)
            elif match.group("sect"):
                if self.here is not None:  # on a page outside the chapters: "§3" of what?
                    skip = re.match(r"[Ss]ections?\s+|", mention).end()
                    out += self._numbers(match, skip,
                                         lambda n: self.section(self.here, n))
            else:
                skip = re.match(r"Figures?\s+", mention).end()
                out += self._numbers(match, skip, self.figure)
        return out


# -- the glossary ------------------------------------------------------------------------------

@dataclass
class Term:
    name: str  # as the glossary writes it: "GQA (grouped-query attention)"
    chapters: set[str]  # the chapters its definition names: "(chapters 03–05, 11)"


def named_chapters(text: str) -> set[str]:
    """The chapters that "chapter 04", "chapters 03–05, 08 and 11" in ``text`` name."""
    out = set()
    for listed in re.findall(rf"chapters?\s+(\d\d(?:{SEP}\d\d)*)", text):
        for start, end in re.findall(r"(\d\d)(?:\s*[–-]\s*(\d\d))?", listed):
            out |= {f"{n:02d}" for n in range(int(start), int(end or start) + 1)}
    return out


def glossary_terms(glossary_md: str) -> dict[str, Term]:
    """Phrase -> glossary term, for the terms of book/glossary.md's ``{glossary}``: "Throughput,
    latency" gives both words, "GQA (grouped-query attention)" its acronym and its expansion;
    terms in code font are left out (code is never linked)."""
    block = re.search(r"```\{glossary\}\n(.*?)^```", glossary_md, re.S | re.M)
    entries = re.findall(r"^(\S[^\n]*)\n((?:[ \t]+[^\n]*\n?|\n)*)",
                         block.group(1) if block else "", re.M)
    phrases: dict[str, Term] = {}
    for name, definition in entries:
        if "`" in name:
            continue
        term = Term(name.strip(), named_chapters(" ".join(definition.split())))
        base, paren = re.match(r"(.*?)\s*(?:\(([^)]*)\))?$", term.name).groups()
        names = [n.strip() for n in base.split(",")]
        if paren and "," not in paren and len(names) == 1 and _abbreviates(names[0], paren):
            names.append(paren.strip())
        for phrase in names:
            phrases.setdefault(phrase, term)
    return phrases


def _abbreviates(a: str, b: str) -> bool:
    """Whether one of ``a`` and ``b`` is an acronym of the other (GQA, MoE, RoPE, SSE, TP)."""
    for short, long in ((a, b), (b, a)):
        if " " not in short and sum(c.isupper() for c in short) >= 2 and " " in long:
            letters, rest = short.lower(), re.sub(r"[^a-z]", "", long.lower())
            it = iter(rest)
            if letters[0] == rest[0] and all(c in it for c in letters):
                return True
    return False


def _phrase_regex(phrase: str) -> str:
    """A phrase in lower case after its first letter also matches with a capital ("Prefill")."""
    head = re.escape(phrase[0])
    if phrase[1:] == phrase[1:].lower() and phrase[0].isalpha():
        head = f"[{phrase[0].upper()}{phrase[0].lower()}]"
    return head + re.escape(phrase[1:])


def _ambiguous(phrase: str) -> bool:
    """One plain word ("rank", "block", "slot") means other things outside the chapters that
    the term's definition names: chapter 01's token ranks are not tensor-parallel ranks, a
    batch slot of chapter 06 is not a KV-cache slot, and the event loop "never blocks"."""
    return phrase.isalpha() and phrase[1:].islower()


class Terms:
    """The first use of each glossary term in one chapter (feed it the prose in order): a
    phrase of several words or an acronym anywhere, one plain word only in the chapters that
    its definition names."""

    def __init__(self, phrases: dict[str, Term], chapter: str):
        self.phrases = {p: t for p, t in phrases.items()
                        if not _ambiguous(p) or not t.chapters or chapter in t.chapters}
        self.linked: set[str] = set()
        longest_first = sorted(self.phrases, key=len, reverse=True)
        alternatives = "|".join(_phrase_regex(p) for p in longest_first)
        self.pattern = re.compile(rf"(?<![\w-])(?:{alternatives})(?:e?s)?(?![\w-])")
        self.exact = {p: re.compile(rf"{_phrase_regex(p)}(?:e?s)?") for p in self.phrases}

    def spans(self, text: str) -> list[tuple[int, int, str]]:
        """(start, end, term) of the terms first used in ``text``."""
        if not self.phrases:
            return []
        out = []
        for match in self.pattern.finditer(text):
            term = next(t for p, t in self.phrases.items() if self.exact[p].fullmatch(match[0]))
            if term.name not in self.linked:
                self.linked.add(term.name)
                out.append((match.start(), match.end(), term.name))
        return out
