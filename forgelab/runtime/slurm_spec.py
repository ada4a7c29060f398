"""The pure half of forgelab's Slurm job: its config, the scripts `sbatch` gets, and reading Slurm's answers.

Nothing here runs a command: `SlurmConfig.from_dict` validates `hosts.job` (kind slurm); `batch_script` and
`batch_run_script` write the interactive and the batch job's scripts; `parse_squeue` reads `squeue --json` of
Slurm 22.05 and 24.11+ for one job; `parse_srun_errors` reads srun's reports of ended tasks. The job that uses
them, and why, is forgelab/runtime/slurm.py.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

TERMINAL_STATES = frozenset({"FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "COMPLETED", "NODE_FAIL",
                             "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})
_TIME = re.compile(r"^(\d+-\d+(:\d+(:\d+)?)?|\d+(:\d+(:\d+)?)?|UNLIMITED|INFINITE)$")
_OWN_FLAGS = ("--nodes", "-N", "--ntasks", "-n", "--ntasks-per-node", "--job-name", "-J", "--output", "-o",
              "--error", "-e")
_KEY_FLAGS = {"--cpus-per-task": "cpus_per_task", "-c": "cpus_per_task", "--partition": "partition",
              "-p": "partition", "--time": "time_limit", "-t": "time_limit", "--account": "account", "-A": "account",
              "--gpus-per-node": "gpus_per_node", "--mem": "mem"}


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
    worker_start_timeout: int = 300
    """Seconds from the job running until every worker listens on its port (a worker's Python starts, imports
    torch and Monarch, then listens: on a loaded node that can take minutes). Monarch's attach is given one
    minute per worker after that, so it waits for listening workers first."""
    signal_before_limit: int = 300
    """Seconds before the time limit at which Slurm signals the job (`--signal=B:USR1@N`; Slurm may send it up to
    60 s earlier). The job's script writes `TIME_LIMIT_LINE` to the job's stderr file, the controller reads it
    there, checkpoints after the current step and stops (docs/clusters.md). Leave enough for a step, a
    checkpoint and the shutdown; 0 turns it off."""

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
        unknown = sorted(set(cfg) - names - {"slurm_args"})
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
        v = cfg.get("signal_before_limit")
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 65535):
            raise SlurmConfigError(f"hosts.job.signal_before_limit must be seconds from 0 (off) to 65535 (Slurm's "
                                   f"limit), got {v!r}")
        for key in ("nodes", "cpus_per_task", "gpus_per_node", "job_start_timeout", "monarch_port", "worker_start_timeout"):
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
        if "slurm_args" in cfg:  # Monarch's SlurmJob's name for them
            if "sbatch_args" in cfg:
                raise SlurmConfigError("hosts.job: give sbatch_args or slurm_args (Monarch's name), not both")
            cfg["sbatch_args"] = cfg.pop("slurm_args")
        extra = cfg.get("sbatch_args", ())
        if isinstance(extra, str) or not isinstance(extra, Sequence) or not all(isinstance(a, str) for a in extra):
            raise SlurmConfigError(f"hosts.job.sbatch_args must be a list of flags like ['--qos=high'], got {extra!r}")
        for a in extra:
            if not a.startswith("-"):
                raise SlurmConfigError(f"hosts.job.sbatch_args: {a!r} is not a flag; write each as '--flag=value'")
            flag = a.split("=", 1)[0]
            if flag == "--signal":
                raise SlurmConfigError("hosts.job.sbatch_args: --signal is set by forgelab (B:USR1 before the time "
                                       "limit, so the run checkpoints); set hosts.job.signal_before_limit instead")
            if flag in _OWN_FLAGS:
                raise SlurmConfigError(f"hosts.job.sbatch_args: {flag} is set by forgelab from meshes and nodes "
                                       "(workers per mesh, nodes to spread them over); set those instead")
            twin = _KEY_FLAGS.get(flag)
            if twin is not None and cfg.get(twin) is not None:
                raise SlurmConfigError(f"hosts.job.sbatch_args: {flag} repeats hosts.job.{twin}; keep one of them")
        cfg["sbatch_args"] = tuple(extra)
        out = cls(**cfg)  # type: ignore[arg-type]  # every key checked above
        limit_s = time_limit_seconds(out.time_limit) if out.time_limit is not None else None
        if limit_s is not None and out.signal_before_limit >= limit_s:
            raise SlurmConfigError(f"hosts.job.signal_before_limit {out.signal_before_limit} s is not less than "
                                   f"time_limit {out.time_limit!r} ({limit_s} s): the run would checkpoint and stop "
                                   "as soon as it starts; lower signal_before_limit (0: off) or raise time_limit")
        nodes = out.nodes or out.workers
        if out.workers % nodes:
            raise SlurmConfigError(f"hosts.job: {out.workers} workers (meshes {out.meshes}) do not spread evenly over "
                                   f"{nodes} nodes; set nodes to a divisor of {out.workers}")
        return out


def time_limit_seconds(limit: str) -> int | None:
    """A Slurm time (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) in seconds; None: UNLIMITED/INFINITE.

    >>> [time_limit_seconds(t) for t in ("30", "1:30", "04:00:00", "1-02", "1-02:30", "1-00:00:10", "UNLIMITED")]
    [1800, 90, 14400, 93600, 95400, 86410, None]
    """
    if limit in ("UNLIMITED", "INFINITE"):
        return None
    days, sep, rest = limit.partition("-")
    if not sep:
        rest, days = days, "0"
    parts = [int(p) for p in rest.split(":")]
    if sep:  # D-HH[:MM[:SS]]
        h, m, sec = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        h, m, sec = parts
    else:  # MM[:SS]
        h, m, sec = 0, parts[0], (parts + [0])[1]
    return ((int(days) * 24 + h) * 60 + m) * 60 + sec


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


@dataclass(frozen=True)
class TimeLimitNear:
    """Slurm signalled the job `signal_before_limit` seconds (or up to 60 s more) before its time limit."""

    job_id: str
    lead_s: int
    """The job's `signal_before_limit`."""

    def __str__(self) -> str:
        return f"Slurm job {self.job_id} reaches its time limit in about {self.lead_s} s (Slurm's --signal)"


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
    if cfg.signal_before_limit:  # B: the batch shell alone (a worker's Python would die of USR1)
        lines.append(f"#SBATCH --signal=B:USR1@{cfg.signal_before_limit}")
    return lines + [f"#SBATCH {a}" for a in cfg.sbatch_args]


TIME_LIMIT_LINE = "forgelab: time limit near: Slurm sent USR1"
"""What a job's script writes to the job's stderr file when Slurm signals it before the time limit (`--signal`);
the controller's job reads that file (`time_limit_signalled`)."""


def _trap(cfg: SlurmConfig) -> list[str]:
    """The batch shell's USR1 trap. Bash runs a trap only between commands, so the script runs its work in the
    background and `wait`s for it (a trapped signal interrupts `wait`, not a foreground command)."""
    if not cfg.signal_before_limit:
        return []
    return [f"trap 'echo \"{TIME_LIMIT_LINE} ($(date -u +%FT%TZ), signal_before_limit "
            f"{cfg.signal_before_limit} s)\" >&2' USR1"]


def _wait_for(var: str, rc: str | None = None) -> str:
    """Wait for background process `$var` to end, through any trapped signal (`wait` returns 128+N then)."""
    status = f"; {rc}=$?" if rc else ""
    return f"while kill -0 ${var} 2>/dev/null; do wait ${var}{status}; done"


def time_limit_signalled(text: str) -> bool:
    """Whether a job's stderr holds the script's report of Slurm's time-limit signal (`TIME_LIMIT_LINE`).

    >>> time_limit_signalled("srun: error: vm: task 0: Killed\\n" + TIME_LIMIT_LINE + " (2026-11-27T23:50:01Z)")
    True
    """
    return any(line.startswith(TIME_LIMIT_LINE) for line in text.splitlines())


def batch_script(cfg: SlurmConfig, log_dir: str, job_name: str) -> str:
    """The `sbatch` script that starts every worker of `cfg` (one `srun` step, one task per worker), and reports
    Slurm's time-limit signal to the controller (`TIME_LIMIT_LINE` in the job's stderr)."""
    return "\n".join([*_directives(cfg, log_dir, job_name), *_trap(cfg), _worker_command(cfg) + " &", "workers=$!",
                      _wait_for("workers"), ""])


BATCH_ENV = "FORGELAB_SLURM_BATCH"
"""Set (to the job's stderr path) in a batch job's controller: its Slurm job adopts $SLURM_JOB_ID, submits nothing."""


def batch_run_script(cfg: SlurmConfig, log_dir: str, job_name: str, config_path: str,
                     overrides: Sequence[str] = (), resume: str | None = None) -> str:
    """The `sbatch` script of batch mode: the workers (one `srun` step, in the background) and the controller
    (`forgelab run CONFIG [--resume CHECKPOINT]` in the batch step, on the first node) in one allocation; the
    workers stop when the controller exits, and the job's exit status is the controller's. Slurm's time-limit
    signal reaches the controller as `TIME_LIMIT_LINE` in the job's stderr file."""
    err = os.path.join(log_dir, f"slurm_${{SLURM_JOB_ID}}_{job_name}.err")
    run = [cfg.python_exe, "-m", "forgelab.cli", "run", os.path.abspath(config_path)]
    for o in overrides:
        run += ["--set", o]
    if resume is not None:
        run += ["--resume", resume if resume == "latest" else os.path.abspath(resume)]
    return "\n".join([
        *_directives(cfg, log_dir, job_name),
        f'export {BATCH_ENV}="{err}"',
        *_trap(cfg),
        _worker_command(cfg) + " &",
        "workers=$!",
        " ".join(shlex.quote(a) for a in run) + " &",
        "controller=$!",
        _wait_for("controller", "rc"),
        "kill $workers 2>/dev/null; wait $workers 2>/dev/null",
        "exit $rc",
        "",
    ])
