"""Suite-wide scheduling for `make test` (pytest-xdist, ``--dist loadfile``): files run longest first.

Each xdist worker takes a whole file at a time, in collection order, when it finishes its last one. Files in
the order they happen to be collected let a long file start last and run alone while the other worker idles;
longest first (the greedy rule for two machines) makes both end close together. Durations come from
``tests/durations.json``, the record of a whole `make test` written by ``make durations``; a file missing from
it (a new one) goes first, as if it were the longest, so it cannot be the one that starts last.

With ``FORGELAB_DURATIONS_OUT=path`` the controller process sums each file's setup, call and teardown times of
this run and writes them there (``make test`` writes ``artifacts/test_durations.json``).
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
RECORD = ROOT / "tests" / "durations.json"


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


def longest_first(files: list[str], record: dict[str, float]) -> list[str]:
    """``files`` (each once, in collection order) reordered longest first by ``record``; files the record lacks
    come first, in collection order. Ties keep collection order."""
    unknown = [f for f in files if f not in record]
    known = sorted((f for f in files if f in record), key=lambda f: -record[f])
    return unknown + known


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    record = load_record()
    if not record:
        return
    by_file: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        by_file[_file_of(item.nodeid)].append(item)
    order = longest_first(list(by_file), record)
    items[:] = [item for f in order for item in by_file[f]]


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
