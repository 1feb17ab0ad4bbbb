"""The documentation holds together: README.md and the pages under docs/.

Checks, with the standard library only:

- every relative link (and image) in README.md and docs/**/*.md points to a file that exists;
- every ``#anchor`` of a link to a Markdown page matches a heading of that page, by GitHub's
  slug rules (lower case, punctuation other than ``-`` and ``_`` dropped, each space a ``-``,
  ``-1``, ``-2``... for repeated headings);
- README.md stays short (at most ``README_MAX_LINES`` lines): details go to docs/;
- every page under docs/ can be reached from README.md by following links.

Links to http(s) and mailto addresses are not followed. Links inside code blocks and code
spans are not links and are not checked.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 220

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_INLINE_LINK = re.compile(r"\]\(\s*(?:<([^>]*)>|([^)\s]+))(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^>\s]+)>?")
_HTML_ATTR = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
_HTML_ID = re.compile(r"""\b(?:id|name)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
_EXTERNAL = re.compile(r"^(?:https?:|mailto:)", re.IGNORECASE)
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


@dataclass(frozen=True)
class Link:
    source: Path  # the Markdown file the link is in
    line: int  # 1-based line number in source
    target: str  # the link as written


def prose_lines(text: str, blank_code_spans: bool = True) -> list[tuple[int, str]]:
    """(line number, line) of a Markdown text outside fenced code blocks, code spans blanked
    (links in code are not links) unless ``blank_code_spans`` is false (headings keep theirs)."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        m = _FENCE.match(line)
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        if blank_code_spans:
            line = _CODE_SPAN.sub(lambda s: " " * len(s.group(0)), line)
        out.append((number, line))
    return out


def links_in(path: Path) -> list[Link]:
    """Every link and image target of a Markdown file, in order."""
    found: list[Link] = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        targets = [
            m.group(1) if m.group(1) is not None else m.group(2)
            for m in _INLINE_LINK.finditer(line)
        ]
        ref = _REF_DEF.match(line)
        if ref:
            targets.append(ref.group(1))
        targets += _HTML_ATTR.findall(line)
        found += [Link(path, number, t.strip()) for t in targets if t.strip()]
    return found


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading's text (before de-duplication)."""
    text = re.sub(r"!\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # images: their alt text
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links: their text
    text = re.sub(r"<[^>]+>", "", text)  # HTML tags
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    """The anchors a Markdown page offers: its headings' slugs, and explicit HTML ids."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    previous = ""

    def add(heading: str) -> None:
        slug = github_slug(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")

    for _, line in prose_lines(path.read_text(encoding="utf-8"), blank_code_spans=False):
        atx = _ATX.match(line)
        if atx:
            add(atx.group(2) or "")
        elif (
            _SETEXT.match(line)
            and previous.strip()
            and not re.match(r"^ {0,3}([#>|*+-]|\d+[.)])", previous)
        ):
            add(previous)
        anchors.update(_HTML_ID.findall(line))
        previous = "" if atx else line
    return anchors


def markdown_files(root: Path) -> list[Path]:
    """README.md and every Markdown page under docs/."""
    readme = root / "README.md"
    pages = sorted((root / "docs").rglob("*.md")) if (root / "docs").is_dir() else []
    return ([readme] if readme.is_file() else []) + pages


def rel(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


def resolve(link: Link) -> tuple[Path, str] | None:
    """The file a relative link points to, and its anchor; None for external links."""
    if _EXTERNAL.match(link.target) or _SCHEME.match(link.target):
        return None
    path_part, _, anchor = link.target.partition("#")
    path_part = unquote(path_part.split("?", 1)[0])
    target = link.source if not path_part else (link.source.parent / path_part)
    return target.resolve(), unquote(anchor)


def link_problems(root: Path) -> list[str]:
    """Broken relative links and anchors in README.md and docs/, one message each."""
    problems: list[str] = []
    anchor_cache: dict[Path, set[str]] = {}
    for md in markdown_files(root):
        for link in links_in(md):
            resolved = resolve(link)
            if resolved is None:
                continue
            target, anchor = resolved
            where = f"{rel(md, root)}:{link.line}: link '{link.target}'"
            if not target.exists():
                problems.append(
                    f"{where} points to {rel(target, root)}, which does not exist; "
                    "fix the path (relative to the page the link is in) or create the file"
                )
                continue
            if not anchor or target.suffix.lower() != ".md" or not target.is_file():
                continue
            if target not in anchor_cache:
                anchor_cache[target] = anchors_of(target)
            if anchor not in anchor_cache[target]:
                known = ", ".join(sorted(anchor_cache[target])) or "(none)"
                problems.append(
                    f"{where}: no heading of {rel(target, root)} has the anchor '#{anchor}'; "
                    f"use one of its anchors ({known}) or rename the heading"
                )
    return problems


def readme_length_problems(root: Path, max_lines: int = README_MAX_LINES) -> list[str]:
    readme = root / "README.md"
    if not readme.is_file():
        return ["README.md is missing; the project's front page must exist"]
    n = len(readme.read_text(encoding="utf-8").splitlines())
    if n > max_lines:
        return [
            f"README.md has {n} lines, more than {max_lines}; move details to a page "
            "under docs/ and link it from the README's Documentation list"
        ]
    return []


def unreachable_pages(root: Path) -> list[str]:
    """Pages under docs/ that no chain of links from README.md reaches."""
    readme = (root / "README.md").resolve()
    pages = {p.resolve() for p in markdown_files(root)} - {readme}
    reached: set[Path] = set()
    queue: deque[Path] = deque([readme] if readme.is_file() else [])
    while queue:
        md = queue.popleft()
        if md in reached:
            continue
        reached.add(md)
        for link in links_in(md):
            resolved = resolve(link)
            if resolved is None:
                continue
            target, _ = resolved
            if target.suffix.lower() == ".md" and target.is_file() and target not in reached:
                queue.append(target)
    return [
        f"{rel(p, root)} is not reachable by links from README.md; link it from the "
        "README's Documentation list (or from a page the README links to)"
        for p in sorted(pages - reached)
    ]


# --- the repository's documentation ---------------------------------------------------------


def test_relative_links_and_anchors_resolve() -> None:
    problems = link_problems(ROOT)
    assert not problems, "broken documentation links:\n" + "\n".join(problems)


def test_readme_is_short() -> None:
    problems = readme_length_problems(ROOT)
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_reachable_from_readme() -> None:
    problems = unreachable_pages(ROOT)
    assert not problems, "\n".join(problems)


def test_readme_links_to_docs() -> None:
    assert (ROOT / "docs").is_dir(), "docs/ is missing"
    linked = [link for link in links_in(ROOT / "README.md") if link.target.startswith("docs/")]
    assert linked, "README.md links to no page under docs/; add a Documentation list"


# --- the checker itself ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("Fleet topology", "fleet-topology"),
        ("`kvscope advise --prometheus`", "kvscope-advise---prometheus"),
        (
            "Zero-install: advise from an existing Prometheus",
            "zero-install-advise-from-an-existing-prometheus",
        ),
        (
            "KV-cache events: prefix duplication across replicas",
            "kv-cache-events-prefix-duplication-across-replicas",
        ),
        (
            "Report JSON (`--json`, `--out`; `schema_version` 1)",
            "report-json---json---out-schema_version-1",
        ),
        ("See [the collector](collector.md)", "see-the-collector"),
    ],
)
def test_github_slug(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def test_checker_reports_what_is_broken(tmp_path: Path) -> None:
    _write(
        tmp_path / "README.md",
        "\n".join(
            [
                "# Demo",
                "[good](docs/a.md#a-section) and [good too](docs/a.md#a-section-1)",
                "[missing page](docs/missing.md)",
                "[bad anchor](docs/a.md#no-such-heading)",
                "![missing image](docs/images/none.png)",
                "[own heading](#demo) and [external](https://example.com/x.md) [mail](mailto:a@b.c)",
                "`[in a code span](docs/ignored.md)`",
                "```",
                "[in a code block](docs/ignored-too.md)",
                "```",
                *["filler"] * 215,
            ]
        )
        + "\n",
    )
    _write(
        tmp_path / "docs" / "a.md", "# Page A\n## A section\n## A section\n[back](../README.md)\n"
    )
    _write(tmp_path / "docs" / "orphan.md", "# Orphan\n[a](a.md)\n")

    problems = link_problems(tmp_path)
    assert len(problems) == 3, problems
    assert any(
        "README.md:3: link 'docs/missing.md'" in p and "does not exist" in p for p in problems
    )
    assert any(
        "README.md:4: link 'docs/a.md#no-such-heading'" in p and "a-section-1" in p
        for p in problems
    )
    assert any("README.md:5: link 'docs/images/none.png'" in p for p in problems)

    assert readme_length_problems(tmp_path) == [
        "README.md has 225 lines, more than 220; move details to a page under docs/ and "
        "link it from the README's Documentation list"
    ]
    assert readme_length_problems(tmp_path, max_lines=300) == []

    unreachable = unreachable_pages(tmp_path)
    assert len(unreachable) == 1 and unreachable[0].startswith("docs/orphan.md is not reachable")


def test_checker_passes_a_sound_tree(tmp_path: Path) -> None:
    _write(tmp_path / "README.md", "# Top\nSee [a](docs/a.md).\n")
    _write(
        tmp_path / "docs" / "a.md",
        "# A\n## `kvscope lint`: checks\n"
        "[b](sub/b.md#b-title) [top](../README.md#top) [self](#kvscope-lint-checks)\n",
    )
    _write(tmp_path / "docs" / "sub" / "b.md", "B title\n=======\n![img](../img/x.png)\n")
    _write(tmp_path / "docs" / "img" / "x.png", "")
    assert link_problems(tmp_path) == []
    assert unreachable_pages(tmp_path) == []
