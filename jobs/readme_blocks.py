"""Generated blocks of README.md and the docs pages: the text between `<!-- KIND:ID -->` and `<!-- /KIND:ID -->`
belongs to the command that writes KIND (`jobs.reproduce` for reproduce, `bench.report` for bench, ...), so no table
there is typed by hand. A block may live on any page; the commands find it there."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from fedsim.errors import ConfigError


def doc_pages(root: Path) -> list[Path]:
    """README.md and every page of the docs site under `root`: the pages that may hold generated blocks."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _pattern(kind: str) -> re.Pattern[str]:
    k = re.escape(kind)
    return re.compile(rf"<!-- {k}:(?P<id>[a-z0-9_-]+) -->\n(?P<body>.*?)<!-- /{k}:(?P=id) -->", re.S)


def read_blocks(text: str, kind: str) -> dict[str, str]:
    """id -> the text between the markers of every `kind` block in `text`."""
    return {m["id"]: m["body"] for m in _pattern(kind).finditer(text)}


def read_page_blocks(pages: Sequence[Path], kind: str) -> dict[str, str]:
    """id -> the body of every `kind` block on `pages` (the first page holding an id wins)."""
    out: dict[str, str] = {}
    for page in pages:
        for i, body in read_blocks(page.read_text(encoding="utf-8"), kind).items():
            out.setdefault(i, body)
    return out


def paste_blocks(pages: Path | Sequence[Path], kind: str, contents: dict[str, str]) -> list[Path]:
    """Replace the body of each `kind` block named in `contents` (bodies end with a newline) on whichever of `pages`
    holds it; returns the pages rewritten. A block that no page holds is a ConfigError naming it, and then no page
    changes."""
    from fedsim.persist.io import atomic_write_text

    pages = [pages] if isinstance(pages, Path) else list(pages)
    texts = {page: page.read_text(encoding="utf-8") for page in pages}
    found = {i for text in texts.values() for i in read_blocks(text, kind)}
    missing = [i for i in contents if i not in found]
    if missing:
        where = str(pages[0]) if len(pages) == 1 else f"{len(pages)} pages under {os.path.commonpath(pages)}"
        raise ConfigError(f"{where}: no <!-- {kind}:{missing[0]} --> ... <!-- /{kind}:{missing[0]} --> block")

    def fill(m: re.Match) -> str:
        if m["id"] not in contents:
            return m[0]
        body = contents[m["id"]]
        return f"<!-- {kind}:{m['id']} -->\n{body}{'' if body.endswith(chr(10)) else chr(10)}<!-- /{kind}:{m['id']} -->"

    written = []
    for page, text in texts.items():
        new = _pattern(kind).sub(fill, text)
        if new != text:
            atomic_write_text(page, new)
            written.append(page)
    return written
