"""The documents hold to the code: every pointer "(<page>.md, "<title>")" in the code and the
docs names a section that exists; every section of docs/performance.md gives the command
that measures it again; every relative link leads to a file; every `make` target and
variable the docs name is the Makefile's; every CONVEYOR_* variable they name is a setting
or is read by something in the repository."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic import BaseModel

from tasks.settings import AREAS, FLAT, Settings

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
PERF = ROOT / "docs" / "performance.md"
PACKAGES = ("api", "tasks", "workers", "kvbm", "cluster", "planner", "bench", "tests")

# a pointer: a page (docs/x.md, x.md, or a markdown link to it), a comma, the title in quotes
POINTER = re.compile(r"(?:docs/)?(\w+)\.md`*(?:\]\([^)\s]*\))?,\s*\"([^\"]+)\"")
# a line break inside a docstring or a comment, with the next line's indent and its '#'
BREAK = re.compile(r"[ \t]*\n[ \t]*(?:#[ \t]*)?")
COMMAND = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(?:python|py-spy|make)\s", re.M)
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`((?:python|py-spy|make)\s[^`]+)`")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
MAKE = re.compile(r"\bmake ([a-z][a-z-]*)((?: [A-Z_]+=\S+)*)")
ENV = re.compile(r"CONVEYOR_[A-Z0-9_]*[A-Z0-9]")


def _sections(path: Path) -> dict[str, str]:
    """Title -> body of every ``##`` (or deeper) section of a page."""
    parts = re.split(r"^#{2,4} (.+)$", path.read_text(), flags=re.M)
    titles = parts[1::2]
    assert len(titles) == len(set(titles)), f"{path.name}: a section title is used twice"
    return dict(zip(titles, parts[2::2], strict=True))


def _sources() -> list[Path]:
    files = list(PAGES)
    for package in PACKAGES:
        files += sorted((ROOT / package).rglob("*.py"))
    return files


def _pointers() -> list[tuple[str, str, str]]:
    """(file, page, title) of every pointer, a title broken over lines joined again."""
    out = []
    for path in _sources():
        text = BREAK.sub(" ", path.read_text())
        rel = str(path.relative_to(ROOT))
        out += [(rel, m.group(1), m.group(2)) for m in POINTER.finditer(text)]
    return out


def _page(name: str) -> Path | None:
    path = ROOT / "README.md" if name == "README" else ROOT / "docs" / f"{name}.md"
    return path if path.exists() else None


def test_pointers_are_found() -> None:
    found = {(f, page) for f, page, _ in _pointers()}
    # some files known to point there: the pattern above must keep finding them
    assert {
        ("api/sse.py", "performance"),
        ("tasks/broker.py", "performance"),
        ("workers/stream.py", "performance"),
        ("tests/unit/test_layering.py", "architecture"),
        ("docs/operations.md", "performance"),
        ("docs/vllm.md", "api"),
    } <= found


def test_every_pointer_names_a_section() -> None:
    missing = []
    for f, name, title in _pointers():
        page = _page(name)
        if page is None or title.startswith("<"):
            continue  # another project's page (a URL's last part), or the form's placeholder
        if title not in _sections(page):
            missing.append(f"{f}: {name}.md, {title!r}")
    assert not missing, "pointers to no section:\n" + "\n".join(missing)


@pytest.mark.parametrize("title", list(_sections(PERF)))
def test_every_performance_section_gives_a_command(title: str) -> None:
    body = _sections(PERF)[title]
    fenced = any(COMMAND.search(block) for block in FENCE.findall(body))
    assert fenced or INLINE.search(body), f"section {title!r} gives no command to run"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file(page: Path) -> None:
    targets = [t for t in LINK.findall(page.read_text()) if "://" not in t]
    missing = [t for t in targets if not (page.parent / t).exists()]
    assert not missing, f"{page.name} links to files that do not exist: {missing}"


def _makefile() -> tuple[set[str], str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z-]*):", text, flags=re.M)), text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_make_target_and_variable_named_exists(page: Path) -> None:
    targets, text = _makefile()
    bad = []
    for m in MAKE.finditer(page.read_text()):
        if m.group(1) not in targets:
            bad.append(f"make {m.group(1)}")
        for var in re.findall(r"([A-Z_]+)=", m.group(2)):
            if f"$({var})" not in text and not var.startswith("CONVEYOR_"):
                bad.append(f"make {m.group(1)} {var}=...")
    assert not bad, f"{page.name} names what the Makefile does not have: {bad}"


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    for t in (annotation, *get_args(annotation)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _aliases(field: Any) -> list[str]:
    alias = field.validation_alias or field.alias
    if alias is None:
        return []
    if isinstance(alias, str):
        return [alias]
    return [c for c in getattr(alias, "choices", []) if isinstance(c, str)]


def _setting_names() -> tuple[set[str], set[str]]:
    """The env names Settings reads (every area field under its flat name, the top-level
    fields under theirs), and the prefixes under which it reads any key (a dict field
    through the nested delimiter, e.g. CONVEYOR_VLLM__MAX_NUM_SEQS)."""
    prefix = Settings.model_config.get("env_prefix", "")
    delim = Settings.model_config.get("env_nested_delimiter") or "__"
    names = {(prefix + flat).upper() for flat in FLAT}
    open_prefixes: set[str] = set()
    for name, field in Settings.model_fields.items():
        if name in AREAS:
            continue
        names.add((prefix + name).upper())
        names.update((prefix + a).upper() for a in _aliases(field))
        sub = _nested_model(field.annotation)
        if sub is not None:  # a nested model outside the areas (mock): NAME__FIELD
            names.update((prefix + name + delim + f).upper() for f in sub.model_fields)
        elif "dict" in str(field.annotation):
            open_prefixes.add((prefix + name + delim).upper())
    return names, open_prefixes


def _read_elsewhere(name: str) -> bool:
    """Whether something in the repository other than the docs reads ``name``."""
    files = [ROOT / "Makefile", ROOT / ".ci" / "run", ROOT / "docker-compose.yml"]
    files += sorted((ROOT / "scripts").rglob("*"))
    for package in PACKAGES:
        files += sorted((ROOT / package).rglob("*.py"))
    return any(f.is_file() and name in f.read_text(errors="replace") for f in files)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_conveyor_variable_named_exists(page: Path) -> None:
    names, open_prefixes = _setting_names()
    unknown = sorted(
        name
        for name in set(ENV.findall(page.read_text()))
        if name not in names
        and not any(name.startswith(p) for p in open_prefixes)
        and not _read_elsewhere(name)
    )
    assert not unknown, f"{page.name} names variables nothing reads: {unknown}"


def test_the_setting_names_are_found() -> None:
    names, open_prefixes = _setting_names()
    assert {"CONVEYOR_MODE", "CONVEYOR_REDIS_URL", "CONVEYOR_MOCK__DECODE_STEP_MS"} <= names
    assert "CONVEYOR_VLLM__" in open_prefixes


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    first = FENCE.search(text)
    assert first is not None
    commands = [ln.split("#")[0].split() for ln in first.group(1).splitlines()]
    assert commands == [["make", "serve"], ["make", "test"]]
