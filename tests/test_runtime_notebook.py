"""A service in a Jupyter kernel: kill a replica, keep calling, the kernel lives.

The notebook runs in a kernel whose spec (installed in a temp prefix and put
first on JUPYTER_PATH) starts this venv's python; the first cell checks that.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
kernelspec = pytest.importorskip("ipykernel.kernelspec")

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

CELLS = [
    f"""
import os, sys, asyncio
assert (sys.executable, sys.prefix) == {(sys.executable, sys.prefix)!r}, (sys.executable, sys.prefix)
sys.path.insert(0, {str(TESTS)!r})
from runtime_actors import Echo
svc = await Echo.options(num_replicas=2).as_service("notebook")
pids = [s.pid for s in svc.status()]
assert len(set(pids)) == 2, pids
""",
    """
victim = pids[0]
os.kill(victim, 9)
answers = [await svc.route("pid") for _ in range(6)]
assert victim not in answers, answers
await svc.wait_healthy(timeout=180)
status = svc.status()
assert status[0].restarts == 1 and status[0].pid not in pids, status
[e.kind for e in svc.events]
""",
    """
assert await svc.fanout("ping") == [1, 1]
await svc.shutdown()
print("kernel alive", os.getpid())
""",
]


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_service_survives_kill_in_jupyter_kernel(tmp_path, monkeypatch):
    prefix = tmp_path / "jupyter"
    kernelspec.install(kernel_name="python3", prefix=str(prefix))
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src.strip()) for src in CELLS]
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(REPO)}}
    )
    client.execute()

    kinds = nb.cells[1].outputs[-1]["data"]["text/plain"]
    assert "'replica_failed'" in kinds and "'replica_restarted'" in kinds
    printed = "".join(o.get("text", "") for o in nb.cells[2].outputs)
    assert "kernel alive" in printed
    kernel_pid = int(printed.split()[-1])
    assert kernel_pid != os.getpid()
