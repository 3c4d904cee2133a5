"""README.md's generated blocks: the text between `<!-- KIND:ID -->` and `<!-- /KIND:ID -->` belongs to the command
that writes KIND (`jobs.reproduce` for reproduce, `bench.report` for bench), so no table there is typed by hand."""

from __future__ import annotations

import re
from pathlib import Path

from fedsim.errors import ConfigError


def _pattern(kind: str) -> re.Pattern[str]:
    k = re.escape(kind)
    return re.compile(rf"<!-- {k}:(?P<id>[a-z0-9_-]+) -->\n(?P<body>.*?)<!-- /{k}:(?P=id) -->", re.S)


def read_blocks(text: str, kind: str) -> dict[str, str]:
    """id -> the text between the markers of every `kind` block in `text`."""
    return {m["id"]: m["body"] for m in _pattern(kind).finditer(text)}


def paste_blocks(readme: Path, kind: str, contents: dict[str, str]) -> None:
    """Replace the body of each `kind` block named in `contents` (bodies end with a newline); a block missing from
    the file is a ConfigError naming it, and then the file is left as it was."""
    from fedsim.persist.io import atomic_write_text

    text = readme.read_text(encoding="utf-8")
    missing = [i for i in contents if i not in read_blocks(text, kind)]
    if missing:
        raise ConfigError(f"{readme}: no <!-- {kind}:{missing[0]} --> ... <!-- /{kind}:{missing[0]} --> block")

    def fill(m: re.Match) -> str:
        if m["id"] not in contents:
            return m[0]
        body = contents[m["id"]]
        return f"<!-- {kind}:{m['id']} -->\n{body}{'' if body.endswith(chr(10)) else chr(10)}<!-- /{kind}:{m['id']} -->"

    atomic_write_text(readme, _pattern(kind).sub(fill, text))
