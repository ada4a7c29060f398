"""Benchmark suites: fast smoke checks only.

Every suite's ``--quick`` mode spawns vLLM / Monarch processes and takes
minutes on a 2-core host, so here each suite is imported and its pure
formatting helpers are checked (the keys the combined ``all`` table and
docs/benchmarks.md rely on). No wall-clock numbers are checked.
"""
import importlib
import json

import pytest

from forgelab.bench import module_name, suites
from forgelab.bench.common import emit_json, machine_info

SUITES = ["all", "async", "dashboard", "e2e", "generator", "limits", "runtime", "weight_sync"]


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


def test_e2e_summary_keys():
    from forgelab.bench.e2e import summarize

    evals = [{"step": 0, "train_s": 0.0, "accuracy": 0.25}, {"step": 10, "train_s": 8.0, "accuracy": 0.3},
             {"step": 20, "train_s": 16.0, "accuracy": 0.41}]
    r = summarize("forgelab", evals, 0.4)
    assert {"reached", "time_to_target_s", "steps_to_target", "final_step", "final_accuracy", "s_per_step",
            "curve"} <= set(r)
    assert (r["time_to_target_s"], r["steps_to_target"], r["s_per_step"]) == (16.0, 20, 0.8)
    missed = summarize("trl", evals[:2], 0.4)
    assert not missed["reached"] and missed["time_to_target_s"] is None and missed["final_step"] == 10


def test_async_ratio():
    from forgelab.bench.async_ import async_ratio

    assert async_ratio({0: [10.0, 12.0], 1: [8.0], 2: [5.5, None]}) == 0.5
    assert async_ratio({0: [10.0], 1: [None], 2: [None]}) is None


def test_dashboard_segments():
    from forgelab.bench.dashboard import segment_rates

    times = {s: float(s) for s in range(1, 9)}  # one step per second
    assert segment_rates(times, 4, 2) == [1.0, 1.0]


def test_limits_fraction():
    from forgelab.bench.limits import fraction

    assert fraction(500.0, 4e6, 10.0) == pytest.approx(0.2)


def test_all_headlines():
    from forgelab.bench.all import headline_rows

    rows = headline_rows("e2e", {"forgelab_over_trl": 0.3})
    assert rows == [{"suite": "e2e", "key": "forgelab_over_trl", "value": 0.3, "goal": "<= 0.5", "met": "yes"}]
    assert headline_rows("dashboard", {"dashboard_throughput_ratio": None})[0]["met"] == "n/a"
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
