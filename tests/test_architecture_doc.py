"""docs/ARCHITECTURE.md is the project's own description, and the code cites it, not a file
outside the repository.

- Nothing under src/, tests/, benchmarks/ nor README.md cites the design notes or the
  checklist that lived outside the repository, or a path out of it (``OUTSIDE``).
- Every ``docs/ARCHITECTURE.md: <Section>`` citation (several: ``<A>; <B>``) names a heading
  of the document, and the document has the sections the code is told to cite (``SECTIONS``).
- Every file path and every ``qkv.`` name written in backticks in the document exists.

Oracles: the files' own text, the document's headings, the file system and ``importlib``.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGE = ROOT / "src" / "qkv"

#: what may not be cited: (pattern, what it is). This file is the one place that names them.
OUTSIDE = (
    (re.compile(r"\bDESIGN(\.md)?\b"), "the design notes outside the repository"),
    (re.compile(r"\bCHECKLIST\b"), "the checklist outside the repository (its items are "
                                     "docs/ARCHITECTURE.md: Checklist)"),
    (re.compile(r"\.\./shared\b|/work/shared\b"), "a path outside the repository"),
)

#: the sections the code is told to cite (issue 21)
SECTIONS = ("Floors", "Packages", "Shapes", "Masks", "Tolerances", "Errors", "Files",
            "Backends (attention)", "The model registry", "Adding a model family",
            "Trainer kinds", "Adding a trainer kind", "Decode backends", "Tests", "Checklist")

CITATION = re.compile(r"docs/ARCHITECTURE\.md:")


def sources() -> list[Path]:
    """The files whose citations are checked: Python under src/, tests/ and benchmarks/, and
    README.md (this file aside: it names what it forbids)."""
    files = [p for top in ("src", "tests", "benchmarks") for p in sorted((ROOT / top).rglob("*.py"))
             if "__pycache__" not in p.parts and p != Path(__file__).resolve()]
    return [*files, ROOT / "README.md"]


def without_fences(text: str) -> str:
    """``text`` with its fenced code blocks blanked (their lines kept, so line numbers hold)."""
    return re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text,
                  flags=re.S | re.M)


def headings(text: str) -> list[str]:
    """The Markdown headings of ``text`` (any level), outside code blocks."""
    return re.findall(r"^#{1,6} +(.+?) *$", without_fences(text), flags=re.M)


def cited_sections(rest: str, known: list[str]) -> list[str]:
    """The sections a citation names, from the text after ``docs/ARCHITECTURE.md:``
    (``" Errors; Backends (attention))."``): one or more of ``known`` separated by "; ".

    Raises:
        ValueError: the text there is not a known section (quoting it).
    """
    found = []
    text = rest.removeprefix(" ")
    longest_first = sorted(known, key=len, reverse=True)
    while True:
        name = next((h for h in longest_first if text.startswith(h)
                     and not text[len(h):len(h) + 1].isalnum()), None)
        if name is None:
            raise ValueError(f"{text.strip()[:50]!r} is not a section of docs/ARCHITECTURE.md")
        found.append(name)
        text = text[len(name):]
        if not text.startswith("; "):
            return found
        text = text[2:]


def test_nothing_cites_a_file_outside_the_repository():
    bad = []
    for path in sources():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            bad += [f"{path.relative_to(ROOT)}:{number}: {what}: {line.strip()}"
                    for pattern, what in OUTSIDE if pattern.search(line)]
    assert not bad, ("cite docs/ARCHITECTURE.md (a section: 'docs/ARCHITECTURE.md: "
                     "Tolerances') instead:\n" + "\n".join(bad))


def citation_text(text: str, end: int) -> str:
    """What follows a citation ending at ``end``, a docstring's or comment's line breaks (and
    the ``#`` / ``#:`` that open the next comment line) read as one space."""
    return re.sub(r"[ \t]*\n[ \t]*(#:?[ \t]*)?", " ", text[end:end + 200])


def test_every_cited_section_is_a_heading_of_the_document():
    known = headings(DOC.read_text(encoding="utf-8"))
    bad, cited = [], 0
    for path in sources():
        text = path.read_text(encoding="utf-8")
        for m in CITATION.finditer(text):
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
            try:
                cited += len(cited_sections(citation_text(text, m.end()), known))
            except ValueError as err:
                bad.append(f"{where}: {err}")
    assert not bad, ("cite as 'docs/ARCHITECTURE.md: <Section>[; <Section>]'; "
                     f"the sections: {known}\n" + "\n".join(bad))
    assert cited >= 10  # the citations of this suite and the package (a scan that found none
    # would pass vacuously)


def test_the_document_has_every_section_the_code_is_told_to_cite():
    have = headings(DOC.read_text(encoding="utf-8"))
    assert [s for s in SECTIONS if s not in have] == []
    assert len(have) == len(set(have)), "two headings of one name: a citation would be ambiguous"


def test_the_citation_parser():
    known = ["Errors", "Backends (attention)", "Files", "The model registry"]
    wrapped = ("x (docs/ARCHITECTURE.md: The model\n    registry) y\n"
               "#: (docs/ARCHITECTURE.md:\n#: Files)")
    ends = [m.end() for m in CITATION.finditer(wrapped)]
    assert [cited_sections(citation_text(wrapped, e), known) for e in ends] == [
        ["The model registry"], ["Files"]]
    assert cited_sections(" Errors; Backends (attention)).", known) == [
        "Errors", "Backends (attention)"]
    assert cited_sections(" The model registry).", known) == ["The model registry"]
    assert cited_sections(" Files, the names", known) == ["Files"]
    for rest in (" Backends).", " True = \"may", "", " Filesystem", " Errors; Tolerance"):
        with pytest.raises(ValueError, match="not a section"):
            cited_sections(rest, known)


def _spans(text: str) -> list[str]:
    """The inline code spans of Markdown ``text`` (code blocks left out), whitespace joined."""
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", without_fences(text))]


def _resolve(dotted: str) -> object:
    """The object a dotted ``qkv.`` name names: the longest importable module prefix, then
    attributes (ModuleNotFoundError / AttributeError when it does not exist)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            if i == 1:
                raise
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise AssertionError("unreachable")


def _path_exists(span: str) -> bool | None:
    """Whether a path the document writes exists (relative to the repository root or
    src/qkv/; a bare file name anywhere in src/qkv/); None when ``span`` is not one that can
    be checked (a pattern like ``hf_<family>.py``, a run directory's ``checkpoint/``)."""
    if re.fullmatch(r"[\w./-]+\.(py|md)", span):
        if "/" not in span:
            return any(PACKAGE.rglob(span))
        return (ROOT / span).is_file() or (PACKAGE / span).is_file()
    if re.fullmatch(r"[\w./-]+/", span):
        first = span.split("/")[0]
        if first in ("src", "tests", "benchmarks", "docs") or (PACKAGE / first).is_dir():
            return (ROOT / span).is_dir() or (PACKAGE / span).is_dir()
    return None


def test_every_path_and_qkv_name_in_the_document_exists():
    spans = _spans(DOC.read_text(encoding="utf-8"))
    missing, checked = [], 0
    for span in spans:
        exists = _path_exists(span)
        if exists is not None:
            checked += 1
            if not exists:
                missing.append(f"path {span}")
        name = re.match(r"qkv(\.\w+)+", span)
        if name:
            checked += 1
            try:
                _resolve(name.group(0))
            except (ModuleNotFoundError, AttributeError) as err:
                missing.append(f"name {name.group(0)} ({err})")
    assert not missing, "docs/ARCHITECTURE.md names what does not exist:\n" + "\n".join(missing)
    assert checked >= 100  # the document names files and qkv names throughout


def checklist_items(text: str) -> dict[int, str]:
    """Item number -> first line of each numbered item of the document's Checklist section."""
    section = text.split("\n## Checklist\n", 1)[1].split("\n## ", 1)[0]
    return {int(n): line for n, line in re.findall(r"^(\d+)\. (.+)$", section, flags=re.M)}


def test_every_checklist_item_a_test_cites_exists():
    items = checklist_items(DOC.read_text(encoding="utf-8"))
    assert sorted(items) == list(range(1, len(items) + 1)) and len(items) >= 30
    bad, cited = [], 0
    for path in sources():
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"\bChecklist (\d+)((?:, \d+)*)", text):
            numbers = [int(m.group(1)), *(int(n) for n in re.findall(r"\d+", m.group(2)))]
            cited += len(numbers)
            bad += [f"{path.relative_to(ROOT)}: Checklist {n}" for n in numbers if n not in items]
    assert not bad, "no such item in docs/ARCHITECTURE.md: Checklist:\n" + "\n".join(bad)
    assert cited >= 20  # the suite cites the checklist throughout (a scan finding none passes)
