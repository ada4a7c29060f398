"""Keeping replicas alive: N copies of a component spawned, watched, and respawned when a process dies.

`ReplicaPool` is the half of `forgelab.runtime.service.Service` that owns the
replicas: it spawns them (`start`), notices a dead process (a call that fails
with Monarch's `SupervisionError` is reported through `_fail`; the supervision
hook reports a failed mesh; for local replicas a pid watch sees the process
gone), respawns it in the background (a fresh proc mesh, same constructor
arguments, up to `max_respawn_attempts` tries with a doubling delay, then
`on_respawn(handle)` before it serves again), records each failure and restart
as a `ServiceEvent`, and reports `ReplicaStatus` snapshots. `Service` adds the
routing (least-loaded, sticky sessions, fanout, the one retry) on top; build
services with `Component.options(num_replicas=...).as_service(...)` or
`Service.start(...)`, not with this class.
"""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import itertools
import logging
import math
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable, Generic, NamedTuple, Protocol, Self, TypeVar

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

from forgelab.runtime import supervision
from forgelab.runtime.errors import NoHealthyReplicaError as NoHealthyReplicaError
from forgelab.runtime.errors import ReplicaFailedError as ReplicaFailedError
from forgelab.runtime.supervision import pid_alive
from forgelab.runtime.mesh import ActorHandle, Placement, spawn

if TYPE_CHECKING:
    from monarch.actor import Actor

    from forgelab.runtime.watchdog import Watchdog

C = TypeVar("C", bound="Actor")

log = logging.getLogger("forgelab.runtime.replicas")

service_ids = itertools.count()




class ServiceEvent(NamedTuple):
    kind: str
    """"replica_failed" or "replica_restarted"."""
    replica: int
    time: float
    """Unix time (s)."""
    detail: str


@dataclass(frozen=True)
class ReplicaStatus:
    """A snapshot of one replica, for panels and error messages."""

    index: int
    healthy: bool
    state: str
    """"starting", "healthy", "respawning", "failed" (gave up respawning) or "stopped"."""
    in_flight: int
    restarts: int
    pids: tuple[int, ...]
    last_error: str | None
    info: dict[str, object] = field(default_factory=dict)
    """Fields the controller set with `set_replica_info` / `refresh_info`."""
    name: str | None = None
    calls: int = 0
    """Calls routed to this replica (every endpoint, retries included)."""
    failures: int = 0
    """Calls that raised (the endpoint's error or the process's death)."""
    latency_ms: dict[str, float] = field(default_factory=dict)
    """p50/p95/p99 of its recent calls, and the window size ``n`` (`RequestStats`)."""

    @property
    def pid(self) -> int | None:
        return self.pids[0] if self.pids else None


class RequestStats:
    """One replica's requests: calls and failures since it was created (respawns included), and the latencies
    of its most recent `WINDOW` calls, from which the percentiles are taken (the window, not every call: a
    live panel's view; `calls` counts them all)."""

    WINDOW = 1024
    __slots__ = ("calls", "failures", "latencies_s")

    def __init__(self) -> None:
        self.calls = 0
        self.failures = 0
        self.latencies_s: deque[float] = deque(maxlen=self.WINDOW)

    def record(self, seconds: float, ok: bool) -> None:
        self.calls += 1
        self.failures += not ok
        self.latencies_s.append(seconds)

    def percentiles_ms(self) -> dict[str, float]:
        """p50/p95/p99 latency (ms, nearest rank) over the window, and its size ``n`` (NaN with no calls)."""
        xs = sorted(self.latencies_s)
        out: dict[str, float] = {"n": float(len(xs))}
        for q in (50, 95, 99):
            out[f"p{q}"] = xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))] * 1e3 if xs else math.nan
        return out


class _NamedEndpoint(Protocol):
    def call_one(self, *args: object, **kwargs: object) -> Awaitable[object]: ...


class Replica(Generic[C]):
    __slots__ = ("index", "handle", "state", "in_flight", "restarts", "pids", "last_error", "info", "endpoints", "single",
                 "stats")

    def __init__(self, index: int, single: bool):
        self.index = index
        self.handle: ActorHandle[C] | None = None
        self.state = "starting"
        self.in_flight = 0
        self.restarts = 0
        self.pids: list[int] = []
        self.last_error: str | None = None
        self.info: dict[str, object] = {}
        self.endpoints: dict[str, _NamedEndpoint] = {}
        self.single = single
        self.stats = RequestStats()

    @property
    def live(self) -> ActorHandle[C]:
        """The handle of a replica that is serving (healthy, or failing during a call: never None then)."""
        if self.handle is None:
            raise NoHealthyReplicaError(f"replica #{self.index} has no process yet ({self.state})")
        return self.handle

    def describe(self) -> str:
        text = f"#{self.index} {self.state} (pids {self.pids}, restarts {self.restarts}"
        if self.last_error:
            text += f", last error: {self.last_error}"
        return text + ")"


def first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {' '.join(lines[:2])[:300]}"


class ReplicaPool(Generic[C]):
    """`placement.num_replicas` copies of a component, kept alive; the base of `Service` (see the module docstring)."""

    def __init__(self, cls: type[C], placement: Placement, args: tuple[object, ...] = (),
                 kwargs: dict[str, object] | None = None, *,
                 name: str | None = None, on_respawn: Callable[[ActorHandle[C]], Awaitable[None]] | None = None,
                 max_respawn_attempts: int = 3, watch_interval_s: float = 0.5):
        """The arguments of `Service` (documented there)."""
        self.cls = cls
        self.placement = placement
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})
        self.name = name or cls.__name__.lower()
        self.on_respawn = on_respawn
        """Async callback run on a respawned replica's handle before it serves."""
        self.max_respawn_attempts = max_respawn_attempts
        self.watch_interval_s = watch_interval_s
        self.events: list[ServiceEvent] = []
        self._listeners: list[Callable[[ServiceEvent], None]] = []
        single = placement.procs * placement.hosts == 1
        self._replicas: list[Replica[C]] = [Replica(i, single) for i in range(placement.num_replicas)]
        self._healthy: list[Replica[C]] = []
        self._uid = next(service_ids)
        self._spawns = itertools.count()
        self._tasks: set[asyncio.Future[None]] = set()  # respawns and the pid watch: cancelled on shutdown
        self._teardowns: set[asyncio.Future[None]] = set()  # old meshes stopping: awaited on shutdown
        self._changed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context: contextvars.Context | None = None
        self._closed = False
        self.watchdog: Watchdog | None = None
        """Declares a call stuck (`forgelab.runtime.watchdog`); None: the controller's default one."""
        self.progress_from: Callable[[], list[int]] | None = None
        """The pids of other processes this service's calls wait on, whose progress counters count as the calls'
        progress (an environment's rollout waits on the generators' engine steps); None: only its own."""

    @classmethod
    async def start(cls, component: type[C], placement: Placement, args: tuple[object, ...],
                    kwargs: dict[str, object], *, name: str | None = None,
                    on_respawn: Callable[[ActorHandle[C]], Awaitable[None]] | None = None,
                    max_respawn_attempts: int = 3, watch_interval_s: float = 0.5) -> Self:
        """Spawn every replica concurrently; returns once all ran `setup()`."""
        placement.validate(component.__name__)
        svc = cls(component, placement, args, kwargs, name=name, on_respawn=on_respawn,
                  max_respawn_attempts=max_respawn_attempts, watch_interval_s=watch_interval_s)
        svc._loop = asyncio.get_running_loop()
        # Monarch calls the fault hook on its own thread, where Monarch's `context()` is some internal
        # actor's, not the client's: a respawn started from there would spawn from the wrong proc
        # (its host mesh is None). Fault callbacks therefore run in the context captured here.
        svc._context = contextvars.copy_context()
        supervision.install()
        supervision.add_listener(svc._fault_listener)
        try:
            started = await asyncio.gather(*(svc._spawn(rep) for rep in svc._replicas), return_exceptions=True)
            errors = [(i, r) for i, r in enumerate(started) if isinstance(r, BaseException)]
            if errors:
                i, err = errors[0]
                raise RuntimeError(
                    f"service {svc.name!r}: replica {i} of {len(svc._replicas)} failed to start: "
                    f"{first_line(err)}"
                ) from err
        except BaseException:
            await svc.shutdown()
            raise
        for rep, handle in zip(svc._replicas, started):
            assert not isinstance(handle, BaseException)  # errors raised above
            svc._install(rep, handle)
        if placement.job is None and os.path.isdir("/proc") and svc.watch_interval_s > 0:
            svc._spawn_task(svc._watch())
        return svc

    async def _spawn(self, rep: Replica[C]) -> ActorHandle[C]:
        name = f"{self.name}_{self._uid}_r{rep.index}_{next(self._spawns)}"
        handle = await spawn(
            self.cls, self.placement, self.args, self.kwargs, name=name,
            first_host=rep.index * self.placement.hosts,
        )
        try:
            handle.pids_list = await handle.pids()
        except BaseException:
            await handle.shutdown()
            raise
        handle.replica_index = rep.index
        return handle

    def _install(self, rep: Replica[C], handle: ActorHandle[C]) -> None:
        rep.handle, rep.pids, rep.endpoints, rep.state = handle, list(handle.pids_list), {}, "healthy"
        self._refresh_healthy()

    # ---------------------------------------------------------------- calls
    async def _call_all(self, rep: Replica[C], handle: ActorHandle[C], endpoint: str, args: tuple[object, ...],
                        kwargs: dict[str, object]) -> object:
        """`endpoint` on every rank of `rep` (timed into its `RequestStats`, watched by the watchdog)."""
        if rep.single:
            return await self._timed(rep, self._watched(rep, handle, endpoint, self._endpoint(rep, endpoint).call_one(*args, **kwargs)))
        return await self._timed(rep, self._watched(rep, handle, endpoint, handle.call(endpoint, *args, **kwargs)))

    async def _call_one(self, rep: Replica[C], handle: ActorHandle[C], endpoint: str, args: tuple[object, ...],
                        kwargs: dict[str, object]) -> object:
        """`endpoint` on `rep` (rank 0 of a multi-process replica), timed into its `RequestStats`, watched."""
        if rep.single:
            return await self._timed(rep, self._watched(rep, handle, endpoint, self._endpoint(rep, endpoint).call_one(*args, **kwargs)))
        return await self._timed(rep, self._watched(rep, handle, endpoint, handle.call_one(endpoint, *args, **kwargs)))

    async def _watched(self, rep: Replica[C], handle: ActorHandle[C], endpoint: str, call: Awaitable[object]) -> object:
        """`call`, under the watchdog (`forgelab.runtime.watchdog`): a replica that stops answering or progressing
        raises `StuckError`, after its stacks are dumped; it is then killed and respawned like a dead one."""
        from forgelab.runtime.watchdog import default_watchdog

        wd = self.watchdog or default_watchdog()

        def stuck(err: Exception) -> None:
            self._fail(rep, handle, f"stuck in {endpoint}(): {err}")
            if self.placement.job is None:  # a stopped or deadlocked process never acknowledges a stop: end it
                for pid in handle.pids_list or rep.pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass

        return await wd.watch(call, pids=list(handle.pids_list or rep.pids), what=f"{endpoint}()",
                              part=f"service {self.name!r} replica {rep.index}", on_stuck=stuck,
                              progress_pids=self.progress_from() if self.progress_from is not None else ())

    @staticmethod
    async def _timed(rep: Replica[C], call: Awaitable[object]) -> object:
        t0, ok = time.perf_counter(), False
        try:
            result = await call
            ok = True
            return result
        finally:
            rep.stats.record(time.perf_counter() - t0, ok)

    def _endpoint(self, rep: Replica[C], endpoint: str) -> _NamedEndpoint:
        ep = rep.endpoints.get(endpoint)
        if ep is None:
            if not hasattr(self.cls, endpoint):
                raise AttributeError(f"service {self.name!r}: {self.cls.__name__} has no endpoint {endpoint!r}")
            ep = rep.endpoints[endpoint] = getattr(rep.live.actor, endpoint)
        return ep

    # ------------------------------------------------------------- failures
    def _fault_listener(self, event: supervision.FaultEvent) -> None:
        """Called on Monarch's thread: hand the event to our loop."""
        loop = self._loop
        if loop is None or self._closed or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._on_fault, event, context=self._context)
        except RuntimeError:  # loop closed in between
            pass

    def _on_fault(self, event: supervision.FaultEvent) -> None:
        for rep in self._replicas:
            h = rep.handle
            if h is not None and (event.mesh_name == h.name or event.mesh_name.startswith(h.name + "-")):
                self._fail(rep, h, f"process died (mesh {event.mesh_name}, ranks {event.crashed_ranks})")

    async def _watch(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.watch_interval_s)
            for rep in list(self._healthy):
                dead = [pid for pid in rep.pids if not pid_alive(pid)]
                if dead:
                    self._fail(rep, rep.handle, f"process {dead} is gone")

    def _fail(self, rep: Replica[C], handle: ActorHandle[C] | None, detail: str) -> None:
        """Mark `rep` unhealthy and respawn it, unless this failure is stale or known."""
        if self._closed or rep.handle is not handle or rep.state != "healthy":
            return
        rep.state, rep.last_error = "respawning", detail
        if handle is not None:
            handle.failed = True
        self._refresh_healthy()
        log.warning("service %s: replica %d failed: %s", self.name, rep.index, detail)
        self._record("replica_failed", rep.index, detail)
        self._spawn_task(self._respawn(rep, handle))

    async def _respawn(self, rep: Replica[C], old: ActorHandle[C] | None) -> None:
        if old is not None:  # a dead mesh may take a while to stop: don't wait for it
            self._teardown(old)
        delay = 1.0
        for attempt in range(1, self.max_respawn_attempts + 1):
            handle = None
            try:
                handle = await self._spawn(rep)
                rep.info = {}
                if self.on_respawn is not None:
                    await self.on_respawn(handle)
            except asyncio.CancelledError:
                if handle is not None:
                    await handle.shutdown()
                raise
            except Exception as err:
                rep.last_error = f"respawn attempt {attempt}/{self.max_respawn_attempts} failed: {first_line(err)}"
                log.warning("service %s: replica %d: %s", self.name, rep.index, rep.last_error)
                if handle is not None:
                    self._teardown(handle)
                if attempt < self.max_respawn_attempts:
                    await asyncio.sleep(delay)
                    delay *= 2
                continue
            rep.restarts += 1
            self._install(rep, handle)
            self._record("replica_restarted", rep.index, f"pids {rep.pids}")
            return
        rep.state = "failed"
        self._record("replica_failed", rep.index, f"gave up respawning: {rep.last_error}")

    async def restart_replica(self, index: int) -> ReplicaStatus:
        """Restart replica `index` (healthy or given up) and wait until it is back."""
        rep = self._replicas[index]
        if rep.state == "healthy":
            self._fail(rep, rep.handle, "restart requested by the controller")
        elif rep.state == "failed":
            rep.state = "respawning"
            self._spawn_task(self._respawn(rep, None))
        while rep.state == "respawning" and not self._closed:
            await self._wait_change()
        return self.status()[index]

    # --------------------------------------------------------------- status
    def status(self) -> list[ReplicaStatus]:
        return [
            ReplicaStatus(
                index=rep.index, healthy=rep.state == "healthy", state=rep.state,
                in_flight=rep.in_flight, restarts=rep.restarts, pids=tuple(rep.pids),
                last_error=rep.last_error, info=dict(rep.info),
                name=rep.handle.name if rep.handle is not None else None,
                calls=rep.stats.calls, failures=rep.stats.failures, latency_ms=rep.stats.percentiles_ms(),
            )
            for rep in self._replicas
        ]

    @property
    def replicas(self) -> list[ReplicaStatus]:
        """Same as `status()`."""
        return self.status()

    def handles(self) -> list[ActorHandle[C] | None]:
        """The current ActorHandle of each healthy replica (None otherwise)."""
        return [rep.handle if rep.state == "healthy" else None for rep in self._replicas]

    def set_replica_info(self, index: int, **fields: object) -> None:
        """Attach fields (e.g. weight_version=3) to replica `index`'s status."""
        self._replicas[index].info.update(fields)

    async def refresh_info(self, endpoint: str = "status") -> None:
        """Merge each healthy replica's `endpoint()` result (a dict, or a dataclass's top-level fields) into its
        info."""
        for rep in list(self._healthy):
            try:
                result = await self._call_all(rep, rep.live, endpoint, (), {})
            except SupervisionError as err:
                self._fail(rep, rep.handle, f"process died during {endpoint}(): {first_line(err)}")
                continue
            if dataclasses.is_dataclass(result) and not isinstance(result, type):
                result = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
            if isinstance(result, dict):
                rep.info.update(result)

    async def wait_healthy(self, count: int | None = None, timeout: float | None = None) -> None:
        """Wait until `count` replicas (default: all) are healthy."""
        need = len(self._replicas) if count is None else count

        async def wait() -> None:
            while len(self._healthy) < need:
                if self._closed or all(r.state in ("failed", "stopped") for r in self._replicas if r.state != "healthy"):
                    raise NoHealthyReplicaError(
                        f"service {self.name!r}: waiting for {need} healthy replica(s), but the others "
                        f"will not come back: {'; '.join(r.describe() for r in self._replicas)}"
                    )
                await self._wait_change()

        await asyncio.wait_for(wait(), timeout)

    # --------------------------------------------------------------- events
    def add_listener(self, fn: Callable[[ServiceEvent], None]) -> None:
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[ServiceEvent], None]) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def clear_listeners(self) -> None:
        """Forget every listener (a pooled service's finished run must not hear the next run's events)."""
        self._listeners.clear()

    def _record(self, kind: str, index: int, detail: str) -> None:
        event = ServiceEvent(kind, index, time.time(), detail)
        self.events.append(event)
        for fn in list(self._listeners):
            try:
                fn(event)
            except Exception:
                log.exception("service %s: event listener %r failed", self.name, fn)
        self._signal()

    # ------------------------------------------------------------- plumbing
    def _refresh_healthy(self) -> None:
        self._healthy = [rep for rep in self._replicas if rep.state == "healthy"]
        self._signal()

    def _signal(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _wait_change(self) -> None:
        await self._changed.wait()

    def _spawn_task(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _teardown(self, handle: ActorHandle[C]) -> None:
        task = asyncio.ensure_future(handle.shutdown())
        self._teardowns.add(task)
        task.add_done_callback(self._teardowns.discard)

    # ------------------------------------------------------------- shutdown
    async def shutdown(self) -> None:
        """Stop every replica and any respawn in progress. Safe to call twice."""
        self._closed = True
        supervision.remove_listener(self._fault_listener)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        handles = [rep.handle for rep in self._replicas if rep.handle is not None]
        for rep in self._replicas:
            rep.state = "stopped"
        self._healthy = []
        await asyncio.gather(*(h.shutdown() for h in handles), *list(self._teardowns), return_exceptions=True)
        self._signal()
