"""forgelab's Slurm job (forgelab/runtime/slurm.py) against a real Slurm: a single-node cluster on loopback.

The integration tests start Debian 12's Slurm 22.05 (munged, slurmctld, slurmd; tests/slurm_cluster.py: its own
slurm.conf, munge key, ports and state in a temp dir, nothing of the machine's own setup used) and submit with the
real `sbatch`. The only node is this machine (2 CPUs); the generator and the trainer are two Slurm tasks of one
`srun` step on it, exactly as on two nodes (`nodes: 2`) except for the node count. The job runs in a child
process (tests/slurm_job_main.py): a Slurm job switches its process's Monarch transport to TCP for good.

Slurm 24.11+'s `squeue --json` layout is tested from tests/data/squeue_24_11.json, a fixture built by hand from
that version's documented layout (not captured: 22.05 is the only Slurm installable here); tests/data/
squeue_22_05.json is the real output of `squeue --json --job 2` on the test cluster (it lists both jobs: 22.05
ignores `--job` there). The run's side of the job's reports (a lost worker, the time limit) is tested first with
in-process fakes for the parts, then live: Slurm's own `--signal` in batch mode. Without Slurm the integration
tests skip, and fail with CI set (`make setup` installs
slurm-wlm and munge as root with apt).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from forgelab.runtime.slurm import (
    LostWorker,
    SlurmConfig,
    SlurmConfigError,
    batch_script,
    parse_squeue,
    parse_srun_errors,
    TimeLimitNear,
    worker_addresses,
    worker_of_task,
)
from forgelab.runtime.slurm_spec import TIME_LIMIT_LINE

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DATA = HERE / "data"
MAIN = HERE / "slurm_job_main.py"
integration = pytest.mark.integration


# --- Slurm's answers, both layouts -----------------------------------------------------------------------------


def test_squeue_22_05_real_output_is_read_for_the_job_asked_only():
    data = json.loads((DATA / "squeue_22_05.json").read_text())
    assert data["meta"]["Slurm"]["release"] == "22.05.8"
    assert [j["job_id"] for j in data["jobs"]] == [1, 2]  # asked for job 2 only: 22.05 lists every job
    pending = parse_squeue(data, "2")
    assert pending is not None and pending.states == ("PENDING",) and not pending.running and not pending.ended
    running = parse_squeue(data, "1")
    assert running is not None and running.running and running.hosts == ("vm",) and running.nodelist == "vm"
    assert parse_squeue(data, "3") is None


def test_squeue_24_11_layout_is_read():
    data = json.loads((DATA / "squeue_24_11.json").read_text())
    job = parse_squeue(data, "1041")
    assert job is not None and job.states == ("RUNNING",) and job.hosts == ("gpu007", "gpu008")
    assert job.nodelist == "gpu[007-008]"
    other = parse_squeue(data, "1042")
    assert other is not None and other.states == ("PENDING",) and other.hosts is None
    ended = parse_squeue({"jobs": [{"job_id": {"set": True, "infinite": False, "number": 7},
                                    "job_state": ["CANCELLED", "COMPLETING"]}]}, "7")
    assert ended is not None and ended.ended
    with pytest.raises(ValueError, match="jobs"):
        parse_squeue({"errors": ["slurmctld down"]}, "1")


# --- config --------------------------------------------------------------------------------------------------


def test_workers_spread_over_nodes_in_mesh_order():
    cfg = SlurmConfig.from_dict({"kind": "slurm", "meshes": {"gen": 3, "train": 1}, "nodes": 2, "monarch_port": 4000})
    assert cfg.workers_per_node == 2
    assert worker_addresses(cfg, ["n1", "n2"]) == {"gen": ["tcp://n1:4000", "tcp://n1:4001", "tcp://n2:4000"],
                                                   "train": ["tcp://n2:4001"]}
    with pytest.raises(RuntimeError, match="allocated 1 node"):
        worker_addresses(cfg, ["n1"])


def test_srun_reports_name_the_mesh_and_host():
    text = ("Monarch internal logs are being written to ...\nsrun: error: vm: task 0: Killed\n"
            "srun: error: n2: tasks 2-3: Exited with exit code 1\n")
    assert parse_srun_errors(text) == [("vm", 0, "Killed"), ("n2", 2, "Exited with exit code 1"),
                                       ("n2", 3, "Exited with exit code 1")]
    cfg = SlurmConfig.from_dict({"kind": "slurm", "meshes": {"gen": 3, "train": 1}, "nodes": 2})
    assert [worker_of_task(cfg, t) for t in range(4)] == [("gen", 0), ("gen", 1), ("gen", 2), ("train", 0)]
    with pytest.raises(ValueError, match="beyond"):
        worker_of_task(cfg, 4)


def test_monarchs_slurm_args_are_accepted():
    cfg = SlurmConfig.from_dict({"kind": "slurm", "meshes": {"gen": 1}, "slurm_args": ["--account=rl"]})
    assert cfg.sbatch_args == ("--account=rl",) and "#SBATCH --account=rl" in batch_script(cfg, "/l", "j")


def test_batch_script_carries_every_setting():
    cfg = SlurmConfig.from_dict({"kind": "slurm", "meshes": {"gen": 1, "train": 1}, "partition": "gpu",
                                 "cpus_per_task": 8, "time_limit": "1-02:00:00", "account": "rl",
                                 "gpus_per_node": 8, "sbatch_args": ["--qos=high", "--constraint=a100"]})
    script = batch_script(cfg, "/logs", "forgelab_1")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=gpu",
                 "#SBATCH --cpus-per-task=8", "#SBATCH --time=1-02:00:00", "#SBATCH --account=rl",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --qos=high", "#SBATCH --constraint=a100",
                 "#SBATCH --output=/logs/slurm_%j_forgelab_1.out"):
        assert line in script.splitlines(), line
    lines = script.splitlines()
    assert "#SBATCH --signal=B:USR1@300" in lines  # signal_before_limit's default
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert lines[srun - 1].startswith("trap ") and TIME_LIMIT_LINE in lines[srun - 1]  # the trap before the work
    assert lines[srun].endswith(" &") and lines[-1].startswith("while kill -0 $workers")  # waited on: traps run
    off = batch_script(SlurmConfig.from_dict({"kind": "slurm", "meshes": {"gen": 1}, "signal_before_limit": 0}),
                       "/l", "j")
    assert "--signal" not in off and "trap" not in off


def test_the_batch_scripts_trap_reports_slurms_signal_and_keeps_the_exit_status(tmp_path):
    """The script's own lines, run by bash with a stand-in for the work: USR1 to the shell (what `--signal=B:`
    does) writes TIME_LIMIT_LINE to stderr, the work runs on, and the script exits with the work's status."""
    from forgelab.runtime.slurm_spec import batch_run_script, time_limit_signalled

    cfg = SlurmConfig.from_dict({"kind": "slurm", "meshes": {"gen": 1}, "signal_before_limit": 120,
                                 "python_exe": str(tmp_path / "python")})
    script = batch_run_script(cfg, str(tmp_path), "j", str(tmp_path / "c.yaml"), ["train.steps=9"], "latest")
    assert "#SBATCH --signal=B:USR1@120" in script
    assert "forgelab.cli run " + str(tmp_path / "c.yaml") + " --set train.steps=9 --resume latest &" in script
    started = tmp_path / "started"
    # the stand-in python: the workers (srun) sleep; the controller says it started, sleeps 2 s, exits 3
    (tmp_path / "python").write_text(f"#!/bin/sh\ncase \"$*\" in *forgelab.cli*) touch {started}; sleep 2; "
                                     "exit 3;; *) exec sleep 30;; esac\n")
    (tmp_path / "python").chmod(0o755)
    body = script.replace("srun --kill-on-bad-exit=0 ", "")  # no Slurm here: the workers' command itself
    proc = subprocess.Popen(["bash", "-c", body], stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, SLURM_JOB_ID="5"))
    deadline = time.monotonic() + 30
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # until the stand-in controller runs (a condition, bounded)
    os.kill(proc.pid, signal.SIGUSR1)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 3, err  # the controller's status, not 128+10 from the interrupted wait
    assert time_limit_signalled(err) and "signal_before_limit 120 s" in err, err


def test_resuming_with_no_checkpoint_is_refused_by_name(tmp_path, capsys):
    """`forgelab run --resume latest` (what a resubmitted batch job runs) with no checkpoint in the run directory,
    and `submit --resume` with a path that is not there, fail before anything runs, naming what is missing."""
    from forgelab.cli import main
    from forgelab.runtime.slurm import submit_batch

    path = _run_config(tmp_path)
    assert main(["run", str(path), "--resume", "latest"]) == 2
    assert "two-hosts/checkpoints holds no checkpoint" in capsys.readouterr().err
    with pytest.raises(SlurmConfigError, match="not a directory"):
        submit_batch(str(path), (), str(tmp_path / "nowhere"))


def test_the_time_limit_signal_is_slurms_to_set():
    with pytest.raises(SlurmConfigError, match="signal_before_limit"):
        SlurmConfig.from_dict({"kind": "slurm", "meshes": {"gen": 1}, "sbatch_args": ["--signal=USR1@60"]})
    for bad in (-1, 70000, "300", True):
        with pytest.raises(SlurmConfigError, match="signal_before_limit"):
            SlurmConfig.from_dict({"kind": "slurm", "meshes": {"gen": 1}, "signal_before_limit": bad})


@pytest.mark.parametrize("bad, names", [
    ({"meshes": {}}, "meshes"),
    ({"meshes": {"gen": 0}}, "meshes.gen"),
    ({"meshes": {"gen": 3}, "nodes": 2}, "nodes to a divisor of 3"),
    ({"meshes": {"gen": 1}, "time_limit": "4 hours"}, "time_limit"),
    ({"meshes": {"gen": 1}, "cpus_per_task": -1}, "cpus_per_task"),
    ({"meshes": {"gen": 1}, "account": ""}, "account"),
    ({"meshes": {"gen": 1}, "sbatch_args": "--qos=high"}, "sbatch_args"),
    ({"meshes": {"gen": 1}, "sbatch_args": ["qos=high"]}, "not a flag"),
    ({"meshes": {"gen": 1}, "sbatch_args": ["--nodes=4"]}, "--nodes is set by forgelab"),
    ({"meshes": {"gen": 1}, "account": "rl", "slurm_args": ["--account=ml"]}, "repeats hosts.job.account"),
    ({"meshes": {"gen": 1}, "sbatch_args": [], "slurm_args": []}, "not both"),
    ({"meshes": {"gen": 1}, "partiton": "gpu"}, "partiton"),
    ({"meshes": {"gen": 1}, "time_limit": "5"}, "signal_before_limit 300 s is not less than time_limit '5'"),
])
def test_bad_config_is_named(bad, names):
    with pytest.raises(SlurmConfigError, match=names.replace("[", r"\[")):
        SlurmConfig.from_dict({"kind": "slurm", **bad})


# --- the run's side of the job's reports (in-process fakes for the parts) ------------------------------------


class _ReportingJob:
    """A hosts job that reports as ForgelabSlurmJob does: listeners called from a thread of its own."""

    def __init__(self) -> None:
        self.listeners: list = []

    def add_listener(self, fn) -> None:
        self.listeners.append(fn)

    def report(self, notice) -> None:
        import threading

        t = threading.Thread(target=lambda: [fn(notice) for fn in self.listeners])
        t.start()
        t.join()

    def kill(self) -> None:
        pass


def _fake_run_config(tmp_path, steps: int):
    from forgelab.config.run_config import (EvalConfig, HostsConfig, RolloutConfig, RunConfig, TrackingConfig,
                                            TrainConfig)

    return RunConfig(name="tl", rollout=RolloutConfig(task="addition", group_size=4, prompts_per_rollout=2,
                                                      concurrency=2, max_tokens=6),
                     train=TrainConfig(steps=steps, batch_size=8, warmup_steps=1),
                     eval=EvalConfig(every=0, n=8), tracking=TrackingConfig(out_dir=str(tmp_path), wandb=False),
                     hosts=HostsConfig(job={"kind": "slurm", "meshes": {"gen": 1, "train": 1}, "nodes": 1},
                                       generator="gen", trainer="train"))


def test_a_run_checkpoints_and_stops_before_the_time_limit_and_resumes_from_it(tmp_path):
    """The job's time-limit notice (from its thread): the run stops after the current step, writes a checkpoint,
    says where in its message and events; a run resumed from that checkpoint continues with the next step."""
    from forgelab.run import Run

    job = _ReportingJob()

    spawn = _spawn_with(job)

    async def first():
        run = Run(_fake_run_config(tmp_path, steps=1000), spawn=spawn)
        await run.start()
        await run.until(step=2, timeout=60)
        job.report(TimeLimitNear("41", 300))
        await asyncio.wait_for(run.wait(), 60)
        await run.shutdown()
        return run

    import asyncio

    run = asyncio.run(first())
    assert run.state == "stopped" and 2 <= run.step < 1000, (run.state, run.step, run.message)
    ckpt = run.out_dir / "checkpoints" / f"step_{run.step:06d}"
    assert (run.out_dir / "checkpoints" / "LATEST").read_text() == ckpt.name
    assert "time limit" in run.message and str(ckpt) in run.message and "--resume latest" in run.message, run.message
    kinds = [e["kind"] for e in run.events]
    assert kinds.index("time_limit") < kinds.index("stopped") < kinds.index("checkpoint") < kinds.index(
        "time_limit_checkpoint"), kinds
    tl = next(e for e in run.events if e["kind"] == "time_limit")
    assert tl["job_id"] == "41" and tl["lead_s"] == 300
    k = run.step

    async def second():
        return await Run(_fake_run_config(tmp_path, steps=k + 2), resume_from=run.out_dir / "checkpoints",
                         spawn=spawn).run()

    resumed = asyncio.run(second())
    assert resumed.state == "finished" and list(resumed.metrics["step"]) == list(range(1, k + 3))
    assert any(e["kind"] == "resumed_from_checkpoint" and e["path"] == str(ckpt) for e in resumed.events)


def _spawn_with(job, held=None):
    """A spawn of the fakes whose parts carry `job` (as a hosts job's parts do); the parts go in ``held["parts"]``."""
    from forgelab.testing.fakes import fake_spawn

    async def spawn(cfg):
        parts = await fake_spawn(cfg)
        parts.job = job
        if held is not None:
            held["parts"] = parts
        return parts

    return spawn


def test_a_lost_worker_is_in_the_runs_message_events_and_error(tmp_path):
    """srun's report of a lost worker becomes the event worker_lost and the run's message (host, part, reason);
    when the run then fails, its error carries it; the episode accounting identity holds."""
    import asyncio

    from forgelab.run import Run

    job = _ReportingJob()
    held = {}

    spawn = _spawn_with(job, held)

    async def go():
        run = Run(_fake_run_config(tmp_path, steps=1000), spawn=spawn)
        await run.start()
        await run.until(step=1, timeout=60)
        job.report(LostWorker("gen", 0, "node7", 0, "Killed", "41"))
        await run.until(predicate=lambda r: any(e["kind"] == "worker_lost" for e in r.events), timeout=60)
        seen = run.message

        async def dead(batch):
            raise RuntimeError("the actor's process is gone")

        held["parts"].trainer.train_step = dead  # the next call to the lost worker's part fails
        with pytest.raises(RuntimeError, match="gone") as err:
            await asyncio.wait_for(run.wait(), 60)
        await run.shutdown()
        return run, seen, err.value

    run, seen, err = asyncio.run(go())
    for text in (seen, run.message, "\n".join(getattr(err, "__notes__", []))):
        assert "generator" in text and "host node7" in text and "Killed" in text and "mesh 'gen'" in text, text
    assert run.state == "failed" and run.message.startswith("RuntimeError: the actor's process is gone; ")
    ev = next(e for e in run.events if e["kind"] == "worker_lost")
    assert (ev["host"], ev["parts"], ev["mesh"], ev["reason"], ev["job_id"]) == ("node7", ["generator"], "gen",
                                                                                  "Killed", "41")
    c = run.buffer.check_accounting()
    assert c["generated"] == c["trained"] + c["evicted"] + c["dropped"] + c["buffered"] + c["in_flight"], c


# --- the live cluster ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    sys.path.insert(0, str(HERE))
    from slurm_cluster import SlurmCluster, missing

    reason = missing()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and the Slurm tests cannot run: {reason}", pytrace=False)
        pytest.skip(f"{reason} (with CI set this fails instead)")
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


def _free_ports(n: int) -> int:
    """A port p with p .. p+n-1 all free on loopback (worker i of a node listens on p+i)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            for i in range(n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


def _job_listed(cluster, job_id: str) -> bool:
    """Whether the job is pending, running or completing (squeue --json also lists ended jobs for MinJobAge)."""
    job = parse_squeue(json.loads(cluster.run("squeue", "--json").stdout), job_id)
    return job is not None and not job.ended


def _wait_gone(cluster, job_id: str, pids: list[int], timeout: float = 60.0) -> tuple[bool, list[int]]:
    """Wait until the job leaves squeue and every pid is gone (or a zombie); (job still listed, live pids)."""
    from forgelab.runtime.supervision import pid_alive

    deadline = time.monotonic() + timeout
    while True:
        listed, alive = _job_listed(cluster, job_id), [p for p in pids if pid_alive(p)]
        if (not listed and not alive) or time.monotonic() > deadline:
            return listed, alive
        time.sleep(0.2)  # polling the scheduler and /proc: conditions, bounded by the deadline


def _env(cluster) -> dict[str, str]:
    return dict(cluster.env, PYTHONPATH=str(ROOT))


def _under_step(chain: list[dict], job_id: str) -> bool:
    """Whether an ancestor is the slurmstepd of a step of job `job_id` ("slurmstepd: [12.0]")."""
    return any(p["name"] == "slurmstepd" and f"[{job_id}." in p["cmdline"] for p in chain)


@integration
def test_sbatch_runs_on_the_test_cluster(cluster, tmp_path):
    out = tmp_path / "hostname.out"
    job_id = cluster.run("sbatch", "--parsable", "-o", str(out), "--wrap", "hostname").stdout.strip()
    listed, _ = _wait_gone(cluster, job_id, [])
    assert not listed and out.read_text().strip() == cluster.node, cluster.log("slurmd")


@integration
def test_the_watcher_cancels_when_its_process_dies_and_leaves_when_the_job_ends(cluster, tmp_path, monkeypatch):
    import threading

    from forgelab.runtime.slurm_watch import watch

    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    owner = subprocess.Popen(["sleep", "600"])
    try:
        long_job = cluster.run("sbatch", "--parsable", "-o", "/dev/null", "--wrap", "sleep 600").stdout.strip()
        result: list[str] = []
        t = threading.Thread(target=lambda: result.append(watch(long_job, owner.pid, poll=0.1)))
        t.start()
        assert _job_listed(cluster, long_job)
        owner.kill()
        owner.wait()
        t.join(timeout=30)
        assert result == ["cancelled"]
        assert _wait_gone(cluster, long_job, [])[0] is False
    finally:
        owner.kill()
        owner.wait()
    short_job = cluster.run("sbatch", "--parsable", "-o", "/dev/null", "--wrap", "true").stdout.strip()
    assert watch(short_job, os.getpid(), poll=0.1, check_job_every=0.2) == "ended"  # this process lives on


@integration
def test_a_worker_that_never_listens_is_named_before_monarch_attaches(cluster, tmp_path):
    """The controller waits for every worker to listen before Monarch's attach (whose config push gives a
    worker one minute, too little for one still importing torch on a loaded node); workers that run but never
    listen are named with their mesh and address once `worker_start_timeout` has passed, and the job is
    cancelled."""
    never = tmp_path / "never_listens"
    never.write_text("#!/bin/sh\nexec sleep 600\n")  # takes the worker's arguments and never opens its port
    never.chmod(0o755)
    job = {"kind": "slurm", "meshes": {"gen": 1, "train": 1}, "nodes": 1, "cpus_per_task": 1,
           "python_exe": str(never), "monarch_port": _free_ports(2), "log_dir": str(tmp_path / "logs"),
           "worker_start_timeout": 3}
    (tmp_path / "job.json").write_text(json.dumps(job))
    proc = subprocess.run([sys.executable, str(MAIN), "hold", str(tmp_path / "job.json")], env=_env(cluster),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and proc.stdout == "", proc.stdout
    err = proc.stderr
    assert "gen at tcp://" in err and "train at tcp://" in err, err[-3000:]
    assert "not listening after 3 s" in err and "worker_start_timeout" in err, err[-3000:]
    assert str(tmp_path / "logs") in err, err[-3000:]
    job_id = err.split("Slurm job ", 1)[1].split(":", 1)[0]
    assert _wait_gone(cluster, job_id, [])[0] is False  # cancelled, its sleeping workers with it


@integration
def test_a_lost_worker_is_named_and_killing_the_controller_cancels_the_job(cluster, tmp_path):
    job = {"kind": "slurm", "meshes": {"gen": 1, "train": 1}, "nodes": 1, "cpus_per_task": 1,
           "python_exe": sys.executable, "monarch_port": _free_ports(2), "log_dir": str(tmp_path / "logs")}
    (tmp_path / "job.json").write_text(json.dumps(job))
    proc = subprocess.Popen([sys.executable, str(MAIN), "hold", str(tmp_path / "job.json")], env=_env(cluster),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, f"the controller exited ({proc.wait()}): {proc.stderr.read()[-4000:]}"
        res = json.loads(line)
        assert _job_listed(cluster, res["job_id"])
        assert len(res["workers"]) == 2
        import psutil

        for pid in [*res["workers"], *res["actors"].values()]:
            chain = [{"name": p.name(), "cmdline": " ".join(p.cmdline())} for p in psutil.Process(pid).parents()]
            assert _under_step(chain, res["job_id"]), (pid, chain)
        # a worker lost mid-run: the generator's (its actor's parent) is killed; the job names host, mesh, reason
        gen_worker = psutil.Process(res["actors"]["gen"]).ppid()
        assert gen_worker in res["workers"]
        os.kill(gen_worker, signal.SIGKILL)
        proc.stdin.write("lost\n")
        proc.stdin.flush()
        lost = json.loads(proc.stdout.readline())
        assert [(w["mesh"], w["index"], w["host"], w["reason"]) for w in lost["lost"]] == [
            ("gen", 0, cluster.node, "Killed")], lost
        assert f"mesh 'gen' on host {cluster.node}" in lost["text"][0]
        assert lost["heard"] == [f"LostWorker: {lost['text'][0]}"]  # what a Run's JobReports gets
        assert _job_listed(cluster, res["job_id"]) and psutil.pid_exists(res["actors"]["train"])  # the rest runs on
        # interactive mode's time limit: Slurm's --signal=B:USR1 reaches the batch shell; sent here at once with
        # scancel (the same delivery; the batch test waits for the real one), its trap reports it to the controller
        cluster.run("scancel", "--batch", "--signal=USR1", res["job_id"])
        proc.stdin.write("time_limit\n")
        proc.stdin.flush()
        tl = json.loads(proc.stdout.readline())
        assert tl["time_limit"] == str(TimeLimitNear(res["job_id"], 300)), tl
        assert tl["heard"][1:] == [f"TimeLimitNear: {tl['time_limit']}"], tl
        assert _job_listed(cluster, res["job_id"]) and psutil.pid_exists(res["actors"]["train"])  # nothing died

        os.kill(proc.pid, signal.SIGKILL)  # a killed notebook kernel: no cleanup code of the controller runs
        proc.wait(timeout=30)
        listed, alive = _wait_gone(cluster, res["job_id"], [*res["workers"], *res["actors"].values(), res["watcher"]])
        assert not listed, "the Slurm job outlived its controller"
        assert alive == [], f"processes left after the controller died: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _run_config(tmp: Path) -> Path:
    """configs/two_hosts.yaml, 3 small steps, its two hosts the two workers of a one-node Slurm job."""
    data = yaml.safe_load((ROOT / "configs" / "two_hosts.yaml").read_text())
    data["hosts"]["job"] = {"kind": "slurm", "meshes": {"gen": 1, "train": 1}, "nodes": 1, "cpus_per_task": 1,
                            "time_limit": "00:15:00", "python_exe": sys.executable, "monarch_port": _free_ports(2),
                            "log_dir": str(tmp / "logs")}
    data.update({"rollout": {"task": "addition", "group_size": 4, "prompts_per_rollout": 4, "concurrency": 1,
                             "max_tokens": 8},
                 "train": {"steps": 3, "batch_size": 16, "warmup_steps": 1, "loss_kwargs": {"kl_coef": 0.0}},
                 "eval": {"every": 0, "n": 8}, "tracking": {"wandb": False, "out_dir": str(tmp / "runs")}})
    path = tmp / "slurm.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def slurm_run(cluster, tmp_path_factory):
    """A Run whose generator and trainer run on the Slurm job's workers (tests/slurm_job_main.py run); once it
    has trained 3 steps its job's batch shell gets Slurm's time-limit signal (USR1, as `--signal=B:` sends it)."""
    path = _run_config(tmp_path_factory.mktemp("slurmrun"))
    data = yaml.safe_load(path.read_text())
    data["train"]["steps"] = 1000  # ended by the signal after step 3, not by the step count
    path.write_text(yaml.safe_dump(data))
    out = subprocess.run([sys.executable, str(MAIN), "run", str(path), "3"], env=_env(cluster), capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@integration
def test_a_run_on_slurm_workers_trains_three_steps(slurm_run):
    res = slurm_run
    k = res["steps"][-1]
    assert res["steps"] == list(range(1, k + 1)) and k >= 3, res["steps"]
    # a step whose groups all scored alike has zero advantages and a zero gradient; not all three can
    assert all(x == x for x in res["loss"]) and any(g > 0 for g in res["grad_norm"])
    assert res["version"] == k  # weights crossed from the trainer's worker to the generator's after every step
    print(f"slurm: sbatch to first trained step {res['seconds_to_first_step']:.1f} s")


@integration
def test_interactive_the_time_limit_signal_checkpoints_and_stops_the_run(slurm_run):
    """The controller outside the allocation learns of Slurm's signal (the batch shell's trap writes it to the
    job's stderr, which the controller reads) and the run stops after its step with a checkpoint, saying so."""
    res = slurm_run
    k = res["steps"][-1]
    assert res["state"] == "stopped" and k < 1000, (res["state"], res["message"])
    ckpt = str(Path(res["out_dir"]) / "checkpoints" / f"step_{k:06d}")
    assert res["checkpoint"] == ckpt and ckpt in res["message"] and "time limit" in res["message"], res["message"]
    kinds = [e["kind"] for e in res["events"]]
    assert kinds.index("time_limit") < kinds.index("stopped") < kinds.index("time_limit_checkpoint"), kinds
    assert next(e for e in res["events"] if e["kind"] == "time_limit")["job_id"] == res["job_id"]
    assert (Path(ckpt) / "controller.json").is_file()


@integration
def test_each_part_descends_from_a_slurm_step(slurm_run):
    res = slurm_run
    assert len(res["workers"]) == 2, res["workers"]
    for part in ("generator", "trainer"):
        assert res[part], f"no {part} process reported"
        for pid, chain in res[part].items():
            assert _under_step(chain, res["job_id"]), (part, pid, chain)
            assert any(p["pid"] in res["workers"] for p in chain), (part, pid, "not under a job worker")


@integration
def test_stopping_the_run_cancels_the_job(slurm_run, cluster):
    res = slurm_run
    listed, alive = _wait_gone(cluster, res["job_id"], [*res["workers"], res["watcher"]])
    assert not listed, "the Slurm job outlived the run"
    assert res["alive_after_shutdown"] == [] and alive == [], res


def _submit(cluster, *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "forgelab.runtime.slurm", "submit", *args], env=_env(cluster),
                          capture_output=True, text=True, check=True, timeout=120).stdout.strip()


def _elapsed_s(cluster, job_id: str) -> int:
    """The job's run time so far from squeue (%M: M:SS, H:MM:SS or D-H:MM:SS)."""
    text = cluster.run("squeue", "-h", "-j", job_id, "-o", "%M").stdout.strip()
    days, _, hms = text.rpartition("-")
    secs = 0
    for part in hms.split(":"):
        secs = secs * 60 + int(part)
    return secs + int(days or 0) * 86400


def _metric_steps(run_dir: Path) -> list[int]:
    import csv

    path = run_dir / "metrics.csv"
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return [int(float(r["step"])) for r in csv.DictReader(f) if r.get("step")]


def _batch_summary(cluster, logs: Path, job_id: str) -> dict:
    """The ended batch job's final JSON line (forgelab run's summary), checked COMPLETED (exit status 0)."""
    info = parse_squeue(json.loads(cluster.run("squeue", "--json").stdout), job_id)
    err = "\n".join(p.read_text()[-3000:] for p in logs.glob(f"slurm_{job_id}_*.err"))
    assert info is not None and info.states == ("COMPLETED",), (info, err)  # the controller's exit status: 0
    out = next(logs.glob(f"slurm_{job_id}_*.out")).read_text().strip().splitlines()
    return json.loads(out[-1]) | {"_err": err}


@integration
def test_batch_mode_checkpoints_before_the_time_limit_and_its_resubmission_resumes(cluster, tmp_path):
    """Batch mode end to end: one allocation runs the whole run (no second job from inside it); once it has
    trained, its time limit is cut (`scontrol update TimeLimit`) so that Slurm's `--signal=B:USR1@180` is due;
    the run stops after its step, checkpoints and exits 0 with the reason in its summary; `submit --resume`
    continues from that checkpoint: the next step is the checkpoint's step + 1, the metrics continue."""
    t0 = time.monotonic()
    path = _run_config(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["hosts"]["job"]["signal_before_limit"] = 180
    path.write_text(yaml.safe_dump(data))
    run_dir, logs = tmp_path / "runs" / data["name"], tmp_path / "logs"
    before = {j["job_id"] for j in json.loads(cluster.run("squeue", "--json").stdout)["jobs"]}
    first = _submit(cluster, str(path), "--set", "train.steps=1000")  # it cannot finish before the signal
    deadline = time.monotonic() + 600
    while not _metric_steps(run_dir):
        assert _job_listed(cluster, first) and time.monotonic() < deadline, \
            "\n".join(p.read_text()[-3000:] for p in logs.glob(f"slurm_{first}_*"))
        time.sleep(0.5)  # until the first trained step's row (a condition, bounded)
    to_first_step = time.monotonic() - t0
    # remaining time 120-180 s: within signal_before_limit, so Slurm signals at its next time-limit check (<= 30 s)
    limit_min = _elapsed_s(cluster, first) // 60 + 3
    cluster.run("scontrol", "update", f"JobId={first}", f"TimeLimit={limit_min}")
    listed, _ = _wait_gone(cluster, first, [], timeout=240)
    assert not listed
    after = {j["job_id"] for j in json.loads(cluster.run("squeue", "--json").stdout)["jobs"]}
    assert after - before == {int(first)}, (before, after)  # the controller adopted its allocation
    a = _batch_summary(cluster, logs, first)
    assert TIME_LIMIT_LINE in a["_err"], a["_err"]
    k = a["steps"]
    ckpt = run_dir / "checkpoints" / f"step_{k:06d}"
    assert a["state"] == "stopped" and "time limit" in a["message"] and str(ckpt) in a["message"], a
    assert 1 <= k < 1000 and (run_dir / "checkpoints" / "LATEST").read_text() == ckpt.name
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["kind"] == "time_limit" and e["job_id"] == first for e in events), [e["kind"] for e in events]
    t_first_job = time.monotonic() - t0

    second = _submit(cluster, str(path), "--resume", "--set", f"train.steps={k + 1}")
    listed, _ = _wait_gone(cluster, second, [], timeout=600)
    assert not listed
    b = _batch_summary(cluster, logs, second)
    assert b["state"] == "finished" and b["steps"] == k + 1, b
    assert _metric_steps(run_dir) == list(range(1, k + 2))  # the metrics continue: no step twice, none missing
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["kind"] == "resumed_from_checkpoint" and e["path"] == str(ckpt) for e in events)
    e = b["episodes"]  # every generated episode is accounted for
    assert e["generated"] == e["trained"] + e["evicted"] + e["dropped"] + e["buffered"] + e["in_flight"], e
    print(f"slurm batch: submit to first step {to_first_step:.1f} s; first job (to its checkpoint at step {k} and "
          f"exit) {t_first_job:.1f} s; whole test {time.monotonic() - t0:.1f} s")
