"""Notebooks are committed clean: no outputs, valid nbformat 4, a title first.

Outputs in git make diffs unreadable and go stale; CI re-creates them by
running every notebook (`pytest --nbval-lax tutorials notebooks`). Strip with
`python tools/strip_notebooks.py` before committing.
"""
from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("tutorials", "notebooks")
NOTEBOOKS = sorted(
    p
    for folder in FOLDERS
    if (REPO / folder).is_dir()
    for p in (REPO / folder).rglob("*.ipynb")
    if ".ipynb_checkpoints" not in p.parts
)
STRIP = "python tools/strip_notebooks.py"


def _name(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_there_are_tutorials():
    assert any(p.parent == REPO / "tutorials" for p in NOTEBOOKS), "no notebook found in tutorials/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_name)
def test_notebook_is_clean(path: Path):
    raw = nbformat.read(path, as_version=nbformat.NO_CONVERT)
    assert raw.nbformat == 4, f"{_name(path)}: nbformat {raw.nbformat}, expected 4"
    nbformat.validate(raw)  # raises ValidationError naming the bad field

    dirty = [
        i for i, cell in enumerate(raw.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, f"{_name(path)}: code cells {dirty} have outputs or execution counts; run `{STRIP}`"
    assert "widgets" not in raw.metadata, f"{_name(path)}: saved widget state in metadata; run `{STRIP}`"

    assert raw.cells, f"{_name(path)}: empty notebook"
    first = raw.cells[0]
    assert first.cell_type == "markdown" and first.source.lstrip().startswith("# "), (
        f"{_name(path)}: the first cell must be a markdown title ('# ...'), got a "
        f"{first.cell_type} cell starting {first.source[:40]!r}"
    )
    kernel = raw.metadata.get("kernelspec", {}).get("name")
    assert kernel == "python3", f"{_name(path)}: kernelspec {kernel!r}; nbval starts the kernel named there, use 'python3'"


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.parent == REPO / "tutorials"], ids=_name)
def test_tutorial_is_listed_in_readme(path: Path):
    readme = (REPO / "tutorials" / "README.md").read_text()
    assert f"({path.name})" in readme, f"tutorials/README.md does not link {path.name}"
    front = (REPO / "README.md").read_text()
    assert f"(tutorials/{path.name})" in front, f"README.md's tutorials table does not link tutorials/{path.name}"


def test_strip_tool_cleans_an_executed_notebook(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("strip_notebooks", REPO / "tools" / "strip_notebooks.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("1 + 1", execution_count=3)
    cell.outputs = [nbformat.v4.new_output("execute_result", {"text/plain": "2"}, execution_count=3)]
    cell.metadata["execution"] = {"iopub.status.busy": "2025-01-01T00:00:00Z"}
    nb.cells = [nbformat.v4.new_markdown_cell("# t"), cell]
    path = tmp_path / "run.ipynb"
    nbformat.write(nb, path)

    assert tool.main(["--check", str(tmp_path)]) == 1
    assert tool.main([str(path)]) == 0
    clean = nbformat.read(path, as_version=4)
    assert clean.cells[1].outputs == [] and clean.cells[1].execution_count is None
    assert "execution" not in clean.cells[1].metadata
    assert tool.main(["--check", str(path)]) == 0
