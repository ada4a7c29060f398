"""The controller watcher: cancel a Slurm job when the process that owns it dies.

    python forgelab/runtime/slurm_watch.py --job 1041 --pid 4242     # run by path: the standard library only

`ForgelabSlurmJob` starts it right after `sbatch`, in a session of its own (a signal to the controller's process
group, or a killed notebook kernel, does not reach it). It polls the controller's pid (and its start time, so a
reused pid is not mistaken for it) every 0.5 s and runs `scancel` when it is gone; it exits on its own when
`squeue` no longer lists the job as pending or running (asked every 10 s; `squeue -j` with a plain format
honours the job id on every Slurm version, unlike `--json` on 22.05). It imports nothing of forgelab or Monarch:
it sits beside the whole run, so it costs a bare interpreter (13 MB resident), not a Monarch import (145 MB).
"""
from __future__ import annotations

import argparse
import subprocess
import time
from collections.abc import Sequence

ACTIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING",
                           "STAGE_OUT", "SIGNALING", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "STOPPED"})


def start_time(pid: int) -> str | None:
    """Process `pid`'s start time in clock ticks (/proc/PID/stat field 22); None: no such live process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X", "x") else fields[19]  # a zombie has ended


def job_active(job_id: str) -> bool | None:
    """Whether squeue lists the job as pending or running; None: squeue did not answer."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:  # an ended job is "Invalid job id" once slurmctld forgets it
        return False if "Invalid job id" in out.stderr else None
    return any(state in ACTIVE_STATES for state in out.stdout.split())


def watch(job_id: str, pid: int, poll: float = 0.5, check_job_every: float = 10.0) -> str:
    """Wait until process `pid` ends (then `scancel job_id`: "cancelled") or the job ends ("ended")."""
    born = start_time(pid)
    last_check = time.monotonic()
    while born is not None and start_time(pid) == born:
        if time.monotonic() - last_check > check_job_every:
            last_check = time.monotonic()
            if job_active(job_id) is False:
                return "ended"
        time.sleep(poll)  # waiting on a non-child's death: Linux has no portable wait for it
    subprocess.run(["scancel", job_id], capture_output=True, timeout=60)
    return "cancelled"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Cancel a Slurm job when the controller process dies.")
    parser.add_argument("--job", required=True)
    parser.add_argument("--pid", type=int, required=True)
    args = parser.parse_args(argv)
    print(watch(args.job, args.pid), flush=True)


if __name__ == "__main__":
    main()
