"""Checking a YAML value against a config field's type annotation (int, float, bool, str, Optional, lists, tuples).

    >>> check_type([0.9, 0.99], tuple[float, float], "trainer.betas")
    (0.9, 0.99)
    >>> check_type(3, float | None, "train.is_cap")
    3.0
    >>> check_type("2", int, "train.steps")
    Traceback (most recent call last):
    ...
    TypeError: train.steps: expected an integer, got '2'
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any

from forgelab.config.sections import shared_owner


def check_type(value: Any, t: Any, path: str) -> Any:
    origin = typing.get_origin(t)
    if t is Any or t is object:
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(t)
        if value is None:
            if type(None) in options:
                return None
            raise TypeError(f"{path}: must not be null")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return check_type(value, option, path)
            except TypeError as err:
                errors.append(err)
        raise errors[0] if len(errors) == 1 else TypeError(f"{path}: {value!r} matches none of {t}")
    if value is None:
        raise TypeError(f"{path}: must not be null")
    if t is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{path}: expected true/false, got {value!r}")
    elif t is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{path}: expected an integer, got {value!r}")
    elif t is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{path}: expected a number, got {value!r}")
        value = float(value)
    elif t is str:
        if not isinstance(value, str):
            raise TypeError(f"{path}: expected a string, got {value!r}")
    elif t is dict or origin is dict:
        if not isinstance(value, dict):
            raise TypeError(f"{path}: expected a mapping, got {value!r}")
    elif t in (list, tuple) or origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{path}: expected a list, got {value!r}")
        args = typing.get_args(t)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise TypeError(f"{path}: expected {len(args)} values, got {value!r}")
            return tuple(check_type(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [check_type(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (t is tuple or origin is tuple) else items
    return value


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field."""


def build_section(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            owner = shared_owner(cls, key)
            if owner is not None:
                raise ConfigError(f"{prefix}{key}: set by {owner} (one value for every component); set it there")
            near = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            raise ConfigError(
                f"{prefix}{key}: unknown field"
                + (f"; did you mean {prefix}{near[0]}?" if near else "")
                + f" (known fields of {prefix.rstrip('.') or 'the config'}: {', '.join(fields)})"
            )
        f = fields[key]
        sub = dataclass_type(cls, f)
        if sub is not None:
            kwargs[key] = build_section(sub, value, f"{prefix}{key}.")
        else:
            kwargs[key] = coerce_field(value, f, f"{prefix}{key}", cls)
    return cls(**kwargs)


def dataclass_type(cls: type, f: dataclasses.Field) -> type | None:
    t = typing.get_type_hints(cls).get(f.name)
    return t if dataclasses.is_dataclass(t) else None


def coerce_field(value: Any, f: dataclasses.Field, path: str, cls: type | None = None) -> Any:
    """Check `value` against the field's type annotation; YAML lists become tuples where a tuple is declared."""
    t = typing.get_type_hints(cls).get(f.name, Any) if cls is not None else Any
    try:
        return check_type(value, t, path)
    except TypeError as err:
        raise ConfigError(str(err)) from None


def positive_int(path: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{path}: must be a positive integer, got {value!r}")


def non_negative(path: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or not math.isfinite(value):
        raise ConfigError(f"{path}: must be a non-negative number, got {value!r}")


def finite_range(path: str, value: Any, lo: float, hi: float, low_open: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok:
        ok = (value > lo if low_open else value >= lo) and value <= hi
    if not ok:
        bound = f"({lo}, {hi}]" if low_open else f"[{lo}, {hi}]"
        raise ConfigError(f"{path}: must be a finite number in {bound}, got {value!r}")
