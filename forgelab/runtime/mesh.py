"""Placement and spawning: where a component's processes go (`Placement`), the handle of a spawned actor
(`ActorHandle`), and `spawn`, which starts the processes and the actor in them. `forgelab.runtime.component`
builds the user-facing `Component.options(...).as_actor()/as_service()` on top."""
from __future__ import annotations

import asyncio
import itertools
import os
import sys
from dataclasses import dataclass, field
from typing import Any


from forgelab.runtime import supervision

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
    job: Any = None
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


def _host_mesh(placement: Placement, first_host: int = 0):
    """The host mesh to spawn on: this host, or `placement.hosts` hosts of a job mesh.

    With a job, hosts `first_host .. first_host + hosts - 1` of the named mesh
    are used (wrapping to 0 when they run past its end), so a service can put
    its replicas on different hosts.
    """
    if placement.job is None:
        from monarch.actor import this_host

        return this_host()
    from forgelab.runtime.placement import job_mesh_names

    names = job_mesh_names(placement.job)
    name = placement.mesh or (names[0] if names else None)
    if name is None:
        raise ValueError(f"placement job {placement.job!r} declares no host mesh; pass mesh=...")
    state = placement.job.state(cached_path=None)
    try:
        host = getattr(state, name)
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


class ActorHandle:
    """A spawned component: its proc mesh and the actor mesh on it.

    Endpoints are reachable as attributes (`handle.generate.call_one(...)`),
    as on a Monarch actor mesh; `call`/`call_one` take the endpoint by name.
    """

    def __init__(self, cls: type, placement: Placement, name: str, procs: Any, actor: Any):
        self.cls = cls
        self.placement = placement
        self.name = name
        self.procs = procs
        self.actor = actor
        self.alive = True
        self.failed = False  # set when one of its processes died

    def __getattr__(self, item: str) -> Any:
        if item.startswith("_"):
            raise AttributeError(item)
        return getattr(self.actor, item)

    async def call(self, endpoint_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call an endpoint on every rank; returns the values in rank order."""
        mesh = await getattr(self.actor, endpoint_name).call(*args, **kwargs)
        return [value for _, value in mesh.items()]

    async def call_one(self, endpoint_name: str, *args: Any, **kwargs: Any) -> Any:
        """Call an endpoint of a single-process component."""
        if self.placement.procs * self.placement.hosts == 1:
            return await getattr(self.actor, endpoint_name).call_one(*args, **kwargs)
        return (await self.call(endpoint_name, *args, **kwargs))[0]

    async def pids(self) -> list[int]:
        return await self.call("_forgelab_pid")

    async def shutdown(self) -> None:
        """Stop the processes. Safe to call twice and on a dead mesh."""
        if not self.alive:
            return
        self.alive = False
        if not self.failed:  # release and flush, then exit without finalising the interpreter (Component.prepare_exit)
            try:
                await asyncio.wait_for(self.actor.prepare_exit.call(), timeout=10)
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
    cls: type,
    placement: Placement,
    args: tuple,
    kwargs: dict,
    name: str | None = None,
    first_host: int = 0,
) -> ActorHandle:
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
    if placement.with_gpus:
        per_host = {"gpus": placement.procs}
        # Meshes on this host must not share GPUs: the generator, the reference and each trainer rank
        # get distinct devices (on a job's remote hosts each host's workers count from 0 themselves).
        gpus = list(placement.gpus) if placement.gpus else (
            list(range(placement.procs)) if placement.job is not None else _take_gpus(placement.procs)
        )
        cmd = lambda point: default_bootstrap_cmd().with_env(  # noqa: E731
            {**env, "CUDA_VISIBLE_DEVICES": str(gpus[point.rank % placement.procs])}
        )
    else:
        cmd = default_bootstrap_cmd().with_env(env)
    actor_name = name or f"{cls.__name__.lower()}{next(_counter)}"
    procs = host.spawn_procs(per_host=per_host, bootstrap_command=cmd)
    try:
        actor = procs.spawn(actor_name, cls, *args, **kwargs)
        await actor.setup.call()
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
    return ActorHandle(cls, placement, actor_name, procs, actor)


