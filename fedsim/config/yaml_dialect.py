"""The YAML dialect of config files and `-o` values: safe, no duplicate keys, and floats as people write them.

PyYAML follows YAML 1.1, where `1e-3` is a string (a float needs a dot and a signed exponent), `1:30` is 90
(base 60), `010` is 8, `no` and `on` are booleans, `2026-01-02` is a date, and a repeated key silently
replaces the first. Here plain values resolve as in YAML 1.2's core schema (what people mean, and what JSON
and most other tools read): `1e-3`, `5E4`, `.5`, `-.5` and `-2e+1` are floats, integers are decimal, `0o17` or
`0x1F`, only true/false are booleans, and everything else (`1:30`, `no`, dates) stays text. Digits may be
grouped with `_` as in Python. A duplicate key is an error naming the key and both lines, and a document of more
than MAX_CONFIG_VALUES values (aliases expanded) or nested deeper than MAX_CONFIG_DEPTH is refused, from the
parser's events (libyaml's, where PyYAML has it) before a value is built: a few lines of anchors cannot expand into
gigabytes, and a long list is refused in milliseconds rather than built for minutes. `dump` writes YAML that both
rules read back the same: any text that either would take for something else is quoted.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.nodes import MappingNode

from fedsim.config.limits import MAX_CONFIG_DEPTH, MAX_CONFIG_VALUES

FLOAT_TAG = "tag:yaml.org,2002:float"
INT_TAG = "tag:yaml.org,2002:int"
BOOL_TAG = "tag:yaml.org,2002:bool"
NULL_TAG = "tag:yaml.org,2002:null"
MERGE_TAG = "tag:yaml.org,2002:merge"
DIGITS = r"[0-9](?:_?[0-9])*"  # Python's grouping: one underscore between two digits
FLOAT = re.compile(rf"""^(?:
      [-+]?{DIGITS}\.(?:{DIGITS})?(?:[eE][-+]?[0-9]+)?
    | [-+]?\.{DIGITS}(?:[eE][-+]?[0-9]+)?
    | [-+]?{DIGITS}[eE][-+]?[0-9]+
    | [-+]?\.(?:inf|Inf|INF)
    | \.(?:nan|NaN|NAN))$""", re.X)
DECIMAL = re.compile(rf"^[-+]?{DIGITS}$")
INT = re.compile(rf"^(?:[-+]?{DIGITS}|0o[0-7](?:_?[0-7])*|0x[0-9a-fA-F](?:_?[0-9a-fA-F])*)$")
BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
NULL = re.compile(r"^(?:~|null|Null|NULL|)$")


class YAMLShapeError(yaml.YAMLError):
    """A well-formed document that is still refused: a duplicate key, or one too large or deep once expanded."""

    def __init__(self, problem: str, line: int | None = None) -> None:
        super().__init__(problem)
        self.problem, self.line = problem, line


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys and reads exponent-only and sign-dot numbers as floats."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict:
        if isinstance(node, MappingNode):
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first.get(key)
                except TypeError:  # an unhashable key: SafeConstructor reports it below
                    break
                line = key_node.start_mark.line + 1
                if seen is not None:
                    raise YAMLShapeError(f"duplicate key {key!r} (first at line {seen})", line)
                first[key] = line
        return super().construct_mapping(node, deep=deep)


def _yaml12_core(resolvers: dict) -> dict:
    """`resolvers` with their null, bool, int, float and timestamp rules replaced by YAML 1.2's core schema."""
    core = {NULL_TAG: NULL, BOOL_TAG: BOOL, FLOAT_TAG: FLOAT, INT_TAG: INT}  # float before int: "1e3" is a float
    out: dict = {}
    for first, rules in resolvers.items():  # the rest (merge keys, PyYAML's own markers) as PyYAML has them
        kept = [(tag, rx) for tag, rx in rules if tag not in core and not tag.endswith(":timestamp")]
        if kept:
            out[first] = kept
    starts = {NULL_TAG: "~nN", BOOL_TAG: "tTfF", FLOAT_TAG: "-+0123456789.", INT_TAG: "-+0123456789"}
    for tag, rx in core.items():
        for first in starts[tag]:
            out.setdefault(first, []).append((tag, rx))
    out.setdefault("", []).append((NULL_TAG, NULL))  # an empty value is null
    return out


StrictLoader.yaml_implicit_resolvers = _yaml12_core(yaml.SafeLoader.yaml_implicit_resolvers)


def _construct_int(loader: StrictLoader, node: Any) -> int:
    """A core-schema integer: decimal (a leading zero is still decimal), 0o octal or 0x hexadecimal."""
    text = loader.construct_scalar(node).replace("_", "")
    try:
        return int(text, 10) if DECIMAL.match(text) else int(text, 0)
    except ValueError:  # past Python's 4,300 digits (no config value is that large), or `!!int` on other text
        problem = f"a number of {len(text):,} digits" if DECIMAL.match(text) else f"{text[:40]!r} is not an integer"
        raise YAMLShapeError(problem, node.start_mark.line + 1) from None


StrictLoader.add_constructor(INT_TAG, _construct_int)


def measure(text: str, max_values: int = MAX_CONFIG_VALUES, max_depth: int = MAX_CONFIG_DEPTH) -> None:
    """Refuse a document of more than `max_values` values (an alias counts as the values it repeats) or nested more
    than `max_depth` levels, from the parser's events, before anything is built; raises yaml.YAMLError."""
    count = 0
    sizes: dict[str, int] = {}  # values under each anchor
    open_at: list[tuple[str | None, int]] = []  # (anchor, values before it) of each open collection
    for event in yaml.parse(text, Loader=_EVENTS):
        if isinstance(event, yaml.AliasEvent):
            count += sizes.get(event.anchor or "", 1)
        elif isinstance(event, yaml.ScalarEvent):
            count += 1
            if event.anchor:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.CollectionStartEvent):
            count += 1
            open_at.append((event.anchor, count - 1))
            if len(open_at) > max_depth:
                raise YAMLShapeError(f"nested more than {max_depth} levels deep "
                                     "(fedsim.config.limits.MAX_CONFIG_DEPTH)", _line(event))
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, start = open_at.pop()
            if anchor:
                sizes[anchor] = count - start
        if count > max_values:
            raise YAMLShapeError(f"more than {max_values:,} values, aliases expanded "
                                 "(fedsim.config.limits.MAX_CONFIG_VALUES); a config holds a few hundred", _line(event))


def _line(event: yaml.Event) -> int | None:
    return event.start_mark.line + 1 if event.start_mark is not None else None


_EVENTS = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser: events at a microsecond a value


def parse(text: str) -> Any:
    """Parse one YAML document with StrictLoader, once `measure` let it; raises yaml.YAMLError (YAMLShapeError for
    refused shapes)."""
    measure(text)
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506  (StrictLoader is a SafeLoader)


def describe_error(exc: yaml.YAMLError) -> tuple[int | None, str]:
    """(line, one-line reason) of a parse error, for messages that name the file or override."""
    if isinstance(exc, YAMLShapeError):
        return exc.line, exc.problem
    mark = getattr(exc, "problem_mark", None)
    reason = " ".join(str(getattr(exc, "problem", None) or exc).split())
    return (mark.line + 1 if mark is not None else None), reason


class _QuotingDumper(yaml.SafeDumper):
    """SafeDumper that quotes text which YAML 1.1 (PyYAML, other tools) or StrictLoader would read as another type."""


_QuotingDumper.yaml_implicit_resolvers = {
    first: StrictLoader.yaml_implicit_resolvers.get(first, []) + yaml.SafeDumper.yaml_implicit_resolvers.get(first, [])
    for first in set(StrictLoader.yaml_implicit_resolvers) | set(yaml.SafeDumper.yaml_implicit_resolvers)}


def dump(data: Any) -> str:
    """`data` as YAML (keys in their order) that StrictLoader and PyYAML's safe_load both read back as `data`."""
    return yaml.dump(data, Dumper=_QuotingDumper, sort_keys=False)
