"""Services: N replicas of a component behind one routing handle, kept alive.

    svc = await Generator.options(num_replicas=2).as_service(config)
    out = await svc.route("generate", prompts)           # least-loaded replica
    async with svc.session("episode-7") as s:             # sticky: same replica
        await s.route("generate", turn1); await s.route("generate", turn2)
    versions = await svc.fanout("version")        # every healthy replica
    svc.status()                                          # list[ReplicaStatus]
    await svc.shutdown()

Typed calls: an `Endpoint[Req, Res]` names an endpoint that takes one request object and answers a `Res`;
`svc.call(endpoint, request)`, `svc.call_each(endpoint, request)` and `session.call(...)` are `route`,
`fanout` and `Session.route` with the request and the answer typed, so a type checker sees a wrong request
where it is written. A component's typed methods live on its service class (`Component.SERVICE`, e.g.
`forgelab.engines.generator_service.GeneratorService.generate`); the string forms stay for the rest.

Routing picks the healthy replica with the fewest calls in flight (ties go
round robin). A replica whose process dies is noticed three ways: a call
fails with Monarch's `SupervisionError`, the supervision hook reports its
mesh failed, or (local replicas) the service's pid watch sees the process gone.
The replica is then marked unhealthy and respawned in the background (a fresh
proc mesh, same constructor arguments); `on_respawn(handle)` runs before it
serves again (the controller pushes current weights there). The call that was
running on it is retried once on another replica if its endpoint is in the
component's `IDEMPOTENT`, otherwise it raises `ReplicaFailedError`. An
endpoint that raises (`ActorError`) is the caller's business: re-raised
unchanged, replica untouched.

`svc.events` lists `ServiceEvent(kind, replica, time, detail)` tuples, kind
"replica_failed" or "replica_restarted"; `add_listener(fn)` is called with
each new one (on the event loop's thread).

Multi-process replicas (procs * hosts > 1) are SPMD: `route` runs the
endpoint on every rank of the chosen replica and returns rank 0's value;
`fanout` returns, per replica, the list of rank values.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generic, TypeVar, cast

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

from forgelab.runtime.mesh import ActorHandle, Placement
from forgelab.runtime.supervision import pid_alive  # noqa: F401  (re-exported)
from forgelab.runtime.replicas import (  # noqa: F401  (re-exported: this module's names before the split)
    NoHealthyReplicaError,
    ReplicaFailedError,
    ReplicaPool,
    ReplicaStatus,
    ServiceEvent,
    first_line,
    Replica,
    service_ids,
    log,
)

ReqT = TypeVar("ReqT")
ResT = TypeVar("ResT")


@dataclass(frozen=True)
class Endpoint(Generic[ReqT, ResT]):
    """An endpoint that takes one request object (`ReqT`; None: no argument) and answers a `ResT`.

        GENERATE: Endpoint[GenerateRequest, CompletionGroups] = Endpoint("generate")
        groups = await svc.call(GENERATE, GenerateRequest(prompts_P=[ids]))
    """

    name: str

    def args(self, request: ReqT) -> tuple[object, ...]:
        """The positional arguments the endpoint receives for `request`."""
        return () if request is None else (request,)


class Session:
    """Sticky routing: calls go to one replica while it stays healthy.

    When that replica dies (or is respawned: a fresh process has lost any
    per-session state) the session re-pins to the least-loaded healthy one.
    """

    __slots__ = ("service", "key", "_rep", "_handle")

    def __init__(self, service: "Service", key: Any):
        self.service = service
        self.key = key
        self._rep: Replica | None = None
        self._handle: ActorHandle | None = None

    @property
    def replica(self) -> int | None:
        """Index of the replica this session is pinned to (None before the first call)."""
        return None if self._rep is None else self._rep.index

    async def route(self, endpoint: str, *args: Any, **kwargs: Any) -> Any:
        rep = self._rep
        if rep is None or rep.state != "healthy" or rep.handle is not self._handle:
            rep = self.service.pick(endpoint)
            self._rep, self._handle = rep, rep.handle
        return await self.service.route_on(rep, endpoint, args, kwargs)

    async def call(self, endpoint: Endpoint[ReqT, ResT], request: ReqT) -> ResT:
        """`route` typed: `endpoint` with `request` on this session's replica."""
        return cast(ResT, await self.route(endpoint.name, *endpoint.args(request)))

    def close(self) -> None:
        self.service.forget_session(self.key)

    async def __aenter__(self) -> "Session":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()


class Service(ReplicaPool):
    """`num_replicas` copies of a component behind one routing handle; see the module docstring."""

    def __init__(
        self,
        cls: type,
        placement: Placement,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        name: str | None = None,
        on_respawn: Callable[[ActorHandle], Awaitable[None]] | None = None,
        max_respawn_attempts: int = 3,
        watch_interval_s: float = 0.5,
    ):
        """`watch_interval_s`: how often local replicas' pids are checked (0 turns
        the watch off; Monarch itself reports a dead process after ~10 s)."""
        super().__init__(cls, placement, args, kwargs, name=name, on_respawn=on_respawn,
                         max_respawn_attempts=max_respawn_attempts, watch_interval_s=watch_interval_s)
        self._idempotent = frozenset(getattr(cls, "IDEMPOTENT", ()))
        self._sessions: dict[Any, Session] = {}
        self._rr = 0

    # ---------------------------------------------------------------- routing
    async def route(self, endpoint: str, *args: Any, **kwargs: Any) -> Any:
        """Call `endpoint` on the least-loaded healthy replica."""
        return await self.route_on(self.pick(endpoint), endpoint, args, kwargs)

    async def call(self, endpoint: Endpoint[ReqT, ResT], request: ReqT) -> ResT:
        """`route` typed: `endpoint` with `request` on the least-loaded healthy replica (retried once on
        another if the replica dies and the endpoint is in the component's ``IDEMPOTENT``)."""
        return cast(ResT, await self.route(endpoint.name, *endpoint.args(request)))

    async def call_each(self, endpoint: Endpoint[ReqT, ResT], request: ReqT) -> list[ResT]:
        """`fanout` typed: `endpoint` with `request` on every healthy replica, answers in replica order (rank 0's
        answer for a multi-process replica)."""
        answers = await self.fanout(endpoint.name, *endpoint.args(request))
        if self.placement.procs * self.placement.hosts > 1:  # SPMD replicas: one answer per rank
            answers = [ranks[0] for ranks in answers]
        return cast(list[ResT], answers)

    def forget_session(self, key: Any) -> None:
        """Drop the sticky session for `key` (`Session.close`); a later `session(key)` starts a new one."""
        self._sessions.pop(key, None)

    def session(self, key: Any) -> Session:
        """The sticky session for `key` (same object for the same key until closed)."""
        s = self._sessions.get(key)
        if s is None:
            s = self._sessions[key] = Session(self, key)
        return s

    async def fanout(self, endpoint: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `endpoint` on every healthy replica; results in replica order.

        One entry per replica: the value (single-process replicas) or the list
        of rank values (multi-process). A replica that dies during the call is
        left out (it is respawned, and `on_respawn` is where it catches up); an
        endpoint that raises re-raises here.
        """
        pairs = [(rep, rep.handle) for rep in self._healthy if rep.handle is not None]
        if not pairs:
            raise NoHealthyReplicaError(self._no_healthy_message(endpoint))
        reps, handles = [rep for rep, _ in pairs], [h for _, h in pairs]
        for rep in reps:
            rep.in_flight += 1
        try:
            results = await asyncio.gather(
                *(self._call_all(rep, h, endpoint, args, kwargs) for rep, h in zip(reps, handles)),
                return_exceptions=True,
            )
        finally:
            for rep in reps:
                rep.in_flight -= 1
        out, error = [], None
        for rep, handle, result in zip(reps, handles, results):
            if isinstance(result, SupervisionError):
                self._fail(rep, handle, f"process died during fanout {endpoint}(): {first_line(result)}")
            elif isinstance(result, BaseException):
                error = error or result
            else:
                out.append(result)
        if error is not None:
            raise error
        if not out:
            raise NoHealthyReplicaError(self._no_healthy_message(endpoint))
        return out

    def pick(self, endpoint: str, exclude: Replica | None = None) -> Replica:
        """A healthy replica for `endpoint` (the route policy), other than `exclude` where there is one."""
        healthy = self._healthy
        n = len(healthy)
        if n == 1 and healthy[0] is not exclude:
            return healthy[0]
        start = self._rr
        self._rr = start + 1
        best = None
        for k in range(n):
            rep = healthy[(start + k) % n]
            if rep is not exclude and (best is None or rep.in_flight < best.in_flight):
                best = rep
        if best is None:
            raise NoHealthyReplicaError(self._no_healthy_message(endpoint))
        return best

    async def route_on(self, rep: Replica, endpoint: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call `endpoint` on replica `rep`; a failed replica's call is retried once on another."""
        handle = rep.handle
        if handle is None:  # not healthy: `pick` returns none such
            raise NoHealthyReplicaError(self._no_healthy_message(endpoint))
        rep.in_flight += 1
        try:
            return await self._call_one(rep, handle, endpoint, args, kwargs)
        except SupervisionError as err:
            failure = err
        finally:
            rep.in_flight -= 1
        return await self._recover(rep, handle, endpoint, args, kwargs, failure)

    async def _recover(self, rep: Replica, handle: ActorHandle, endpoint: str, args: tuple[Any, ...],
                       kwargs: dict[str, Any], err: SupervisionError) -> Any:
        self._fail(rep, handle, f"process died during {endpoint}(): {first_line(err)}")
        where = (
            f"service {self.name!r}: replica {rep.index} (pids {list(handle.pids_list)}) died while "
            f"running {endpoint!r}"
        )
        if endpoint not in self._idempotent:
            raise ReplicaFailedError(
                f"{where}; not retried because {endpoint!r} is not in {self.cls.__name__}.IDEMPOTENT "
                "(it may have had side effects). The replica is being respawned (see svc.status()); "
                "retry the call yourself if that is safe, or add the endpoint to IDEMPOTENT."
            ) from err
        try:
            other = self.pick(endpoint, exclude=rep)
        except NoHealthyReplicaError as none:
            raise NoHealthyReplicaError(f"{where}, and it could not be retried: {none}") from err
        other_handle = other.handle
        if other_handle is None:
            raise NoHealthyReplicaError(f"{where}, and it could not be retried: {self._no_healthy_message(endpoint)}")
        other.in_flight += 1
        try:
            return await self._call_one(other, other_handle, endpoint, args, kwargs)
        except SupervisionError as err2:
            self._fail(other, other_handle, f"process died during {endpoint}() (retry): {first_line(err2)}")
            raise ReplicaFailedError(
                f"{where}; the one retry, on replica {other.index}, died too. Both are being respawned; "
                "see svc.status() and the Monarch log for why processes die."
            ) from err2
        finally:
            other.in_flight -= 1

    def _no_healthy_message(self, endpoint: str) -> str:
        if self._closed:
            return f"service {self.name!r} was shut down; cannot call {endpoint!r}"
        states = "; ".join(rep.describe() for rep in self._replicas)
        return (
            f"service {self.name!r} has no healthy replica for {endpoint!r}. Replicas: {states}. "
            "Respawns run in the background: `await svc.wait_healthy()` waits for them, "
            "`await svc.restart_replica(i)` restarts one that gave up; the last errors above and "
            "the Monarch log say why the processes died."
        )

    # ------------------------------------------------------------- shutdown
    async def shutdown(self) -> None:
        """Stop every replica and any respawn in progress. Safe to call twice."""
        self._sessions.clear()
        await super().shutdown()

    async def __aenter__(self) -> "Service":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()

    def __repr__(self) -> str:
        return f"<Service {self.name}: {len(self._healthy)}/{len(self._replicas)} healthy>"
