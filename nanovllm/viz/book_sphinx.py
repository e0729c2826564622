"""The book's Sphinx extension (book/_config.yml, ``sphinx.extra_extensions``), for ``make book``.

- **Links.** Every "chapter NN", "chapter NN §M", "§M.K", "section M.K" and "Figure N.M" in a
  chapter's prose links to its target, and each glossary term's first use in a chapter links to
  book/glossary.md (nanovllm/viz/book_links.py finds them; the notebooks are not changed). The
  targets get labels: ``ch04`` (the chapter), ``ch04-s3`` / ``ch04-s3-1`` (its numbered
  headings) and ``fig-4-2`` (the image that the caption "Figure 4.2. ..." is under). A mention
  whose target does not exist stays text and is a build warning.
- **Alt text.** A figure's image gets its caption as alt text (without one, the HTML would show
  the image's hashed file name).
- **Bibliography.** Author–year labels, "[Kwon et al. 2023]", in the text and in the list
  (pybtex's ``alpha`` labels read "[KLZ+23]", and worse for a group as author).
- **MathJax offline.** Formulas are typeset by a copy of MathJax 3 in the built book (``_static/
  mathjax``), from the ``django-static-mathjax`` package of the ``book`` extra (static files
  only; Django is not needed); without that package the book loads MathJax from its CDN.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

from docutils import nodes
from pybtex.plugin import register_plugin
from pybtex.richtext import Text
from pybtex.style.formatting.unsrt import Style as UnsrtStyle
from pybtex.style.labels import BaseLabelStyle
from pybtex.style.sorting import BaseSortingStyle
from sphinx import addnodes
from sphinx.transforms import SphinxTransform
from sphinx.util import logging

from nanovllm.viz import book_links as links

logger = logging.getLogger(__name__)
CHAPTER_DOC = re.compile(r"^chapters/(\d\d)_\w+$")
# SVG output: the glyphs are inside the script, so no web fonts to fetch (file:// pages too).
MATHJAX = "tex-mml-svg.js"
MATHJAX_PARTS = ["input", "a11y", "ui", "output/svg", "sre/mathmaps/base.json",
                 "sre/mathmaps/en.json"]  # loaded on demand: TeX extensions, the menu, speech
# Where no link may go: code, math, headings, links, and the notebooks' cells and outputs.
NO_LINKS = (nodes.title, nodes.literal, nodes.literal_block, nodes.math, nodes.math_block,
            nodes.reference, addnodes.pending_xref, nodes.raw, nodes.citation, nodes.image,
            nodes.citation_reference, nodes.footnote_reference, nodes.comment, nodes.target,
            nodes.term, nodes.rubric, nodes.caption, nodes.field_name, addnodes.toctree)


# -- bibliography labels -----------------------------------------------------------------------

class AuthorYearLabels(BaseLabelStyle):
    """"Kwon et al. 2023", "Dao 2024", "Milakov and Gimelshein 2018"; "2023a", "2023b" where two
    entries would share a label."""

    def format_labels(self, sorted_entries):
        labels = [self.format_label(entry) for entry in sorted_entries]
        count, seen = Counter(labels), Counter()
        for label in labels:
            yield label if count[label] == 1 else label + "abcdefghijklmnopqrstuvwxyz"[seen[label]]
            seen[label] += 1

    @staticmethod
    def format_label(entry) -> str:
        persons = entry.persons.get("author") or entry.persons.get("editor") or []
        names = [Text.from_latex(" ".join(p.prelast_names + p.last_names)).render_as("text")
                 for p in persons]
        who = (names[0] if len(names) == 1 else " and ".join(names) if len(names) == 2
               else f"{names[0]} et al." if names else entry.key)
        return f"{who} {entry.fields.get('year', 'n.d.')}"


class AuthorYearSorting(BaseSortingStyle):
    """In the order of the labels ("bloc97" among the b's, not after "Zhong": pybtex's own
    sorting puts a name in braces last), then by title."""

    def sorting_key(self, entry):
        return AuthorYearLabels.format_label(entry).lower(), entry.fields.get("title", "").lower()


class AuthorYearStyle(UnsrtStyle):
    """pybtex's ``unsrt`` entries, labelled author–year and listed in the labels' order."""
    default_label_style = AuthorYearLabels
    default_sorting_style = AuthorYearSorting


# -- labels for the link targets ---------------------------------------------------------------

def _label(document: nodes.document, node: nodes.Element, name: str) -> None:
    """Give ``node`` the anchor and explicit label ``name`` (what ``(name)=`` would give)."""
    if name in document.ids:
        return
    node["ids"].append(name)
    document.ids[name] = node
    document.nameids[name] = name
    document.nametypes[name] = True


def figure_caption(image: nodes.image) -> str | None:
    """The caption printed under ``image`` in the same cell ("Figure 4.1. Block tables ..."),
    from the outputs after the image's own, up to the next image."""
    bundle = image.parent
    while bundle is not None and bundle.get("nb_element") != "mime_bundle":
        bundle = bundle.parent
    if bundle is None or bundle.parent is None:
        return None
    outputs = bundle.parent.children
    for sibling in outputs[outputs.index(bundle) + 1:]:
        if next(sibling.findall(nodes.image), None) is not None:
            return None
        for part in sibling.findall(nodes.container):
            if part.get("mime_type") == "text/markdown":
                text = " ".join(part.astext().split())
                return text if links.CAPTION_TEXT.match(text) else None
    return None


class Targets(SphinxTransform):
    """Labels for a chapter's page, its numbered sections and its captioned figures (before
    Sphinx collects the labels, at priority 850), and each captioned image's alt text."""
    default_priority = 400

    def apply(self, **kwargs) -> None:
        chapter = CHAPTER_DOC.match(self.env.docname)
        for image in self.document.findall(nodes.image):
            caption = figure_caption(image)
            if caption:
                image["alt"] = image.get("alt") or caption
                number = links.CAPTION_TEXT.match(caption)
                _label(self.document, image, links.figure_label(*map(int, number.groups())))
        if not chapter:
            return
        sections = list(self.document.findall(nodes.section))
        if sections:
            _label(self.document, sections[0], links.chapter_label(chapter.group(1)))
        for section in sections[1:]:
            number = links.SECTION_TITLE.match(section[0].astext())
            if number:
                _label(self.document, section,
                       links.section_label(chapter.group(1), number.group(1)))


def _xref(text: str, reftype: str, target: str, docname: str) -> addnodes.pending_xref:
    inner = nodes.inline(text, text, classes=["xref", "std", f"std-{reftype}"])
    return addnodes.pending_xref("", inner, refdomain="std", reftype=reftype, reftarget=target,
                                 refexplicit=True, refwarn=True, refdoc=docname)


class Links(SphinxTransform):
    """The mentions and the glossary terms of a page's prose, as cross-references (after the
    smart quotes, at priority 750: a quote just before a link would turn the wrong way)."""
    default_priority = 800

    def apply(self, **kwargs) -> None:
        index = getattr(self.app, "book_index", None)
        if index is None:
            return
        chapters, phrases = index
        docname = self.env.docname
        chapter = CHAPTER_DOC.match(docname)
        here = chapter.group(1) if chapter else None
        mentions = links.Mentions(chapters, here)
        terms = links.Terms(phrases, here) if here else None
        self._join_lines()
        for text in list(self.document.findall(nodes.Text)):
            if not self._prose(text):
                continue
            spans = [(s.start, s.end, s) for s in mentions.spans(str(text))]
            for span in (s for *_, s in spans if s.label is None and here):
                logger.warning("no target for %r: no such chapter, section or figure",
                               span.mention, location=text.parent, type="book", subtype="link")
            spans = [(a, b, s) for a, b, s in spans if s.label]
            if terms:
                taken = [(a, b) for a, b, _ in spans]
                free = [t for t in terms.spans(str(text))
                        if not any(a < t[1] and t[0] < b for a, b in taken)]
                spans += free
            if spans:  # (by identity: a Text node is a str, equal to any other same text)
                parent = text.parent
                at = next(i for i, child in enumerate(parent.children) if child is text)
                parent[at:at + 1] = self._linked(str(text), sorted(spans), docname)

    def _join_lines(self) -> None:
        """One Text node for each run of them: MyST gives each line break of a paragraph its
        own, and a mention may straddle one ("chapter" ending a line, "04" starting the next)."""
        for element in list(self.document.findall(nodes.Element)):
            children: list[nodes.Node] = []
            for child in element.children:
                if isinstance(child, nodes.Text) and children and isinstance(children[-1],
                                                                             nodes.Text):
                    children[-1] = nodes.Text(str(children[-1]) + str(child))
                else:
                    children.append(child)
            if len(children) < len(element.children):
                element[:] = children

    @staticmethod
    def _prose(text: nodes.Text) -> bool:
        node = text.parent
        while node is not None:
            if isinstance(node, NO_LINKS) or node.get("nb_element"):
                return False
            node = node.parent
        return True

    @staticmethod
    def _linked(text: str, spans: list, docname: str) -> list[nodes.Node]:
        out, last = [], 0
        for start, end, what in spans:
            out.append(nodes.Text(text[last:start]))
            if isinstance(what, links.Span):
                out.append(_xref(text[start:end], "ref", what.label, docname))
            else:
                out.append(_xref(text[start:end], "term", what, docname))
            last = end
        out.append(nodes.Text(text[last:]))
        return [n for n in out if not isinstance(n, nodes.Text) or str(n)]


def read_index(app) -> None:
    """What the links may point to, from the staged notebooks and glossary (once a build)."""
    src = Path(app.srcdir)
    chapters = {}
    for path in sorted((src / "chapters").glob("[0-9][0-9]_*.ipynb")):
        chapters[path.stem[:2]] = links.chapter_targets(path.stem[:2], json.loads(path.read_text()))
    glossary = src / "glossary.md"
    app.book_index = (chapters,
                      links.glossary_terms(glossary.read_text()) if glossary.is_file() else {})


# -- MathJax from the build --------------------------------------------------------------------

def mathjax_source() -> Path | None:
    """MathJax 3's ``es5`` folder from the ``django-static-mathjax`` package, if installed."""
    try:
        import mathjax
    except ImportError:
        return None
    es5 = Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"
    return es5 if (es5 / MATHJAX).is_file() else None


def use_local_mathjax(app, config) -> None:
    if mathjax_source() is not None:
        config.mathjax_path = f"mathjax/{MATHJAX}"  # under _static/
    else:
        logger.info("book: MathJax is loaded from its CDN (pip install django-static-mathjax "
                    "to serve it from the book)")


def copy_mathjax(app, exception) -> None:
    es5 = mathjax_source()
    if exception is not None or es5 is None or app.builder.format != "html":
        return
    out = Path(app.outdir) / "_static" / "mathjax"
    for part in [MATHJAX, *MATHJAX_PARTS]:
        source, target = es5 / part, out / part
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True)
        elif source.is_file():
            shutil.copy2(source, target)


def setup(app):
    register_plugin("pybtex.style.formatting", "authoryear", AuthorYearStyle, force=True)
    app.add_transform(Targets)
    app.add_transform(Links)
    app.connect("builder-inited", read_index)
    app.connect("config-inited", use_local_mathjax)
    app.connect("build-finished", copy_mathjax)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
