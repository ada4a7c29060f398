"""Placement on many hosts: `monarch.job` jobs built from a plain config dict.

A component runs on this host unless its placement names a job. A job
(`monarch.job`) provides *host meshes*; `Component.options(hosts=, job=,
mesh=)` spawns on `hosts` hosts of the job mesh called `mesh`, `procs`
processes on each. A service puts replica `i` on hosts `i*hosts ...` of the
mesh (wrapping around), so two single-host replicas on a two-host mesh land
on different hosts.

    from monarch.job import ProcessJob
    job = ProcessJob({"gen": 2})          # two local "hosts" (subprocesses)
    svc = await Generator.options(hosts=1, num_replicas=2, job=job, mesh="gen").as_service(cfg)
    ...
    await svc.shutdown(); job.kill()      # the job's owner kills its hosts

`job_from_config` builds the job from a dict (a YAML file's `job:` section).
The constructor arguments are monarch 0.6's; anything not listed below is
passed through unchanged to the constructor:

    # local stand-in for N hosts: one subprocess per host, unix sockets only
    {"kind": "process", "meshes": {"gen": 2, "trainer": 1}}

    # this host under a name (lets a config switch between local and remote)
    {"kind": "local", "meshes": ["gen", "trainer"]}

    # SLURM (forgelab.runtime.slurm): one sbatch job; meshes map name -> worker count, spread over `nodes`
    {"kind": "slurm", "meshes": {"gen": 2, "trainer": 4}, "nodes": 6,
     "partition": "gpu", "gpus_per_node": 8, "cpus_per_task": 32, "time_limit": "04:00:00", "account": "rl",
     "python_exe": "/shared/forgelab/.venv/bin/python", "monarch_port": 22222,
     "sbatch_args": ["--qos=high"], "exclusive": True, "job_start_timeout": 900}

    # SSH: start a worker on each named host (meshes map name -> host list)
    {"kind": "ssh", "meshes": {"gen": ["node1", "node2"], "trainer": ["node3"]},
     "python_exe": "/opt/forgelab/.venv/bin/python", "ssh_args": ["-i", "~/.ssh/rl"],
     "monarch_port": 22222, "transport": "tcp"}

    # Kubernetes (needs the `kubernetes` package): meshes map name -> add_mesh
    # arguments; "image" (+ "resources") provisions pods through the
    # MonarchMesh operator, otherwise pods are found by label selector.
    {"kind": "kubernetes", "namespace": "rl", "timeout": 900,
     "kubeconfig": "~/.kube/config",
     "meshes": {"gen": {"num_replicas": 2, "image": "ghcr.io/meta-pytorch/monarch:latest",
                        "resources": {"nvidia.com/gpu": 8}}}}

Side effect to know: constructing a SlurmJob, SSHJob or KubernetesJob
switches this process's Monarch transport to TCP (`configure(default_transport=
TcpWithHostname)` / `enable_transport("tcp")`): channels then listen on the
host's address, reachable from the network, as multi-host needs. Local runs
(no job, LocalJob, ProcessJob) keep the default unix-socket transport and
listen on no TCP port.
"""
from __future__ import annotations

import asyncio
import inspect
import os
import stat
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeVar

from forgelab.runtime.supervision import pid_alive

if TYPE_CHECKING:
    from monarch.job import JobTrait

J = TypeVar("J", bound="JobTrait")

JOB_KINDS = ("process", "local", "slurm", "ssh", "kubernetes")
WORKER_LISTEN_TIMEOUT = 300.0  # seconds a ProcessJob's worker may take to start listening


class JobWorkerError(RuntimeError):
    """A local job's host worker died, or never listened, before the controller attached to it."""


def _listening(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


async def workers_listening(job: JobTrait, timeout: float | None = None, poll: float = 0.05) -> None:
    """Start a local `ProcessJob`'s host workers (once) and wait until each listens on its socket.

    Monarch's attach pushes its configuration to each worker once: a message to a unix socket
    nobody listens on yet is dropped after `message_delivery_timeout` (30 s), and the attach then
    fails after `mesh_attach_config_timeout` (1 min) with "config push failed during attach". A
    worker is a fresh Python importing Monarch: on a loaded machine that can take longer than
    30 s, so the controller attaches only once every worker's socket exists. Other job kinds are
    left to their schedulers; this returns at once for them. `timeout` defaults to
    `WORKER_LISTEN_TIMEOUT` (read at each call, so setting the module attribute takes effect).
    """
    from monarch.job import ProcessJob

    if not isinstance(job, ProcessJob):
        return
    timeout = WORKER_LISTEN_TIMEOUT if timeout is None else timeout
    job.apply()  # a no-op once the job runs; state() would do it next anyway
    pending = {key: w for key, w in getattr(job, "_host_to_pid", {}).items() if str(w.channel).startswith("ipc://")}
    deadline = time.monotonic() + timeout
    while True:
        for key, worker in list(pending.items()):
            path = str(worker.channel)[len("ipc://"):]
            if _listening(path):
                del pending[key]
            elif not pid_alive(worker.pid):
                raise JobWorkerError(
                    f"ProcessJob worker {key!r} (pid {worker.pid}) exited before it listened on {path}; "
                    "its output goes nowhere, so run its command to see why: python -c "
                    "'from monarch.actor import run_worker_loop_forever' (with the job's env), then "
                    "job.kill() and build a new job"
                )
        if not pending:
            return
        if time.monotonic() > deadline:
            raise JobWorkerError(
                f"ProcessJob workers {sorted(pending)} did not listen on their sockets within {timeout:.0f} s "
                "(each is a new Python importing Monarch); the machine may be overloaded: "
                "job.kill() and try again, or raise forgelab.runtime.placement.WORKER_LISTEN_TIMEOUT"
            )
        await asyncio.sleep(poll)


def job_mesh_names(job: JobTrait) -> list[str]:
    """Names of the host meshes a `monarch.job` job declares, in order."""
    meshes = getattr(job, "_meshes", None)
    if meshes is not None:
        return list(meshes)
    hosts = getattr(job, "_host_names", None)  # LocalJob
    return list(hosts) if hosts is not None else []


def _construct(kind: str, factory: type[J], kwargs: Mapping[str, object]) -> J:
    try:
        return factory(**kwargs)
    except TypeError as err:
        accepted = ", ".join(inspect.signature(factory).parameters)
        raise ValueError(
            f"job config kind={kind!r}: {err}; {factory.__name__} accepts: {accepted}"
        ) from err


def _mapping(kind: str, meshes: object) -> Mapping[str, object]:
    if not isinstance(meshes, Mapping):
        raise ValueError(f"job config kind={kind!r}: 'meshes' must map mesh names to hosts, got {meshes!r}")
    return meshes


def _names(kind: str, name: str, hosts: object) -> list[str]:
    if isinstance(hosts, str) or not isinstance(hosts, (list, tuple)):
        raise ValueError(f"job config kind={kind!r}: mesh {name!r} needs a list of host names, got {hosts!r}")
    return [str(h) for h in hosts]


def job_from_config(config: Mapping[str, object]) -> JobTrait:
    """Build a `monarch.job` job from a dict (see the module docstring for examples).

    `kind` is one of "process", "local", "slurm", "ssh", "kubernetes"; `meshes`
    describes the host meshes; the other keys are the job constructor's
    keyword arguments.
    """
    cfg = dict(config)
    kind = cfg.pop("kind", None)
    if not isinstance(kind, str) or kind not in JOB_KINDS:
        raise ValueError(f"job config: kind must be one of {list(JOB_KINDS)}, got {kind!r}")
    if kind == "slurm":  # forgelab's own (Slurm 22.05 and 24.11+, controller watcher): see forgelab.runtime.slurm
        from forgelab.runtime.slurm import slurm_job_from_config

        return slurm_job_from_config(config)
    meshes = cfg.pop("meshes", None)
    if not meshes:
        raise ValueError(f"job config kind={kind!r}: 'meshes' is required (e.g. {{'gen': 2}})")

    if kind == "process":
        from monarch.job import ProcessJob

        return _construct(kind, ProcessJob, {"meshes": dict(_mapping(kind, meshes)), **cfg})
    if kind == "local":
        from monarch.job import LocalJob

        host_names = [str(n) for n in meshes] if isinstance(meshes, Mapping) else _names(kind, "meshes", meshes)
        return _construct(kind, LocalJob, {"hosts": tuple(host_names), **cfg})
    if kind == "ssh":
        from monarch._src.job.job import SSHJob

        ssh = _construct(kind, SSHJob, cfg)
        for name, hosts in _mapping(kind, meshes).items():
            ssh.add_mesh(name, _names(kind, name, hosts))
        return ssh

    try:
        from monarch._src.job.kubernetes import ImageSpec, KubeConfig, KubernetesJob
    except ImportError as err:
        raise ValueError(
            "job config kind='kubernetes' needs the `kubernetes` package (pip install kubernetes)"
        ) from err
    kubeconfig = cfg.pop("kubeconfig", None)
    if isinstance(kubeconfig, str):
        cfg["kubeconfig"] = KubeConfig.from_path(os.path.expanduser(kubeconfig))
    kube = _construct(kind, KubernetesJob, cfg)
    for name, mesh_spec in _mapping(kind, meshes).items():
        spec = dict(_mapping(kind, mesh_spec))
        image = spec.pop("image", None)
        resources = spec.pop("resources", None)
        if image is not None:
            spec["image_spec"] = ImageSpec(str(image), resources=dict(_mapping(kind, resources or {})))
        kube.add_mesh(name, **spec)
    return kube
