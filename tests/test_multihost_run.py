"""A Run across hosts: configured from YAML, its generator and trainer on two hosts of a `monarch.job` job.

`monarch.job.ProcessJob` stands in for two machines: each "host" is a worker process of this test
(on a cluster it would be a node; only `hosts.job` changes). The parts are spawned under their host's
worker, so a part's host is its process's parent, which the test compares with the job's workers.
"""
from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import yaml

pytestmark = pytest.mark.integration

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "two_hosts.yaml"
# The shipped example, shrunk to a few small steps.
SMALL = {"rollout": {"group_size": 4, "prompts_per_rollout": 4, "concurrency": 1},
         "train": {"steps": 3, "batch_size": 16, "warmup_steps": 1}, "eval": {"every": 0, "n": 8},
         "tracking": {"wandb": False}}


def _host_workers() -> set[int]:
    """The job's host processes (Monarch's worker loop), children of this process."""
    return {p.pid for p in psutil.Process().children()
            if "run_worker_loop_forever" in " ".join(p.cmdline())}


@pytest.fixture(scope="module")
def multihost(loop, tmp_path_factory):
    from forgelab.config.run_config import RunConfig
    from forgelab.run import Run

    tmp = tmp_path_factory.mktemp("multihost")
    data = yaml.safe_load(CONFIG.read_text())
    for section, values in SMALL.items():
        data.setdefault(section, {}).update(values)
    data["tracking"]["out_dir"] = str(tmp / "runs")
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    run = Run(RunConfig.from_yaml(path))
    try:
        loop.run_until_complete(run.start())
        workers = _host_workers()
        gen_pids = [s.pid for s in run.parts.generators.status()]
        trainer_pids = loop.run_until_complete(run.parts.trainer.pids())
        job = run.parts.job
        loop.run_until_complete(run.wait())
        yield run, job, workers, gen_pids, trainer_pids
    finally:
        loop.run_until_complete(run.shutdown())


def test_generator_and_trainer_run_on_different_hosts(multihost):
    run, job, workers, gen_pids, trainer_pids = multihost
    from monarch.job import ProcessJob

    assert isinstance(job, ProcessJob) and job._meshes == {"gen": 1, "train": 1}
    assert (run.config.hosts.generator, run.config.hosts.trainer) == ("gen", "train")
    assert len(workers) == 2, f"expected the job's 2 host workers, found {workers}"
    gen_hosts = {psutil.Process(p).ppid() for p in gen_pids}
    trainer_hosts = {psutil.Process(p).ppid() for p in trainer_pids}
    assert len(gen_hosts) == 1 and len(trainer_hosts) == 1
    assert gen_hosts | trainer_hosts == workers  # each part under one of the job's hosts, not this process
    assert gen_hosts != trainer_hosts, "generator and trainer share a host"


def test_the_run_trains_across_hosts(multihost):
    run = multihost[0]
    assert run.state == "finished", run.message
    df = run.metrics
    assert len(df) == run.config.train.steps
    assert df["loss"].notna().all() and (df["grad_norm"] > 0).all()
    # weights went from the trainer's host to the generator's host after every step
    assert run.version == run.config.train.steps


def test_the_parts_heartbeats_reach_the_controller_over_the_network(multihost):
    """Parts on a job's hosts send their heartbeats to the controller's UDP sink (docs/hangs.md, "Processes on
    other hosts"), which the watchdog reads where their heartbeat files are on another disk."""
    from forgelab.runtime.beat_sink import running_sink

    run, job, workers, gen_pids, trainer_pids = multihost
    sink = running_sink()
    assert sink is not None, "no heartbeat sink started for parts on a job's hosts"
    for pid in gen_pids + trainer_pids:
        # the parts beat every second while they live; a beat sent after the run's work carries its counters (the
        # newest one heard may predate them on a loaded machine: CI once read beat 1 with no counters yet), so the
        # test waits for it, woken by each arriving beat; 60 s only bounds a failure
        rec = sink.wait_record(pid, lambda r: bool(r.get("counters")), timeout_s=60.0)
        assert rec is not None, (pid, sink.record(pid))
        assert rec["pid"] == pid and rec["beat"] >= 1 and rec["counters"], (pid, rec)
    assert sink.dropped == 0


def test_shutdown_kills_the_job_hosts(multihost, loop):
    run, job, workers, *_ = multihost
    loop.run_until_complete(run.shutdown())
    procs = []
    for pid in workers:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:  # already gone and reaped: what this test wants
            pass
    gone, alive = psutil.wait_procs(procs, timeout=30)
    assert not alive, f"host workers still running after shutdown: {[p.pid for p in alive]}"
