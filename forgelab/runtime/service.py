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
`fanout` and `Session.route` with the request and the answer typed. A component's typed methods live on its
service class (`Component.SERVICE`, e.g. `forgelab.engines.generator_service.GeneratorService.generate`);
`route(Component.method, ...)` types the arguments from the endpoint itself; the string forms stay for the rest.

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
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, ParamSpec, TypeVar, cast, overload

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

from forgelab.runtime.mesh import ActorHandle, Placement, endpoint_name
# re-exported: this module's names before the split
from forgelab.runtime.replicas import NoHealthyReplicaError as NoHealthyReplicaError
from forgelab.runtime.replicas import Replica as Replica
from forgelab.runtime.replicas import ReplicaFailedError as ReplicaFailedError
from forgelab.runtime.replicas import ReplicaPool as ReplicaPool
from forgelab.runtime.replicas import ReplicaStatus as ReplicaStatus
from forgelab.runtime.replicas import ServiceEvent as ServiceEvent
from forgelab.runtime.replicas import first_line as first_line
from forgelab.runtime.replicas import log as log
from forgelab.runtime.supervision import pid_alive as pid_alive
from forgelab.runtime.replicas import service_ids as service_ids

if TYPE_CHECKING:
    from monarch.actor import Actor
    from monarch.actor import Endpoint as ActorEndpoint


C = TypeVar("C", bound="Actor")
P = ParamSpec("P")
R = TypeVar("R")
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


class Session(Generic[C]):
    """Sticky routing: calls go to one replica while it stays healthy.

    When that replica dies (or is respawned: a fresh process has lost any
    per-session state) the session re-pins to the least-loaded healthy one.
    """

    __slots__ = ("service", "key", "_rep", "_handle")

    def __init__(self, service: Service[C], key: Hashable):
        self.service = service
        self.key = key
        self._rep: Replica[C] | None = None
        self._handle: ActorHandle[C] | None = None

    @property
    def replica(self) -> int | None:
        """Index of the replica this session is pinned to (None before the first call)."""
        return None if self._rep is None else self._rep.index

    @overload
    async def route(self, endpoint: ActorEndpoint[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R: ...
    @overload
    async def route(self, endpoint: str, /, *args: object, **kwargs: object) -> object: ...

    async def route(self, endpoint: ActorEndpoint[P, R] | str, /, *args: object, **kwargs: object) -> R | object:
        """Call `endpoint` (``Generator.generate``, or its name) on this session's replica."""
        name = endpoint_name(endpoint)
        rep = self._rep
        if rep is None or rep.state != "healthy" or rep.handle is not self._handle:
            rep = self.service.pick(name)
            self._rep, self._handle = rep, rep.handle
        return await self.service.route_on(rep, name, args, kwargs)

    async def call(self, endpoint: Endpoint[ReqT, ResT], request: ReqT) -> ResT:
        """`route` typed: `endpoint` with `request` on this session's replica."""
        return cast(ResT, await self.route(endpoint.name, *endpoint.args(request)))

    def close(self) -> None:
        self.service.forget_session(self.key)

    async def __aenter__(self) -> Session[C]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class Service(ReplicaPool[C]):
    """`num_replicas` copies of a component behind one routing handle; see the module docstring."""

    def __init__(
        self,
        cls: type[C],
        placement: Placement,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
        *,
        name: str | None = None,
        on_respawn: Callable[[ActorHandle[C]], Awaitable[None]] | None = None,
        max_respawn_attempts: int = 3,
        watch_interval_s: float = 0.5,
    ):
        """`watch_interval_s`: how often local replicas' pids are checked (0 turns
        the watch off; Monarch itself reports a dead process after ~10 s)."""
        super().__init__(cls, placement, args, kwargs, name=name, on_respawn=on_respawn,
                         max_respawn_attempts=max_respawn_attempts, watch_interval_s=watch_interval_s)
        self._idempotent = frozenset(getattr(cls, "IDEMPOTENT", ()))
        self._sessions: dict[Hashable, Session[C]] = {}
        self._rr = 0

    # ---------------------------------------------------------------- routing
    @overload
    async def route(self, endpoint: ActorEndpoint[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R: ...
    @overload
    async def route(self, endpoint: str, /, *args: object, **kwargs: object) -> object: ...

    async def route(self, endpoint: ActorEndpoint[P, R] | str, /, *args: object, **kwargs: object) -> R | object:
        """Call `endpoint` on the least-loaded healthy replica.

        Name the endpoint by the component's method (``await svc.route(Generator.generate, prompts)``) and the
        checker types the arguments and the result; by its name (``svc.route("generate", prompts)``) it does not.
        """
        name = endpoint_name(endpoint)
        return await self.route_on(self.pick(name), name, args, kwargs)

    async def call(self, endpoint: Endpoint[ReqT, ResT], request: ReqT) -> ResT:
        """`route` typed: `endpoint` with `request` on the least-loaded healthy replica (retried once on
        another if the replica dies and the endpoint is in the component's ``IDEMPOTENT``)."""
        return cast(ResT, await self.route(endpoint.name, *endpoint.args(request)))

    async def call_each(self, endpoint: Endpoint[ReqT, ResT], request: ReqT) -> list[ResT]:
        """`fanout` typed: `endpoint` with `request` on every healthy replica, answers in replica order (rank 0's
        answer for a multi-process replica)."""
        answers: list[object] = list(await self.fanout(endpoint.name, *endpoint.args(request)))
        if self.placement.procs * self.placement.hosts > 1:  # SPMD replicas: one answer per rank
            answers = [cast(list[object], ranks)[0] for ranks in answers]
        return cast(list[ResT], answers)

    def forget_session(self, key: Hashable) -> None:
        """Drop the sticky session for `key` (`Session.close`); a later `session(key)` starts a new one."""
        self._sessions.pop(key, None)

    def session(self, key: Hashable) -> Session[C]:
        """The sticky session for `key` (same object for the same key until closed)."""
        s = self._sessions.get(key)
        if s is None:
            s = self._sessions[key] = Session(self, key)
        return s

    @overload
    async def fanout(
        self, endpoint: ActorEndpoint[P, R], /, *args: P.args, **kwargs: P.kwargs
    ) -> list[R] | list[list[R]]: ...
    @overload
    async def fanout(self, endpoint: str, /, *args: object, **kwargs: object) -> list[object]: ...

    async def fanout(
        self, endpoint: ActorEndpoint[P, R] | str, /, *args: object, **kwargs: object
    ) -> list[R] | list[list[R]] | list[object]:
        """Call `endpoint` on every healthy replica; results in replica order.

        One entry per replica: the value (single-process replicas) or the list
        of rank values (multi-process). A replica that dies during the call is
        left out (it is respawned, and `on_respawn` is where it catches up); an
        endpoint that raises re-raises here.
        """
        name = endpoint_name(endpoint)
        reps = list(self._healthy)
        if not reps:
            raise NoHealthyReplicaError(self._no_healthy_message(name))
        handles = [rep.live for rep in reps]
        for rep in reps:
            rep.in_flight += 1
        try:
            results = await asyncio.gather(
                *(self._call_all(rep, h, name, args, kwargs) for rep, h in zip(reps, handles)),
                return_exceptions=True,
            )
        finally:
            for rep in reps:
                rep.in_flight -= 1
        out: list[object] = []
        error: BaseException | None = None
        for rep, handle, result in zip(reps, handles, results):
            if isinstance(result, SupervisionError):
                self._fail(rep, handle, f"process died during fanout {name}(): {first_line(result)}")
            elif isinstance(result, BaseException):
                error = error or result
            else:
                out.append(result)
        if error is not None:
            raise error
        if not out:
            raise NoHealthyReplicaError(self._no_healthy_message(name))
        return out

    def pick(self, endpoint: str, exclude: Replica[C] | None = None) -> Replica[C]:
        """A healthy replica for `endpoint` (the route policy), other than `exclude` where there is one."""
        healthy = self._healthy
        n = len(healthy)
        if n == 1 and healthy[0] is not exclude:
            return healthy[0]
        start = self._rr
        self._rr = start + 1
        best: Replica[C] | None = None
        for k in range(n):
            rep = healthy[(start + k) % n]
            if rep is not exclude and (best is None or rep.in_flight < best.in_flight):
                best = rep
        if best is None:
            raise NoHealthyReplicaError(self._no_healthy_message(endpoint))
        return best

    async def route_on(self, rep: Replica[C], endpoint: str, args: tuple[object, ...],
                       kwargs: dict[str, object]) -> object:
        """Call `endpoint` on replica `rep`; a failed replica's call is retried once on another."""
        handle = rep.live
        rep.in_flight += 1
        try:
            return await self._call_one(rep, handle, endpoint, args, kwargs)
        except SupervisionError as err:
            failure = err
        finally:
            rep.in_flight -= 1
        return await self._recover(rep, handle, endpoint, args, kwargs, failure)

    async def _recover(self, rep: Replica[C], handle: ActorHandle[C], endpoint: str, args: tuple[object, ...],
                       kwargs: dict[str, object], err: SupervisionError) -> object:
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
        other_handle = other.live
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

    async def __aenter__(self) -> Service[C]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    def __repr__(self) -> str:
        return f"<Service {self.name}: {len(self._healthy)}/{len(self._replicas)} healthy>"
