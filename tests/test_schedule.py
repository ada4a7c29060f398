"""The suite's file order for two xdist workers (the root conftest.py): longest first from the record."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("forgelab_root_conftest", ROOT / "conftest.py")
assert _spec is not None and _spec.loader is not None
schedule = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(schedule)


def test_longest_first_unknown_files_lead() -> None:
    record = {"a.py": 10.0, "b.py": 300.0, "c.py": 50.0}
    files = ["a.py", "new.py", "b.py", "c.py", "other.ipynb"]
    assert schedule.longest_first(files, record) == ["new.py", "other.ipynb", "b.py", "c.py", "a.py"]


def test_greedy_two_workers_end_closer_than_collection_order() -> None:
    # the case the scheduler exists for: a long file collected last runs alone at the end
    record = {"f1": 10.0, "f2": 10.0, "f3": 10.0, "f4": 10.0, "long": 40.0}

    def makespan(order: list[str]) -> float:
        ends = [0.0, 0.0]
        for f in order:  # each file goes to the worker that frees first
            i = ends.index(min(ends))
            ends[i] += record[f]
        return max(ends)

    collected = ["f1", "f2", "f3", "f4", "long"]
    assert makespan(collected) == 60.0
    assert makespan(schedule.longest_first(collected, record)) == 40.0


def test_record_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"total_s": 3.0, "files": {"tests/x.py": 2.0, "tests/y.py": 1.0}}))
    assert schedule.load_record(path) == {"tests/x.py": 2.0, "tests/y.py": 1.0}
    assert schedule.load_record(tmp_path / "missing.json") == {}


def test_committed_record_names_files_that_exist() -> None:
    record = schedule.load_record()
    stale = [f for f in record if not (ROOT / f).exists()]
    assert not stale, f"tests/durations.json names files that are gone: {stale}; run `make durations`"


def test_exclusive_files_go_last() -> None:
    record = {"a.py": 10.0, "heavy.py": 300.0}
    assert schedule.longest_first(["heavy.py", "a.py", "new.py"], record, frozenset({"heavy.py"})) == \
        ["new.py", "a.py", "heavy.py"]


def test_memory_lock_shared_and_exclusive(tmp_path: Path) -> None:
    """A worker running an ordinary file holds the lock shared (another ordinary file may run beside it, an
    exclusive one may not); a worker running an `EXCLUSIVE` file holds it alone."""
    import fcntl

    def can(mode: int) -> bool:
        with open(tmp_path / "memory.lock", "a+") as probe:
            try:
                fcntl.flock(probe, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(probe, fcntl.LOCK_UN)
            return True

    heavy = next(iter(schedule.EXCLUSIVE))
    a = schedule.FileLock(str(tmp_path))
    a.hold("tests/test_x.py")
    assert can(fcntl.LOCK_SH) and not can(fcntl.LOCK_EX)
    a.hold("tests/test_x.py")  # the same file again: still held, once
    a.release()
    assert can(fcntl.LOCK_EX)
    a.hold(heavy)
    assert not can(fcntl.LOCK_SH)
    a.hold("tests/test_y.py")  # the next file: the exclusive hold is given back first
    assert can(fcntl.LOCK_SH) and not can(fcntl.LOCK_EX)
    a.release()


def test_engine_groups_stay_together_longest_first() -> None:
    """Files sharing pooled engines run back to back (one worker's pool hands the set on); a group goes where its
    summed time puts it, its files longest first; ungrouped files are their own unit."""
    record = {"a.py": 100.0, "r1.py": 30.0, "r2.py": 80.0, "b.py": 90.0, "n1.py": 10.0}
    groups = {"r1.py": "R", "r2.py": "R", "n1.py": "N", "n2.py": "N"}
    files = ["a.py", "r1.py", "b.py", "r2.py", "n1.py", "n2.py"]
    # n2.py is new: its group goes first; R (110 s) before a.py (100 s) before b.py (90 s)
    assert schedule.longest_first(files, record, frozenset(), groups) == \
        ["n2.py", "n1.py", "r2.py", "r1.py", "a.py", "b.py"]
    assert schedule.group_of("r1.py") == "r1.py"  # not in the suite's table: its own group


def test_files_taking_the_engine_pool_are_grouped() -> None:
    """A module whose fixtures take ``engine_pool`` is in ENGINE_GROUPS (else it may land on the other worker
    and spawn its own engines), and every grouped file exists and takes it."""
    takers = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")
              if "engine_pool" in p.read_text() and p.name != "test_schedule.py"}
    assert takers == set(schedule.ENGINE_GROUPS), (sorted(takers), sorted(schedule.ENGINE_GROUPS))


def test_loadfile_scheduler_hands_out_an_engine_group_as_one_unit() -> None:
    """Under ``--dist loadfile`` the suite's scheduler puts a group's files in one unit of work (one worker), and
    every other file in its own; other modes keep xdist's scheduler."""
    grouped = [f for f, g in schedule.ENGINE_GROUPS.items() if list(schedule.ENGINE_GROUPS.values()).count(g) > 1]
    assert len(grouped) >= 2, "no engine group with two files: nothing to check"

    class Config:
        def __init__(self, dist: str) -> None:
            self.values = {"dist": dist, "tx": ["2*popen"]}

        def getvalue(self, name: str) -> object:
            return self.values[name]

    assert schedule.pytest_xdist_make_scheduler(Config("load"), None) is None
    sched = schedule.pytest_xdist_make_scheduler(Config("loadfile"), None)
    scope = sched._split_scope
    a, b = grouped[0], next(f for f in grouped[1:] if schedule.ENGINE_GROUPS[f] == schedule.ENGINE_GROUPS[grouped[0]])
    assert scope(f"{a}::test_x") == scope(f"{b}::test_y[1]") == schedule.ENGINE_GROUPS[a]
    assert scope("tests/test_other.py::test_z") == "tests/test_other.py" != scope(f"{a}::test_x")
