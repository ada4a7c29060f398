"""Rollouts at scale, real cluster jobs: a Run placed over Monarch's SSH job, against a real sshd.

The test starts OpenSSH's server on loopback with its own host key and an authorised client key it generates
(nothing of the machine's own ssh setup is used or changed). Two "hosts" are two loopback addresses,
127.0.0.1 and 127.0.0.2, each running one Monarch worker that `SSHJob` starts over ssh, exactly as on two
cluster nodes; only `hosts.job` differs from a real cluster. Without an sshd binary the test skips locally and
fails under CI (`make setup` installs openssh-server where it can: root and apt).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "two_hosts.yaml"
HOSTS = ("127.0.0.1", "127.0.0.2")


def _sshd_binary() -> str:
    path = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
    if path is None:
        reason = "no sshd (OpenSSH server) on this machine; `make setup` installs it as root with apt"
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and the ssh job test cannot run: {reason}", pytrace=False)
        pytest.skip(f"{reason} (with CI set this fails instead)")
    return path


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait_for_port(host: str, port: int, proc: subprocess.Popen, log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited ({proc.returncode}): {log.read_text() if log.exists() else ''}")
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)  # waiting on a condition (the port accepting), bounded by the deadline
    raise RuntimeError(f"sshd did not listen on {host}:{port} within {timeout}s: {log.read_text()}")


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """A private sshd on 127.0.0.1 and 127.0.0.2 (port chosen here); yields the ssh arguments that reach it."""
    binary = _sshd_binary()
    d = tmp_path_factory.mktemp("sshd")
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
    (d / "authorized_keys").chmod(0o600)
    port = _free_port()
    (d / "sshd_config").write_text("\n".join([
        f"Port {port}", *(f"ListenAddress {h}" for h in HOSTS), f"HostKey {d / 'host_key'}",
        f"AuthorizedKeysFile {d / 'authorized_keys'}", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password", "StrictModes no", "UsePAM no", f"PidFile {d / 'sshd.pid'}",
        # the worker inherits the test's environment the way a cluster's login shell would set it
        "PermitUserEnvironment no", "",
    ]))
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # OpenSSH's privilege-separation directory
    log = d / "sshd.log"
    proc = subprocess.Popen([binary, "-D", "-f", str(d / "sshd_config"), "-E", str(log)])
    try:
        for h in HOSTS:
            _wait_for_port(h, port, proc, log)
        args = ["-p", str(port), "-i", str(d / "client_key"), "-o", "StrictHostKeyChecking=no",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes"]
        out = subprocess.run(["ssh", *args, HOSTS[1], "-n", "echo ok"], capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == "ok", f"ssh to the test's sshd failed: {out.stderr}"
        yield args, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _host_of(pid: int, res: dict, procs: dict) -> str | None:
    """The job host whose worker `pid` descends from (None: not under any of them)."""
    by_pid = {v: k for k, v in res["workers"].items()}
    for parent in procs[str(pid)]:
        if parent in by_pid:
            return by_pid[parent]
    return None


@pytest.fixture(scope="module")
def ssh_run(sshd, tmp_path_factory):
    """The Run over the SSH job, in its own process (tests/ssh_job_main.py): an SSHJob switches its process's
    Monarch transport to TCP for good."""
    import json

    tmp = tmp_path_factory.mktemp("sshrun")
    monarch_port = _free_port()
    data = yaml.safe_load(CONFIG.read_text())
    data["hosts"]["job"] = {"kind": "ssh", "meshes": {"gen": [HOSTS[0]], "train": [HOSTS[1]]},
                            "python_exe": sys.executable, "ssh_args": sshd[0], "monarch_port": monarch_port}
    data.update({"rollout": {"task": "addition", "group_size": 4, "prompts_per_rollout": 4, "concurrency": 1,
                             "max_tokens": 8},
                 "train": {"steps": 3, "batch_size": 16, "warmup_steps": 1, "loss_kwargs": {"kl_coef": 0.0}},
                 "eval": {"every": 0, "n": 8}, "tracking": {"wandb": False, "out_dir": str(tmp / "runs")}})
    path = tmp / "ssh.yaml"
    path.write_text(yaml.safe_dump(data))
    script = Path(__file__).resolve().parent / "ssh_job_main.py"
    out = subprocess.run([sys.executable, str(script), str(path), str(monarch_port), *HOSTS], capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), sshd[1]


def test_a_run_over_the_ssh_job_trains_three_steps(ssh_run):
    """Claim: a Run placed over Monarch's SSH job (two loopback hosts behind a real sshd) trains, and its
    weights cross hosts after every step. Structural: 3 steps of 16 (the time is the job's two cold starts)."""
    res, _ = ssh_run
    assert res["state"] == "finished", res["message"]
    assert res["steps"] == [1, 2, 3]
    # a step whose groups all scored alike has zero advantages and a zero gradient; not all three can
    assert all(x == x for x in res["loss"]) and any(g > 0 for g in res["grad_norm"])
    assert res["version"] == 3  # weights crossed from the trainer's host to the generator's after every step


def test_each_part_runs_under_its_ssh_host(ssh_run):
    res, sshd_pid = ssh_run
    assert set(res["workers"]) == set(HOSTS), f"expected one worker per host started over ssh, found {res['workers']}"
    for host, chain in res["worker_parents"].items():  # each started by the ssh server for a login of the job's
        assert sshd_pid in chain, (host, chain)
    assert {_host_of(int(p), res, res["generator"]) for p in res["generator"]} == {HOSTS[0]}
    assert {_host_of(int(p), res, res["trainer"]) for p in res["trainer"]} == {HOSTS[1]}


def test_the_parts_heartbeats_reach_the_controller_over_the_network(ssh_run):
    """The parts on the ssh hosts send their heartbeats to the controller's UDP sink (docs/hangs.md, "Processes on
    other hosts"), signed with the key their spawn message carried over the job's channel."""
    res, _ = ssh_run
    pids = set(res["generator"]) | set(res["trainer"])
    assert set(res["heard"]) == pids, res["heard"]
    for pid, rec in res["heard"].items():
        assert rec is not None and rec["beat"] >= 1 and rec["counters"], (pid, rec)


def test_shutdown_stops_the_ssh_workers(ssh_run):
    res, _ = ssh_run
    assert res["workers"] and res["alive_after_shutdown"] == [], f"ssh workers still running: {res}"


# --- environment replicas under load ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def env_replica_killed(loop, tmp_path_factory):
    """A Run on 2 environment replicas with about 1,000 episodes in flight; one replica is killed then, and the
    run trains its 2 steps. Waits are on conditions: the buffer reaching 1,000, the run ending, the killed
    replica restarted (the service does that on its own; on a loaded machine it may come after the run ends)."""
    import asyncio
    import signal

    from forgelab.config import RunConfig
    from forgelab.run import Run

    tmp = tmp_path_factory.mktemp("envkill")
    cfg = RunConfig.from_dict({
        "name": "envkill",
        # each episode: 2 turns, the environment thinks 1 s per step: an episode is in flight for at least 2 s, so
        # the kill (within a 0.05 s poll of the buffer reaching 1,000) finds the victim's rollouts running
        "rollout": {"task": "addition", "env": "echo", "env_kwargs": {"turns": 2, "think_s": 1.0}, "max_turns": 2,
                    "group_size": 8, "prompts_per_rollout": 32, "concurrency": 4, "max_tokens": 4,
                    "env_step_timeout_s": 60.0},
        # admission lets (served version + max_policy_age + 1) * batch_size = 1024 episodes be live at the start;
        # 2 steps (1,024 trained) cannot be filled by the 1,024 admitted before the kill, of which at least one
        # rollout (256) is lost: the run must go on generating after the kill
        "train": {"steps": 2, "batch_size": 512, "warmup_steps": 1, "max_policy_age": 1,
                  "loss_kwargs": {"kl_coef": 0.0}},
        "placement": {"reference": False, "env_replicas": 2},
        "eval": {"every": 0, "n": 8},
        "tracking": {"wandb": False, "out_dir": str(tmp / "runs")},
    })
    run = Run(cfg)

    async def go():
        await run.start()
        deadline = time.monotonic() + 600
        # episodes being played: admitted slots not yet added or dropped (the condition itself, checked until
        # it holds)
        while run.buffer.reserved < 1000:
            assert time.monotonic() < deadline and run.state == "running", (run.state, run.buffer.counts())
            await asyncio.sleep(0.05)
        victim = run.parts.envs.status()[0]
        in_flight = run.buffer.reserved
        os.kill(victim.pid, signal.SIGKILL)
        await run.wait()
        deadline = time.monotonic() + 120
        while not (run.parts.envs.status()[victim.index].restarts >= 1
                   and all(s.healthy for s in run.parts.envs.status())) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # the service restarting the killed replica (asserted by the test)
        return victim, in_flight

    try:
        victim, in_flight = loop.run_until_complete(go())
        yield run, victim, in_flight
    finally:
        loop.run_until_complete(run.shutdown())


def test_killing_an_env_replica_at_1000_in_flight_loses_no_episode(env_replica_killed):
    """Claim: with >= 1,000 episodes in flight, SIGKILLing one of two environment replicas loses no episode: the
    run trains all its steps (more episodes than were admitted before the kill), the killed replica's rollouts
    are counted unused in rollout_error events (whole rollouts of 256), every episode id is accounted for, and
    the service restarts the replica. Structural: the fixture's 1,024 admitted episodes (batch 512, staleness
    bound 1) are the smallest load that reaches 1,000; 2 steps are the fewest that need episodes generated after
    the kill."""
    run, victim, in_flight = env_replica_killed
    assert in_flight >= 1000
    c = run.buffer.check_accounting()  # generated == trained + evicted + dropped + buffered + in_flight
    assert run.state == "finished", run.message
    assert c["trained"] == run.config.train.steps * 512 == 1024
    # the killed replica's rollouts never reached the controller: their ids are counted unused, rollout by
    # rollout (a rollout is 32 x 8 = 256 episodes), each in a rollout_error event; every id is accounted for
    # (ids_unused also counts the rollouts cancelled when the run ended)
    errors = [e for e in run.events if e["kind"] == "rollout_error"]
    never = sum(e["episodes_never_generated"] for e in errors)
    lost = never + sum(e["episodes_dropped"] for e in errors)
    assert errors and lost >= 256 and lost % 256 == 0 and never <= run.rollout.ids_unused
    assert c["generated"] + run.rollout.ids_unused == run.rollout.next_episode_id
    assert all("envactor" in e["message"] for e in errors)
    # the service replaced the replica: both replicas healthy again, the killed one restarted
    status = run.parts.envs.status()
    assert all(s.healthy for s in status) and status[victim.index].restarts >= 1


# --- in-flight weight updates -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inflight_run(loop, tmp_path_factory):
    """Async GRPO with generator.update_mode inflight. Every completion is at least 48 tokens (min_tokens) and
    three rollouts of 8 overlap (max_policy_age 2 admits 24 episodes ahead of a batch of 8), so the generator is
    busy when a step's weights arrive. The run trains until an episode with tokens of two versions has been
    trained (a condition, checked at every step and event), at most 12 steps."""
    from forgelab.config import RunConfig
    from forgelab.controller.rollout_log import read_rollouts
    from forgelab.run import Run

    tmp = tmp_path_factory.mktemp("inflight")
    cfg = RunConfig.from_dict({
        "name": "inflight",
        "model": {"max_model_len": 128},
        "rollout": {"task": "addition", "group_size": 4, "prompts_per_rollout": 2, "concurrency": 3, "max_tokens": 64},
        "generator": {"update_mode": "inflight", "sampling": {"min_tokens": 48}},
        "train": {"steps": 12, "batch_size": 8, "warmup_steps": 1, "max_policy_age": 2,
                  "loss_kwargs": {"kl_coef": 0.0}},
        "placement": {"reference": False},
        "eval": {"every": 0, "n": 8},
        "tracking": {"wandb": False, "out_dir": str(tmp / "runs")},
    })
    run = Run(cfg)

    def mixed_trained(r) -> bool:
        return r.state != "running" or any(
            "token_versions" in ep.info and r.buffer.status(ep.id) == "trained" for ep in list(r.rollout.recent))

    async def go():
        await run.start()
        await run.until(predicate=mixed_trained, timeout=600)
        await run.stop()  # after the current step and its weight push
        return (await run.parts.generators.fanout("stats"))[0]

    try:
        stats = loop.run_until_complete(go())
        loop.run_until_complete(run.shutdown())  # the rollout log's last part is written when the run stops
        yield run, stats, read_rollouts(run.out_dir)
    finally:
        loop.run_until_complete(run.shutdown())


def test_inflight_trains_episodes_whose_tokens_come_from_two_versions(inflight_run):
    import json

    run, stats, df = inflight_run
    assert run.state in ("running", "finished", "stopped"), run.message
    # every push was loaded in flight (none drained), and some requests ran across one
    assert stats["inflight_updates"] == stats["weight_updates"] == run.version, stats
    assert stats["requests_spanning_versions"] >= 1, stats
    trained = df[df["status"] == "trained"]
    assert len(trained) == 8 * run.step
    mixed = []
    for _, r in trained.iterrows():
        runs = json.loads(r["info"]).get("token_versions") if isinstance(r["info"], str) else r["info"].get("token_versions")
        if runs:
            mixed.append((r, runs))
    assert mixed, "no trained episode has tokens of two versions: every push landed between rollouts"
    for r, runs in mixed:
        versions = [v for v, _ in runs]
        starts = [s for _, s in runs]
        # run-length pairs: the first from token 0 at the episode's version (the oldest: what staleness counts),
        # later ones strictly newer, starting inside the completion
        assert starts[0] == 0 and versions[0] == r["policy_version"], runs
        assert versions == sorted(set(versions)) and len(versions) >= 2, runs
        assert starts == sorted(set(starts)) and starts[-1] < len(r["completion_ids"]), runs
        # the staleness bound held on the oldest token: trained at most max_policy_age versions after it
        assert r["trained_step"] - 1 - r["policy_version"] <= 2
        # every token still has its behaviour logprob, as the loss's importance weights use
        assert len(r["generator_logprobs"]) == len(r["completion_ids"])


def test_step_metrics_carry_the_generators_kv_cache_usage_and_preemptions(inflight_run):
    run, stats, _ = inflight_run
    m = run.metrics
    cols = ["generator/kv_cache_usage", "generator/kv_cache_usage_now", "generator/preemptions",
            "generator/preemptions_per_request"]
    assert set(cols) <= set(m.columns), sorted(c for c in m.columns if c.startswith("generator/"))
    usage = m["generator/kv_cache_usage"]
    # rollouts of 8 running 64-token requests hold blocks through every step: some usage, never above the cache
    assert ((usage >= 0) & (usage <= 1)).all() and (usage > 0).any(), usage.tolist()
    # the rows' preemptions add up to the engine's own count at the last row (1 GiB holds them all: 0 here)
    assert m["generator/preemptions"].sum() <= stats["preemptions"]
