"""Cores busy as a headline (`forgelab.runtime.cpu_use`): the computation against an independent one, the CPU
seconds read from /proc against the kernel's own accounting, and the keys in the demo's JSON (`follow_run`) and
the services panel on a short run against in-process fakes."""
from __future__ import annotations

import asyncio
import os
import random
import time

import pytest

from forgelab.runtime.cpu_use import CpuSample, cpu_use_between, process_cpu_s

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def test_cpu_use_between_matches_a_direct_sum():
    rng = random.Random(3)
    for _ in range(50):
        parts = ["controller", "generator", "trainer", "reference", "envs"]
        before = {pid: (rng.choice(parts), rng.uniform(0, 100)) for pid in range(1, 12)}
        after = {}
        for pid, (part, t) in before.items():
            if rng.random() < 0.8:  # still alive: it spent something more
                after[pid] = (part, t + rng.uniform(0, 20))
        for pid in range(100, 100 + rng.randint(0, 3)):  # started in between
            after[pid] = (rng.choice(parts), rng.uniform(0, 5))
        wall, cores, eps = rng.uniform(1, 50), rng.choice([1, 2, 16]), rng.randint(0, 500)
        u = cpu_use_between(CpuSample(7.0, before, 10), CpuSample(7.0 + wall, after, 10 + eps), cores)
        # independently: each live process's CPU seconds since `before` (all of it for the new ones)
        spent = [after[p][1] - (before[p][1] if p in before else 0.0) for p in after]
        assert u is not None
        assert u.cores_busy == pytest.approx(sum(spent) / (wall * cores), rel=1e-12)  # float64 sums of ~15 terms
        assert u.cpu_s_per_episode == (pytest.approx(sum(spent) / eps, rel=1e-12) if eps else None)
        assert sum(u.per_part.values()) == pytest.approx(u.cores_busy, rel=1e-12)
    assert cpu_use_between(CpuSample(5.0, {}, 0), CpuSample(5.0, {}, 0), 2) is None  # no wall time: no answer


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_process_cpu_seconds_agree_with_the_kernels_accounting():
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # some CPU time of our own to read
        pass
    lo = sum(os.times()[:2])
    got = process_cpu_s(os.getpid(), children=False)
    hi = sum(os.times()[:2])
    # /proc counts whole clock ticks of user and system time: at most one tick short of each
    assert lo - 2 * TICK_S <= got <= hi + 2 * TICK_S, (lo, got, hi)
    assert process_cpu_s(2 ** 22 + 1) is None  # beyond pid_max: gone


def test_cores_busy_in_the_demo_json_and_the_services_panel(tmp_path):
    from forgelab.config.run_config import EvalConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig
    from forgelab.lab.controls_panel import ServicesPanel
    from forgelab.lab.summary import services_lines
    from forgelab.progress import follow_run
    from forgelab.run import Run
    from forgelab.testing.fakes import fake_spawn

    cfg = RunConfig(name="cpu", rollout=RolloutConfig(task="addition", group_size=4, prompts_per_rollout=2, concurrency=2,
                                                      max_tokens=6),
                    train=TrainConfig(steps=5, batch_size=8, warmup_steps=1), eval=EvalConfig(every=0, n=8),
                    tracking=TrackingConfig(out_dir=str(tmp_path), wandb=False))
    run = Run(cfg, spawn=fake_spawn)

    async def go():
        await run.start()
        await run.until(step=3, timeout=60)
        panel = ServicesPanel(run)
        panel.widget
        panel.refresh()
        view = (panel.table.value, services_lines(run), run.status()["cpu_use"])
        return view, await follow_run(run, started_at=time.time())

    (html, lines, status_use), result = asyncio.run(go())
    # fake steps take milliseconds and /proc counts 10 ms ticks: the values may round to 0, but they are there
    assert status_use is not None and 0 <= status_use["cores_busy"] <= 1 and status_use["cpu_s_per_episode"] >= 0
    assert "cores busy" in html and "CPU-s per episode" in html
    assert any(line.startswith("cores busy") for line in lines), lines
    # the demo's JSON: the steady state from the end of step 1 to the end of the last step, recomputed here
    first, last = run.cpu.first, run.cpu.last
    expected = cpu_use_between(first, last, run.cpu.cores)
    assert last.episodes - first.episodes == (cfg.train.steps - 1) * cfg.train.batch_size
    assert result["cores_busy"] == round(expected.cores_busy, 3)
    assert result["cpu_s_per_episode"] == round(expected.cpu_s_per_episode, 4)
    assert set(result["cores_busy_by_part"]) == {"controller"}  # the fakes run inside the controller


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_a_part_that_is_the_controllers_child_counts_once():
    import subprocess
    import sys

    from forgelab.runtime.cpu_use import CpuMeter

    # a child that burns CPU, as Monarch's processes are the controller's children
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time() + 0.5\n"
                              "while time.process_time() < t: pass\ntime.sleep(60)"])
    try:
        while process_cpu_s(child.pid, children=False) < 0.4:  # until it has burnt its CPU (it then sleeps)
            time.sleep(0.05)
        meter = CpuMeter(lambda: {"controller": [os.getpid()], "generator": [child.pid]}, episodes=lambda: 0, cores=2)
        s = meter.sample()
        own = process_cpu_s(os.getpid(), children=False)
        child_s = process_cpu_s(child.pid)
        # the controller's entry is itself (plus children that are no part): not the generator's seconds again
        assert s.cpu_s[child.pid] == ("generator", child_s)
        assert s.cpu_s[os.getpid()][1] < own + child_s - 0.3, (s.cpu_s, own, child_s)
        assert process_cpu_s(os.getpid()) >= own + child_s - 2 * TICK_S  # unskipped, the child is in
    finally:
        child.kill()
        child.wait()
