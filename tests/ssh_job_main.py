"""Run as a script: a Run placed over Monarch's SSH job, in a process of its own.

    python tests/ssh_job_main.py CONFIG.yaml MONARCH_PORT HOST_A HOST_B   -> prints one JSON line

Constructing an `SSHJob` switches the process's Monarch transport to TCP for good, so the test that uses it
runs it here, not in the pytest process (whose later tests use the default transport).
"""
import asyncio
import json
import sys

import psutil


def workers(port: int, hosts: list[str]) -> dict[str, int]:
    """host address -> pid of the Monarch worker listening there (started over ssh by the job)."""
    found = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "run_worker_loop_forever" in cmd:
            for h in hosts:
                if f"tcp://{h}:{port}" in cmd:
                    found[h] = p.info["pid"]
    return found


def parents(pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(pid).parents()]


async def main(config: str, port: int, hosts: list[str]) -> dict:
    from forgelab.config import RunConfig
    from forgelab.run import Run

    run = Run(RunConfig.from_yaml(config))
    try:
        await run.start()
        found = workers(port, hosts)
        gen = {p: parents(p) for p in (s.pid for s in run.parts.generators.status())}
        trainer = {p: parents(p) for p in await run.parts.trainer.pids()}
        worker_parents = {h: parents(pid) for h, pid in found.items()}
        await run.wait()
        from forgelab.runtime.beat_sink import running_sink

        sink = running_sink()  # the parts' heartbeats, sent over the network to the controller (docs/hangs.md)
        heard = {} if sink is None else {p: sink.record(p) for p in [*gen, *trainer]}
        df = run.metrics
        out = {"state": run.state, "message": run.message, "version": run.version, "steps": list(df["step"]),
               "loss": list(df["loss"]), "grad_norm": list(df["grad_norm"]), "workers": found,
               "worker_parents": worker_parents, "generator": gen, "trainer": trainer,
               "heard": {str(p): None if r is None else {"beat": r["beat"], "counters": r["counters"]}
                         for p, r in heard.items()}}
    finally:
        await run.shutdown()
    procs = []
    for pid in found.values():
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=60)
    out["alive_after_shutdown"] = [p.pid for p in alive]
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3:]))), flush=True)
    import gc

    gc.freeze()  # the exit skips collecting the torch/Monarch heap (seconds; as `forgelab run` does, forgelab/cli.py)
