"""Turning nested dicts into validated, typed dataclasses, collecting every error with its key path.

Fields declare their range and documentation through `knob(...)`; `from_dict` checks types (int, float,
bool, str, Literal, Optional, list, dict, nested dataclasses), ranges and unknown keys, and raises one
ConfigError listing all problems. Floats must be finite unless a knob says `nonfinite=True`; an int knob
takes an integral float (`1e3`). `describe` renders the documentation for the README's reference.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import types
import typing
from dataclasses import MISSING, field, fields, is_dataclass
from typing import Any, Literal, TypeGuard, Union, get_args, get_origin

from fedsim.errors import ConfigError


def knob(default: Any = MISSING, *, doc: str = "", ge: float | None = None, gt: float | None = None,
         le: float | None = None, lt: float | None = None, nonfinite: bool = False, factory: Any = MISSING) -> Any:
    """A documented config field with optional numeric bounds (on a number, or on each number of a list or
    mapping); `nonfinite` lets a float field take inf and nan."""
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le, "lt": lt, "nonfinite": nonfinite}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    if isinstance(default, (list, dict)):
        def fresh_copy() -> Any:
            return type(default)(default)

        return field(default_factory=fresh_copy, metadata=meta)
    return field(default=default, metadata=meta)


class _Errors(list):
    def add(self, path: str, msg: str) -> None:
        self.append(f"{path if len(path) <= 100 else path[:97] + '...'}: {msg}")  # an absurd key stays readable


def shown(value: Any, limit: int = 60) -> str:
    """repr(value), shortened so an absurd value still gives a readable one-line message."""
    try:
        text = repr(value)
    except ValueError:  # an integer past Python's 4,300-digit conversion limit (hexadecimal has none)
        text = f"an integer of {value.bit_length():,} bits"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_config_class(tp: Any) -> TypeGuard[type]:
    """Whether a type hint names a (nested) config dataclass."""
    return isinstance(tp, type) and is_dataclass(tp)


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str, errors: _Errors, nonfinite: bool = False) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        real = [a for a in args if a is not type(None)]
        if len(real) == 1:  # Optional[X]: X's own message says more than "expected X | null"
            return _convert(value, real[0], path, errors, nonfinite)
        own = None  # the errors of the member of value's own kind (a number's float): they say more
        for arg in args:
            if arg is type(None):
                continue
            sub = _Errors()
            out = _convert(value, arg, path, sub, nonfinite)
            if not sub:
                return out
            if arg in (float, int, str) and isinstance(value, (float, int) if arg is float else arg) and \
                    not isinstance(value, bool):
                own = own or sub
        if own:
            errors.extend(own)
        else:
            errors.add(path, f"expected {_type_name(tp)}, got {shown(value)}")
        return None
    if origin is Literal:
        if value not in get_args(tp):
            errors.add(path, f"must be one of {list(get_args(tp))}, got {shown(value)}")
        return value
    if _is_config_class(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            errors.add(path, f"expected a mapping, got {shown(value)}")
            return None
        return _build(tp, value, path, errors)
    if origin is list:
        (item,) = get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            errors.add(path, f"expected a list, got {shown(value)}")
            return None
        return [_convert(v, item, f"{path}[{i}]", errors, nonfinite) for i, v in enumerate(value)]
    if origin is dict:
        kt, vt = get_args(tp) or (Any, Any)
        if not isinstance(value, dict):
            errors.add(path, f"expected a mapping, got {shown(value)}")
            return None
        return {k: _convert(v, vt, f"{path}.{k}", errors, nonfinite) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            errors.add(path, f"expected true or false, got {shown(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            errors.add(path, f"expected an integer, got {shown(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            errors.add(path, f"expected a number, got {shown(value)}")
            return value
        try:
            out = float(value)
        except OverflowError:
            errors.add(path, f"{shown(value)} is too large for a float")
            return value
        if not nonfinite and not math.isfinite(out):
            errors.add(path, f"must be a finite number, got {shown(value)}")
        return out
    if tp is str:
        if not isinstance(value, str):
            errors.add(path, f"expected a string, got {shown(value)}")
        return value
    return value


def _check_bounds(value: Any, meta: Any, path: str, errors: _Errors) -> None:
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_bounds(v, meta, f"{path}[{i}]", errors)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _check_bounds(v, meta, f"{path}.{k}", errors)
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        return
    for key, ok, word in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                          ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<")):
        bound = meta.get(key)
        if bound is not None and not ok(value, bound):
            errors.add(path, f"must be {word} {bound}, got {shown(value)}")


def _merge(base: dict, update: dict) -> dict:
    """`update` laid over `base`, recursively for nested mappings."""
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _build(cls: type, data: dict, prefix: str, errors: _Errors) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in known:
            errors.add(path, f"unknown key; valid keys are {sorted(known)}")
            continue
        f = known[key]
        if isinstance(value, dict) and is_dataclass(hints[key]) and f.default_factory is not MISSING:
            value = _merge(to_dict(f.default_factory()), value)  # a partial section keeps the field's defaults
        sub = _Errors()
        out = _convert(value, hints[key], path, sub, f.metadata.get("nonfinite", False))
        if not sub:
            _check_bounds(out, f.metadata, path, sub)
        errors.extend(sub)
        kwargs[key] = out
    for name, f in known.items():
        if name not in kwargs and f.default is MISSING and f.default_factory is MISSING:
            errors.add(f"{prefix}.{name}" if prefix else name, "required key is missing")
    if len(errors):
        return None
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:  # __post_init__ cross-field checks
        errors.add(prefix or cls.__name__, str(exc))
        return None


def check_value(value: Any, tp: Any, path: str, *, ge: float | None = None, gt: float | None = None,
                le: float | None = None, lt: float | None = None) -> Any:
    """`value` converted to type `tp` and checked against the bounds, like a knob; else a ConfigError naming `path`."""
    errors = _Errors()
    out = _convert(value, tp, path, errors)
    if not errors:
        _check_bounds(out, {"ge": ge, "gt": gt, "le": le, "lt": lt}, path, errors)
    if errors:
        raise ConfigError("; ".join(errors))
    return out


def check_kwargs(fn: Any, options: dict, prefix: str, owner: str, skip: tuple[str, ...] = (),
                 limits: dict[str, dict[str, float]] | None = None) -> dict:
    """Options meant as keyword arguments of `fn`, checked against its signature: each name must be a named
    parameter (not in `skip`), each value must fit the parameter's annotation and `limits[name]` (ge/gt/le/lt).
    Returns the converted options; the ConfigError names `<prefix>.<name>` and the allowed names or type."""
    if not isinstance(options, dict):
        raise ConfigError(f"{prefix}: expected a mapping of option names to values, got {shown(options)}")
    params = {p.name: p for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in skip}
    try:
        hints = typing.get_type_hints(inspect.unwrap(fn))
    except (NameError, TypeError):  # an annotation that does not resolve: check names only
        hints = {}
    out = {}
    for name, value in options.items():
        if name not in params:
            raise ConfigError(f"{prefix}.{name}: not an option of {owner}; its options are {sorted(params)}")
        tp = hints.get(name, Any)
        out[name] = check_value(value, Any if tp is object else tp, f"{prefix}.{name}", **(limits or {}).get(name, {}))
    return out


def from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    """Build dataclass `cls` from `data`, raising one ConfigError that lists every problem."""
    errors = _Errors()
    out = _build(cls, data or {}, prefix, errors)
    if errors:
        raise ConfigError("; ".join(errors))
    return out


def to_dict(obj: Any) -> Any:
    """A dataclass tree as plain dicts/lists (YAML-safe)."""
    if is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def describe(cls: type, prefix: str = "", instance: Any = None) -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) rows for every knob of `cls`, nested dataclasses flattened."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if instance is not None:
            default = getattr(instance, f.name)
        elif f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = "required"
        if _is_config_class(tp):
            rows.extend(describe(tp, key, default if is_dataclass(default) else None))
            continue
        bounds = ", ".join(f"{w} {f.metadata[k]}" for k, w in (("ge", ">="), ("gt", ">"), ("le", "<="),
                                                               ("lt", "<")) if f.metadata.get(k) is not None)
        doc = f.metadata.get("doc", "") + (f" ({bounds})" if bounds else "")
        rows.append((key, _type_name(tp), repr(default) if not isinstance(default, str) else default, doc))
    return rows


def replace(obj: Any, **changes: Any) -> Any:
    """dataclasses.replace, re-exported so callers need one import."""
    return dataclasses.replace(obj, **changes)
