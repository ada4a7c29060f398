"""Placement and spawning: where a component's processes go (`Placement`), the handle of a spawned actor
(`ActorHandle`), and `spawn`, which starts the processes and the actor in them. `forgelab.runtime.component`
builds the user-facing `Component.options(...).as_actor()/as_service()` on top."""
from __future__ import annotations

import asyncio
import itertools
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, ParamSpec, Protocol, TypeVar, cast, overload

from forgelab.runtime import liveness, startup_cpus, supervision

if TYPE_CHECKING:  # Monarch loads lazily: importing forgelab stays cheap
    from monarch.actor import Actor, BootstrapCommand, Endpoint, HostMesh, Point, ProcMesh, ValueMesh
    from monarch.job import JobTrait


P = ParamSpec("P")
R = TypeVar("R")
A = TypeVar("A", bound="Actor")
"""The component class (`forgelab.runtime.component.Component`, whose ``setup`` and ``prepare_exit`` endpoints
`spawn` and `ActorHandle.shutdown` call by name)."""

_counter = itertools.count()
_gpu_cursor = itertools.count()


def _take_gpus(n: int) -> list[int]:
    """The next n GPUs of this host, round robin (a respawned replica moves to the next free ones)."""
    import torch

    have = max(1, torch.cuda.device_count())
    return [next(_gpu_cursor) % have for _ in range(n)]

#: Environment every forgelab process starts with (callers may override).
DEFAULT_PROCESS_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"),
    # vLLM logs every weight reload at INFO (and a harmless RotaryEmbedding warning): keep the
    # notebook readable. Set VLLM_LOGGING_LEVEL=INFO in the controller environment to see them.
    "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
}


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a component runs. Decided by the controller, never by the actor."""

    procs: int = 1
    """Processes per host (FSDP ranks for the trainer)."""
    hosts: int = 1
    """Hosts in the mesh; more than one needs `job` (a `monarch.job` job)."""
    with_gpus: bool = False
    """Give each process its own GPU: local meshes take consecutive free GPUs of this host (see `gpus`)."""
    gpus: tuple[int, ...] | None = None
    """Explicit GPU indices for the processes of one host (len == procs); None: the next free ones."""
    num_replicas: int = 1
    """Independent copies behind a service (`as_service`)."""
    threads: int = 1
    """torch / OpenMP threads per process."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for every process."""
    job: JobTrait | None = None
    """Optional `monarch.job` job (ProcessJob, SlurmJob, ...) providing hosts."""
    mesh: str | None = None
    """Name of the host mesh inside `job` (e.g. "generators")."""

    def validate(self, what: str) -> None:
        for name in ("procs", "hosts", "num_replicas", "threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"{what}: placement field '{name}' must be a positive integer, got {value!r}"
                )
        if self.hosts > 1 and self.job is None:
            raise ValueError(
                f"{what}: placement asks for hosts={self.hosts} but gives no job; pass "
                "job=monarch.job.ProcessJob({...}) (local) or a SlurmJob/KubernetesJob/SSHJob"
            )
        if self.with_gpus:
            try:
                import torch

                have = torch.cuda.device_count()
            except Exception:  # pragma: no cover - torch always importable here
                have = 0
            if self.job is None and have < self.procs:
                raise ValueError(
                    f"{what}: placement asks for with_gpus=True and procs={self.procs} but this "
                    f"host has {have} GPU(s); lower procs or set with_gpus=False"
                )

    def process_env(self) -> dict[str, str]:
        env = dict(DEFAULT_PROCESS_ENV)
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(self.threads)
        env["FORGELAB_THREADS"] = str(self.threads)
        env.update(self.env)
        return env


def _user_sys_path() -> list[str]:
    """This interpreter's `sys.path` entries outside the Python installation.

    Child processes start as `python -m monarch._src.actor.bootstrap_main` in
    the controller's cwd, so they see neither a notebook's `sys.path.insert`
    nor pytest's rootdir insertion; an actor class defined in such a module
    then fails to unpickle (`ModuleNotFoundError`) and the actor aborts.
    Passing these entries on as PYTHONPATH keeps controller and children
    importing the same modules.
    """
    install = {
        os.path.realpath(p)
        for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)
    }
    out: list[str] = []
    for entry in sys.path:
        path = os.path.realpath(entry or os.getcwd())
        if not os.path.isdir(path) or path in out:
            continue
        if any(path == p or path.startswith(p + os.sep) for p in install):
            continue
        out.append(path)
    return out


_MONARCH_ADMIN_DEFAULT = "[::]:1729"


def _loopback_admin() -> None:
    """Keep Monarch's mesh-admin HTTP server on loopback unless configured.

    Local channels are unix sockets (nothing listens on TCP), but the admin
    server that `job.enable_admin()` starts defaults to `[::]:1729`: every
    interface, unauthenticated, with py-spy introspection. Set
    FORGELAB_MESH_ADMIN_ADDR (or configure `mesh_admin_addr` yourself) to expose it.
    """
    from monarch.config import configure, get_global_config

    wanted = os.environ.get("FORGELAB_MESH_ADMIN_ADDR")
    if wanted:
        configure(mesh_admin_addr=wanted)
    elif get_global_config().get("mesh_admin_addr") == _MONARCH_ADMIN_DEFAULT:
        configure(mesh_admin_addr="127.0.0.1:1729")


def _host_mesh(placement: Placement, first_host: int = 0) -> HostMesh:
    """The host mesh to spawn on: this host, or `placement.hosts` hosts of a job mesh.

    With a job, hosts `first_host .. first_host + hosts - 1` of the named mesh
    are used (wrapping to 0 when they run past its end), so a service can put
    its replicas on different hosts.
    """
    job = placement.job
    if job is None:
        from monarch.actor import this_host

        return this_host()
    from forgelab.runtime.placement import job_mesh_names

    names = job_mesh_names(job)
    name = placement.mesh or (names[0] if names else None)
    if name is None:
        raise ValueError(f"placement job {job!r} declares no host mesh; pass mesh=...")
    state = job.state(cached_path=None)
    try:
        host: HostMesh = getattr(state, name)
    except AttributeError:
        raise ValueError(
            f"placement asks for mesh={name!r} but the job has only {names}; "
            "pass one of those names as mesh=..."
        ) from None
    have = host.sizes.get("hosts", len(host))
    if placement.hosts > have:
        raise ValueError(
            f"placement asks for hosts={placement.hosts} but job mesh {name!r} has {have} host(s); "
            "lower hosts or give the job more"
        )
    if placement.hosts < have:
        start = first_host % have
        if start + placement.hosts > have:
            start = 0
        host = host.slice(hosts=slice(start, start + placement.hosts))
    return host


class ComponentStartError(RuntimeError):
    """A component's process died (or its actor aborted) before `setup()` finished."""


def endpoint_name(endpoint: Endpoint[P, R] | str) -> str:
    """The name of an endpoint given as the component's method (``Trainer.train_step``) or as a string."""
    if isinstance(endpoint, str):
        return endpoint
    # Read from the class, a Monarch endpoint is its `EndpointProperty`, which keeps the decorated method.
    name = getattr(getattr(endpoint, "_method", None), "__name__", None)
    if not isinstance(name, str):
        raise TypeError(f"{endpoint!r} is not an endpoint of a component class (e.g. Trainer.train_step)")
    return name


class _NamedEndpoint(Protocol):
    """An endpoint looked up by name: what the checker knows of its arguments and result is nothing."""

    def call(self, *args: object, **kwargs: object) -> Awaitable[ValueMesh[object]]: ...
    def call_one(self, *args: object, **kwargs: object) -> Awaitable[object]: ...


class ActorHandle(Generic[A]):
    """A spawned component: its proc mesh and the actor mesh on it.

    Typed calls name the endpoint by the component's method, so the checker sees its arguments and result:
    ``await handle.call_one(Trainer.train_step, batch)`` (or ``await handle.actor.train_step.call_one(batch)``,
    the Monarch mesh itself, typed as the component class). The older forms still run: endpoints by name
    (``handle.call_one("train_step", batch)``, whose result the checker sees as ``object``) and endpoints as
    attributes of the handle (``handle.train_step.call_one(...)``, invisible to the checker).
    """

    def __init__(self, cls: type[A], placement: Placement, name: str, procs: ProcMesh, actor: A):
        self.cls = cls
        self.placement = placement
        self.name = name
        self.procs = procs
        self.actor = actor
        self.alive = True
        self.failed = False  # set when one of its processes died
        self.pids_list: list[int] = []
        """The processes' pids (set by a service when it spawns a replica)."""
        self.replica_index: int | None = None
        """Which replica of a service this is (None outside a service)."""

    if not TYPE_CHECKING:  # untyped: the checker makes callers go through `actor` or `call`/`call_one`

        def __getattr__(self, item):
            if item.startswith("_"):
                raise AttributeError(item)
            return getattr(self.actor, item)

    def endpoint(self, endpoint: Endpoint[P, R] | str) -> Endpoint[P, R]:
        """The endpoint of this handle's actor mesh (``Trainer.train_step`` -> the mesh's ``train_step``)."""
        return cast("Endpoint[P, R]", getattr(self.actor, endpoint_name(endpoint)))

    def _untyped(self, endpoint: Endpoint[P, R] | str) -> _NamedEndpoint:
        """The endpoint for a call whose arguments the overloads below have already typed."""
        ep: _NamedEndpoint = getattr(self.actor, endpoint_name(endpoint))
        return ep

    @overload
    async def call(self, endpoint: Endpoint[P, R], /, *args: P.args, **kwargs: P.kwargs) -> list[R]: ...
    @overload
    async def call(self, endpoint: str, /, *args: object, **kwargs: object) -> list[object]: ...

    async def call(self, endpoint: Endpoint[P, R] | str, /, *args: object, **kwargs: object) -> list[R] | list[object]:
        """Call an endpoint on every rank; returns the values in rank order."""
        mesh = await self._untyped(endpoint).call(*args, **kwargs)
        return [value for _, value in mesh.items()]

    @overload
    async def call_one(self, endpoint: Endpoint[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R: ...
    @overload
    async def call_one(self, endpoint: str, /, *args: object, **kwargs: object) -> object: ...

    async def call_one(self, endpoint: Endpoint[P, R] | str, /, *args: object, **kwargs: object) -> R | object:
        """Call an endpoint of a single-process component (rank 0's value on a multi-process one)."""
        if self.placement.procs * self.placement.hosts == 1:
            return await self._untyped(endpoint).call_one(*args, **kwargs)
        return (await self.call(endpoint_name(endpoint), *args, **kwargs))[0]

    async def pids(self) -> list[int]:
        """The pid of each rank's process."""
        pids = await self.call("_forgelab_pid")
        return [pid if isinstance(pid, int) else int(str(pid)) for pid in pids]

    async def shutdown(self) -> None:
        """Stop the processes. Safe to call twice and on a dead mesh."""
        if not self.alive:
            return
        self.alive = False
        if not self.failed:  # release and flush, then exit without finalising the interpreter (Component.prepare_exit)
            try:
                await asyncio.wait_for(self._untyped("prepare_exit").call(), timeout=10)
            except Exception:  # noqa: BLE001 -- an actor without it, or a dying process: the plain stop follows
                pass
        # A mesh with a dead process never acknowledges stop(): don't wait long for it.
        try:
            await asyncio.wait_for(self.procs.stop(), timeout=3 if self.failed else 30)
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<ActorHandle {self.name} procs={self.placement.procs} hosts={self.placement.hosts}>"


async def spawn(
    cls: type[A],
    placement: Placement,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    name: str | None = None,
    first_host: int = 0,
) -> ActorHandle[A]:
    """Spawn `cls` on a new proc mesh described by `placement` and run `setup()`.

    `first_host` picks where in a job's host mesh the hosts start (services
    spread replicas with it); it is ignored without a job.
    """
    placement.validate(cls.__name__)
    supervision.install()
    _loopback_admin()
    from monarch.actor import default_bootstrap_cmd

    env = placement.process_env()
    inherited = env.get("PYTHONPATH") or os.environ.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join([p for p in [inherited, *_user_sys_path()] if p])
    if placement.job is not None:
        from forgelab.runtime.placement import workers_listening

        await workers_listening(placement.job)
    host = _host_mesh(placement, first_host)
    per_host: dict[str, int] = {"procs": placement.procs}
    cmd: BootstrapCommand | Callable[[Point], BootstrapCommand]
    if placement.with_gpus:
        per_host = {"gpus": placement.procs}
        # Meshes on this host must not share GPUs: the generator, the reference and each trainer rank
        # get distinct devices (on a job's remote hosts each host's workers count from 0 themselves).
        gpus = list(placement.gpus) if placement.gpus else (
            list(range(placement.procs)) if placement.job is not None else _take_gpus(placement.procs)
        )

        def gpu_cmd(point: Point) -> BootstrapCommand:
            return default_bootstrap_cmd().with_env(
                {**env, "CUDA_VISIBLE_DEVICES": str(gpus[point.rank % placement.procs])}
            )

        cmd = gpu_cmd
    else:
        cmd = default_bootstrap_cmd().with_env(env)
    actor_name = name or f"{cls.__name__.lower()}{next(_counter)}"
    # inside a start with a critical part: another part's processes start on the other cores (startup_cpus)
    cmd = startup_cpus.pinned_command(cmd, local=placement.job is None)
    procs = host.spawn_procs(per_host=per_host, bootstrap_command=cmd)
    startup_cpus.note_launch(cls.__name__)
    try:
        actor = procs.spawn(actor_name, cls, *args, **kwargs)
        setup: _NamedEndpoint = getattr(actor, "setup")
        await setup.call()
        if hasattr(cls, "_forgelab_liveness"):  # a Component: heartbeat and stack dumps (forgelab.runtime.liveness)
            beats: _NamedEndpoint = getattr(actor, "_forgelab_liveness")
            sink = None
            if placement.job is not None:  # another host: its heartbeat files are on its own disk
                from forgelab.runtime.beat_sink import beat_sink

                sink = beat_sink().address
            ranks = await beats.call(str(liveness.liveness_dir()), actor_name, liveness.HEARTBEAT_S[0], sink)
            pids = [int(str(pid)) for _, pid in ranks.items()]
    except BaseException as err:
        try:
            await asyncio.wait_for(procs.stop(), timeout=30)
        except BaseException:
            pass
        if type(err).__name__ == "SupervisionError":
            raise ComponentStartError(
                f"{cls.__name__} ({actor_name}): a process died or the actor aborted before setup() "
                f"finished. If the cause below says ModuleNotFoundError, the child cannot import "
                f"{cls.__module__!r}: put that module's folder on sys.path before spawning (it is "
                f"passed on as PYTHONPATH) or in options(env={{'PYTHONPATH': ...}})."
            ) from err
        raise
    handle = ActorHandle(cls, placement, actor_name, procs, actor)
    if hasattr(cls, "_forgelab_liveness"):
        handle.pids_list = pids
    return handle


