"""Suite-wide scheduling for `make test` (pytest-xdist, ``--dist loadfile``): files run longest first.

Each xdist worker takes a whole file (or a group of files, below) at a time, in collection order, when it
finishes its last one. Files in
the order they happen to be collected let a long file start last and run alone while the other worker idles;
longest first (the greedy rule for two machines) makes both end close together. Durations come from
``tests/durations.json``, the record of a whole `make test` written by ``make durations``; a file missing from
it (a new one) goes first, as if it were the longest, so it cannot be the one that starts last.

**Files that need the machine's memory to themselves** (`EXCLUSIVE`: real-shape checkpoints, whose generator
alone peaks near 12 GiB during a 1.5 GB weight message; with any other run beside it a 24 GiB machine's OOM
killer took the generator) go last, and hold an exclusive lock while they run: a worker starting any other
file takes the lock shared, so the two never overlap (a gate lock keeps shared takers from starving the
exclusive one). Without xdist nothing is locked.

**Files that share pooled engines** (`ENGINE_GROUPS`: modules whose fixtures take the worker's ``engine_pool``
with the same engine key, `forgelab.engines.pool.engine_key`) run on one worker, one after the other, so the
second takes the first's warm processes instead of spawning its own (~25-45 s each). Under ``--dist loadfile``
(`make test`) this conftest's scheduler (`pytest_xdist_make_scheduler`) hands out a group as one unit of work, as
loadfile hands out a file (xdist's own ``--dist loadgroup`` does not work with pytest 9: it renames items through
a field pytest no longer reads); groups go out longest first by their summed time, files longest first within.

With ``FORGELAB_DURATIONS_OUT=path`` the controller process sums each file's setup, call and teardown times of
this run and writes them there (``make test`` writes ``artifacts/test_durations.json``).
"""
from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
RECORD = ROOT / "tests" / "durations.json"
EXCLUSIVE = frozenset({"tests/test_real_shapes.py"})
"""Files that run with no other file beside them (see the module)."""

ENGINE_GROUPS: dict[str, str] = {
    # the shipped model's GRPO engines with a reference process (generator, trainer, reference)
    "tests/test_run.py": "engines:grpo-reference",
    "tests/test_lab.py": "engines:grpo-reference",
    # the same without a reference process (generator, trainer); door runs too (the door is controller-side)
    "tests/test_records_replay.py": "engines:grpo",
    "tests/test_experiments.py": "engines:grpo",
    "tests/test_provenance.py": "engines:grpo",
    "tests/test_trl_compat.py": "engines:grpo",
    "tests/test_agent_door.py": "engines:grpo",
    "tests/test_lm_eval_door.py": "engines:grpo",
    "tests/test_token_truth.py": "engines:grpo",
}
"""File -> the engine group it shares on one worker (files whose module fixtures take ``engine_pool``)."""


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load_record(path: Path = RECORD) -> dict[str, float]:
    """``{file: seconds}`` from a record, or ``{}`` when there is none (then collection order stands)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    files = data.get("files", {}) if isinstance(data, dict) else {}
    return {str(k): float(v) for k, v in files.items()}


def longest_first(files: list[str], record: dict[str, float], last: frozenset[str] = frozenset(),
                  groups: dict[str, str] | None = None) -> list[str]:
    """``files`` (each once, in collection order) reordered longest first by ``record``; files the record lacks
    come first, in collection order; the files in ``last`` go at the end (they run alone). Files in one of
    ``groups`` stay together: the group goes where its summed time puts it (first if the record lacks one of
    its files), its files longest first. Ties keep collection order."""
    groups = groups or {}
    units: dict[str, list[str]] = {}
    for f in files:
        if f not in last:
            units.setdefault(groups.get(f, f), []).append(f)

    def inner(unit: list[str]) -> list[str]:
        return [f for f in unit if f not in record] + sorted((f for f in unit if f in record), key=lambda f: -record[f])

    ordered = [inner(u) for u in units.values()]
    unknown = [u for u in ordered if any(f not in record for f in u)]
    known = sorted((u for u in ordered if all(f in record for f in u)), key=lambda u: -sum(record[f] for f in u))
    return [f for u in unknown + known for f in u] + [f for f in files if f in last]


def group_of(file: str) -> str:
    """The unit of work a file goes to a worker in: its engine group, or the file itself."""
    return ENGINE_GROUPS.get(file, file)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    by_file: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        by_file[_file_of(item.nodeid)].append(item)
    order = longest_first(list(by_file), load_record(), EXCLUSIVE, ENGINE_GROUPS)
    items[:] = [item for f in order for item in by_file[f]]


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadfile`` with `ENGINE_GROUPS`: a group's files go to one worker as one unit, in collection order."""
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own scheduler for the other modes
    from xdist.scheduler import LoadFileScheduling

    class EngineGroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(_file_of(nodeid))

    return EngineGroupScheduling(config, log)


class FileLock:
    """One worker's hold on the suite's memory lock for the file it runs (shared, or exclusive for `EXCLUSIVE`)."""

    def __init__(self, directory: str) -> None:
        self.gate = open(os.path.join(directory, "gate.lock"), "a+")
        self.main = open(os.path.join(directory, "memory.lock"), "a+")
        self.file: str | None = None

    def hold(self, file: str) -> None:
        if file == self.file:
            return
        self.release()
        fcntl.flock(self.gate, fcntl.LOCK_EX)  # one taker at a time: a waiting exclusive taker blocks new shared ones
        try:
            fcntl.flock(self.main, fcntl.LOCK_EX if file in EXCLUSIVE else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self.gate, fcntl.LOCK_UN)
        self.file = file

    def release(self) -> None:
        if self.file is not None:
            fcntl.flock(self.main, fcntl.LOCK_UN)
            self.file = None


_lock: FileLock | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _lock
    worker = getattr(config, "workerinput", None)
    if worker is not None:  # an xdist worker: the workers of one run share a directory named by the run's id
        directory = os.path.join(tempfile.gettempdir(), f"forgelab-suite-{worker['testrunuid']}")
        os.makedirs(directory, exist_ok=True)
        _lock = FileLock(directory)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    if _lock is not None:
        _lock.hold(_file_of(item.nodeid))
    try:
        return (yield)
    finally:  # the file's last item has torn its module fixtures (its processes) down: let the other worker in
        if _lock is not None and (nextitem is None or _file_of(nextitem.nodeid) != _file_of(item.nodeid)):
            _lock.release()


_times: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _times[_file_of(report.nodeid)] += float(report.duration)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = os.environ.get("FORGELAB_DURATIONS_OUT")
    if not out or hasattr(session.config, "workerinput"):  # only the controller has every worker's reports
        return
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    files = {f: round(t, 1) for f, t in sorted(_times.items(), key=lambda kv: -kv[1])}
    Path(out).write_text(json.dumps({"total_s": round(sum(_times.values()), 1), "files": files}, indent=1) + "\n")
