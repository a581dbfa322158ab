"""The documentation holds together: README.md and ``docs/*.md`` link only to files and headings that exist,
the README lists every ``docs/`` file, long files open with a table of contents, and every pointer from the
code to a document (``docs/deploying.md, "Stack multi-region"``) names a file and a heading it has.

Guards the README's split into ``docs/`` (issue 21, item 7): a section moved or renamed later must take its
links and the code's pointers with it. Links are checked the way GitHub renders them: a heading's anchor is
its text lower-cased, without punctuation (backticks, parentheses, commas), spaces turned into hyphens.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MARKDOWN = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), ROOT / "infra" / "policy" / "README.md"]
"""The files whose links are checked."""

POINTER_SOURCES = ("runtime", "infra", "tests", "stacks", ".github", "Makefile", "pyproject.toml")
"""Where the code points at documents (files and folders, from the repository root)."""

OTHER_PROJECTS_DOCS = frozenset({"build-repro.md"})
"""``docs/<name>.md`` files of other projects that the code cites (moby/buildkit's build-repro.md)."""

TOC_OVER_LINES = 150
"""A docs/ file longer than this opens with a table of contents ("Contents:")."""

_FENCE = re.compile(r"^(```|~~~)")
_HEADING = re.compile(r"^(#{1,6}) +(.*?) *#*$")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`[^`]*`")
_POINTER = re.compile(r'docs/([a-z0-9-]+\.md)(?:, "([^"]+)")?')


def _prose_lines(text: str) -> list[str]:
    """The lines of ``text`` outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def headings(text: str) -> list[str]:
    """The heading texts of a Markdown document, code blocks left out, backticks removed."""
    found = []
    for line in _prose_lines(text):
        match = _HEADING.match(line)
        if match:
            found.append(match.group(2).replace("`", ""))
    return found


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: ``Stack `dev` (GCP, T4)`` -> ``stack-dev-gcp-t4``."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a document has, with GitHub's ``-1``, ``-2`` suffixes for repeated headings."""
    seen: dict[str, int] = {}
    found = set()
    for heading in headings(text):
        slug = anchor(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(path: Path) -> list[str]:
    """One line per relative link of ``path`` whose file is missing or whose ``#anchor`` is no heading of it
    (links to other sites are not followed)."""
    problems = []
    for line in _prose_lines(path.read_text()):
        for target in _LINK.findall(_CODE_SPAN.sub("", line)):
            if re.match(r"[a-z]+:", target):
                continue
            file_part, _, fragment = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                problems.append(f"{path.name}: link to {target}: no file {file_part}")
            elif fragment and linked.suffix == ".md" and fragment not in anchors(linked.read_text()):
                problems.append(f"{path.name}: link to {target}: no heading with anchor #{fragment}")
    return problems


def broken_pointers(text: str, where: str, docs: Path = DOCS) -> list[str]:
    """One line per ``docs/<file>.md`` or ``docs/<file>.md, "<Heading>"`` in ``text`` (line breaks and
    comment markers inside it allowed) whose file is missing or has no heading starting with that text."""
    flat = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)
    problems = []
    for name, section in _POINTER.findall(flat):
        if name in OTHER_PROJECTS_DOCS:
            continue
        path = docs / name
        if not path.is_file():
            problems.append(f"{where}: docs/{name}: no such file")
        elif section and not any(h.startswith(section.replace("`", "")) for h in headings(path.read_text())):
            problems.append(f'{where}: docs/{name}, "{section}": no such heading')
    return problems


def _pointer_files() -> list[Path]:
    files = []
    for name in POINTER_SOURCES:
        path = ROOT / name
        if path.is_file():
            files.append(path)
        else:
            files.extend(p for p in sorted(path.rglob("*")) if p.suffix in (".py", ".yml", ".yaml"))
    return [f for f in files if f.is_file() and f != Path(__file__).resolve()]  # this file's are examples


# --- the project -----------------------------------------------------------------------------------------


def test_every_relative_link_resolves() -> None:
    problems = [problem for path in MARKDOWN for problem in broken_links(path)]
    assert not problems, "\n".join(problems)


def test_the_readme_lists_every_doc() -> None:
    readme = (ROOT / "README.md").read_text()
    docs = sorted(p.name for p in DOCS.glob("*.md"))
    assert docs, "no docs/*.md"
    assert [name for name in docs if f"(docs/{name})" not in readme] == []


def test_long_docs_open_with_contents() -> None:
    long_ones = [p for p in sorted(DOCS.glob("*.md")) if len(p.read_text().splitlines()) > TOC_OVER_LINES]
    assert [p.name for p in long_ones if "\nContents:\n" not in p.read_text()[:600]] == []


def test_pointers_from_the_code_name_real_sections() -> None:
    problems = []
    for path in _pointer_files():
        problems.extend(broken_pointers(path.read_text(), str(path.relative_to(ROOT)), DOCS))
    assert not problems, "\n".join(problems)


def test_the_code_points_at_docs() -> None:
    """The pointer check reads something: the code's pointers at the split documents are found."""
    text = (ROOT / "infra" / "k8s" / "region.py").read_text() + (ROOT / "runtime" / "config.py").read_text()
    assert {name for name, _ in _POINTER.findall(re.sub(r"\s+", " ", text))} >= {
        "deploying.md",
        "protocol.md",
    }


# --- the checks themselves can fail --------------------------------------------------------------------


def test_a_broken_link_or_anchor_is_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Stack `dev` (GCP, T4)\n\n```\n# not a heading\n```\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "[ok](docs/a.md#stack-dev-gcp-t4) [code](docs/a.md#not-a-heading) [gone](docs/b.md) "
        "`[in code](docs/c.md)` [web](https://example.com/x#y)\n"
    )
    assert broken_links(readme) == [
        "README.md: link to docs/a.md#not-a-heading: no heading with anchor #not-a-heading",
        "README.md: link to docs/b.md: no file docs/b.md",
    ]


def test_a_stale_pointer_is_reported(tmp_path: Path) -> None:
    (tmp_path / "deploying.md").write_text("# Deploying\n\n## Stack `multi-region` (GKE)\n")
    code = '"""Wrapped: docs/deploying.md, "Stack\n    multi-region"."""\n# see docs/deploying.md, "Drain"\n'
    assert broken_pointers(code, "x.py", tmp_path) == ['x.py: docs/deploying.md, "Drain": no such heading']
    assert broken_pointers("docs/gone.md", "y.py", tmp_path) == ["y.py: docs/gone.md: no such file"]
