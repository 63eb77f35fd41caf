"""Every relative link of the repository's Markdown files resolves.

Each `[text](path)` and `![alt](path)` of every tracked `*.md` file (every `*.md` outside
hidden folders and virtual environments when the tree is not a git checkout) must name a file
or folder that exists, relative to the Markdown file's folder; the `#anchor` part is stripped,
and external links (`http:`, `https:`, `mailto:`, any other scheme) and pure anchors are
skipped. Links inside code (fenced blocks and inline code spans) are not links and are skipped.
A link's `#anchor` into a Markdown file (or a pure anchor into its own page) must name one of
that file's headings, as GitHub makes heading anchors.
"""
import functools
import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIPPED_FOLDERS = {".venv", "venv", "node_modules", "mutants", "work-demo", "build", "dist"}
FENCE = re.compile(r"^([ \t]*)(```|~~~).*?^\1\2[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
# [text](target) or ![alt](target), the target optionally in <...> and followed by a "title"
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
HEADING = re.compile(r"^#{1,6}[ \t]+(.*?)[ \t]*#*[ \t]*$", re.MULTILINE)
LINK_TEXT = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def markdown_files():
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", "*.md"], cwd=ROOT, capture_output=True,
                                text=True, check=True, timeout=30).stdout
        files = [ROOT / name for name in listed.split("\0") if name]
    except (OSError, subprocess.SubprocessError):
        files = []
    if not files:  # not a git checkout (an unpacked archive): every Markdown file of the tree
        files = [path for path in ROOT.rglob("*.md")
                 if not any(part.startswith(".") or part in SKIPPED_FOLDERS
                            for part in path.relative_to(ROOT).parts[:-1])]
    return sorted(path for path in files if path.is_file())


def without_code(text):
    """``text`` with its fenced blocks and code spans blanked out, line numbers kept."""
    text = FENCE.sub(lambda match: "\n" * match.group(0).count("\n"), text)
    return CODE_SPAN.sub(lambda match: "\n" * match.group(0).count("\n"), text)


def local_links(text):
    """The link targets of a Markdown text, outside code, that are no URL (paths and pure
    anchors), with their line numbers."""
    text = without_code(text)
    for match in LINK.finditer(text):
        target = match.group(1).strip("<>").strip()
        if target and not SCHEME.match(target):
            yield text.count("\n", 0, match.start()) + 1, target


def relative_links(text):
    """The link targets of a Markdown text, outside code, that are paths (no scheme, not a
    pure anchor), with their line numbers."""
    return ((line, target) for line, target in local_links(text) if not target.startswith("#"))


def heading_anchors(text):
    """The anchors of a Markdown text: those GitHub gives its headings (the heading's text, a
    link's text for a link, in lower case, every character but letters, digits, '_', '-' and
    spaces dropped, spaces made '-', and '-1', '-2', ... added to repeats) and the ids of its
    ``<a id="...">`` tags."""
    anchors, seen = set(HTML_ANCHOR.findall(without_code(text))), {}
    for match in HEADING.finditer(FENCE.sub("", text)):  # a heading's code spans are its text
        anchor = re.sub(r"[^\w\- ]", "", LINK_TEXT.sub(r"\1", match.group(1)).lower()).replace(" ", "-")
        seen[anchor] = seen.get(anchor, -1) + 1
        anchors.add(f"{anchor}-{seen[anchor]}" if seen[anchor] else anchor)
    return anchors


@functools.lru_cache(maxsize=None)
def page_anchors(page):
    """``heading_anchors`` of the Markdown file ``page``, read once however many links name it."""
    return heading_anchors(page.read_text(encoding="utf-8"))


def broken_anchors(path):
    """The links of ``path`` to '#anchor' of a Markdown file (itself included) that name none
    of its headings."""
    broken = []
    for line, target in local_links(path.read_text(encoding="utf-8")):
        file_part, _, anchor = unquote(target).partition("#")
        page = (path.parent / file_part).resolve() if file_part else path
        if anchor and page.suffix == ".md" and page.is_file() and anchor not in page_anchors(page):
            broken.append(f"{path.relative_to(ROOT)}:{line}: ({target}) names no heading of "
                          f"{page.resolve().relative_to(ROOT)}")
    return broken


def broken_links(path):
    broken = []
    for line, target in relative_links(path.read_text(encoding="utf-8")):
        file_part = unquote(target.split("#", 1)[0].split("?", 1)[0])
        resolved = (ROOT / file_part.lstrip("/")) if file_part.startswith("/") else (path.parent / file_part)
        if not resolved.exists():
            broken.append(f"{path.relative_to(ROOT)}:{line}: ({target}) -> {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved} does not exist")
    return broken


FILES = markdown_files()


def test_the_repository_has_markdown_files_to_check():
    names = {path.relative_to(ROOT).as_posix() for path in FILES}
    assert "README.md" in names and "docs/testing.md" in names


@pytest.mark.parametrize("path", FILES, ids=[path.relative_to(ROOT).as_posix() for path in FILES])
def test_every_relative_link_resolves(path):
    broken = broken_links(path)
    assert not broken, "broken relative links:\n" + "\n".join(broken)


# The front door and the pages a newcomer reads stay short (CONTRIBUTING.md, "Documentation").
LINE_LIMITS = {"README.md": 250, "examples/*/README.md": 150, "docs/testing.md": 150,
               "docs/experiment/**/*.md": 150}


def test_the_front_pages_stay_within_their_line_limits():
    too_long = [f"{path.relative_to(ROOT)}: {lines} lines, at most {limit}"
                for pattern, limit in LINE_LIMITS.items() for path in ROOT.glob(pattern) if path in FILES
                for lines in [len(path.read_text(encoding="utf-8").splitlines())] if lines > limit]
    assert not too_long, "pages over their line limit (move details to docs/):\n" + "\n".join(too_long)


@pytest.mark.parametrize("path", FILES, ids=[path.relative_to(ROOT).as_posix() for path in FILES])
def test_every_anchor_names_a_heading(path):
    broken = broken_anchors(path)
    assert not broken, "links to anchors that no heading has:\n" + "\n".join(broken)


def test_heading_anchors_are_githubs():
    text = ("# Results\n## 1. After 400 updates (CPU)\n### German → English, `matched`\n"
            "## Results\n## [Linked](a.md) heading ##\n```\n# not a heading\n```\n    # code\n"
            '- <a id="note-a"></a>a. A note\n')
    assert heading_anchors(text) == {"results", "1-after-400-updates-cpu", "german--english-matched",
                                     "results-1", "linked-heading", "note-a"}


def test_a_fenced_block_after_a_blank_line_ends_at_its_own_fence():
    text = "a\n\n```\ncode\n```\n\n[x](x.md)\n\n```\nmore\n```\n"
    assert list(relative_links(text)) == [(7, "x.md")]


def test_the_link_finder_reads_links_and_skips_code_and_external_targets():
    text = ("[a](docs/a.md#x) ![img](img/b.png \"title\") [web](https://example.org) [m](mailto:x@y.z)\n"
            "[anchor](#local) `[code](not/a/link.md)` [nested [brackets]](c.md) [angle](<d e.md>)\n"
            "```\n[fenced](not/a/link.md)\n```\n[after](f.md)\n")
    assert list(relative_links(text)) == [(1, "docs/a.md#x"), (1, "img/b.png"), (2, "c.md"),
                                          (2, "<d e.md>".strip("<>")), (6, "f.md")]
