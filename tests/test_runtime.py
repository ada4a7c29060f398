"""Runtime: services over real Monarch process meshes (no mocks).

One 2-replica service is shared by the routing tests and then by the kill
tests (which leave it healthy again); tests that need their own placement
spawn their own. The last test shuts everything down and checks that no child
process of this test process is left.
"""
from __future__ import annotations

import asyncio
import os
import socket

import psutil
import pytest
from monarch.actor import ActorError

from forgelab.runtime import (
    NoHealthyReplicaError,
    Placement,
    ReplicaFailedError,
    Service,
    job_from_config,
)
from runtime_actors import Echo

integration = pytest.mark.integration
pytestmark = pytest.mark.timeout(300)

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


@pytest.fixture(scope="module")
def svc(loop):
    service = loop.run_until_complete(Echo.options(num_replicas=2).as_service("shared"))
    yield service
    loop.run_until_complete(service.shutdown())


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def _until_in_flight(svc: Service, index: int, n: int, timeout_s: float = 120.0) -> None:
    """Wait (yielding the CPU, not spinning) until replica `index` has `n` calls in flight."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while svc.status()[index].in_flight < n:
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"replica {index} never had {n} calls in flight: {svc.status()}")
        await asyncio.sleep(0.01)


# ----------------------------------------------------------------- routing
@integration
def test_route_spreads_load_across_replicas(svc, loop, tmp_path):
    release = tmp_path / "release"

    async def body():
        calls = [asyncio.ensure_future(svc.route("hold_until", str(release))) for _ in range(8)]
        # All 8 stay in flight until the file appears, whatever the machine's speed: no time window.
        await _until_in_flight(svc, 0, 4)
        await _until_in_flight(svc, 1, 4)
        in_flight = [s.in_flight for s in svc.status()]
        release.touch()
        return in_flight, await asyncio.gather(*calls)

    in_flight, pids = loop.run_until_complete(body())
    replica_pids = {s.pid for s in svc.status()}
    assert len(replica_pids) == 2
    assert in_flight == [4, 4]  # least-loaded: even split
    assert set(pids) == replica_pids
    assert sorted(pids.count(p) for p in replica_pids) == [4, 4]


@integration
def test_sticky_session_sticks_under_load(svc, loop):
    async def body():
        session = svc.session("conversation-1")
        assert svc.session("conversation-1") is session
        first = await session.route("pid")
        # Load the pinned replica so plain routing would prefer the other one.
        load = [asyncio.ensure_future(svc.route("hold", 0.5)) for _ in range(4)]
        seen = [await session.route("pid") for _ in range(6)]
        await asyncio.gather(*load)
        session.close()
        return first, seen, session.replica

    first, seen, index = loop.run_until_complete(body())
    assert seen == [first] * 6
    assert svc.status()[index].pid == first


@integration
def test_fanout_reaches_every_replica(svc, loop):
    pids = loop.run_until_complete(svc.fanout("pid"))
    assert sorted(pids) == sorted(s.pid for s in svc.status())


@integration
def test_endpoint_that_raises_keeps_replica_up(svc, loop):
    before = svc.status()
    with pytest.raises(ActorError) as info:
        loop.run_until_complete(svc.route("boom", "hello"))
    text = str(info.value)
    assert "ValueError: boom: hello" in text
    assert "runtime_actors.py" in text  # the remote traceback
    after = svc.status()
    assert [(s.pid, s.healthy, s.restarts) for s in after] == [(s.pid, True, s.restarts) for s in before]
    assert loop.run_until_complete(svc.route("ping")) == 1


@integration
def test_status_carries_component_fields(svc, loop):
    svc.set_replica_info(0, weight_version=3)
    loop.run_until_complete(svc.refresh_info())
    status = svc.replicas
    assert status[0].info == {"weight_version": 3, "tag": "shared", "calls": 0}
    assert status[1].info["tag"] == "shared"
    assert all(s.healthy and s.in_flight == 0 and len(s.pids) == 1 for s in status)


@integration
def test_each_replica_reports_calls_failures_and_latency_percentiles(svc, loop):
    """Per-replica request metrics (issue #29 item 3): every routed call counts on the replica that served it,
    a call whose endpoint raised counts as a failure, and the latency percentiles bound the known hold."""
    before = {s.index: (s.calls, s.failures) for s in svc.status()}
    hold = 0.05

    async def go():
        await asyncio.gather(*(svc.route("hold", hold) for _ in range(6)))
        with pytest.raises(ActorError):
            await svc.route("boom", "counted")

    loop.run_until_complete(go())
    after = svc.status()
    calls = sum(s.calls - before[s.index][0] for s in after)
    failures = sum(s.failures - before[s.index][1] for s in after)
    assert calls == 7 and failures == 1
    for s in after:
        ms = s.latency_ms
        assert ms["n"] == min(s.calls, 1024) and ms["p50"] <= ms["p95"] <= ms["p99"]
    held = [s for s in after if s.calls - before[s.index][0] >= 1 and s.latency_ms["p99"] >= hold * 1e3]
    assert held, "no replica's p99 covers a call that held 50 ms"


# ------------------------------------------------------------------ faults
@integration
def test_kill_replica_retries_idempotent_and_respawns(svc, loop, tmp_path):
    respawned = []

    async def on_respawn(handle):
        # The fresh replica answers through its handle before it serves.
        respawned.append((handle.replica_index, await handle.pid.call_one()))

    release = tmp_path / "release"

    async def body():
        svc.on_respawn = on_respawn
        victim = svc.status()[0].pid
        # The calls hold until the file appears, so the victim dies with its two calls still running.
        in_flight = [asyncio.ensure_future(svc.route("hold_until", str(release))) for _ in range(4)]
        await _until_in_flight(svc, 0, 2)
        await _until_in_flight(svc, 1, 2)
        os.kill(victim, 9)
        deadline = asyncio.get_running_loop().time() + 60
        while _alive(victim) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        release.touch()
        held = await asyncio.gather(*in_flight)  # two of these ran on the victim and were retried
        after = [await svc.route("pid") for _ in range(6)]
        await svc.wait_healthy(timeout=180)
        return victim, held, after

    victim, held, after = loop.run_until_complete(body())
    svc.on_respawn = None
    assert victim not in held and victim not in after
    status = svc.status()
    assert status[0].healthy and status[0].restarts == 1
    assert status[0].pid != victim and _alive(status[0].pid) and not _alive(victim)
    assert respawned == [(0, status[0].pid)]
    kinds = [(e.kind, e.replica) for e in svc.events]
    assert kinds[-2:] == [("replica_failed", 0), ("replica_restarted", 0)]
    assert loop.run_until_complete(svc.fanout("ping")) == [1, 1]  # controller alive, both serve


@integration
def test_kill_during_non_idempotent_call_gives_clear_error(svc, loop):
    async def body():
        await svc.wait_healthy(timeout=180)
        session = svc.session("victim")
        victim = await session.route("pid")
        index = session.replica
        restarts_before = svc.status()[index].restarts  # an earlier test may have restarted this replica
        call = asyncio.ensure_future(session.route("slow", 120))
        await _until_in_flight(svc, index, 1)
        os.kill(victim, 9)
        with pytest.raises(ReplicaFailedError) as info:
            await asyncio.wait_for(call, 120)
        repinned = await session.route("pid")
        await svc.wait_healthy(timeout=180)
        return victim, index, str(info.value), repinned, restarts_before

    victim, index, message, repinned, restarts_before = loop.run_until_complete(body())
    assert f"service 'echo': replica {index} (pids [{victim}])" in message
    assert "'slow'" in message and "Echo.IDEMPOTENT" in message
    assert repinned != victim
    assert svc.status()[index].restarts == restarts_before + 1


@integration
def test_no_healthy_replica_error_names_service(loop):
    async def body():
        gate = asyncio.Event()
        ran = []

        async def on_respawn(handle):
            ran.append(handle.replica_index)
            await gate.wait()  # hold the respawn so the service stays empty

        solo = await Service.start(
            Echo, Placement(num_replicas=1), ("solo",), {}, name="solo", on_respawn=on_respawn
        )
        try:
            failed = asyncio.Event()
            solo.add_listener(lambda e: e.kind == "replica_failed" and failed.set())
            victim = solo.status()[0].pid
            os.kill(victim, 9)
            await asyncio.wait_for(failed.wait(), 120)
            with pytest.raises(NoHealthyReplicaError) as info:
                await solo.route("ping")
            gate.set()
            await solo.wait_healthy(timeout=180)
            return str(info.value), await solo.route("ping"), solo.status()[0], ran

        finally:
            await solo.shutdown()

    message, answer, status, ran = loop.run_until_complete(body())
    assert "service 'solo' has no healthy replica for 'ping'" in message
    assert "#0 respawning" in message and "wait_healthy" in message
    assert answer == 1 and status.restarts == 1 and ran == [0]


@integration
def test_respawn_driven_by_monarch_fault_hook_alone(loop):
    """With the pid watch off, only Monarch's fault hook (called on Monarch's own thread) sees the
    death; the respawn it starts must spawn from the controller's context, not that thread's."""
    async def body():
        solo = await Service.start(
            Echo, Placement(num_replicas=1), ("hooked",), {}, name="hooked", watch_interval_s=0
        )
        try:
            victim = solo.status()[0].pid
            os.kill(victim, 9)
            back = asyncio.Event()
            solo.add_listener(
                lambda e: (e.kind == "replica_restarted" or "gave up" in e.detail) and back.set()
            )
            await asyncio.wait_for(back.wait(), 240)
            status = solo.status()[0]
            answer = await solo.route("pid") if status.healthy else None
            return victim, status, answer, [(e.kind, e.detail) for e in solo.events]
        finally:
            await solo.shutdown()

    victim, status, answer, events = loop.run_until_complete(body())
    assert events[0][0] == "replica_failed" and "process died (mesh hooked_" in events[0][1], events
    assert status.healthy and status.restarts == 1, (status, events)
    assert answer == status.pid and answer != victim


# --------------------------------------------------------------- placement
def test_job_from_config_builds_process_job_and_rejects_unknown_kind():
    from monarch.job import ProcessJob

    job = job_from_config({"kind": "process", "meshes": {"gen": 2, "trainer": 1}})
    assert isinstance(job, ProcessJob) and job._meshes == {"gen": 2, "trainer": 1}
    with pytest.raises(ValueError, match="kind must be one of"):
        job_from_config({"kind": "mainframe", "meshes": {"gen": 1}})
    with pytest.raises(ValueError, match="ProcessJob accepts"):
        job_from_config({"kind": "process", "meshes": {"gen": 1}, "gpus": 8})


def _our_processes() -> list[psutil.Process]:
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


@integration
def test_process_job_two_hosts_and_loopback_only(loop):
    from monarch.job import ProcessJob

    job = ProcessJob({"gen": 2})

    async def body():
        actor = await Echo.options(hosts=2, job=job, mesh="gen").as_actor("two-hosts")
        spread = await Echo.options(num_replicas=2, job=job, mesh="gen").as_service("spread")
        try:
            hosts_of = lambda ps: [psutil.Process(p).ppid() for p in ps]  # noqa: E731
            placed = hosts_of(await actor.pids()), hosts_of([s.pid for s in spread.status()])
            assert await spread.route("ping") == 1
            sockets = {}
            for proc in _our_processes():
                try:
                    sockets[proc.pid] = (proc.net_connections(kind="inet"), proc.net_connections(kind="unix"))
                except psutil.NoSuchProcess:
                    pass
            return placed, sockets
        finally:
            await asyncio.gather(spread.shutdown(), actor.shutdown())

    try:
        (actor_hosts, replica_hosts), sockets = loop.run_until_complete(body())
        workers = {p.pid for p in psutil.Process().children() if "run_worker_loop_forever" in " ".join(p.cmdline())}
    finally:
        job.kill()
    assert len(workers) == 2
    # hosts=2: one process under each host worker; the two replicas on different hosts.
    assert sorted(actor_hosts) == sorted(workers)
    assert sorted(replica_hosts) == sorted(workers)
    # Every listening socket of this process tree is loopback or unix.
    inet = [(pid, c) for pid, (conns, _) in sockets.items() for c in conns]
    exposed = [(pid, c.laddr) for pid, c in inet if c.laddr and c.laddr.ip not in LOOPBACK and
               (c.status == psutil.CONN_LISTEN or c.type == socket.SOCK_DGRAM)]
    assert exposed == [], f"sockets reachable from the network: {exposed}"
    assert sum(len(unix) for _, unix in sockets.values()) >= 4  # the channels really are unix sockets
    # Monarch's opt-in admin HTTP server would default to [::]:1729; spawn pins it to loopback.
    from monarch.config import get_global_config

    assert get_global_config()["mesh_admin_addr"] == "127.0.0.1:1729"


@integration
def test_process_job_attaches_to_a_worker_that_listens_late(loop, tmp_path):
    """A worker that starts listening after Monarch's message delivery timeout still attaches.

    Monarch pushes its config to each worker once and drops it if nobody listens within
    `message_delivery_timeout`; the attach then fails ("config push failed during attach"), as CI
    saw on a loaded machine. Both timeouts are shrunk here so a 4 s late worker shows it; spawn
    waits for the worker's socket first (remove that wait and this fails after 8 s).
    """
    from monarch.config import configured

    (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(4)\n")
    job = job_from_config({"kind": "process", "meshes": {"gen": 1}, "env": {"PYTHONPATH": str(tmp_path)}})
    try:
        with configured(message_delivery_timeout="1500ms", mesh_attach_config_timeout="8s"):
            actor = loop.run_until_complete(Echo.options(hosts=1, job=job, mesh="gen").as_actor("late"))
        try:
            assert loop.run_until_complete(actor.ping.call_one()) == 1
        finally:
            loop.run_until_complete(actor.shutdown())
    finally:
        job.kill()


def test_process_job_worker_that_never_listens_times_out_with_the_setting_to_raise(loop, tmp_path, monkeypatch):
    """No worker process is started: a job whose one 'worker' (this process) never binds its socket."""
    from monarch._src.job.job import ProcessState
    from monarch.job import ProcessJob

    from forgelab.runtime import placement
    from forgelab.runtime.placement import JobWorkerError, workers_listening

    job = ProcessJob({"gen": 1})
    monkeypatch.setattr(job, "apply", lambda *a, **k: None)
    monkeypatch.setattr(job, "_host_to_pid", {"gen_0": ProcessState(os.getpid(), f"ipc://{tmp_path}/gen_0")})
    monkeypatch.setattr(placement, "WORKER_LISTEN_TIMEOUT", 0.2)  # the module setting, read at each call
    with pytest.raises(JobWorkerError, match=r"\['gen_0'\] did not listen on their sockets within 0 s"):
        loop.run_until_complete(workers_listening(job))
    (tmp_path / "gen_0").write_text("")  # a plain file is not a listening socket
    with pytest.raises(JobWorkerError, match="did not listen"):
        loop.run_until_complete(workers_listening(job, timeout=0.1))


@integration
def test_process_job_worker_that_dies_gives_a_clear_error(loop, tmp_path):
    from forgelab.runtime.placement import JobWorkerError

    (tmp_path / "sitecustomize.py").write_text("raise SystemExit(3)\n")
    job = job_from_config({"kind": "process", "meshes": {"gen": 1}, "env": {"PYTHONPATH": str(tmp_path)}})
    try:
        with pytest.raises(JobWorkerError, match=r"worker 'gen_0' \(pid \d+\) exited before it listened"):
            loop.run_until_complete(Echo.options(hosts=1, job=job, mesh="gen").as_actor("dead"))
    finally:
        job.kill()


# ---------------------------------------------------------------- shutdown
@integration
def test_shutdown_leaves_no_child_processes(svc, loop):
    children = psutil.Process().children(recursive=True)
    assert len(children) >= 2  # the shared service's replicas
    loop.run_until_complete(svc.shutdown())
    loop.run_until_complete(svc.shutdown())  # idempotent
    gone, alive = psutil.wait_procs(psutil.Process().children(recursive=True), timeout=30)
    assert alive == []
    assert [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE] == []
    with pytest.raises(NoHealthyReplicaError, match="was shut down"):
        loop.run_until_complete(svc.route("ping"))


@integration
def test_shutdown_releases_then_exits_without_finalising(loop, tmp_path):
    """`ActorHandle.shutdown` calls the component's `release_for_exit` (what it holds outside the process) and
    then the process exits at once: an exit handler registered in the actor never runs (finalising torch/vLLM
    processes took 1.5-4 s each), and the process is gone."""
    from runtime_actors import ExitMarks

    h = loop.run_until_complete(ExitMarks.options(procs=1).as_actor(str(tmp_path)))
    (pid,) = loop.run_until_complete(h.pids())
    try:
        proc = psutil.Process(pid)
    except psutil.NoSuchProcess:
        proc = None
    loop.run_until_complete(h.shutdown())
    if proc is not None:
        gone, alive = psutil.wait_procs([proc], timeout=30)
        assert alive == []
    assert sorted(os.listdir(tmp_path)) == ["released"]
