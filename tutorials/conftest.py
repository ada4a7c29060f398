"""nbval runs every tutorial; this adds one check to its run: a tutorial's first code cell writes nothing to stderr.

The first cell imports forgelab, torch, transformers and friends in a fresh kernel: any third-party line that
`forgelab.quiet` fails to filter (a deprecation warning, a C++ log line) shows there first, as a stderr stream
output of the cell. Checking it on nbval's own kernel costs nothing; a separate kernel per tutorial cost about
40 s of the suite.
"""
from __future__ import annotations

import pytest


def first_cell_stderr(outputs) -> str:
    """The text a cell wrote to stderr, from its notebook outputs (nbval's `test_outputs`)."""
    return "".join(o.get("text", "") for o in outputs or []
                   if o.get("output_type") == "stream" and o.get("name") == "stderr")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield  # the cell ran (an error in it has already failed the item)
    if getattr(item, "cell_num", None) == 0 and hasattr(item, "test_outputs"):
        stderr = first_cell_stderr(item.test_outputs)
        if stderr.strip():
            item.raise_cell_error(f"{item.fspath.basename}: the first cell wrote to stderr (forgelab.quiet lets "
                                  f"a line through, or a new one appeared):\n{stderr}")
    return result
