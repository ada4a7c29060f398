"""Benchmark suites: pure helpers, and every suite's ``--quick`` mode run for real.

The quick modes (marked integration) run each suite as ``python -m
forgelab.bench NAME --quick`` in a fresh process, exactly as a user would,
and check the last line's JSON: the suite's headline keys from
``forgelab.bench.all.GOALS`` (every suite must have an entry there) plus the
keys its readers rely on. They prove the code path, not the numbers: no
wall-clock value is compared with a goal here.
"""
import importlib
import json
import numbers
import os
import subprocess
import sys

import pytest

from forgelab.bench import module_name, suites
from forgelab.bench.common import emit_json, machine_info

SUITES = ["all", "async", "dashboard", "e2e", "generator", "limits", "runtime", "weight_sync", "envs", "startup"]
#: Suites run by `bench all`: everything but the tools.
RUNNABLE = sorted(set(suites()) - {"all", "plot"})

#: Keys beyond the GOALS headline each suite's quick JSON must hold (what docs, `all` and the plot read).
EXTRA_KEYS = {
    "e2e": {"pairs", "trl_threads", "trl_s_per_step_by_threads", "censored", "ci95", "ci95_cold",
            "forgelab_over_trl", "forgelab_time_to_target_s", "trl_time_to_target_s", "forgelab_startup_s",
            "trl_startup_s", "forgelab_eval_s", "trl_eval_s", "goals_met"},
    "async": {"async_over_sync_by_age", "censored", "time_to_target_s", "ci95", "s_per_step"},
    "dashboard": {"lab_cpu_ms_per_step", "step_s_on", "ci95", "pair_ratios"},
    "variants": {"one_s", "four_s", "separate_s", "trainer_s_per_step_one", "trainer_s_per_step_four",
                 "cpu_util_one", "cpu_util_four", "four_over_one_cpu_floor"},
    "distill": {"censored", "curves", "target", "teacher_accuracy", "s_per_step"},
    "inflight": {"heldout_accuracy_drain", "heldout_accuracy_inflight", "accuracy_spread", "learning_not_worse",
                 "censored", "time_to_target_s", "inflight_over_drain_s_per_step", "drain_wait_s",
                 "process_sets_spawned", "update_mode_served", "weight_updates", "inflight_updates"},
    "agent_door": {"ci95", "round_ratios", "native_s_per_episode", "door_s_per_episode", "tokens_per_episode",
                   "rounds_with_failures", "door_1k", "native_1k", "accounting_holds", "goals_met"},
    "primitives": {"primitives_over_fused_ci95", "fused_s_per_step", "primitives_s_per_step", "rest_over_python_ci95",
                   "rest_s_per_step"},
}


def _is_number_or_numbers(v) -> bool:
    if isinstance(v, dict):
        return bool(v) and all(_is_number_or_numbers(x) for x in v.values())
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def test_every_runnable_suite_has_a_goal():
    from forgelab.bench.all import GOALS

    for name in RUNNABLE:
        assert name in GOALS, f"suite {name!r} has no entry in forgelab.bench.all.GOALS"
        assert any(ok is not None for _, ok in GOALS[name].values()), f"suite {name!r} has no goal with a predicate"


@pytest.fixture(scope="module")
def quick_env():
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.integration
@pytest.mark.parametrize("name", RUNNABLE)
def test_quick_mode_runs_and_reports(name, quick_env):
    from forgelab.bench.all import GOALS

    proc = subprocess.run([sys.executable, "-m", "forgelab.bench", name, "--quick"], env=quick_env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{name} --quick failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n" \
                                 f"{proc.stderr[-3000:]}"
    last = [ln for ln in proc.stdout.splitlines() if ln.strip()][-1]
    result = json.loads(last)
    assert result["suite"] == name and ("machine" in result or "loadavg_start" in result)
    missing = (set(GOALS[name]) | EXTRA_KEYS.get(name, set())) - set(result)
    assert not missing, f"{name} --quick JSON lacks {sorted(missing)}: {sorted(result)}"
    for key, (_, ok) in GOALS[name].items():
        if ok is not None:
            assert _is_number_or_numbers(result[key]), f"{name}: headline {key} = {result[key]!r} is not a number"
    if name == "e2e":
        assert set(result["trl_s_per_step_by_threads"]) == {"1", "2"}
        assert str(result["trl_threads"]) in result["trl_s_per_step_by_threads"]
        assert set(result["censored"]) == {"forgelab", "trl"} and result["pairs"] >= 1
        assert len(result["ci95"]) == 2 and len(result["ci95_cold"]) == 2
        assert result["forgelab_over_trl"] == result["forgelab_over_trl_warm"]
        assert ("trl_vllm" in result) != ("trl_vllm_error" in result)
    # -- quick modes shrunk in #39: each part still ran and produced its numbers (not an empty window or a NaN)
    if name == "envs":  # every wave level, both steady levels and the replicas level had episodes back in a window
        assert set(result["levels"]) == {"1", "10", "100"} and set(result["steady"]) == {"10", "100"}, result
        assert all(s["episodes_per_s"] > 0 for s in result["steady"].values()), result["steady"]
        assert result["episodes_in_flight_max"] > 0 and result["big"]["2"]["episodes_per_s"] > 0, result["big"]
        assert result["turn_latency_p99_ms_at_10k"] == result["turn_latency_p99_ms_at_10k"], result["big"]  # not NaN
    if name == "startup":  # the warm run got the cold run's processes back
        assert result["same_processes"] and result["processes"] >= 2, result
    if name == "lora":  # both loops ran, each process's peak measured; only the full loop has a reference process
        loops = result["loops"]
        assert loops["full_tiny"]["reference_process"] and not loops["lora_tiny"]["reference_process"], loops
        assert all(v > 0 for lp in result["loops"].values() for v in lp["peak_pss_gib"].values()), result["loops"]
    if name == "realmodel":  # the loop's three processes were sampled and compared with the plan
        assert set(result["peak_pss_gib"]) == {"generator0", "trainer0", "reference0"}, result["peak_pss_gib"]
        assert all(v > 0 for v in result["peak_pss_gib"].values()) and result["steps"] == 1, result
    if name == "distill":  # both arms ran and were evaluated at step 0 and after training
        assert set(result["censored"]) == {"distill", "grpo"}
        assert all(len(c) == 1 and len(c[0]) >= 2 for c in result["curves"].values()), result["curves"]
    if name == "inflight":  # both modes ran on one set of processes, each run's pushes loaded in its own mode
        assert result["process_sets_spawned"] == 1, result
        assert result["update_mode_served"] == {"drain": ["drain"], "inflight": ["inflight"]}, result
        for mode, ups in result["weight_updates"].items():
            assert ups and all(u >= 1 for u in ups), result["weight_updates"]
            assert result["inflight_updates"][mode] == (ups if mode == "inflight" else [0] * len(ups)), result
    if name == "agent_door":  # both paths played every episode and the accounting identity held
        assert result["rounds_with_failures"] == 0 and result["door_1k"]["failed"] == 0, result
        assert result["accounting_holds"] and result["agent_counters"]["agent/retokenized_segments"] == 0, result
    if name == "async":
        assert set(result["time_to_target_s"]) == {"0", "1", "2"}
        assert result["async_over_sync_default"] == result["async_over_sync_by_age"]["1"]
    # -- agent_lift, variants: what their smaller quick modes must still have run (issue 39) --
    if name == "agent_lift":  # both arms trained every step on the pooled processes; the door's episodes trained
        for arm in ("native", "door"):
            (r,) = result["per_seed"][arm]
            assert r["steps"] == result["steps"] and r["accounting_holds"], result
        door = result["per_seed"]["door"][0]  # quick: 2 problems x 4 sessions a step
        assert door["sessions"] - door["failed"] >= 8 * result["steps"] and door["retokenized_segments"] == 0, result
    if name == "variants":  # the one variant's steps, then each of the four forks' own steps, on the shared trainer
        assert result["trainer_steps"] == 5 * result["steps"], result


def test_update_mode_is_not_in_the_engine_key(tmp_path):
    """The inflight bench runs both modes on one pooled set: the update mode is set per run (`_reinit`)."""
    import dataclasses

    from forgelab.demo import demo_config
    from forgelab.engines.pool import engine_key

    cfg = demo_config(10, out_dir=str(tmp_path))
    modes = [dataclasses.replace(cfg, generator=dataclasses.replace(cfg.generator, update_mode=m)) for m in
             ("drain", "inflight")]
    assert engine_key(modes[0]) == engine_key(modes[1])
    other = dataclasses.replace(cfg, generator=dataclasses.replace(cfg.generator, max_num_seqs=64))
    assert engine_key(other)["generator"] != engine_key(cfg)["generator"]  # an engine setting still is


def test_suites_registered():
    names = suites()
    for name in SUITES:
        assert name in names
    assert "async_" not in names and "common" not in names
    assert module_name("async") == "forgelab.bench.async_"


@pytest.mark.parametrize("name", SUITES)
def test_suite_imports(name):
    mod = importlib.import_module(module_name(name))
    assert callable(mod.main)


def test_machine_info_keys(capsys):
    m = machine_info()
    assert set(m) == {"cores", "cpu", "loadavg"} and m["cores"] >= 1
    emit_json({"suite": "x", "machine": m})
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["machine"] == m


def _ev(step, wall, acc, eval_s=1.0, end=None):
    return {"step": step, "wall_s": wall, "accuracy": acc, "eval_s": eval_s, "end_unix": end}


def test_e2e_summary_counts_evaluations_and_censors_misses():
    from forgelab.bench._stats import censored_time
    from forgelab.bench.e2e import summarize

    # step 0 eval ends at t0 (unix 100); steps end at 3, 6 (eval 6..7 at step 2), 9, 12 (eval 12..13 at step 4)
    evals = [_ev(0, 0.0, 0.25, end=100.0), _ev(2, 7.0, 0.3, end=107.0), _ev(4, 13.0, 0.41, end=113.0)]
    res = {"evals": evals, "step_end_s": [3.0, 7.0, 10.0, 12.0], "popen_unix": 80.0, "startup_s": 15.0}
    r = summarize("forgelab", res, 0.4)
    assert {"reached", "time_to_target_s", "cold_to_target_s", "steps_to_target", "end_s", "cold_end_s",
            "final_step", "final_accuracy", "s_per_step", "curve"} <= set(r)
    # warm: evaluations included (13.0); cold adds the 20 s from launch to t0; s/step leaves out the
    # one evaluation that ended before the last step (12 - 1) / 4
    assert (r["time_to_target_s"], r["cold_to_target_s"], r["steps_to_target"]) == (13.0, 33.0, 4)
    assert r["s_per_step"] == pytest.approx(2.75)
    missed = summarize("trl", {**res, "evals": evals[:2]}, 0.4)
    assert not missed["reached"] and missed["time_to_target_s"] is None and missed["final_step"] == 2
    assert censored_time(missed) == 7.0 and censored_time(missed, "cold_to_target_s", "cold_end_s") == 27.0
    # a hit at step 0 is not a hit: training has not started
    assert not summarize("x", {"evals": [_ev(0, 0.0, 0.9)], "step_end_s": []}, 0.4)["reached"]


def test_bootstrap_interval_brackets_the_median():
    import statistics

    from forgelab.bench._stats import bootstrap_median_ci, median_ratio

    vals = [0.3, 0.45, 0.5, 0.55, 0.9]
    lo, hi = bootstrap_median_ci(vals)
    assert lo <= statistics.median(vals) <= hi and lo >= min(vals) and hi <= max(vals) and lo < hi
    assert bootstrap_median_ci(vals) == bootstrap_median_ci(vals)  # seeded: the same JSON twice
    med, ci = median_ratio([(1.0, 2.0), (3.0, 4.0), (2.0, 2.0)])
    assert med == 0.75 and ci[0] <= 0.75 <= ci[1]


def test_async_ratio_is_the_default_age_with_misses_included():
    from forgelab.bench.async_ import async_ratio

    # age 2 is faster, but the headline is the default age 1; times are already censored
    assert async_ratio({0: [10.0, 12.0, 14.0], 1: [8.0, 9.0, 30.0], 2: [5.0]}) == 0.75
    assert async_ratio({0: [10.0], 1: [8.0], 2: [4.0]}, age=2) == 0.4
    assert async_ratio({0: [10.0], 1: []}) is None


def test_trl_probe_seconds_per_step():
    from forgelab.bench.e2e import probe_s_per_step

    assert probe_s_per_step({"step_end_s": [4.0, 5.0, 5.5, 6.0, 6.5]}) == 0.5  # first step's warm-up left out


def test_dashboard_segments():
    from forgelab.bench.dashboard_bench import segment_rates

    times = {s: float(s) for s in range(1, 9)}  # one step per second
    assert segment_rates(times, 4, 2) == [1.0, 1.0]


def test_limits_fraction():
    from forgelab.bench.limits import fraction

    assert fraction(500.0, 4e6, 10.0) == pytest.approx(0.2)


def test_all_headlines():
    from forgelab.bench.all import headline_rows

    rows = headline_rows("e2e", {"forgelab_over_trl_warm": 0.6})
    assert rows[0] == {"suite": "e2e", "key": "forgelab_over_trl_warm", "value": 0.6, "goal": "<= 0.4", "met": "no"}
    rows = {r["key"]: r for r in headline_rows("dashboard", {"lab_cpu_fraction": 0.01,
                                                             "dashboard_throughput_ratio": None})}
    assert rows["lab_cpu_fraction"]["met"] == "yes" and rows["dashboard_throughput_ratio"]["met"] == "n/a"
    keys = [r["key"] for r in headline_rows("weight_sync", {"sync_over_raw": {"tiny": 1.2, "large-101M": 2.5}})]
    assert keys == ["sync_over_raw[tiny]", "sync_over_raw[large-101M]"]


def test_plot_writes_a_png_from_suite_json(tmp_path):
    from forgelab.bench.plot import plot

    run = lambda curve: {"curve": curve}  # noqa: E731
    e2e = {"target_accuracy": 0.4, "runs": {"forgelab": [run([[0, 0.0, 0.25], [10, 5.0, 0.45]])],
                                             "trl": [run([[0, 0.0, 0.25], [10, 9.0, 0.3]])]}}
    asy = {"target_accuracy": 0.4, "runs": {"0": [run([[0, 0.0, 0.25], [10, 6.0, 0.41]])], "1": [run([])]}}
    out = plot(e2e, asy, str(tmp_path / "fig.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
