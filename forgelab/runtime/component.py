"""Components: forgelab's actors, with placement kept outside the actor.

A component is a Monarch `Actor` subclass with an optional async `setup`
endpoint. Where it runs is decided by the caller:

    gen = await Generator.options(procs=1).as_actor(config)       # one mesh
    svc = await Generator.options(num_replicas=2).as_service(config)

`as_actor` spawns one process mesh (`procs` processes per host on `hosts`
hosts) and one actor per process, then awaits `setup()` on every rank before
returning an `ActorHandle`. Every process starts with one torch/OpenMP thread
(`threads`), set in the environment before Python starts, because on small
hosts a generator and a trainer with default threads starve each other.
"""
from __future__ import annotations

import asyncio
import atexit
import os
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar, Generic, Self, TypedDict, TypeVar, Unpack

from monarch.actor import Actor, Port, endpoint

from forgelab.runtime import liveness
from forgelab.runtime.mesh import DEFAULT_PROCESS_ENV as DEFAULT_PROCESS_ENV
from forgelab.runtime.mesh import ActorHandle as ActorHandle
from forgelab.runtime.mesh import ComponentStartError as ComponentStartError
from forgelab.runtime.mesh import Placement as Placement
from forgelab.runtime.mesh import spawn
from forgelab.runtime.service import Service

if TYPE_CHECKING:
    from monarch.job import JobTrait

C = TypeVar("C", bound="Component")
R = TypeVar("R")


class PlacementOptions(TypedDict, total=False):
    """The keyword arguments of `Component.options`: `Placement`'s fields (documented there)."""

    procs: int
    hosts: int
    with_gpus: bool
    gpus: tuple[int, ...] | None
    num_replicas: int
    threads: int
    env: dict[str, str]
    job: JobTrait | None
    mesh: str | None


class Configured(Generic[C]):
    """A component class with a placement: what `Component.options(...)` returns.

    The constructor arguments of `as_actor` / `as_service` go to the component's ``__init__`` in its own
    processes; they are checked there, not here (Monarch's ``spawn`` takes them untyped)."""

    def __init__(self, cls: type[C], placement: Placement):
        self.cls = cls
        self.placement = placement

    def options(self, **kwargs: Unpack[PlacementOptions]) -> Configured[C]:
        return Configured(self.cls, replace(self.placement, **kwargs))

    async def as_actor(self, *args: object, **kwargs: object) -> ActorHandle[C]:
        return await spawn(self.cls, self.placement, args, kwargs)

    async def as_service(self, *args: object, **kwargs: object) -> Service[C]:
        """Replicas behind the component's service class (`Component.SERVICE`: its typed methods)."""
        service: type[Service[C]] = getattr(self.cls, "SERVICE", Service)
        return await service.start(self.cls, self.placement, args, kwargs)

    def __repr__(self) -> str:
        return f"{self.cls.__name__}.options({self.placement})"


class Component(Actor):
    """Base class of forgelab's actors.

    Subclasses take their configuration in `__init__` (keep it cheap), do the
    heavy lifting in an async `setup` endpoint, and declare which endpoints are
    safe to retry on another replica in `IDEMPOTENT`.
    """

    #: Endpoints a service may retry once on another replica after a crash.
    IDEMPOTENT: ClassVar[frozenset[str]] = frozenset()

    #: The service class `as_service` returns: a `Service` subclass with this component's typed endpoint methods.
    SERVICE: ClassVar[type[Service[Component]]] = Service

    @classmethod
    def options(cls, **kwargs: Unpack[PlacementOptions]) -> Configured[Self]:
        return Configured(cls, Placement(**kwargs))

    @classmethod
    async def as_actor(cls, *args: object, **kwargs: object) -> ActorHandle[Self]:
        return await Configured(cls, Placement()).as_actor(*args, **kwargs)

    @classmethod
    async def as_service(cls, *args: object, **kwargs: object) -> Service[Self]:
        return await Configured(cls, Placement()).as_service(*args, **kwargs)

    @endpoint
    async def setup(self) -> None:
        """Heavy initialisation; runs on every rank before `as_actor` returns."""

    @endpoint
    async def _forgelab_pid(self) -> int:
        return os.getpid()

    @endpoint
    async def _forgelab_liveness(self, directory: str, label: str, interval_s: float,
                                 sink: tuple[list[str], int, str] | None = None) -> int:
        """Start this process's heartbeat and faulthandler dump (`forgelab.runtime.liveness`); `spawn` calls it,
        with the controller's heartbeat sink for a process on a job's hosts (`forgelab.runtime.beat_sink`)."""
        liveness.start(directory, label, interval_s, sink)
        return os.getpid()

    @endpoint
    async def _forgelab_arm(self, point: str, action: str, seconds: float = 0.0) -> None:
        """A test hook: make this process slow, hang or deadlock at `point` (`forgelab.runtime.liveness.arm`)."""
        liveness.arm(point, action, seconds)

    def release_for_exit(self) -> None:
        """Release what this process holds outside itself (shared-memory files, ...) before a fast exit;
        subclasses that hold such things override it. Called by `prepare_exit`."""

    @endpoint
    async def prepare_exit(self) -> None:
        """`ActorHandle.shutdown` calls this just before stopping the process: `release_for_exit`, flush the
        output, then make the interpreter's exit immediate (``os._exit`` as the first exit handler to run).

        Why: after Monarch's stop a forgelab process exits normally, and finalising an interpreter holding torch,
        vLLM or torchtitan (their exit handlers, module teardown, collecting every object) took 1.5-4 s per
        process, for every run that shuts down. What must be released is released here, explicitly."""
        self.release_for_exit()
        import multiprocessing.util

        # what multiprocessing's own exit handler does (the fast exit skips it): unlink the semaphores and other
        # resources registered with its resource tracker (vLLM's), which otherwise warns of "leaked semaphore
        # objects" on stderr as the process ends
        multiprocessing.util._exit_function()  # type: ignore[attr-defined]  # private in the stdlib; typeshed omits it
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 -- a closed stream has nothing left to lose
                pass
        atexit.register(os._exit, 0)  # handlers run last-registered first: this one ends the process

    @endpoint
    async def received_config(self) -> object:
        """The config object this actor was constructed with (`self.config`; None if it keeps none)."""
        return getattr(self, "config", None)


_replies: set[asyncio.Task[None]] = set()  # strong references: the loop keeps only weak ones


def answer_in_task(port: Port[R], start: Callable[[], Awaitable[R]], what: str) -> None:
    """Run `start()` in its own task (it copies the caller's context) and answer `port` with its value or its
    error. For endpoints that answer through an explicit response port: Monarch delivers one call at a time per
    actor, so an endpoint that awaited its work would block every other caller; every error goes to the port
    (one that raised would leave its caller waiting forever). ``what`` names the endpoint in the error, e.g.
    ``"Generator.generate"``."""

    async def run() -> None:
        try:
            port.send(await start())
        except Exception as e:
            from monarch._src.actor.actor_mesh import ActorError

            port.exception(ActorError(e, f"{what} failed."))

    task = asyncio.get_running_loop().create_task(run())
    _replies.add(task)
    task.add_done_callback(_replies.discard)
