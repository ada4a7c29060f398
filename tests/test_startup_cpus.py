"""The critical path first at start-up (`forgelab.runtime.startup_cpus`, `forgelab.engines.spawn.start_all`).

Read from the real processes: the critical part is launched before the others, the others (every thread of
them) and the controller's threads run on the other cores while it starts, and all of them get the controller's
original affinity back once it is ready, also when the start fails. No timing is checked.
"""
from __future__ import annotations

import asyncio
import os

import pytest

from forgelab.runtime import startup_cpus
from forgelab.runtime.startup_cpus import ShadowWork, StartWindow, split_cores

BASE = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
needs_two_cores = pytest.mark.skipif(split_cores(BASE) is None, reason="needs 2 or more usable cores (affinity)")


def controller_threads() -> dict[int, frozenset[int]]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = frozenset(os.sched_getaffinity(int(tid)))
        except OSError:
            pass
    return out


def cpus_allowed_list(pid: int) -> str:
    """The kernel's own line for process `pid` (/proc/PID/status)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


def as_kernel_list(cpus) -> str:
    """A core set as /proc writes it: ranges of consecutive cores ("0-3,6")."""
    cores, out, i = sorted(cpus), [], 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        out.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(out)


def test_one_core_or_no_affinity_restricts_nothing_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(startup_cpus, "affinity", lambda tid: frozenset({0}))
    window = StartWindow()
    with caplog.at_level("INFO", logger="forgelab.runtime.startup_cpus"):
        record = window.open()
    assert not window.active and "1 core(s)" in record.note and "1 core(s)" in caplog.text
    assert controller_threads() == {t: a for t, a in controller_threads().items()}  # nothing touched
    window.close()
    monkeypatch.setattr(startup_cpus, "affinity_supported", lambda: False)
    record = StartWindow().open()
    assert "sched_setaffinity" in record.note


def test_a_window_disabled_for_remote_hosts_says_why():
    record = StartWindow(enabled=False, why_not="the parts run on a monarch.job's hosts").open()
    assert record.note == "the parts run on a monarch.job's hosts" and not record.others


@needs_two_cores
def test_controller_threads_restricted_and_restored_with_overlapping_windows():
    async def body():
        a, b = StartWindow(), StartWindow()
        a.open()
        b.open()  # a second run starting in the same kernel: its "original" must not be a's restriction
        during = controller_threads()
        a.close()
        still = controller_threads()
        b.close()
        return a.record, during, still, controller_threads()

    record, during, still, after = asyncio.run(body())
    assert set(during.values()) == {record.others}
    assert set(still.values()) == {record.others}, "the first window out restored while the second was open"
    assert set(after.values()) == {BASE}


@pytest.mark.integration
@needs_two_cores
def test_critical_first_others_pinned_during_start_and_restored_after(loop, tmp_path):
    from forgelab.engines.spawn import start_all
    from startup_actors import AffinityProbe, Gate

    files = [str(tmp_path / f"probe{i}") for i in range(2)]
    record: list = []
    shadow_saw: dict = {}

    def controller_work():  # the controller's start-up work: runs once the critical part is launched
        shadow_saw["launches"] = list(record[0].launches)
        shadow_saw["affinity"] = frozenset(os.sched_getaffinity(0))
        return "tokenizer"

    async def body():
        work = ShadowWork(controller_work)
        token = startup_cpus.SHADOW.set(work)
        try:
            parts = await start_all([AffinityProbe.as_actor(files[0]),
                                     Gate.as_actor(str(tmp_path / "gate"), files),
                                     AffinityProbe.as_actor(files[1])], critical=1, record=record)
        finally:
            startup_cpus.SHADOW.reset(token)
        try:
            assert await work.wait() == "tokenizer"
            pids = [(await p.pids())[0] for p in parts]
            return (pids, [await p.call_one("during_setup") for p in parts], [await p.call_one("now") for p in parts],
                    [cpus_allowed_list(pid) for pid in pids], controller_threads())
        finally:
            for p in parts:
                await p.shutdown()

    pids, during, now, kernel_lists, controller = loop.run_until_complete(body())
    rec = record[0]
    assert rec.note == "" and rec.restored
    assert rec.base == BASE and rec.critical | rec.others == BASE and not rec.critical & rec.others
    assert rec.launches[0] == ("critical", "Gate"), rec.launches
    assert sorted(rec.launches[1:]) == [("other", "AffinityProbe")] * 2
    assert shadow_saw["launches"][:1] == [("critical", "Gate")], "the controller's work started before the generator"
    assert shadow_saw["affinity"] == rec.others
    assert rec.controller_during == rec.others
    probe_a, gate, probe_b = during
    for probe in (probe_a, probe_b):  # every thread of the other parts, as the processes read it during setup
        assert {frozenset(v) for v in probe.values()} == {rec.others}, probe
    assert {frozenset(v) for v in gate.values()} == {BASE}, gate  # the critical part keeps every core
    assert set(rec.pinned) == {pids[0], pids[2]}
    for proc in now:  # after: every thread of every part back on the controller's cores
        assert {frozenset(v) for v in proc.values()} == {BASE}, proc
    assert kernel_lists == [as_kernel_list(BASE)] * 3
    assert set(controller.values()) == {BASE}


@pytest.mark.integration
@needs_two_cores
def test_affinity_restored_when_the_critical_start_fails(loop, tmp_path):
    from forgelab.engines.spawn import start_all
    from startup_actors import AffinityProbe, Gate

    probe = str(tmp_path / "probe")
    record: list = []

    async def body():
        with pytest.raises(Exception, match="failing on purpose|setup"):
            await start_all([Gate.as_actor(str(tmp_path / "gate"), [probe], fail=True), AffinityProbe.as_actor(probe)],
                            record=record)
        return controller_threads()

    controller = loop.run_until_complete(body())
    rec = record[0]
    assert rec.restored and rec.launches[0] == ("critical", "Gate")
    assert set(controller.values()) == {BASE}
    probe_pid = int(open(probe).read())
    assert probe_pid in rec.pinned and set(rec.pinned[probe_pid].values()) == {rec.others}
    assert not os.path.exists(f"/proc/{probe_pid}") or cpus_allowed_list(probe_pid) == as_kernel_list(BASE)
