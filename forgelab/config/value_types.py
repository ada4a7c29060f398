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

import types
import typing
from typing import Any


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
