"""Suite-wide scheduling for `make test` (pytest-xdist, ``--dist loadfile``): files run longest first.

Each xdist worker takes a whole file at a time, in collection order, when it finishes its last one. Files in
the order they happen to be collected let a long file start last and run alone while the other worker idles;
longest first (the greedy rule for two machines) makes both end close together. Durations come from
``tests/durations.json``, the record of a whole `make test` written by ``make durations``; a file missing from
it (a new one) goes first, as if it were the longest, so it cannot be the one that starts last.

**Files that need the machine's memory to themselves** (`EXCLUSIVE`: real-shape checkpoints, whose generator
alone peaks near 12 GiB during a 1.5 GB weight message; with any other run beside it a 24 GiB machine's OOM
killer took the generator) go last, and hold an exclusive lock while they run: a worker starting any other
file takes the lock shared, so the two never overlap (a gate lock keeps shared takers from starving the
exclusive one). Without xdist nothing is locked.

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


def longest_first(files: list[str], record: dict[str, float], last: frozenset[str] = frozenset()) -> list[str]:
    """``files`` (each once, in collection order) reordered longest first by ``record``; files the record lacks
    come first, in collection order; the files in ``last`` go at the end (they run alone). Ties keep
    collection order."""
    shared = [f for f in files if f not in last]
    unknown = [f for f in shared if f not in record]
    known = sorted((f for f in shared if f in record), key=lambda f: -record[f])
    return unknown + known + [f for f in files if f in last]


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    by_file: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        by_file[_file_of(item.nodeid)].append(item)
    order = longest_first(list(by_file), load_record(), EXCLUSIVE)
    items[:] = [item for f in order for item in by_file[f]]


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
