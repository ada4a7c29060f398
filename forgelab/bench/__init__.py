"""Benchmarks: `python -m forgelab.bench NAME [--quick]`.

Each suite is a module `forgelab.bench.NAME` (or the module `MODULES` names) with `main(argv)`; it prints a
table for people and, as its last line, one JSON object for tools
(`common.emit_json`). Adding a suite is adding a module.
"""
import pkgutil

_NOT_SUITES = {"common"}

#: Suite name -> module name, where the module's name differs: a Python keyword (`async`), or a name that
#: would repeat a module elsewhere in forgelab (`generator` is also `forgelab.engines.generator`).
MODULES = {"async": "async_", "generator": "generator_bench", "envs": "envs_bench", "runtime": "runtime_bench",
           "dashboard": "dashboard_bench", "lora": "lora_bench", "variants": "variants_bench", "distill": "distill_bench",
           "inflight": "inflight_bench", "primitives": "primitives_bench"}


def suites() -> list[str]:
    """Names of the benchmark suites in this package."""
    alias_of = {mod: alias for alias, mod in MODULES.items()}
    return sorted(
        alias_of.get(m.name, m.name) for m in pkgutil.iter_modules(__path__)
        if not m.name.startswith("_") and m.name not in _NOT_SUITES
    )


def module_name(suite: str) -> str:
    """The module implementing `suite` (`forgelab.bench.<module>`)."""
    return f"forgelab.bench.{MODULES.get(suite, suite)}"
