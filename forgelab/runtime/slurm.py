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
  (forgelab/runtime/slurm_watch.py, run by path: the standard library only) that runs `scancel` when the
  controller process is gone (a killed notebook kernel included), and exits when the job ends. `kill()` (a
  run's shutdown) cancels the job at once.
- A worker that ends while the job runs is named (mesh, host, task, reason) from srun's own report in the job's
  stderr file (`job.lost`, and a warning in the log); the other workers run on (`--kill-on-bad-exit=0`).
- The time limit: `--signal=B:USR1@signal_before_limit`; the job's script traps it and writes `TIME_LIMIT_LINE`
  to the same stderr file (`job.time_limit`). Listeners (`add_listener`: a Run's
  forgelab/controller/job_reports.py) hear of both; the run checkpoints and stops before the limit.
- Config is validated up front (`SlurmConfig`), with errors that name the key; Monarch's `slurm_args` is
  accepted as `sbatch_args`.

Batch mode (the whole run in one allocation): `python -m forgelab.runtime.slurm submit CONFIG.yaml [--resume]`
(`submit_batch`): the batch script starts the workers and runs `forgelab run CONFIG` beside them; that
controller's job adopts `$SLURM_JOB_ID` instead of submitting. `--resume` (after a time limit) continues from the
run's latest checkpoint. docs/clusters.md has the whole story.

Constructing the job switches this process's Monarch transport to TCP, as Monarch's own does.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from monarch.job import JobState, SlurmJob

from forgelab.runtime.slurm_spec import (
    BATCH_ENV,
    LostWorker,
    SlurmConfig,
    SlurmConfigError,
    SqueueJob,
    TimeLimitNear,
    batch_run_script,
    batch_script,
    parse_squeue,
    parse_srun_errors,
    time_limit_signalled,
    worker_addresses,
    worker_of_task,
)

__all__ = ["BATCH_ENV", "ForgelabSlurmJob", "JobNotice", "LostWorker", "SlurmConfig", "SlurmConfigError", "SqueueJob",
           "TimeLimitNear",
           "batch_run_script", "batch_script", "expand_hostlist", "parse_squeue", "parse_srun_errors",
           "slurm_job_from_config", "start_watcher", "submit_batch", "worker_addresses", "worker_of_task"]

log = logging.getLogger(__name__)

JobNotice = LostWorker | TimeLimitNear
"""What the job tells its listeners while it runs (`ForgelabSlurmJob.add_listener`)."""

def submit_batch(config_path: str, overrides: Sequence[str] = (), resume: str | None = None) -> str:
    """Submit a whole run (`forgelab run CONFIG`) as one Slurm batch job; its `hosts.job` (kind slurm) sizes the
    allocation and places the parts. Returns the job id; the run's summary line ends the job's stdout file.

    `resume`: a checkpoint directory, or "latest" (the run's own latest checkpoint: what a run stopped by the
    time limit wrote), passed to `forgelab run --resume`."""
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
    if resume is not None and resume != "latest" and not os.path.isdir(resume):
        raise SlurmConfigError(f"--resume {resume!r}: not a directory; pass a checkpoint directory or 'latest'")
    script = batch_run_script(cfg, log_dir, f"{cfg.job_name}_batch", config_path, overrides, resume)
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
        self.time_limit: TimeLimitNear | None = None
        """Set once the job's script reported Slurm's time-limit signal (read with the lost workers)."""
        self._listeners: list[Callable[[JobNotice], None]] = []

    def add_listener(self, fn: Callable[[JobNotice], None]) -> None:
        """Call `fn(notice)` for each lost worker and for the time-limit signal, from the job's watch thread;
        the notices seen before this call are passed at once (a run attaches after the workers started)."""
        self._listeners.append(fn)
        notices: list[JobNotice] = [*self.lost]
        if self.time_limit is not None:
            notices.append(self.time_limit)
        for notice in notices:
            fn(notice)

    def _notify(self, notice: JobNotice) -> None:
        log.warning("forgelab: %s", notice)
        for fn in list(self._listeners):
            try:
                fn(notice)
            except Exception:  # noqa: BLE001 -- one listener's bug must not end the watch
                log.exception("forgelab: a Slurm job listener failed on %s", notice)

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
        """Workers srun reported ended so far (host, mesh, reason), read from the job's stderr file; the
        script's report of Slurm's time-limit signal is read there too (`time_limit`). Listeners hear each once."""
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
                self._notify(worker)
        if self.time_limit is None and time_limit_signalled(text):
            self.time_limit = TimeLimitNear(job_id, self.config.signal_before_limit)
            self._notify(self.time_limit)
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
        self._wait_for_workers(job_id, addresses)
        return JobState({name: attach_to_workers(name=name, ca="trust_all_connections", workers=list(workers))
                         for name, workers in addresses.items()})

    def _wait_for_workers(self, job_id: str, addresses: Mapping[str, Sequence[str]]) -> None:
        """Wait until every worker accepts a TCP connection on its port, or fail naming the ones that do not.

        Monarch's attach pushes its config to each worker and gives the reply one minute
        (`mesh_attach_config_timeout`); a worker still importing torch on a loaded node misses that. So the
        controller first waits for the workers to listen, up to `worker_start_timeout`, while the job runs."""
        import socket

        pending = {addr: name for name, addrs in addresses.items() for addr in addrs}
        deadline = time.monotonic() + self.config.worker_start_timeout
        while pending:
            for addr in list(pending):
                host, port = addr.removeprefix("tcp://").rsplit(":", 1)
                try:
                    with socket.create_connection((host, int(port)), timeout=2):
                        del pending[addr]
                except OSError:
                    pass
            if not pending:
                return
            lost = self.lost_workers()
            info = self.query(job_id)
            ended = info is None or info.ended
            if lost or ended or time.monotonic() > deadline:
                waiting = ", ".join(f"{name} at {addr}" for addr, name in sorted(pending.items()))
                why = (f"worker(s) ended: {'; '.join(str(w) for w in lost)}" if lost
                       else f"the job ended ({'not listed' if info is None else list(info.states)})" if ended
                       else f"not listening after {self.config.worker_start_timeout} s; raise "
                            "hosts.job.worker_start_timeout on a loaded cluster")
                log_dir = self.config.log_dir or os.getcwd()
                self._kill()
                raise RuntimeError(f"Slurm job {job_id}: {waiting}: {why}. The workers' output is in {log_dir} "
                                   f"(slurm_{job_id}_*.out/.err)")
            time.sleep(0.5)  # a port opening is not an event this process can wait on; bounded by the deadline

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
    """Start forgelab/runtime/slurm_watch.py (by path: a bare interpreter) for `job_id` and the controller `pid`
    (default: this process), in a session of its own; returns its pid."""
    from forgelab.runtime import slurm_watch

    pid = os.getpid() if pid is None else pid
    proc = subprocess.Popen([sys.executable, "-I", slurm_watch.__file__, "--job", job_id, "--pid", str(pid)],
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


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m forgelab.runtime.slurm", description="forgelab on Slurm.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_sub = sub.add_parser("submit", help="batch mode: submit a whole run (hosts.job kind slurm) as one sbatch job")
    p_sub.add_argument("config")
    p_sub.add_argument("--set", action="append", default=[], help="override a field: train.steps=20")
    p_sub.add_argument("--resume", nargs="?", const="latest", default=None,
                       help="resume from a checkpoint directory; alone: the run's latest checkpoint (after a time "
                            "limit)")
    args = parser.parse_args(argv)
    print(submit_batch(args.config, args.set, args.resume), flush=True)


if __name__ == "__main__":
    main()
