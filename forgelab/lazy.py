"""Lazy public names for a package: importing `forgelab` or a subpackage stays cheap (no vLLM, Monarch or
torchtitan until a name that needs them is used), while `__all__` still lists the whole public API.

    __getattr__, __dir__ = lazy_exports(__name__, {"Run": "forgelab.run"})
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from typing import Any, Callable

__all__ = ["lazy_exports", "deprecated_module"]


def lazy_exports(package: str, names: dict[str, str], deprecated: dict[str, tuple[str, str]] | None = None
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module `__getattr__` resolving each of `names` (public name -> defining module) on first use, and
    a `__dir__` that lists them.

    `deprecated` maps an old public name to (defining module, new name): it still resolves, with a
    `DeprecationWarning`, and is left out of `__dir__` (and so of the package's `__all__`).
    """

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        if deprecated and name in deprecated:
            module, new = deprecated[name]
            warnings.warn(f"{package}.{name} is renamed {package}.{new} ({module}.{new}); the old name goes in the "
                          "next release", DeprecationWarning, stacklevel=2)
            return getattr(importlib.import_module(module), new)
        if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            # a subpackage or module reached as an attribute (`forgelab.lab.compare` after `import forgelab`)
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__


def deprecated_module(old: str, new: str) -> None:
    """Make module `old` another name of module `new` (a module renamed; kept one release).

    Called as the whole body of the old module: after it, ``import old`` gives the very module object ``new``
    (private names included), so pickles and records that name the old path load unchanged. Importing the old
    path warns with a `DeprecationWarning`.
    """
    warnings.warn(f"{old} is renamed {new}; the old module path goes in the next release", DeprecationWarning,
                  stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
