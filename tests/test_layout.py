"""The package's shape, checked from the source (no import is executed): layers, cycles, names, sizes,
private fields and the public API the docs use. See docs/architecture.md.

Every import counts, function-level ones included: a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "forgelab"

#: The layers, bottom to top, written once: a module imports only from its own layer and the layers below.
#: Within a layer, modules of the same subpackage import each other freely (no cycle is checked separately).
LAYERS: list[set[str]] = [
    {"forgelab.quiet", "forgelab.types", "forgelab.generation", "forgelab.progress", "forgelab.lazy"},
    {"forgelab.algos"},
    {"forgelab.rewards"},
    {"forgelab.data"},
    {"forgelab.runtime"},
    {"forgelab.envs"},
    {"forgelab.config"},
    {"forgelab.weights"},
    {"forgelab.engines"},
    {"forgelab.testing"},
    {"forgelab.controller"},
    {"forgelab.experiments"},
    {"forgelab.lab"},
    {"forgelab.run"},
    {"forgelab.demo"},
    {"forgelab.recipes"},
    {"forgelab.plan"},
    {"forgelab.bench"},
    {"forgelab.cli"},
    {"forgelab.check_install"},
]


def _modname(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_modname(p): p for p in sorted(PKG.rglob("*.py"))}
TREES = {m: ast.parse(p.read_text(), str(p)) for m, p in MODULES.items()}


def _layer(module: str) -> int:
    for i, layer in enumerate(LAYERS):
        if any(module == top or module.startswith(top + ".") for top in layer):
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_layout.py")


def _imports(module: str) -> dict[str, int]:
    """forgelab modules `module` imports (target -> first line), resolving `from pkg import submodule`."""
    out: dict[str, int] = {}
    package = module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(TREES[module]):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                targets.append(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
        for t in targets:
            if t.startswith("forgelab") and t != "forgelab":
                while t not in MODULES and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in MODULES and t != module:
                    out.setdefault(t, node.lineno)
    return out


GRAPH = {m: _imports(m) for m in MODULES if m != "forgelab"}


def test_every_module_is_in_a_layer():
    for m in GRAPH:
        _layer(m)


def test_no_module_imports_from_a_layer_above():
    upward = [f"{m}:{line} imports {t} (layer {_layer(t)} > {_layer(m)})"
              for m, deps in GRAPH.items() for t, line in deps.items() if _layer(t) > _layer(m)]
    assert not upward, "imports from a higher layer:\n" + "\n".join(sorted(upward))


def test_no_import_cycle():
    # a package's __init__ that re-exports its submodules is part of the package, not a module in a cycle
    graph = {m: {t for t in deps if not (MODULES[t].name == "__init__.py" and m.startswith(t + "."))}
             for m, deps in GRAPH.items()}
    graph = {m: {t for t in deps if not (MODULES[m].name == "__init__.py" and t.startswith(m + "."))}
             for m, deps in graph.items()}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_top_level_is_small_and_names_are_unique_and_modules_short():
    top = [p.name for p in PKG.glob("*.py")]
    assert len(top) <= 15, f"{len(top)} modules directly in forgelab/ (at most 15): {sorted(top)}"
    by_name = defaultdict(list)
    for m, p in MODULES.items():
        if p.name != "__init__.py":
            by_name[p.stem].append(m)
        else:
            by_name[m.rsplit(".", 1)[-1]].append(m)
    dupes = {n: ms for n, ms in by_name.items() if len(ms) > 1 and n not in {"__main__"}}
    assert not dupes, f"module names used twice: {dupes}"
    long = {m: len(p.read_text().splitlines()) for m, p in MODULES.items() if len(p.read_text().splitlines()) > 500}
    assert not long, f"modules over 500 lines (split them): {long}"


def _private_owners() -> dict[str, set[str]]:
    """Private attribute name -> the forgelab classes that define it (a `self._x =`, a `def _x`, a class-level
    `_x`)."""
    owned: dict[str, set[str]] = defaultdict(set)
    for m, tree in TREES.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for n in ast.walk(cls):
                name = None
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = n.name
                elif (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                      and n.value.id in ("self", "cls")):
                    name = n.attr
                elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                    name = n.target.id
                elif isinstance(n, ast.Assign):
                    for t in n.targets:
                        if isinstance(t, ast.Name) and t.id.startswith("_"):
                            owned[t.id].add(f"{m}.{cls.name}")
                if name and name.startswith("_") and not name.endswith("__"):
                    owned[name].add(f"{m}.{cls.name}")
    return owned


def _private_reads(owned: dict[str, set[str]], trees: dict[str, ast.Module] = TREES) -> list[str]:
    found = []
    for m, tree in trees.items():
        classes_at: list[tuple[int, int, str]] = [(c.lineno, c.end_lineno or c.lineno, f"{m}.{c.name}")
                                                   for c in ast.walk(tree) if isinstance(c, ast.ClassDef)]
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.endswith("__")):
                continue
            if n.attr not in owned or (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
                continue
            inside = {name for lo, hi, name in classes_at if lo <= n.lineno <= hi}
            if inside & owned[n.attr]:
                continue  # another instance of the same class (e.g. `other._x` in `__eq__`)
            found.append(f"{m}:{n.lineno} reads .{n.attr} of {'/'.join(sorted(owned[n.attr]))}")
    for m, tree in trees.items():
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("forgelab"):
                for a in n.names:
                    if a.name.startswith("_") and not a.name.endswith("__") and n.module != m:
                        found.append(f"{m}:{n.lineno} imports the private {n.module}.{a.name}")
    return found


def test_no_part_reads_another_parts_private_fields():
    """Nothing outside a forgelab class reads its underscore attributes, and no module imports another's
    private names: if a caller needs one, the part is missing a method. Third-party objects are out of scope:
    only names that a forgelab class defines are checked."""
    found = _private_reads(_private_owners())
    assert not found, "private fields read from outside their part:\n" + "\n".join(sorted(found))


def test_the_private_field_check_can_fail():
    owned = {"_replay": {"forgelab.run.Run"}}
    probe = {"forgelab.probe": ast.parse("def f(run):\n    return run._replay\n\nfrom forgelab.cli import _load\n")}
    assert _private_reads(owned, probe) == ["forgelab.probe:2 reads ._replay of forgelab.run.Run",
                                            "forgelab.probe:4 imports the private forgelab.cli._load"]


def _public(module: str) -> set[str]:
    """`__all__` of a forgelab package or module, read from its source."""
    tree = TREES[module]
    for n in tree.body:
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets):
            if isinstance(n.value, ast.Call):  # __all__ = sorted(_LAZY)
                for m in tree.body:
                    if (isinstance(m, (ast.Assign, ast.AnnAssign)) and
                            getattr(m.targets[0] if isinstance(m, ast.Assign) else m.target, "id", "") == "_LAZY"):
                        return {k.value for k in m.value.keys}
            return {e.value for e in n.value.elts}
    return set()


def _doc_imports() -> list[tuple[str, str, list[str]]]:
    """(where, module, names) of every `from forgelab... import ...` in the tutorials, notebooks and docs."""
    out = []
    pattern = re.compile(r"^\s*from (forgelab[\w.]*) import \(?([\w, ]+)")
    sources = []
    for nb in sorted((ROOT / "tutorials").glob("*.ipynb")) + sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] == "code":
                sources.append((nb.name, "".join(cell["source"])))
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        sources.append((md.name, md.read_text()))
    for where, text in sources:
        for line in text.splitlines():
            mt = pattern.match(line)
            if mt:
                out.append((where, mt.group(1), [n.strip().split(" as ")[0] for n in mt.group(2).split(",") if n.strip()]))
    return out


def test_tutorials_notebooks_and_docs_import_only_the_public_api():
    """A name a tutorial imports is in `__all__` of `forgelab` or of a subpackage (the package itself, not
    one of its modules): that is the public API the docs promise."""
    assert _doc_imports(), "no imports found: the scan is broken"
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    bad = []
    for where, module, names in _doc_imports():
        if module not in packages:
            bad.append(f"{where}: from {module} import ... (import from a package: {module.rsplit('.', 1)[0]})")
            continue
        public = _public(module)
        bad += [f"{where}: {module}.{n} is not in its __all__" for n in names if n not in public]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", sorted(m for m, p in MODULES.items() if p.name == "__init__.py"))
def test_every_public_name_exists(module):
    import importlib

    mod = importlib.import_module(module)
    for name in _public(module):
        assert getattr(mod, name) is not None, f"{module}.{name}"
