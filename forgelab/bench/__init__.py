"""Benchmarks: `python -m forgelab.bench NAME [--quick]`.

Each suite is a module `forgelab.bench.NAME` with `main(argv)`; it prints a
table for people and, as its last line, one JSON object for tools
(`common.emit_json`). Adding a suite is adding a module.
"""
import pkgutil

_NOT_SUITES = {"common"}


def suites() -> list[str]:
    """Names of the benchmark suites in this package."""
    return sorted(
        m.name for m in pkgutil.iter_modules(__path__)
        if not m.name.startswith("_") and m.name not in _NOT_SUITES
    )
