"""Every relative link of the repository's Markdown files resolves.

Each `[text](path)` and `![alt](path)` of every tracked `*.md` file (every `*.md` outside
hidden folders and virtual environments when the tree is not a git checkout) must name a file
or folder that exists, relative to the Markdown file's folder; the `#anchor` part is stripped,
and external links (`http:`, `https:`, `mailto:`, any other scheme) and pure anchors are
skipped. Links inside code (fenced blocks and inline code spans) are not links and are skipped.
"""
import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIPPED_FOLDERS = {".venv", "venv", "node_modules", "mutants", "work-demo", "build", "dist"}
FENCE = re.compile(r"^(\s*)(```|~~~).*?^\1\2[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
# [text](target) or ![alt](target), the target optionally in <...> and followed by a "title"
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


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


def relative_links(text):
    """The link targets of a Markdown text, outside code, that are paths (no scheme, not a
    pure anchor), with their line numbers."""
    text = FENCE.sub(lambda match: "\n" * match.group(0).count("\n"), text)
    text = CODE_SPAN.sub(lambda match: "\n" * match.group(0).count("\n"), text)
    for match in LINK.finditer(text):
        target = match.group(1).strip("<>").strip()
        if not target or target.startswith("#") or SCHEME.match(target):
            continue
        yield text.count("\n", 0, match.start()) + 1, target


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


def test_the_link_finder_reads_links_and_skips_code_and_external_targets():
    text = ("[a](docs/a.md#x) ![img](img/b.png \"title\") [web](https://example.org) [m](mailto:x@y.z)\n"
            "[anchor](#local) `[code](not/a/link.md)` [nested [brackets]](c.md) [angle](<d e.md>)\n"
            "```\n[fenced](not/a/link.md)\n```\n[after](f.md)\n")
    assert list(relative_links(text)) == [(1, "docs/a.md#x"), (1, "img/b.png"), (2, "c.md"),
                                          (2, "<d e.md>".strip("<>")), (6, "f.md")]
