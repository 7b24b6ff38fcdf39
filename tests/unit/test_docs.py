"""docs/performance.md and the pointers into it: every pointer in the code and the README
names a section that exists, and every section gives the command that measures it again."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "performance.md"
PACKAGES = ("api", "tasks", "workers", "kvbm", "bench", "tests")

# a pointer: docs/performance.md (in backticks or not), a comma, then the title in quotes
POINTER = re.compile(r"docs/performance\.md`*,\s*\"([^\"]+)\"")
# a line break inside a docstring or a comment, with the next line's indent and its '#'
BREAK = re.compile(r"[ \t]*\n[ \t]*(?:#[ \t]*)?")
COMMAND = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(?:python|py-spy|make)\s", re.M)
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`((?:python|py-spy|make)\s[^`]+)`")


def _sections() -> dict[str, str]:
    """Title -> body of every ``##`` section of docs/performance.md."""
    parts = re.split(r"^## (.+)$", DOC.read_text(), flags=re.M)
    titles = parts[1::2]
    assert len(titles) == len(set(titles)), "a section title is used twice"
    return dict(zip(titles, parts[2::2], strict=True))


def _sources() -> list[Path]:
    files = [ROOT / "README.md"]
    for package in PACKAGES:
        files += sorted((ROOT / package).rglob("*.py"))
    return files


def _pointers() -> list[tuple[str, str]]:
    """(file, title) of every pointer, a title broken over lines joined again."""
    out = []
    for path in _sources():
        text = BREAK.sub(" ", path.read_text())
        out += [(str(path.relative_to(ROOT)), m.group(1)) for m in POINTER.finditer(text)]
    return out


def test_pointers_are_found() -> None:
    files = {f for f, _ in _pointers()}
    # some files known to point there: the pattern above must keep finding them
    assert {"api/sse.py", "tasks/broker.py", "workers/stream.py", "README.md"} <= files


def test_every_pointer_names_a_section() -> None:
    sections = _sections()
    missing = [f"{f}: {t!r}" for f, t in _pointers() if t not in sections]
    assert not missing, "pointers to no section of docs/performance.md:\n" + "\n".join(missing)


@pytest.mark.parametrize("title", list(_sections()))
def test_every_section_gives_a_command(title: str) -> None:
    body = _sections()[title]
    fenced = any(COMMAND.search(block) for block in FENCE.findall(body))
    assert fenced or INLINE.search(body), f"section {title!r} gives no command to run"
