"""Importing torchtitan's model code without the compiles it starts at import time.

``torchtitan.models.common.attention`` calls ``torch.compile`` twice when it is imported (FlexAttention's kernel
and ``create_block_mask``), which imports dynamo and inductor: 1.9 s of CPU in every trainer and reference
process (measured on a 2-core AMD EPYC), at start-up, beside the generator's own start. forgelab's CPU path uses
SDPA and never calls them. `import_titan_models` imports that module with those compiles deferred: each becomes
a `DeferredCompile` that calls the real ``torch.compile`` (same arguments) the first time it is called, so the
flex path on a GPU compiles on its first use instead of at import; nothing else changes.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Generic, ParamSpec, Protocol, TypeVar

_lock = threading.Lock()

P = ParamSpec("P")
R = TypeVar("R")


class CompileFn(Protocol):
    """``torch.compile`` as forgelab calls it: a function and keyword options in, a compiled function out."""

    def __call__(self, model: Callable[P, R], /, **kwargs: object) -> Callable[P, R]: ...


class DeferredCompile(Generic[P, R]):
    """``torch.compile(fn, **kwargs)``, made on the first call (then every call goes to the compiled function)."""

    def __init__(self, compile_fn: CompileFn, fn: Callable[P, R], kwargs: dict[str, object]) -> None:
        self.compile_fn, self.fn, self.kwargs = compile_fn, fn, kwargs
        self.compiled: Callable[P, R] | None = None
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if self.compiled is None:
            self.compiled = self.compile_fn(self.fn, **self.kwargs)
        return self.compiled(*args, **kwargs)


class _DeferringCompile(Protocol):
    def __call__(self, model: Callable[P, R] | None = None, **kwargs: object
                 ) -> DeferredCompile[P, R] | Callable[[Callable[P, R]], DeferredCompile[P, R]]: ...


def _deferring(compile_fn: CompileFn) -> _DeferringCompile:
    def compile(
        model: Callable[P, R] | None = None, **kwargs: object
    ) -> DeferredCompile[P, R] | Callable[[Callable[P, R]], DeferredCompile[P, R]]:
        if model is None:  # used as @torch.compile(...)
            return lambda fn: DeferredCompile(compile_fn, fn, kwargs)
        return DeferredCompile(compile_fn, model, kwargs)

    return compile


def import_titan_models() -> None:
    """Import ``torchtitan.models.common`` (and so every model family's building blocks) with import-time
    ``torch.compile`` calls deferred to first use. A no-op once it is imported."""
    if "torchtitan.models.common.attention" in sys.modules:
        return
    import torch

    with _lock:
        if "torchtitan.models.common.attention" in sys.modules:
            return
        real = torch.compile
        # torch.compile names its options (fullgraph=, dynamic=, ...); the stand-in passes whichever it gets on
        torch.compile = _deferring(real)  # type: ignore[arg-type, assignment]  # torch's overloaded stub, patched
        try:
            import torchtitan.models.common  # noqa: F401
        finally:
            torch.compile = real
