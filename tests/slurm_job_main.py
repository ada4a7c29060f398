"""Run as a script: forgelab's Slurm job against a test cluster, in a process of its own.

    python tests/slurm_job_main.py run CONFIG.yaml [N] -> a Run placed over the Slurm job (after step N: Slurm's
                                                          time-limit signal to the job); prints one JSON line
    python tests/slurm_job_main.py hold JOB.json       -> applies the job, spawns one actor per mesh, prints one
                                                          JSON line (job id, pids); on "lost" / "time_limit"
                                                          from stdin prints the lost workers and time-limit
                                                          notice the job reported; waits to be killed

Constructing a Slurm job switches the process's Monarch transport to TCP for good, so the tests run it here, not
in the pytest process. SLURM_CONF in the environment points the Slurm commands at the test's cluster.
"""
import asyncio
import dataclasses
import json
import os
import sys
import time

import psutil
from monarch.actor import Actor, endpoint


class Pid(Actor):
    @endpoint
    async def pid(self) -> int:
        return os.getpid()


def chain(pid: int) -> list[dict]:
    """pid's ancestors, nearest first: [{pid, name, cmdline}]."""
    out = []
    for p in psutil.Process(pid).parents():
        try:
            out.append({"pid": p.pid, "name": p.name(), "cmdline": " ".join(p.cmdline())})
        except psutil.NoSuchProcess:
            pass
    return out


def workers() -> list[int]:
    """pids of the Monarch workers the job's srun step started (live ones)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        argv0 = os.path.basename((p.info["cmdline"] or [""])[0])
        if (argv0.startswith("python") and "run_worker_loop_forever" in cmd and "SLURMD_NODENAME" in cmd
                and p.info["status"] != psutil.STATUS_ZOMBIE):
            found.append(p.info["pid"])
    return found


async def run(config: str, signal_after: int | None) -> dict:
    """The Run over the Slurm job; `signal_after`: once that step is done, USR1 to the job's batch shell, as
    Slurm's `--signal=B:USR1` does before the time limit (`scancel --batch --signal=USR1`: the same delivery)."""
    import subprocess

    from forgelab.config import RunConfig
    from forgelab.run import Run

    run = Run(RunConfig.from_yaml(config))
    t0 = time.time()
    signalled_at = None
    try:
        await run.start()
        job = run.parts.job
        job_id, watcher = job.job_id, job.watcher_pid  # the job forgets them once cancelled
        gen = {p: chain(p) for p in (s.pid for s in run.parts.generators.status())}
        trainer = {p: chain(p) for p in await run.parts.trainer.pids()}
        found = workers()
        first_step = None
        async for step in _steps(run):
            if first_step is None:
                first_step = time.time() - t0
            if signal_after is not None and signalled_at is None and step >= signal_after:
                signalled_at = step
                subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, timeout=60)
    finally:
        await run.shutdown()
    df = run.metrics
    reports = run.job_reports
    out = {"state": run.state, "message": run.message, "version": run.version, "steps": list(df["step"]),
           "loss": list(df["loss"]), "grad_norm": list(df["grad_norm"]), "job_id": job_id,
           "watcher": watcher, "workers": found, "generator": gen, "trainer": trainer,
           "seconds_to_first_step": first_step, "signalled_at_step": signalled_at,
           "checkpoint": str(reports.checkpoint) if reports and reports.checkpoint else None,
           "events": [{k: v for k, v in e.items() if k in ("kind", "step", "path", "job_id")} for e in run.events],
           "out_dir": str(run.out_dir)}
    _, alive = psutil.wait_procs([psutil.Process(p) for p in found if psutil.pid_exists(p)], timeout=60)
    out["alive_after_shutdown"] = [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    return out


async def _steps(run):
    """Yield once per trained step until the run ends (polls run.version: a condition, not a sleep on results)."""
    task = asyncio.ensure_future(run.wait())
    seen = 0
    while not task.done():
        if run.version > seen:
            seen = run.version
            yield seen
        await asyncio.sleep(0.05)
    await task
    if run.version > seen:
        yield run.version


async def hold(job_path: str) -> None:
    from forgelab.runtime.placement import job_from_config

    from forgelab.runtime import supervision

    supervision.install()  # as a Run does: a dead process becomes an event, not the controller's exit
    job = job_from_config(json.loads(open(job_path).read()))
    job.apply()
    state = job.state(cached_path=None)
    pids = {}
    for name in job.config.meshes:
        procs = getattr(state, name).spawn_procs(per_host={"procs": 1})
        pids[name] = await procs.spawn("pid", Pid).pid.call_one()
    heard: list[str] = []
    job.add_listener(lambda notice: heard.append(f"{type(notice).__name__}: {notice}"))  # as a Run listens
    print(json.dumps({"job_id": job.job_id, "watcher": job.watcher_pid, "workers": workers(), "actors": pids,
                      "pid": os.getpid()}), flush=True)
    # "lost": the test killed a worker; "time_limit": the test signalled the batch shell as --signal does; report
    # what the job's watch of its stderr learned (within 60 s), and what its listener heard
    while True:
        line = (await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)).strip()
        if line not in ("lost", "time_limit"):
            break
        deadline = time.monotonic() + 60
        while not (job.lost if line == "lost" else job.time_limit) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)  # the job's thread reads srun's and the script's reports; a condition, bounded
        print(json.dumps({"lost": [dataclasses.asdict(w) for w in job.lost], "text": [str(w) for w in job.lost],
                          "time_limit": None if job.time_limit is None else str(job.time_limit),
                          "heard": heard}), flush=True)
    while True:
        await asyncio.sleep(3600)  # held until the test kills this process


if __name__ == "__main__":
    if sys.argv[1] == "run":  # run CONFIG [SIGNAL_AFTER_STEP]
        print(json.dumps(asyncio.run(run(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None))), flush=True)
        import gc

        gc.freeze()  # the exit skips collecting the torch/Monarch heap (seconds; as `forgelab run` does, forgelab/cli.py)
    else:
        asyncio.run(hold(sys.argv[2]))
