"""forgelab's Slurm job (forgelab/runtime/slurm.py) against a real Slurm: a single-node cluster on loopback.

The integration tests start Debian 12's Slurm 22.05 (munged, slurmctld, slurmd; tests/slurm_cluster.py: its own
slurm.conf, munge key, ports and state in a temp dir, nothing of the machine's own setup used) and submit with the
real `sbatch`. The only node is this machine (2 CPUs); the generator and the trainer are two Slurm tasks of one
`srun` step on it, exactly as on two nodes (`nodes: 2`) except for the node count. The job runs in a child
process (tests/slurm_job_main.py): a Slurm job switches its process's Monarch transport to TCP for good.

Slurm 24.11+'s `squeue --json` layout is tested from tests/data/squeue_24_11.json, a fixture built by hand from
that version's documented layout (not captured: 22.05 is the only Slurm installable here); tests/data/
squeue_22_05.json is the real output of `squeue --json --job 2` on the test cluster (it lists both jobs: 22.05
ignores `--job` there). Without Slurm the integration tests skip, and fail with CI set (`make setup` installs
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
    SlurmConfig,
    SlurmConfigError,
    batch_script,
    parse_squeue,
    parse_srun_errors,
    worker_addresses,
    worker_of_task,
)

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
    assert script.splitlines()[-1].startswith("srun ")


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
])
def test_bad_config_is_named(bad, names):
    with pytest.raises(SlurmConfigError, match=names.replace("[", r"\[")):
        SlurmConfig.from_dict({"kind": "slurm", **bad})


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
        assert _job_listed(cluster, res["job_id"]) and psutil.pid_exists(res["actors"]["train"])  # the rest runs on

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
    """A Run whose generator and trainer run on the Slurm job's workers (tests/slurm_job_main.py run)."""
    path = _run_config(tmp_path_factory.mktemp("slurmrun"))
    out = subprocess.run([sys.executable, str(MAIN), "run", str(path)], env=_env(cluster), capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@integration
def test_a_run_on_slurm_workers_trains_three_steps(slurm_run):
    res = slurm_run
    assert res["state"] == "finished", res["message"]
    assert res["steps"] == [1, 2, 3]
    # a step whose groups all scored alike has zero advantages and a zero gradient; not all three can
    assert all(x == x for x in res["loss"]) and any(g > 0 for g in res["grad_norm"])
    assert res["version"] == 3  # weights crossed from the trainer's worker to the generator's after every step
    print(f"slurm: sbatch to first trained step {res['seconds_to_first_step']:.1f} s")


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


@integration
def test_batch_mode_runs_the_whole_run_in_one_allocation(cluster, tmp_path):
    path = _run_config(tmp_path)
    before = {j["job_id"] for j in json.loads(cluster.run("squeue", "--json").stdout)["jobs"]}
    job_id = subprocess.run([sys.executable, "-m", "forgelab.runtime.slurm", "submit", str(path)], env=_env(cluster),
                            capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    listed, _ = _wait_gone(cluster, job_id, [], timeout=600)
    assert not listed
    info = parse_squeue(json.loads(cluster.run("squeue", "--json").stdout), job_id)
    logs = tmp_path / "logs"
    err = "\n".join(p.read_text()[-3000:] for p in logs.glob(f"slurm_{job_id}_*.err"))
    assert info is not None and info.states == ("COMPLETED",), (info, err)  # the controller's exit status: 0
    # the controller adopted its own allocation: no second job was submitted from inside it
    after = {j["job_id"] for j in json.loads(cluster.run("squeue", "--json").stdout)["jobs"]}
    assert after - before == {int(job_id)}, (before, after)
    out = next(logs.glob(f"slurm_{job_id}_*.out")).read_text().strip().splitlines()
    summary = json.loads(out[-1])
    assert summary["steps"] == 3, out[-8:]
    e = summary["episodes"]  # every generated episode is accounted for
    assert e["generated"] == e["trained"] + e["evicted"] + e["dropped"] + e["buffered"] + e["in_flight"], e
