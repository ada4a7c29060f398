"""Lazy public names for a package: importing `forgelab` or a subpackage stays cheap (no vLLM, Monarch or
torchtitan until a name that needs them is used), while `__all__` still lists the whole public API.

    __getattr__, __dir__ = lazy_exports(__name__, {"Run": "forgelab.run"})
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module `__getattr__` resolving each of `names` (public name -> defining module) on first use, and
    a `__dir__` that lists them."""

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            # a subpackage or module reached as an attribute (`forgelab.lab.compare` after `import forgelab`)
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__
