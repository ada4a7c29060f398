"""The package's shape, checked from the source (no import is executed): layers, cycles, names, private fields,
who may write a `Run`'s state, and the public API the docs use; module size is a warning. See
docs/architecture.md.

Every import counts, function-level ones included: a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
import json
import re
import warnings
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
    {"forgelab.serve"},
    {"forgelab.lab"},
    {"forgelab.run"},
    {"forgelab.demo"},
    {"forgelab.recipes"},
    {"forgelab.memory_plan", "forgelab.plan"},
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


def _imports(module: str, modules: dict[str, Path] = MODULES, trees: dict[str, ast.Module] = TREES) -> dict[str, int]:
    """forgelab modules `module` imports (target -> first line), resolving `from pkg import submodule`."""
    MODULES, TREES = modules, trees  # noqa: N806 -- the same names as the real tree's, for a planted one
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


def _cycles(graph: dict[str, set[str] | dict[str, int]]) -> list[list[str]]:
    """The import cycles of `graph` (module -> modules it imports): its strongly connected components (Tarjan)
    with more than one module, each sorted."""
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
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
    return cycles


def test_no_import_cycle():
    """No cycle, package `__init__` files included: a package that imports its submodules, one of which imports
    the package (e.g. for a registry defined in its `__init__`), is a cycle (Python resolves it only because
    the partially initialised module happens to hold the name already). Importing a submodule by its full
    path (``from forgelab.envs.episode import X``) is an edge to that submodule, not to the package."""
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


#: The import lines of forgelab/envs at 893000f: the registry `ENVS` lived in `envs/__init__.py`, which imported
#: `base` and `builtin` (and `actor`, lazily), and `base.make_env` imported `ENVS` back from the package.
ENVS_893000F = {
    "forgelab/envs/__init__.py": "from forgelab.envs.base import Env, make_env\n"
                                 "from forgelab.envs.builtin import EchoEnv\n"
                                 "from forgelab.envs.episode import ChatFormat\n"
                                 "def __getattr__(name):\n    from forgelab.envs import actor\n",
    "forgelab/envs/base.py": "def make_env(env, registry=None):\n    from forgelab.envs import ENVS as registry\n",
    "forgelab/envs/builtin.py": "from forgelab.envs.base import Env, task_prompt\n"
                                "from forgelab.envs.episode import env_metric_means\n",
    "forgelab/envs/actor.py": "from forgelab.envs.episode import EnvActorConfig\n"
                              "from forgelab.envs.base import make_env\n",
    "forgelab/envs/episode.py": "import asyncio\n",
}


def _planted_graph(sources: dict[str, str]) -> dict[str, dict[str, int]]:
    """The import graph of a planted source tree (path under the repository -> source)."""
    modules = {_modname(ROOT / path): ROOT / path for path in sources}
    trees = {_modname(ROOT / path): ast.parse(src) for path, src in sources.items()}
    return {m: _imports(m, modules, trees) for m in modules}


def test_the_cycle_check_catches_a_cycle_through_a_package_init():
    graph = _planted_graph(ENVS_893000F)
    assert _cycles(graph) == [["forgelab.envs", "forgelab.envs.actor", "forgelab.envs.base", "forgelab.envs.builtin"]]
    # the check before issue #38 dropped a package's edges to and from its own submodules, and saw none
    init = {"forgelab.envs"}
    skipping = {m: {t for t in deps if not (t in init and m.startswith(t + ".")) and
                    not (m in init and t.startswith(m + "."))} for m, deps in graph.items()}
    assert _cycles(skipping) == []
    # the registry in a module of its own (as today): no cycle
    fixed = {**ENVS_893000F,
             "forgelab/envs/__init__.py": "from forgelab.envs.base import Env\nfrom forgelab.envs.registry import ENVS\n",
             "forgelab/envs/base.py": "def task_prompt(task):\n    return str(task)\n",
             "forgelab/envs/registry.py": "from forgelab.envs.builtin import EchoEnv\nENVS = {'echo': EchoEnv}\n",
             "forgelab/envs/actor.py": "from forgelab.envs.registry import make_env\n"}
    assert _cycles(_planted_graph(fixed)) == []


def test_the_top_level_is_small_and_names_are_unique():
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
    if long:  # a hint, not a limit: split a module where its topic ends, never to meet a number (issue #38)
        warnings.warn(f"modules over 500 lines (is there a seam where a topic ends?): {long}", stacklevel=1)


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


# ------------------------------------------------------------------ who holds and writes a run (issue #38)
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _is_run_annotation(ann: ast.expr | None) -> bool:
    """`Run`, `"Run"`, `forgelab.run.Run`, `Run | None`, `Optional["Run"]`: the annotation names the class `Run`."""
    return ann is not None and re.search(r"\bRun\b", ast.unparse(ann).replace("'", "").replace('"', "")) is not None


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    a = fn.args
    return [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x is not None)]


def _run_names(scope: ast.AST) -> set[str]:
    """Names that hold a `Run` in `scope` (a function or a module): ``run``, and parameters or variables
    annotated `Run`."""
    names = {"run"}
    if isinstance(scope, _FUNCS):
        names |= {p.arg for p in _params(scope) if _is_run_annotation(p.annotation)}
    for n in ast.walk(scope):
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and _is_run_annotation(n.annotation):
            names.add(n.target.id)
    return names


def _targets(node: ast.AST) -> list[ast.expr]:
    """The expressions an assignment statement writes (tuple and list targets unpacked)."""
    if isinstance(node, ast.Assign):
        out, todo = [], list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        out, todo = [], [node.target]
    elif isinstance(node, (ast.For, ast.AsyncFor)):
        out, todo = [], [node.target]
    elif isinstance(node, ast.withitem) and node.optional_vars is not None:
        out, todo = [], [node.optional_vars]
    else:
        return []
    while todo:
        t = todo.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            todo += t.elts
        elif isinstance(t, ast.Starred):
            todo.append(t.value)
        else:
            out.append(t)
    return out


def _root(expr: ast.expr) -> ast.expr:
    while isinstance(expr, (ast.Attribute, ast.Subscript)):
        expr = expr.value
    return expr


def _run_writes(trees: dict[str, ast.Module] = TREES) -> list[str]:
    """Every assignment to an attribute of a `Run` (``run.x = ...``, ``run.x += ...``, ``run.a.b = ...``,
    ``run.x[k] = ...``, tuple targets) outside forgelab/run.py; a `Run` is a name ``run`` or one annotated `Run`."""
    found = []
    for m, tree in trees.items():
        if m == "forgelab.run":
            continue
        scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, _FUNCS))]
        seen: set[tuple[int, int]] = set()
        for scope in reversed(scopes):  # innermost first: a function's own annotations decide for its body
            names = _run_names(scope)
            for node in ast.walk(scope):
                for t in _targets(node):
                    if not isinstance(t, (ast.Attribute, ast.Subscript)) or (t.lineno, t.col_offset) in seen:
                        continue
                    root = _root(t)
                    if isinstance(root, ast.Name) and root.id in names and isinstance(_first_attr(t), str):
                        seen.add((t.lineno, t.col_offset))
                        found.append(f"{m}:{t.lineno} writes {ast.unparse(t)}")
    return sorted(found)


def _first_attr(t: ast.expr) -> str | None:
    """The attribute right after the root name (``run.a.b`` -> ``a``); None for ``run[k]``."""
    chain = []
    while isinstance(t, (ast.Attribute, ast.Subscript)):
        chain.append(t)
        t = t.value
    return chain[-1].attr if chain and isinstance(chain[-1], ast.Attribute) else None


def _receives_run(trees: dict[str, ast.Module], package: str = "forgelab.controller") -> list[str]:
    """Functions in `package` with a parameter named ``run`` or annotated `Run` (annotated or not)."""
    found = []
    for m, tree in trees.items():
        if m != package and not m.startswith(package + "."):
            continue
        for fn in (n for n in ast.walk(tree) if isinstance(n, _FUNCS)):
            for p in _params(fn):
                if p.arg == "run" or _is_run_annotation(p.annotation):
                    found.append(f"{m}:{fn.lineno} {fn.name}({p.arg}"
                                 + (f": {ast.unparse(p.annotation)}" if p.annotation is not None else "") + ")")
    return sorted(found)


def _untyped_run_params(trees: dict[str, ast.Module] = TREES) -> list[str]:
    """Parameters named ``run`` that are unannotated or annotated `Any`."""
    found = []
    for m, tree in trees.items():
        for fn in (n for n in ast.walk(tree) if isinstance(n, _FUNCS)):
            for p in _params(fn):
                ann = None if p.annotation is None else ast.unparse(p.annotation).strip("'\"")
                if p.arg == "run" and ann in (None, "Any", "typing.Any", "t.Any"):
                    found.append(f"{m}:{fn.lineno} {fn.name}(run{'' if ann is None else ': ' + ann})")
    return sorted(found)




def test_only_run_py_writes_a_runs_state():
    """A part owns its state: nothing outside forgelab/run.py assigns to an attribute of a `Run`."""
    found = _run_writes()
    assert not found, f"{len(found)} writes into a Run outside forgelab/run.py:\n" + "\n".join(found)


def test_no_controller_part_receives_the_run():
    """Controller parts receive the narrow collaborators they use at construction, never the whole `Run`."""
    found = _receives_run(TREES)
    assert not found, f"{len(found)} controller functions receive the Run:\n" + "\n".join(found)


def test_every_run_parameter_is_typed():
    """A parameter named ``run`` says what it is (`Run` or a Protocol), never nothing or `Any`."""
    found = _untyped_run_params()
    assert not found, f"{len(found)} parameters `run` unannotated or Any:\n" + "\n".join(found)


def test_the_run_state_checks_can_fail():
    planted = {"forgelab.controller.probe": ast.parse(
        "from typing import Any\n"
        "def step(run):\n"                                   # (b) named run, (c) unannotated
        "    run.step = 1\n"                                 # (a) 3
        "    run.version += 1\n"                             # (a) 4
        "    run.rollout.tokens = 0\n"                       # (a) 5
        "    a, (run.loss_name, b) = 1, (2, 3)\n"            # (a) 6, tuple target
        "    run.metrics['x'] = 1\n"                         # (a) 7
        "    run.emit('x')\n"                                # a call: not a write
        "    other.step = 2\n"                               # not a run
        "async def save(r: 'Run', run: Any = None):\n"      # (b) twice, (c) Any
        "    r.step = 3\n"                                   # (a) 11: annotated Run
        "    r2: Run = make()\n"
        "    r2.version = 4\n"                               # (a) 13: a variable annotated Run
        "def typed(run: RunView):\n"                         # (b) named run; typed, so not (c)
        "    pass\n"),
        "forgelab.run": ast.parse("def f(run):\n    run.step = 1\n"),  # run.py owns the state
        "forgelab.lab.probe": ast.parse("def g(run: 'forgelab.run.Run | None'):\n    run.x = 1\n")}
    assert _run_writes(planted) == sorted([
        "forgelab.controller.probe:3 writes run.step", "forgelab.controller.probe:4 writes run.version",
        "forgelab.controller.probe:5 writes run.rollout.tokens", "forgelab.controller.probe:6 writes run.loss_name",
        "forgelab.controller.probe:7 writes run.metrics['x']", "forgelab.controller.probe:11 writes r.step",
        "forgelab.controller.probe:13 writes r2.version", "forgelab.lab.probe:2 writes run.x"])
    assert _receives_run(planted) == sorted([
        "forgelab.controller.probe:2 step(run)", "forgelab.controller.probe:10 save(r: 'Run')",
        "forgelab.controller.probe:10 save(run: Any)", "forgelab.controller.probe:14 typed(run: RunView)"])
    assert _untyped_run_params(planted) == sorted([
        "forgelab.controller.probe:10 save(run: Any)", "forgelab.controller.probe:2 step(run)",
        "forgelab.run:1 f(run)"])
