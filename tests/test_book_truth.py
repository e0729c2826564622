"""The book tells the truth: what it prints can be run, what it cites exists, what it measured
comes from a record or a cell (issues 29 and 43). Five checks, each shown failing on a planted
error:

- **Commands.** Every ``python -m nanovllm...`` and ``nanovllm serve ...`` printed in a chapter
  (its source and its stored outputs), the README, book/, a docstring or a record's ``command``
  resolves: the module exists and runs as ``__main__``; with no arguments ``--help`` exits 0,
  with arguments they parse (``argparse`` runs, then stops before any work is done). Every
  ``make X`` in code font names a target of the Makefile.
- **References.** Every "chapter NN §X", "§X" and "section X" names a numbered heading of that
  chapter; a reference followed by a description ("chapter 13 §1, the leak check") must find
  the description's first word in the heading's title, so renumbered sections are caught. A
  ``FILE.md §X`` names a file of the repository, and a path in code font names a file.
- **Records.** A record's file name (``*_h200.json``, ``*_cpu.json``, ...) in a chapter's prose,
  the README or book/ names a file of ``figures/data/``; a code cell may read an uncommitted one
  only behind a check that it exists (it then prints that no record exists yet).
- **Numbers.** A number with a unit of measurement (tok/s, TB/s, TFLOP/s, µs, ms, GiB, %, ×,
  ...) typed in a chapter's markdown must be one the chapter's stored outputs print (equal
  after rounding to the typed precision), or be listed in ``TYPED_NUMBERS`` below: as the
  record field it restates (checked against the record, so the prose goes stale loudly), or
  as a constant that is not a measurement (a datasheet, a configuration, a quoted claim), with
  the reason. The check is by value, not meaning: a typed number that happens to equal some
  other printed number passes; one that matches nothing (stale after a re-run, or typed from
  memory) fails.
- **Notation.** ``book/notation.md`` defines the book's symbols; patterns that use a symbol
  with another meaning (θ_i for the RoPE frequencies, L for layers, B for the block size) fail.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import re
import runpy
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

from nanovllm.viz.records import HEADLINES, PENDING, field_value, load_record

jupytext = pytest.importorskip("jupytext")

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.py"))
DOCS = [ROOT / "README.md", *sorted((ROOT / "book").glob("*.md"))]
RECORDS = sorted((ROOT / "figures" / "data").glob("*.json"))
SOURCES = sorted((ROOT / "nanovllm").rglob("*.py"))


def chapter_no(path: Path) -> str:
    return path.name[:2]


def cells(path: Path, kind: str | None = None) -> list[str]:
    return [c.source for c in jupytext.read(path).cells if kind in (None, c.cell_type)]


def stored_outputs(path: Path) -> str:
    """The text the chapter's executed notebook shows under its code cells."""
    notebook = json.loads(path.with_suffix(".ipynb").read_text())
    texts = []
    for cell in notebook["cells"]:
        for out in cell.get("outputs", []):
            texts.append("".join(out.get("text", "")))
            data = out.get("data", {})
            texts += ["".join(data.get(k, "")) for k in ("text/plain", "text/markdown")]
    return "\n".join(texts)


def record_commands(record: object) -> list[str]:
    """Every string under a key named ``command``/``commands`` of a record, at any depth."""
    found = []
    if isinstance(record, dict):
        for key, value in record.items():
            if key in ("command", "commands"):
                values = [value] if isinstance(value, str) else value
                found += [v for v in values if isinstance(v, str)]
            else:
                found += record_commands(value)
    elif isinstance(record, list):
        for value in record:
            found += record_commands(value)
    return found


def texts_that_print_commands() -> list[tuple[str, str]]:
    """(where, text) of everything a reader may copy a command from."""
    texts = [(p.name, "\n".join(cells(p)) + "\n" + stored_outputs(p)) for p in CHAPTERS]
    texts += [(p.name, p.read_text()) for p in DOCS + SOURCES]
    texts += [(p.name, "\n".join(record_commands(json.loads(p.read_text())))) for p in RECORDS]
    return texts


# ---------------------------------------------------------------------------------- commands

# `python -m nanovllm.x --a 1 b`, stopping at anything an argument is not made of (a backtick,
# a quote, a brace of an f-string, a parenthesis, the end of the line).
_PY_M = re.compile(r"python3? -m (nanovllm(?:\.\w+)*)((?:[ \t]+[-\w./=:,+]+)*)([^\n]?)")
_SERVE = re.compile(r"(?<![\w./-])nanovllm (serve(?:[ \t]+[-\w./=:,+]+)*)([^\n]?)")
_MAKE = re.compile(r"`make ([a-z][\w-]*)")
_INCOMPLETE = set("{<[\\….>")  # the command goes on in a placeholder or on the next line


@dataclass(frozen=True)
class Command:
    module: str
    argv: tuple[str, ...] | None  # None: shown incompletely, only the module is checked
    where: str


def printed_commands(texts: list[tuple[str, str]]) -> set[Command]:
    found = set()
    for where, text in texts:
        for m in _PY_M.finditer(text):
            if text.startswith(".<", m.end(1)):  # `python -m nanovllm.benchmarks.<name>`
                continue
            complete = m.group(3) not in _INCOMPLETE and "..." not in m.group(2)
            argv = tuple(m.group(2).split()) if complete else None
            found.add(Command(m.group(1), argv, where))
        for m in _SERVE.finditer(text):
            complete = m.group(2) not in _INCOMPLETE and "..." not in m.group(1)
            found.add(Command("nanovllm.serve.cli", tuple(m.group(1).split()) if complete else None,
                              where))
    return found


class _Parsed(Exception):
    """Raised where argparse has accepted the arguments: nothing after it runs."""


def module_runs_as_main(module: str) -> Path | None:
    """The file ``python -m module`` executes, or None where it would not run."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return None
    if spec is None or spec.origin is None:
        return None
    if spec.submodule_search_locations:  # a package: it needs a __main__
        main = Path(spec.origin).with_name("__main__.py")
        return main if main.exists() else None
    source = Path(spec.origin).read_text()
    return Path(spec.origin) if "__main__" in source else None


def parse_only(module: str, argv: tuple[str, ...]) -> str | None:
    """Run ``python -m module *argv`` in-process up to its argument parsing; None where the
    arguments parse (or ``--help`` exits 0), else what went wrong."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    err = io.StringIO()
    run_as = module if module != "nanovllm.serve.cli" else "nanovllm.serve"
    if module == "nanovllm.serve.cli":  # the console script `nanovllm serve ...`
        argv = argv[1:]
    with (mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop),
          mock.patch.object(sys, "argv", [run_as, *argv]), warnings.catch_warnings(),
          contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err)):
        warnings.simplefilter("ignore")
        try:
            runpy.run_module(run_as, run_name="__main__", alter_sys=False)
        except _Parsed:
            return None
        except SystemExit as exit_:
            return None if exit_.code in (0, None) and "--help" in argv else (
                f"exit {exit_.code}: {err.getvalue().strip()[-300:]}")
    return "ran to the end without parsing arguments"


def parses_arguments(path: Path) -> bool:
    """Whether the module calls argparse itself or delegates to a ``main`` that does."""
    source = path.read_text()
    delegate = re.search(r"from (nanovllm[\w.]*) import (?:main|\w+_main)", source)
    if "parse_args" in source:
        return True
    if not delegate:
        return False
    target = delegate.group(1)
    return parses_arguments(module_runs_as_main(target)
                            or Path(importlib.util.find_spec(target).origin))


def command_problems(commands: set[Command]) -> list[str]:
    problems, checked = [], {}
    for cmd in sorted(commands, key=lambda c: (c.module, c.argv or (), c.where)):
        runs = cmd.module if cmd.module != "nanovllm.serve.cli" else "nanovllm.serve"
        path = module_runs_as_main(runs)
        if path is None:
            problems.append(f"{cmd.where}: `python -m {cmd.module}` does not run (no such module "
                            f"or no __main__)")
            continue
        if cmd.argv is None or not parses_arguments(path):
            if cmd.argv:
                problems.append(f"{cmd.where}: `{cmd.module}` takes no arguments, given {cmd.argv}")
            continue
        argv = cmd.argv or ("--help",)
        if (cmd.module, argv) not in checked:
            checked[cmd.module, argv] = parse_only(cmd.module, argv)
        if checked[cmd.module, argv]:
            problems.append(f"{cmd.where}: `{cmd.module} {' '.join(argv)}`: "
                            f"{checked[cmd.module, argv]}")
    return problems


def make_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))


def make_problems(texts: list[tuple[str, str]]) -> list[str]:
    targets = make_targets()
    return [f"{where}: `make {t}` is not a Makefile target" for where, text in texts
            for t in _MAKE.findall(text) if t not in targets]


def test_every_printed_command_runs() -> None:
    texts = texts_that_print_commands()
    commands = printed_commands(texts)
    assert len(commands) > 30, "the scan found too few commands: is the pattern broken?"
    problems = command_problems(commands) + make_problems(texts)
    assert not problems, "\n".join(problems)


def test_a_planted_dead_command_fails() -> None:
    planted = [("planted.md", "run `python -m nanovllm.kernels.bench_prefill --sweep`, then "
                "`python -m nanovllm.benchmarks.prefill_kernel --no-such-flag` and `make bench2`")]
    problems = command_problems(printed_commands(planted)) + make_problems(planted)
    assert len(problems) == 3, problems
    assert any("bench_prefill` does not run" in p for p in problems), problems
    assert any("--no-such-flag`: exit 2" in p for p in problems), problems


# -------------------------------------------------------------------------------- references

_HEADING = re.compile(r"^#{2,4} (\d+(?:\.\d+)*)\.?\s+(.+)$", re.M)
_CROSS = re.compile(r"[Cc]hapters? (\d\d)(?:'s)?,? (?:§|section )(\d+(?:\.\d+)*)"
                    r"(?:,\s*([^),;.]+))?")
_OWN = re.compile(r"(?<![Cc]hapter \d\d )(?<![Cc]hapter \d\d's )(?<!\.md )(?:§|\b[Ss]ections? )"
                  r"(\d+(?:\.\d+)*)(?:(?:–|-| and | to |, )(\d+(?:\.\d+)*))?")
_DOC_SECTION = re.compile(r"([\w/.-]+\.md) §")
# Paths inside this repository (other projects' files, e.g. vLLM's, are cited too).
_CODE_PATH = re.compile(r"`((?:nanovllm|chapters|tests|figures|book|benchmarks|configs|course"
                        r"|engine|kernels|layers|models|serve|viz|weights)/[\w./-]+\."
                        r"(?:py|json|md|sh|yml|toml|cfg|ipynb))`")


def headings() -> dict[str, dict[str, str]]:
    """{chapter: {section number: title}} from the chapters' numbered headings."""
    return {chapter_no(p): {m.group(1): m.group(2) for text in cells(p, "markdown")
                            for m in _HEADING.finditer(text)} for p in CHAPTERS}


def describes(title: str, description: str | None) -> bool:
    """Whether a reference's description ("the leak check") fits the heading's title."""
    if not description or description.strip().startswith(("assignment", "`", "and ", "see ")):
        return True
    words = [w for w in re.findall(r"[a-z]+", description.lower()) if len(w) >= 4]
    return not words or bool(re.search(rf"\b{words[0]}s?\b", title.lower()))


def reference_problems(texts: list[tuple[str, str, str | None]]) -> list[str]:
    """``texts``: (where, text, the chapter it belongs to or None)."""
    sections, problems = headings(), []
    for where, text, own in texts:
        for m in _CROSS.finditer(text):
            chapter, number, description = m.groups()
            title = sections.get(chapter, {}).get(number)
            if title is None:
                problems.append(f"{where}: chapter {chapter} has no §{number} ({m.group(0)!r})")
            elif not describes(title, description):
                problems.append(f"{where}: chapter {chapter} §{number} is {title!r}, not "
                                f"{description!r}")
        for m in _OWN.finditer(text) if own else ():
            for number in filter(None, m.groups()):
                if number not in sections[own]:
                    problems.append(f"{where}: no §{number} in chapter {own} ({m.group(0)!r})")
        for m in _DOC_SECTION.finditer(text):
            if not list(ROOT.glob(f"**/{Path(m.group(1)).name}")):
                problems.append(f"{where}: {m.group(0)!r} cites a file the repository lacks")
        for path in _CODE_PATH.findall(text):
            bases = (ROOT, ROOT / "nanovllm", ROOT / "figures" / "data")
            if "NN" not in path and not any((base / path).exists() for base in bases):
                problems.append(f"{where}: `{path}` does not exist")
    return problems


def texts_with_references() -> list[tuple[str, str, str | None]]:
    texts = [(p.name, "\n".join(cells(p)), chapter_no(p)) for p in CHAPTERS]
    texts += [(p.name, p.read_text(), None) for p in DOCS + SOURCES]
    texts += [(p.name, p.read_text(), None) for p in (ROOT / "tests").rglob("*.py")
              if p.name != Path(__file__).name]
    return texts


def test_every_section_reference_resolves() -> None:
    problems = reference_problems(texts_with_references())
    assert not problems, "\n".join(problems)


def test_a_planted_broken_reference_fails() -> None:
    planted = [("planted.py", "(chapter 13 §2, the leak check) and chapter 05 §42; see DESIGN.md §5"
                " and `kernels/bench_prefill.py`", None), ("03_planted", "as §9 showed", "03")]
    problems = reference_problems(planted)
    assert len(problems) == 5, "\n".join(problems)


# ----------------------------------------------------------------------------------- records

# A record's file name: a measurement's device in it (bench_h200.json, routing_cpu.json, ...).
_RECORD = re.compile(r"(?<![\w{}*.-])([\w.-]+_(?:h200|h100|cpu|gpu|2core)[\w.-]*\.json)\b")
# A code cell that only reads a record when it exists, or writes the file it names.
_GUARDED = ("exists(", "is_file(", "--out", "write_text(", "json.dump(")


def record_problems(texts: list[tuple[str, str, str]]) -> list[str]:
    """``texts``: (where, text, "markdown" or "code"). Prose may name only committed records;
    code may read an uncommitted one only behind a check that it exists (issue 43: chapters
    described H200 records that were never committed)."""
    data = ROOT / "figures" / "data"
    problems = []
    for where, text, kind in texts:
        for name in sorted(set(_RECORD.findall(text))):
            if (data / name).exists() or (data / "gpu_runs" / name).exists():
                continue
            if kind == "code" and any(g in text for g in _GUARDED):
                continue
            problems.append(f"{where}: {kind} names {name}, which figures/data/ does not hold")
    return problems


def chapter_texts() -> list[tuple[str, str, str]]:
    texts = [(f"{p.name} cell {i}", c.source, c.cell_type)
             for p in CHAPTERS for i, c in enumerate(jupytext.read(p).cells)]
    return texts + [(p.name, p.read_text(), "markdown") for p in DOCS]


def test_every_named_record_is_committed() -> None:
    problems = record_problems(chapter_texts())
    assert not problems, "\n".join(problems)


def test_a_planted_uncommitted_record_fails() -> None:
    planted = [
        ("prose", "The H200 record (`moe_workload_qwen3_h200.json`) shows it.", "markdown"),
        ("read", 'record = json.loads((DATA / "routing_h999_h200.json").read_text())', "code"),
        ("guarded", 'path = DATA / "routing_h999_h200.json"\nif path.exists(): ...', "code"),
        ("committed", "as `bench_h200.json` records", "markdown"),
    ]
    problems = record_problems(planted)
    assert [p.split(":")[0] for p in problems] == ["prose", "read"], problems


# ----------------------------------------------------------------------------------- numbers

_UNIT = (r"tok(?:ens)?/s|tokens per second|TB/s|GB/s|TFLOP/s|TFLOPS|µs|us\b|ms\b|GiB|MiB|GB\b"
         r"|MB\b|%|×(?!\s*\d)|x\b")
_VALUE = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
_MEASURE = re.compile(rf"(?<![\w.,/$-])({_VALUE})(?:\s*(?:–|-|to)\s*({_VALUE}))?\s?({_UNIT})")
_NUMBER = re.compile(_VALUE)


@dataclass(frozen=True)
class Field:
    """A typed number restating ``record``'s ``field`` (dotted path), times ``scale``, or
    divided by its field ``per`` (a ratio of two measurements)."""
    record: str
    field: str
    scale: float = 1.0
    per: str | None = None

    def value(self) -> float:
        record = load_record(self.record)
        divisor = field_value(record, self.per) if self.per else 1.0
        return field_value(record, self.field) * self.scale / divisor


@dataclass(frozen=True)
class Constant:
    """A typed number that is not a measurement of this book: ``why``."""
    why: str


_TP1_06B, _TP1_8B = "engines.0.output_tok_s", "engines.2.output_tok_s"
# (chapter, the typed number as written, unit included) -> where it comes from.
TYPED_NUMBERS: dict[tuple[str, str], Field | Constant] = {
    ("05", "2.3 TB/s"): Field("bench_decode_h200.json", "rows.-1.sdpa.flash.bytes_per_s", 1e-12),
    # TP=2 over TP=1 throughput: Qwen3-0.6B (engines 1 / 0), Qwen3-8B (engines 3 / 2)
    ("10", "1.26x"): Field("tp_h200x2.json", "engines.1.output_tok_s", per=_TP1_06B),
    ("10", "1.55x"): Field("tp_h200x2.json", "engines.3.output_tok_s", per=_TP1_8B),
    ("06", "75%"): Constant("the `mixed` policy's configured share of the slots"),
    ("06", "23×"): Constant("a quoted claim: Anyscale's 2023 blog post on continuous batching"),
    ("08", "1.74×"): Constant("the ratio of the two printed weight sizes, 16.4 / 9.4 GB"),
    ("09", "0.1 ms"): Constant("the shared-memory broadcast's polling interval (a setting)"),
    ("11", "141 GB"): Constant("the H200's datasheet memory"),
    ("11", "75%"): Constant("a goal the text sets (three quarters of the bound), not a result"),
    ("11", "26 ms"): Field("profile_prefill_h200.json", "runs.0.cpu_ms_per_step.launch"),
    ("13", "500 ms"): Constant("the light load's arrival interval (the experiment's setting)"),
}


def value(text: str) -> float:
    return float(text.replace(",", ""))


def rounds_to(measured: float, typed: str) -> bool:
    """Whether ``measured``, rounded as ``typed`` is written, gives ``typed``: "1.80" is two
    decimals, "21,000" is rounded to thousands."""
    if "." in typed:
        return round(measured, len(typed.split(".")[1])) == value(typed)
    digits = typed.replace(",", "")
    zeros = len(digits) - len(digits.rstrip("0")) if value(typed) else 0
    return round(measured, -zeros) == value(typed)


def number_problems(chapter: str, markdown: list[str], outputs: str,
                    allowed: dict[tuple[str, str], Field | Constant]) -> list[str]:
    printed = [value(n) for n in _NUMBER.findall(outputs)]
    problems = []
    for text in markdown:
        text = re.sub(r"`[^`]*`|\$[^$]*\$", " ", text)  # code and math are not prose numbers
        for m in _MEASURE.finditer(text):
            typed = m.group(0)
            entry = allowed.get((chapter, typed))
            if isinstance(entry, Constant):
                continue
            if isinstance(entry, Field):
                if entry.record in {h.record for k, h in HEADLINES.items() if k in PENDING} and \
                        not (ROOT / "figures" / "data" / entry.record).exists():
                    continue  # pending a GPU record (nanovllm.viz.records.PENDING)
                recorded = entry.value()
                if not rounds_to(recorded, m.group(1)):
                    problems.append(f"chapter {chapter}: {typed!r} but {entry.record} "
                                    f"{entry.field} is {recorded:g}")
                continue
            for number in filter(None, m.group(1, 2)):
                if not any(rounds_to(p, number) for p in printed):
                    context = text[max(0, m.start() - 60):m.end() + 10].replace("\n", " ")
                    problems.append(f"chapter {chapter}: {typed!r} is printed by no cell and "
                                    f"listed in no record (…{context}…)")
                    break
    return problems


@pytest.mark.parametrize("path", CHAPTERS, ids=chapter_no)
def test_typed_numbers_come_from_a_cell_or_a_record(path: Path) -> None:
    problems = number_problems(chapter_no(path), cells(path, "markdown"), stored_outputs(path),
                               TYPED_NUMBERS)
    assert not problems, "\n".join(problems)


def test_the_allowlist_names_real_records_and_typed_numbers() -> None:
    markdown = {chapter_no(p): "\n".join(cells(p, "markdown")) for p in CHAPTERS}
    for (chapter, typed), entry in TYPED_NUMBERS.items():
        assert typed in markdown[chapter], f"chapter {chapter} no longer says {typed!r}: drop it"
        if isinstance(entry, Field):
            assert (ROOT / "figures" / "data" / entry.record).exists(), entry


def test_a_planted_typed_number_fails() -> None:
    outputs = "nanovllm: 21,212 tok/s, 61% of the bound"
    prose = ["The engine ran at about 21,000 tok/s (61%), not 16,994 tok/s."]
    problems = number_problems("11", prose, outputs, {})
    assert len(problems) == 1 and "16,994" in problems[0], problems
    stale = {("11", "21,000 tok/s"): Field("bench_h200.json", "nanovllm_tok_s", 0.5)}
    assert len(number_problems("11", prose, outputs, stale)) == 2


# ---------------------------------------------------------------------------------- notation

# book/notation.md gives each symbol one meaning; these are the ways chapters used to break it,
# for every chapter ("*") or for the chapter that did (its cells, code included: a printed
# header or a figure label is notation too).
NOTATION_BREAKS: dict[str, dict[str, str]] = {
    "*": {
        r"\\theta_i": "the RoPE frequencies are ω_i; θ is the base",
        r"\$L\$ layers|\bL layers": "layers are N_layers; L is a length",
        r"key tiles of \$B\$|blocks? size \$B\$|\$B\$ tokens per block": "the block size is b",
        r"\\text\{base\}": "the RoPE base is θ",
        r"[Ss]eed material|the seed's": "say what the claim is and where it comes from",
    },
    "02": {
        r"tiles of \$B\$|s_1\.\.s_B\$": "key tiles hold B_N keys; B is the batch",
        r"\$2P\$|\$P\$ weights": "P is chapter 02's attention probabilities",
    },
    "03": {
        r"\$P\$ tokens|of \$P\$|\[P, hidden\]": "a prompt has n tokens; P is chapter 02's",
        r"\$I\$ MLP|D\\,I\\,": "the MLP width is D_ff; I is arithmetic intensity",
        r"\{'L':>|\bL = c\.num_layers|, L = [^\n]*num_layers": "layers are N_layers",
        r"O\(N\^[23]\)|\$N\$ tokens": "N is the tensor-parallel ranks; n_out tokens",
    },
    "08": {
        r"L ?H_\{kv\}": "layers are N_layers",
        r"\\frac\{W\}\{B\}|\$W/B|\$W\$ the bytes": "the weights' bytes are M_w; W is a matrix",
        r"\$2PB\$|\$P\$ weights": "a parameter count is N_params",
    },
    "11": {
        r"\\min\(P,|\$P/B\$|I\\cdot B": "the roofline is min(π, Iβ): B is the batch size",
    },
    "12": {
        r"\$L\$|\$sL\$|\d\.\d+L\$|past L\b|< L/2": "the trained length is L_train",
        r"\$W\b|\bW/B|W < B|\(W = \d": "the sliding window is w; W is a weight matrix",
        r"\(B = 16\)|/B\b|\bbB\b": "the block size is b",
        r"\btheta = 1\.0 /": "the frequencies are omega; theta is the base",
    },
}


def notation_problems(texts: list[tuple[str, str]]) -> list[str]:
    """``texts``: (chapter number, the text of its cells)."""
    return [f"chapter {chapter}: {m.group(0)!r}: {why}" for chapter, text in texts
            for scope in ("*", chapter) for pattern, why in NOTATION_BREAKS.get(scope, {}).items()
            for m in re.finditer(pattern, text)]


# Symbols that chapters use in formulas: notation.md must define each.
DEFINED_SYMBOLS = [r"$B$", r"$b$", r"$L$", r"$n$", r"$N_{\text{layers}}$", r"$P$", r"$I$", r"$W$",
                   r"$w$", r"$B_M$", r"$B_N$", r"$D_{\text{ff}}$", r"$N_{\text{params}}$", r"$M_w$",
                   r"$L_{\text{train}}$", r"\omega_i", r"$\pi$", r"$\beta$", r"$e$"]


def test_notation_is_used_with_its_meaning() -> None:
    notation = (ROOT / "book" / "notation.md").read_text()
    missing = [symbol for symbol in DEFINED_SYMBOLS if symbol not in notation]
    assert not missing, f"book/notation.md does not define {missing}"
    problems = notation_problems([(chapter_no(p), "\n".join(cells(p))) for p in CHAPTERS])
    assert not problems, "\n".join(problems)


def test_a_planted_notation_break_fails() -> None:
    planted = [("12", r"frequencies $\theta_i$ over $L$ layers, window $W$"),
               ("03", "a prompt of $P$ tokens"), ("05", "a prompt of $P$ tokens")]
    problems = notation_problems(planted)
    assert len(problems) == 5, "\n".join(problems)  # θ_i, L layers, $L$ (ch12), $W, $P$ (ch03)
