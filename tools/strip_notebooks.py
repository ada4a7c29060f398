"""Strip outputs and execution counts from notebooks, in place.

    python tools/strip_notebooks.py                       # tutorials/ and notebooks/
    python tools/strip_notebooks.py path/to/a.ipynb dir/  # given files / folders
    python tools/strip_notebooks.py --check               # exit 1 if any needs stripping

Run it before committing a notebook: git holds notebooks without outputs
(tests/test_notebooks_clean.py checks). Cell metadata that records a run
(execution timings, collapsed/scrolled state) and saved widget state go too.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DIRS = ("tutorials", "notebooks")
RUN_CELL_METADATA = ("execution", "collapsed", "scrolled", "ExecuteTime")
RUN_NOTEBOOK_METADATA = ("widgets",)


def notebooks(paths: list[Path]) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found += sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
        elif path.suffix == ".ipynb":
            found.append(path)
        else:
            raise SystemExit(f"strip_notebooks: {path} is neither a folder nor a .ipynb file")
    return found


def strip(nb: nbformat.NotebookNode) -> bool:
    """Strip `nb` in place; returns whether anything changed."""
    changed = False
    for key in RUN_NOTEBOOK_METADATA:
        changed |= nb.metadata.pop(key, None) is not None
    for cell in nb.cells:
        for key in RUN_CELL_METADATA:
            changed |= cell.get("metadata", {}).pop(key, None) is not None
        if cell.cell_type == "code":
            if cell.get("outputs") or cell.get("execution_count") is not None:
                changed = True
            cell.outputs = []
            cell.execution_count = None
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help="notebooks or folders (default: tutorials notebooks)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook needs stripping")
    args = parser.parse_args(argv)
    paths = args.paths or [REPO / d for d in DEFAULT_DIRS if (REPO / d).is_dir()]
    dirty = []
    for path in notebooks(paths):
        nb = nbformat.read(path, as_version=4)
        if strip(nb):
            dirty.append(path)
            if not args.check:
                nbformat.write(nb, path)
    verb = "need stripping" if args.check else "stripped"
    for path in dirty:
        print(f"{verb}: {path}")
    return 1 if args.check and dirty else 0


if __name__ == "__main__":
    sys.exit(main())
