"""Writes the API reference's pages from the public API (the packages' `__all__`) and builds it with mkdocs.

    python tools/api_reference.py          # pages -> build/reference-src, site -> build/reference (strict)
    python tools/api_reference.py --pages  # pages only

One page per package in `PACKAGES`, one mkdocstrings entry (`::: path`) per name of its `__all__`, so a
name added to an `__all__` is in the reference at the next build and one removed is gone. The build runs
`mkdocs build --strict`: any warning (a docstring griffe cannot parse, a broken cross-reference) fails it.
mkdocs does not fail on a name without a docstring; tests/test_api_reference.py does.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "build" / "reference-src"
SITE = ROOT / "build" / "reference"

PACKAGES = {
    "forgelab": "The top level: `Run` and the names most scripts need.",
    "forgelab.config": "`RunConfig` and its sections; each component's own config.",
    "forgelab.experiments": "Forks, loss comparisons, replays.",
    "forgelab.rewards": "Rewards: forgelab's per-sample functions, the composer, TRL-style adapters.",
    "forgelab.algos": "Losses, advantages, logprobs, importance sampling, batching.",
    "forgelab.envs": "Multi-turn environments and the EnvActor.",
    "forgelab.lab": "The live lab's widgets.",
    "forgelab.data": "Toy tasks, datasets and the problem stream.",
}
"""Package -> one line for its page. `Run` is public through `forgelab` (forgelab.run is its module)."""


def public_names(package: str) -> list[str]:
    """The package's `__all__`."""
    return list(importlib.import_module(package).__all__)


def object_path(package: str, name: str) -> str:
    """The dotted path mkdocstrings documents `package.name` under: where a class or function is defined (the
    top level's names load lazily, which static analysis cannot follow), else `package.name` itself."""
    obj = getattr(importlib.import_module(package), name)
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if (inspect.isclass(obj) or inspect.isfunction(obj)) and module and module.startswith("forgelab") \
            and qualname and "<" not in qualname:
        return f"{module}.{qualname}"
    return f"{package}.{name}"


def write_pages(src: Path = SRC) -> dict[str, list[str]]:
    """Write index.md and one page per package; returns package -> the paths documented."""
    src.mkdir(parents=True, exist_ok=True)
    for old in src.glob("*.md"):
        old.unlink()
    index = ["# forgelab API reference", "",
             "Every public name (the `__all__` of each package below), from its docstring. The tutorials are the "
             "guide; this is where to look up a signature. Coming from TRL: docs/from_trl.md.", ""]
    out: dict[str, list[str]] = {}
    for package, blurb in PACKAGES.items():
        paths = [object_path(package, n) for n in public_names(package)]
        out[package] = paths
        page = [f"# `{package}`", "", blurb, ""]
        seen: dict[str, str] = {}
        for name, path in zip(public_names(package), paths):
            if path in seen:  # a second name for one object (WeightedReward = RewardComposer): a line, not a copy
                page += [f'<a id="{package}.{name}"></a>', "", f"`{name}` is [`{seen[path]}`][{path}].", ""]
                continue
            seen[path] = name
            page += [f"::: {path}", "    options:", "      heading_level: 2", f"      toc_label: {name}", ""]
        (src / f"{package}.md").write_text("\n".join(page))
        index.append(f"- [`{package}`]({package}.md): {blurb}")
    (src / "index.md").write_text("\n".join(index) + "\n")
    return out


def build(site_dir: Path = SITE) -> None:
    """Pages, then `mkdocs build --strict` into `site_dir` (default build/reference)."""
    write_pages()
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                    "--site-dir", str(site_dir)], cwd=ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tools"),
                                                                                   os.environ.get("PYTHONPATH")]))})


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", action="store_true", help="write the pages only")
    args = ap.parse_args()
    write_pages() if args.pages else build()
