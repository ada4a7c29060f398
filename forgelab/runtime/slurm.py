"""forgelab's Slurm job: Monarch's `SlurmJob` with its own reading of Slurm's answers, and clean exits.

    job = slurm_job_from_config({"kind": "slurm", "meshes": {"gen": 1, "train": 1}, "nodes": 1,
                                 "partition": "gpu", "cpus_per_task": 8, "time_limit": "04:00:00",
                                 "account": "rl", "sbatch_args": ["--qos=high"]})

`meshes` maps a host mesh name to its number of *workers* (Monarch hosts). One `sbatch` job starts them all:
`nodes` nodes (default: one per worker), the same number of workers on each (`--ntasks-per-node`), worker `i`
of a node listening on `monarch_port + i` at the node's Slurm name (`$SLURMD_NODENAME`). Meshes take the
workers in order, node by node (`meshes: {gen: 1, train: 1}, nodes: 1` puts both on one node).

What differs from Monarch 0.6.0's `SlurmJob` (its issue #2330: it fails on Slurm < 24.11):
- The job's state and hosts come from `parse_squeue`, which reads both layouts of `squeue --json`: Slurm 22.05's
  (`job_state` a string, `nodes` a hostlist string, hosts under `allocated_nodes[*].nodename`) and 24.11+'s
  (`job_state` a list, hosts under `job_resources.nodes.allocation[*].name`), and keeps only the job this
  object submitted (22.05 ignores `--job` with `--json` and lists every job). A hostlist string with no list
  beside it is expanded by `scontrol show hostnames`.
- The controller's death cancels the job: `apply()` starts a watcher process in its own session
  (`python -m forgelab.runtime.slurm`) that runs `scancel` when the controller process is gone (a killed
  notebook kernel included), and exits when the job ends. `kill()` (a run's shutdown) cancels it at once.
- Config is validated up front (`SlurmConfig`), with errors that name the key.

Constructing the job switches this process's Monarch transport to TCP, as Monarch's own does.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from monarch.job import JobState, SlurmJob

log = logging.getLogger(__name__)

TERMINAL_STATES = frozenset({"FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "COMPLETED", "NODE_FAIL",
                             "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})
_TIME = re.compile(r"^(\d+-\d+(:\d+(:\d+)?)?|\d+(:\d+(:\d+)?)?|UNLIMITED|INFINITE)$")
_OWN_FLAGS = ("--nodes", "-N", "--ntasks", "-n", "--ntasks-per-node", "--job-name", "-J", "--output", "-o",
              "--error", "-e", "--cpus-per-task", "-c", "--partition", "-p", "--time", "-t", "--account", "-A")


class SlurmConfigError(ValueError):
    """A `hosts.job` Slurm config that cannot work; the message names the key and what to do."""


@dataclass(frozen=True)
class SlurmConfig:
    """The Slurm job's settings (`hosts.job` with `kind: slurm`)."""

    meshes: dict[str, int]
    """Host mesh name -> number of workers (Monarch hosts)."""
    nodes: int | None = None
    """Nodes to allocate; the workers spread evenly over them. None: one node per worker."""
    partition: str | None = None
    cpus_per_task: int | None = None
    """CPUs for each worker (`--cpus-per-task`)."""
    time_limit: str | None = None
    """`--time` in a Slurm format: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    account: str | None = None
    sbatch_args: tuple[str, ...] = ()
    """Extra `sbatch` flags, each one `--flag=value` (e.g. `--qos=high`, `--constraint=a100`)."""
    gpus_per_node: int | None = None
    mem: str | None = None
    exclusive: bool = False
    """`--exclusive`: the nodes to this job alone."""
    python_exe: str = field(default_factory=lambda: sys.executable)
    """The Python on the nodes that runs a worker (a shared filesystem's venv on a cluster)."""
    monarch_port: int = 22222
    """Worker `i` on a node listens on monarch_port + i."""
    job_name: str = "forgelab"
    log_dir: str | None = None
    """Where the job's stdout/stderr files go (default: the current directory, as Monarch's)."""
    job_start_timeout: int | None = None
    """Seconds to wait for the allocation (queueing included); None: wait as long as it takes."""
    watch_controller: bool = True
    """Cancel the job when the controller process dies (a watcher process on the controller's host)."""

    @property
    def workers(self) -> int:
        return sum(self.meshes.values())

    @property
    def workers_per_node(self) -> int:
        return self.workers // (self.nodes or self.workers)

    @classmethod
    def from_dict(cls, config: Mapping[str, object]) -> "SlurmConfig":
        cfg = {k: v for k, v in config.items() if k != "kind"}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(cfg) - names)
        if unknown:
            raise SlurmConfigError(f"hosts.job (kind slurm): unknown key(s) {unknown}; accepted: {sorted(names)}")
        meshes = cfg.get("meshes")
        if not isinstance(meshes, Mapping) or not meshes:
            raise SlurmConfigError(f"hosts.job.meshes must map mesh names to worker counts, e.g. {{gen: 1, train: 1}}; "
                                   f"got {meshes!r}")
        for name, n in meshes.items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise SlurmConfigError(f"hosts.job.meshes.{name} must be a positive number of workers, got {n!r}")
        cfg["meshes"] = {str(k): int(v) for k, v in meshes.items()}
        for key in ("nodes", "cpus_per_task", "gpus_per_node", "job_start_timeout", "monarch_port"):
            v = cfg.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise SlurmConfigError(f"hosts.job.{key} must be a positive integer, got {v!r}")
        for key in ("partition", "account", "mem", "python_exe", "job_name", "log_dir"):
            v = cfg.get(key)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise SlurmConfigError(f"hosts.job.{key} must be a non-empty string, got {v!r}")
        for key in ("exclusive", "watch_controller"):
            if key in cfg and not isinstance(cfg[key], bool):
                raise SlurmConfigError(f"hosts.job.{key} must be true or false, got {cfg[key]!r}")
        t = cfg.get("time_limit")
        if t is not None:
            if isinstance(t, int) and not isinstance(t, bool):
                t = cfg["time_limit"] = str(t)  # minutes, as Slurm reads a bare number
            if not isinstance(t, str) or not _TIME.match(t):
                raise SlurmConfigError(f"hosts.job.time_limit {t!r} is not a Slurm time (MM, MM:SS, HH:MM:SS, D-HH, "
                                       "D-HH:MM or D-HH:MM:SS; e.g. '04:00:00')")
        extra = cfg.get("sbatch_args", ())
        if isinstance(extra, str) or not isinstance(extra, Sequence) or not all(isinstance(a, str) for a in extra):
            raise SlurmConfigError(f"hosts.job.sbatch_args must be a list of flags like ['--qos=high'], got {extra!r}")
        for a in extra:
            if not a.startswith("-"):
                raise SlurmConfigError(f"hosts.job.sbatch_args: {a!r} is not a flag; write each as '--flag=value'")
            flag = a.split("=", 1)[0]
            if flag in _OWN_FLAGS:
                raise SlurmConfigError(f"hosts.job.sbatch_args: {flag} is set by forgelab; use the hosts.job key for it "
                                       "(nodes, partition, cpus_per_task, time_limit, account; meshes for the workers)")
        cfg["sbatch_args"] = tuple(extra)
        out = cls(**cfg)  # type: ignore[arg-type]  # every key checked above
        nodes = out.nodes or out.workers
        if out.workers % nodes:
            raise SlurmConfigError(f"hosts.job: {out.workers} workers (meshes {out.meshes}) do not spread evenly over "
                                   f"{nodes} nodes; set nodes to a divisor of {out.workers}")
        return out


@dataclass(frozen=True)
class SqueueJob:
    """One job of `squeue --json`, whichever Slurm wrote it."""

    job_id: str
    states: tuple[str, ...]
    hosts: tuple[str, ...] | None
    """Allocated node names in allocation order; None: not listed (the hostlist string needs expanding)."""
    nodelist: str
    """The `nodes` hostlist string ("" when absent)."""

    @property
    def running(self) -> bool:
        return "RUNNING" in self.states

    @property
    def ended(self) -> bool:
        return any(s in TERMINAL_STATES for s in self.states)


def _number(v: object) -> object:
    """Slurm 23.02+ wraps numbers as {"set": bool, "infinite": bool, "number": n}; 22.05 gives them bare."""
    if isinstance(v, Mapping) and "number" in v:
        return v["number"]
    return v


def parse_squeue(data: Mapping[str, object], job_id: str) -> SqueueJob | None:
    """Job `job_id` in `squeue --json`'s output (None: not listed), from Slurm 22.05's layout or 24.11+'s.

    22.05 (`openapi/v0.0.38`): `job_id` int, `job_state` "RUNNING", `nodes` "n[1-2]", `allocated_nodes`
    [{"nodename": ...}]. 24.11 (`v0.0.42`): `job_state` ["RUNNING"], `nodes` "n[1-2]",
    `job_resources.nodes.allocation` [{"name": ...}]. Every other job in the answer is ignored."""
    jobs = data.get("jobs")
    if not isinstance(jobs, list):
        raise ValueError(f"squeue --json gave no 'jobs' list (keys: {sorted(data)})")
    for job in jobs:
        if not isinstance(job, Mapping) or str(_number(job.get("job_id"))) != str(job_id):
            continue
        raw_state = job.get("job_state")
        states = (raw_state,) if isinstance(raw_state, str) else tuple(str(s) for s in raw_state or ())
        hosts: tuple[str, ...] | None = None
        resources = job.get("job_resources")
        res_nodes = resources.get("nodes") if isinstance(resources, Mapping) else None
        if isinstance(res_nodes, Mapping) and isinstance(res_nodes.get("allocation"), list):  # 24.11+
            hosts = tuple(str(n["name"]) for n in res_nodes["allocation"])
        elif isinstance(resources, Mapping) and isinstance(resources.get("allocated_nodes"), list):  # 22.05
            hosts = tuple(str(n["nodename"]) for n in resources["allocated_nodes"])
        nodes = job.get("nodes")
        nodelist = nodes if isinstance(nodes, str) else str(res_nodes.get("list", "")) if isinstance(
            res_nodes, Mapping) else ""
        return SqueueJob(job_id=str(job_id), states=states, hosts=hosts or None, nodelist=nodelist)
    return None


def worker_addresses(cfg: SlurmConfig, hosts: Sequence[str]) -> dict[str, list[str]]:
    """Mesh name -> the `tcp://host:port` of each of its workers, given the allocated hosts in order."""
    per_node = cfg.workers_per_node
    if len(hosts) * per_node != cfg.workers:
        raise RuntimeError(f"Slurm allocated {len(hosts)} node(s) {list(hosts)} but the job needs "
                           f"{cfg.workers // per_node} for {cfg.workers} workers; partial allocations are not used")
    slots = [f"tcp://{h}:{cfg.monarch_port + i}" for h in hosts for i in range(per_node)]
    out: dict[str, list[str]] = {}
    for name, n in cfg.meshes.items():
        out[name], slots = slots[:n], slots[n:]
    return out


@dataclass(frozen=True)
class LostWorker:
    """A worker (Slurm task) that ended while its job ran, as srun reported it."""

    mesh: str
    index: int
    """The worker's index within its mesh."""
    host: str
    task: int
    """Its Slurm task id (`SLURM_PROCID`) in the job's step."""
    reason: str
    """srun's words: "Killed", "Exited with exit code 1", ..."""
    job_id: str

    def __str__(self) -> str:
        return (f"Slurm worker {self.index} of mesh {self.mesh!r} on host {self.host} (job {self.job_id}, task "
                f"{self.task}) ended: {self.reason}")


_SRUN_ERROR = re.compile(r"^srun: error: (\S+): tasks? ([0-9,\-]+): (.+)$", re.M)


def parse_srun_errors(text: str) -> list[tuple[str, int, str]]:
    """(host, task, reason) of each task srun reported ended, from a step's stderr.

    >>> parse_srun_errors("srun: error: vm: task 0: Killed\\nsrun: error: n2: tasks 2-3,5: Exited with exit code 1")
    [('vm', 0, 'Killed'), ('n2', 2, 'Exited with exit code 1'), ('n2', 3, 'Exited with exit code 1'), ('n2', 5, 'Exited with exit code 1')]
    """
    out: list[tuple[str, int, str]] = []
    for host, tasks, reason in _SRUN_ERROR.findall(text):
        for part in tasks.split(","):
            lo, _, hi = part.partition("-")
            out += [(host, t, reason.strip()) for t in range(int(lo), int(hi or lo) + 1)]
    return out


def worker_of_task(cfg: SlurmConfig, task: int) -> tuple[str, int]:
    """(mesh, index in it) of Slurm task `task`: tasks fill nodes in order (block distribution), as the meshes."""
    for name, n in cfg.meshes.items():
        if task < n:
            return name, task
        task -= n
    raise ValueError(f"task {task} is beyond the job's {cfg.workers} workers")


def _worker_command(cfg: SlurmConfig) -> str:
    code = ("import os; from monarch.actor import run_worker_loop_forever; "
            "run_worker_loop_forever(address='tcp://%s:%d' % (os.environ['SLURMD_NODENAME'], "
            f"{cfg.monarch_port} + int(os.environ['SLURM_LOCALID'])), ca='trust_all_connections')")
    return f"srun --kill-on-bad-exit=0 {shlex.quote(cfg.python_exe)} -c {shlex.quote(code)}"


def _directives(cfg: SlurmConfig, log_dir: str, job_name: str) -> list[str]:
    nodes = cfg.nodes or cfg.workers
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={nodes}",
             f"#SBATCH --ntasks-per-node={cfg.workers_per_node}",
             f"#SBATCH --output={os.path.join(log_dir, f'slurm_%j_{job_name}.out')}",
             f"#SBATCH --error={os.path.join(log_dir, f'slurm_%j_{job_name}.err')}"]
    for flag, value in (("--time", cfg.time_limit), ("--partition", cfg.partition), ("--account", cfg.account),
                        ("--cpus-per-task", cfg.cpus_per_task), ("--gpus-per-node", cfg.gpus_per_node),
                        ("--mem", cfg.mem)):
        if value is not None:
            lines.append(f"#SBATCH {flag}={value}")
    if cfg.exclusive:
        lines.append("#SBATCH --exclusive")
    return lines + [f"#SBATCH {a}" for a in cfg.sbatch_args]


def batch_script(cfg: SlurmConfig, log_dir: str, job_name: str) -> str:
    """The `sbatch` script that starts every worker of `cfg` (one `srun` step, one task per worker)."""
    return "\n".join([*_directives(cfg, log_dir, job_name), _worker_command(cfg), ""])


BATCH_ENV = "FORGELAB_SLURM_BATCH"
"""Set (to the job's stderr path) in a batch job's controller: its Slurm job adopts $SLURM_JOB_ID, submits nothing."""


def batch_run_script(cfg: SlurmConfig, log_dir: str, job_name: str, config_path: str,
                     overrides: Sequence[str] = ()) -> str:
    """The `sbatch` script of batch mode: the workers (one `srun` step, in the background) and the controller
    (`forgelab run CONFIG` in the batch step, on the first node) in one allocation; the workers stop when the
    controller exits, and the job's exit status is the controller's."""
    err = os.path.join(log_dir, f"slurm_${{SLURM_JOB_ID}}_{job_name}.err")
    run = [cfg.python_exe, "-m", "forgelab.cli", "run", os.path.abspath(config_path)]
    for o in overrides:
        run += ["--set", o]
    return "\n".join([
        *_directives(cfg, log_dir, job_name),
        f'export {BATCH_ENV}="{err}"',
        _worker_command(cfg) + " &",
        "workers=$!",
        " ".join(shlex.quote(a) for a in run),
        "rc=$?",
        "kill $workers 2>/dev/null; wait $workers 2>/dev/null",
        "exit $rc",
        "",
    ])


def submit_batch(config_path: str, overrides: Sequence[str] = ()) -> str:
    """Submit a whole run (`forgelab run CONFIG`) as one Slurm batch job; its `hosts.job` (kind slurm) sizes the
    allocation and places the parts. Returns the job id; the run's summary line ends the job's stdout file."""
    import yaml

    try:
        with open(config_path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as err:
        raise SlurmConfigError(f"config file {config_path!r} cannot be read: {err}") from err
    job = (data.get("hosts") or {}).get("job") if isinstance(data, dict) else None
    if not isinstance(job, dict) or job.get("kind") != "slurm":
        raise SlurmConfigError(f"{config_path}: batch mode needs hosts.job with kind: slurm, got {job!r}")
    if any(o.startswith("hosts.job") for o in overrides):
        raise SlurmConfigError("batch mode sizes the allocation from the file's hosts.job: edit it there, not with "
                               "--set hosts.job...")
    cfg = SlurmConfig.from_dict(job)
    log_dir = os.path.abspath(cfg.log_dir or os.getcwd())
    os.makedirs(log_dir, exist_ok=True)
    script = batch_run_script(cfg, log_dir, f"{cfg.job_name}_batch", config_path, overrides)
    return _sbatch(script)


def _sbatch(script: str) -> str:
    try:
        out = subprocess.run(["sbatch", "--parsable"], input=script, capture_output=True, text=True, check=True,
                             timeout=120)
    except FileNotFoundError as err:
        raise RuntimeError("sbatch not found: run on a Slurm login node (or install slurm-client)") from err
    except subprocess.CalledProcessError as err:
        raise RuntimeError(f"sbatch refused the forgelab job: {err.stderr.strip()}") from err
    job_id = out.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise RuntimeError(f"sbatch --parsable gave {out.stdout!r}, not a job id")
    return job_id


def squeue_json() -> Mapping[str, object]:
    """`squeue --json` (every job: 22.05 ignores `--job` there, so callers filter with `parse_squeue`)."""
    out = subprocess.run(["squeue", "--json"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"squeue --json failed ({out.returncode}): {out.stderr.strip()}")
    data = json.loads(out.stdout)
    if not isinstance(data, Mapping):
        raise RuntimeError(f"squeue --json gave {type(data).__name__}, not an object")
    return data


def expand_hostlist(nodelist: str) -> list[str]:
    """`scontrol show hostnames` of a Slurm hostlist ("n[1-3],m1" -> n1 n2 n3 m1)."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60,
                         check=True)
    return out.stdout.split()


class ForgelabSlurmJob(SlurmJob):
    """Monarch's `SlurmJob` reading job state and hosts with `parse_squeue` (Slurm 22.05 and 24.11+), one worker
    per Slurm task, and a controller watcher (see the module docstring)."""

    def __init__(self, config: SlurmConfig) -> None:
        super().__init__(dict(config.meshes), python_exe=config.python_exe, monarch_port=config.monarch_port,
                         job_name=config.job_name, time_limit=config.time_limit, partition=config.partition,
                         log_dir=config.log_dir, exclusive=config.exclusive, gpus_per_node=config.gpus_per_node,
                         cpus_per_task=config.cpus_per_task, mem=config.mem,
                         job_start_timeout=config.job_start_timeout)
        self.config = config
        self.watcher_pid: int | None = None
        self.err_path: str | None = None
        """The job's stderr file (srun reports lost tasks there)."""
        self.lost: list[LostWorker] = []
        """Workers srun reported ended so far (a thread reads its reports every 2 s while the job runs)."""

    @property
    def job_id(self) -> str | None:
        """The Slurm job id once `apply()` submitted it."""
        return self._slurm_job_id

    @property
    def in_batch(self) -> bool:
        """Whether this controller runs inside its own batch job (`submit_batch`)."""
        return bool(os.environ.get(BATCH_ENV)) and "SLURM_JOB_ID" in os.environ

    def _submit_slurm_job(self, num_nodes: int, client_script: str | None = None) -> str:
        if client_script is not None:
            raise NotImplementedError("forgelab's batch mode is forgelab.runtime.slurm.submit_batch(CONFIG) "
                                      "(python -m forgelab.runtime.slurm submit CONFIG), not apply(client_script=)")
        if self.in_batch:  # the allocation exists: its batch script started the workers
            self.err_path = os.environ[BATCH_ENV]
            return os.environ["SLURM_JOB_ID"]
        log_dir = self.config.log_dir or os.getcwd()
        os.makedirs(log_dir, exist_ok=True)
        name = f"{self.config.job_name}_{os.getpid()}"
        job_id = _sbatch(batch_script(self.config, log_dir, name))
        self.err_path = os.path.join(log_dir, f"slurm_{job_id}_{name}.err")
        log.info("forgelab: Slurm job %s submitted (%d workers); logs in %s", job_id, self.config.workers, log_dir)
        if self.config.watch_controller:
            self.watcher_pid = start_watcher(job_id)
        return job_id

    def lost_workers(self) -> list[LostWorker]:
        """Workers srun reported ended so far (host, mesh, reason), read from the job's stderr file."""
        job_id = self._slurm_job_id
        if job_id is None or self.err_path is None:
            return list(self.lost)
        try:
            with open(self.err_path, errors="replace") as f:
                text = f.read()
        except OSError:
            return list(self.lost)
        for host, task, reason in parse_srun_errors(text):
            mesh, index = worker_of_task(self.config, task)
            worker = LostWorker(mesh, index, host, task, reason, job_id)
            if worker not in self.lost:
                self.lost.append(worker)
                log.warning("forgelab: %s", worker)
        return list(self.lost)

    def _watch_lost(self, job_id: str, every: float = 2.0) -> None:
        """While job `job_id` is this object's, read srun's reports every `every` s (a daemon thread's loop).

        Slurm's report, not Monarch's: a host worker that dies while no call is in flight raises no fault on the
        controller, and srun names the host and task either way."""
        while self._slurm_job_id == job_id:
            try:
                self.lost_workers()
            except Exception as err:  # noqa: BLE001 -- a bad line must not end the watch
                log.warning("forgelab: reading Slurm job %s's lost workers failed: %s", job_id, err)
            time.sleep(every)  # srun appends to a file; polling it is the portable way

    def _get_job_info_json(self, job_id: str) -> dict[str, object] | None:
        info = self.query(job_id)
        return None if info is None else {"job_state": list(info.states)}

    def query(self, job_id: str) -> SqueueJob | None:
        """This job's entry in `squeue` (None: no longer listed)."""
        return parse_squeue(squeue_json(), job_id)

    def _jobs_active(self) -> bool:
        job_id = self._slurm_job_id
        if not self.active or job_id is None:
            return False
        info = self.query(job_id)
        return info is not None and not info.ended

    def _wait_for_job_start(self, job_id: str, expected_nodes: int, timeout: int | None = None) -> list[str]:
        start = time.monotonic()
        try:
            while True:
                info = self.query(job_id)
                if info is None:
                    raise RuntimeError(f"Slurm job {job_id} is no longer listed by squeue (it ended before it ran)")
                if info.ended:
                    raise RuntimeError(f"Slurm job {job_id} ended before it ran: {list(info.states)}")
                if info.running:
                    hosts = list(info.hosts) if info.hosts is not None else expand_hostlist(info.nodelist)
                    log.info("forgelab: Slurm job %s runs on %s", job_id, hosts)
                    return hosts
                if timeout is not None and time.monotonic() - start > timeout:
                    raise RuntimeError(f"Slurm job {job_id} did not start within {timeout} s (state "
                                       f"{list(info.states)}); raise hosts.job.job_start_timeout or check the queue")
                time.sleep(0.5)  # the scheduler's answer, polled; bounded by the timeout above
        except BaseException:
            self._kill()
            raise

    def _state(self) -> JobState:
        from monarch.actor import attach_to_workers

        job_id = self._slurm_job_id
        if job_id is None or not self._jobs_active():
            raise RuntimeError(f"Slurm job {job_id} is not active")
        if not self._all_hostnames:
            self._all_hostnames = self._wait_for_job_start(job_id, self.config.nodes or self.config.workers,
                                                           timeout=self.config.job_start_timeout)
        key = (id(self), job_id)
        if key not in _LOST_WATCHED:  # state() runs more than once: one watch per job
            import threading

            _LOST_WATCHED.add(key)
            threading.Thread(target=self._watch_lost, args=(job_id,), name=f"forgelab-slurm-{job_id}",
                             daemon=True).start()
        addresses = worker_addresses(self.config, self._all_hostnames)
        return JobState({name: attach_to_workers(name=name, ca="trust_all_connections", workers=list(workers))
                         for name, workers in addresses.items()})

    def _kill(self) -> None:
        job_id = self._slurm_job_id
        if job_id is not None and not self.in_batch:  # in batch mode the allocation ends with the controller
            out = subprocess.run(["scancel", job_id], capture_output=True, text=True, timeout=60)
            if out.returncode != 0:
                log.warning("forgelab: scancel %s failed: %s", job_id, out.stderr.strip())
        if self.watcher_pid is not None:  # its job is cancelled: nothing left to watch
            _stop(self.watcher_pid)
            self.watcher_pid = None
        self._slurm_job_id = None
        self._all_hostnames = []


def slurm_job_from_config(config: Mapping[str, object]) -> ForgelabSlurmJob:
    """A `ForgelabSlurmJob` from `hosts.job` (validated: `SlurmConfigError` names a bad key)."""
    return ForgelabSlurmJob(SlurmConfig.from_dict(config))


# -- the controller watcher ---------------------------------------------------


_LOST_WATCHED: set[tuple[int, str]] = set()  # (job object, job id) whose srun reports a thread reads
_WATCHERS: dict[int, subprocess.Popen[bytes]] = {}  # pid -> the watcher this process started (reaped on stop)


def start_watcher(job_id: str, pid: int | None = None) -> int:
    """Start `python -m forgelab.runtime.slurm watch --job JOB --pid PID` in a session of its own (a signal to the
    controller's process group does not reach it); returns its pid."""
    pid = os.getpid() if pid is None else pid
    proc = subprocess.Popen([sys.executable, "-m", "forgelab.runtime.slurm", "watch", "--job", job_id, "--pid", str(pid)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    _WATCHERS[proc.pid] = proc
    return proc.pid


def _stop(pid: int) -> None:
    proc = _WATCHERS.pop(pid, None)
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _start_time(pid: int) -> str | None:
    """Process `pid`'s start time in clock ticks (/proc/PID/stat field 22): tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def watch(job_id: str, pid: int, poll: float = 0.5, check_job_every: float = 10.0) -> str:
    """Wait until process `pid` ends (then `scancel job_id`: "cancelled") or the job leaves the queue ("ended")."""
    from forgelab.runtime.supervision import pid_alive

    born = _start_time(pid)
    last_check = time.monotonic()
    while born is not None and pid_alive(pid) and _start_time(pid) == born:
        if time.monotonic() - last_check > check_job_every:
            last_check = time.monotonic()
            try:
                info = parse_squeue(squeue_json(), job_id)
            except Exception:  # noqa: BLE001 -- a slurmctld hiccup: ask again later
                info = SqueueJob(job_id, ("UNKNOWN",), None, "")
            if info is None or info.ended:
                return "ended"
        time.sleep(poll)  # waiting on another process's death: Linux gives no wait on a non-child but pidfd
    subprocess.run(["scancel", job_id], capture_output=True, timeout=60)
    return "cancelled"


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m forgelab.runtime.slurm", description="forgelab on Slurm.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_watch = sub.add_parser("watch", help="cancel a Slurm job when the controller process dies")
    p_watch.add_argument("--job", required=True)
    p_watch.add_argument("--pid", type=int, required=True)
    p_sub = sub.add_parser("submit", help="batch mode: submit a whole run (hosts.job kind slurm) as one sbatch job")
    p_sub.add_argument("config")
    p_sub.add_argument("--set", action="append", default=[], help="override a field: train.steps=20")
    args = parser.parse_args(argv)
    if args.cmd == "watch":
        print(watch(args.job, args.pid), flush=True)
    else:
        print(submit_batch(args.config, args.set), flush=True)


if __name__ == "__main__":
    main()
