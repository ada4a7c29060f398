"""The live lab, headless: widgets are driven and checked by their traits against a real short `Run`.

The integration tests share one 4-step run (module-scoped, on the test worker's
loop, with engines from the worker's pool: tests/conftest.py `engine_pool`). They read the run only through its public API, like the
widgets do.
"""
import asyncio
import math
import re
import subprocess
import sys
import time

import pytest

from forgelab.lab import Throttle, dashboard
from forgelab.lab.tokens import spans_html, table_html, token_rows


# ---------------------------------------------------------------------------- without a run


def test_lab_never_imports_monarch():
    code = "import sys, forgelab.lab; bad = sorted(m for m in sys.modules if 'monarch' in m); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_token_spans_multi_turn():
    # turn 1 (model: 2 tokens), environment (2 tokens), turn 2 (model: 1 token)
    ep = {"completion_ids": [72, 105, 10, 62, 33], "generator_logprobs": [-0.5, -1.25, 0.0, 0.0, -2.0],
          "ref_logprobs": [-0.75, -1.0, -3.0, -3.0, -2.5], "loss_mask": [1, 1, 0, 0, 1], "advantage": 0.5}
    rows = token_rows(ep, tokenizer=None)
    html = spans_html(rows, "kl")
    titles = re.findall(r'<span class="fl-tok" style="([^"]*)" title="([^"]*)"', html)
    assert len(titles) == 5
    assert html.count('class="fl-turn"') == 2  # model -> environment -> model
    assert "color:#999" in titles[2][0] and "environment token" in titles[2][1]
    d = -0.75 - -0.5  # independent k3: exp(d) - d - 1 with d = ref - logprob
    assert f"kl_k3 {math.exp(d) - d - 1:.4f}" in titles[0][1]
    assert "logprob -0.5000" in titles[0][1] and "advantage 0.5000" in titles[0][1]
    assert table_html(rows).count("<tr") == 6  # header + one per token


def test_throttle_coalesces_pokes():
    calls = []

    async def scenario():
        t = Throttle(lambda: calls.append(time.monotonic()), min_interval_s=0.2)
        t.poke()  # due: runs now
        for _ in range(50):
            t.poke()  # within the interval: one timer absorbs them all
        assert len(calls) == 1 and t._timer is not None
        await t.settled()
        assert len(calls) == 2 and calls[1] - calls[0] >= 0.19

    asyncio.run(scenario())


def test_the_end_of_a_run_is_shown_at_once_not_after_the_budget():
    """A refresh put off by the duty budget (a slow redraw stretches it to a minute) runs when the run ends:
    the controls line says "finished", not the state of two steps ago (CI saw "running step 2/4" 30 s after the
    end). Other events still wait for the throttle."""
    from forgelab.lab.controls_panel import Controls

    class Run:
        def __init__(self):
            self.st, self.listeners = {"state": "running", "step": 2, "steps": 4, "version": 2, "loss": "grpo"}, []

        def status(self):
            return dict(self.st)

        def add_listener(self, fn):
            self.listeners.append(fn)

    async def scenario():
        run = Run()
        panel = Controls(run, min_interval_s=60.0)
        panel.widget  # built and filled once: "running step 2/4"
        assert "step <b>2</b>/4" in panel.state.value
        run.st.update(step=4, version=4)
        for fn in run.listeners:
            fn({"step": 4})  # a metrics row: due in 60 s, so a timer is armed
        assert panel.throttle._timer is not None and "step <b>2</b>/4" in panel.state.value
        waiter = asyncio.ensure_future(panel.throttle.settled())
        await asyncio.sleep(0)
        run.st["state"] = "finished"
        for fn in run.listeners:
            fn({"event": {"kind": "finished", "step": 4}})
        assert panel.throttle._timer is None
        assert "finished" in panel.state.value and "step <b>4</b>/4 · version 4" in panel.state.value
        await asyncio.wait_for(waiter, 5)  # whoever awaited the pending refresh is told
        run.st["step"] = 5
        for fn in run.listeners:
            fn({"event": {"kind": "eval", "step": 4}})  # an ordinary event waits for the interval again
        assert panel.throttle._timer is not None and "step <b>4</b>/4" in panel.state.value
        panel.throttle.cancel()

    asyncio.run(scenario())


def test_throttles_sharing_a_budget_stay_within_it_together():
    from forgelab.lab._base import LAB_BUDGET, DutyBudget

    budget = DutyBudget(max_duty=0.02, active_s=60.0)
    a = Throttle(lambda: None, min_interval_s=0.5, budget=budget)
    b = Throttle(lambda: None, min_interval_s=0.5, budget=budget)
    alone = Throttle(lambda: None, min_interval_s=0.5, max_duty=0.02)
    now = time.monotonic()
    for t, cost in ((a, 0.030), (b, 0.010), (alone, 0.030)):
        t.last_cost, t.last_run = cost, now
    # each member waits for the group's cost: (30 + 10) ms / 2 % = 2 s, so a and b together spend
    # 40 ms per 2 s = 2 %; a throttle of its own would allow 30 ms / 2 % = 1.5 s for a alone
    assert a.interval_s == pytest.approx(2.0) and b.interval_s == pytest.approx(2.0)
    assert alone.interval_s == pytest.approx(1.5)
    b.last_run = now - 61.0  # b went quiet: it no longer counts against a
    assert a.interval_s == pytest.approx(1.5)
    assert b.interval_s == pytest.approx(1.5)  # its own last cost still counts for itself
    b.last_cost, a.last_run = 0.001, now - 61.0  # both quiet now: b's own 1 ms / 2 % is under the floor
    assert b.interval_s == pytest.approx(0.5) and a.interval_s == pytest.approx(1.5)
    # the lab's panels share the process-wide budget
    from forgelab.lab.metrics import MetricsPanel

    assert MetricsPanel(_StubRun()).throttle.budget is LAB_BUDGET


class _StubRun:
    """What the metrics panel reads of a run: `.metrics`, `.events`, `.snapshot()`, listeners."""

    def __init__(self, steps=200):
        import types

        self.rows, self.events, self.listeners, self.steps = [], [], [], steps
        self._snap = types.SimpleNamespace(accuracy_history=(), steps=steps)

    def snapshot(self):
        return self._snap

    @property
    def metrics(self):
        import pandas as pd

        return pd.DataFrame(self.rows)

    def add_listener(self, fn):
        self.listeners.append(fn)

    def remove_listener(self, fn):
        self.listeners.remove(fn)

    def step(self, notify=True, parts=True):
        s = len(self.rows) + 1
        row = {"step": s, "reward_mean": math.sin(s / 7), **({"reward/exact_answer": (s % 5) / 5} if parts else {}),
               "loss": 1 / s, "kl_ref": 0.01 * s, "entropy": 1 + math.cos(s / 3), "tokens_per_s": 100 + s % 13}
        self.rows.append(row)
        for fn in list(self.listeners) if notify else []:
            fn(dict(row))


def _pixels(png: bytes):
    import io

    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def test_metrics_blit_equals_a_full_redraw_and_reuses_the_figure():
    from forgelab.lab import MetricsPanel

    run = _StubRun()
    for _ in range(5):
        run.step(notify=False, parts=False)  # one curve per subplot: no legend, whose 'best' place moves
    panel = MetricsPanel(run)
    _ = panel.widget  # first draw
    fig = panel._fig
    for _ in range(40):  # curves leave their y limits now and then (kl_ref grows): some subplots drawn again
        run.step(notify=False, parts=False)
        assert panel.refresh()
        assert panel._fig is fig  # one figure for the panel's life, never rebuilt
        assert panel._lines[0]["reward_mean"].get_xdata()[-1] == len(run.rows)  # the newest row is on screen
    assert panel.cell_draws > 0  # the test covers redrawing one subplot's cell alone
    # the rest are blits: only the first draw and a new x range (steps 6..45: to 10, 20, 50) draw everything
    assert panel.full_draws == 4 and len(panel.redraw_ms) == 41
    blitted = _pixels(panel.image.value)
    panel._bg = None  # throw the background away: the next redraw draws the whole figure
    assert panel.refresh(force=True)
    assert (blitted == _pixels(panel.image.value)).all()  # pixel for pixel what a full draw shows
    assert not panel.refresh()  # nothing new: no redraw
    panel.close()


def test_metrics_limits_hold_the_data_and_change_rarely():
    from forgelab.lab.metrics import sticky_limits, x_limit

    lim, changes = None, 0
    for s in range(1, 300):
        lo, hi = 0.0, 0.01 * s + math.sin(s)  # a noisy trend upwards
        new = sticky_limits(lim, lo, hi)
        assert new[0] <= lo and hi <= new[1]
        changes += new != lim
        lim = new
    assert changes <= 25  # a refit only when the data leaves the limits, with headroom after it
    assert [x_limit(s, 180) for s in (1, 3, 10, 11, 150, 180, 181)] == [1, 5, 10, 20, 180, 180, 200]


def test_metrics_burst_of_steps_is_one_redraw_of_the_latest_row():
    from forgelab.lab import MetricsPanel

    async def scenario():
        run = _StubRun()
        run.step(notify=False)
        panel = MetricsPanel(run, min_interval_s=0.3)
        _ = panel.widget  # first draw; listening from here
        n = len(panel.redraw_ms)
        for _ in range(30):  # a burst within the interval: one timer absorbs every poke
            run.step()
        assert len(panel.redraw_ms) == n and panel.throttle._timer is not None
        await panel.throttle.settled()
        assert len(panel.redraw_ms) == n + 1
        assert panel._lines[0]["reward_mean"].get_xdata()[-1] == 31  # the redraw shows the last step
        panel.close()

    asyncio.run(scenario())


def test_inspector_filters_and_lists_the_newest_episodes():
    import pandas as pd

    from forgelab.lab import RolloutInspector

    class Rollouts:
        def __init__(self):
            self.rows = []

        @property
        def rollouts(self):
            return pd.DataFrame(self.rows)

        def add(self, n):
            for _ in range(n):
                i = len(self.rows) + 1
                self.rows.append({"id": i, "group_id": i // 4, "task": "addition", "prompt": f"{i}+1=",
                                  "completion": f"{i + 1}" if i % 3 else "x", "target": str(i + 1),
                                  "reward": 1.0 if i % 3 else 0.0, "advantage": 0.1 * (i % 4), "policy_version": i // 8,
                                  "status": "trained", "completion_ids": [50 + i % 10] * (1 + i % 5),
                                  "generator_logprobs": [-0.5] * (1 + i % 5), "ref_logprobs": None, "loss_mask": None,
                                  "turns": None, "reward/exact_answer": 1.0 if i % 3 else 0.0})

    run = Rollouts()
    run.add(40)
    insp = RolloutInspector(run, max_rows=5)
    _ = insp.widget
    assert list(insp.df["id"]) == list(range(40, 0, -1))  # no filter: every episode, newest first
    assert [v for _, v in insp.select.options] == [40, 39, 38, 37, 36] and insp.select.value == 40
    assert list(insp.df["length"]) == [1 + i % 5 for i in range(40, 0, -1)]
    assert "#40" in insp.header.value and insp.tokens.value.count('class="fl-tok"') == 1
    run.add(8)
    insp.refresh()  # new episodes: the selection follows the newest one
    assert insp.select.value == 48 and insp.table.value.count("<tr class='fl-ep'") == 5
    insp.reward_range.value = (0.5, 1.0)
    assert set(insp.df["reward"]) == {1.0} and len(insp.df) == 32
    insp.text.value = "7+1"
    assert list(insp.df["id"]) == [47, 37, 17, 7]
    insp.text.value, insp.reward_range.value = "", (insp.reward_range.min, insp.reward_range.max)
    assert len(insp.df) == 48
    insp.close()


# ---------------------------------------------------------------------------- one real run


@pytest.fixture(scope="module")
def live(loop, engine_pool, tmp_path_factory):
    from forgelab.config.run_config import EvalConfig, PlacementConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig
    from forgelab.run import Run

    tmp = tmp_path_factory.mktemp("lab")
    cfg = RunConfig(
        name="labtest",
        rollout=RolloutConfig(task="addition", group_size=4, prompts_per_rollout=4, concurrency=1, max_tokens=6),
        train=TrainConfig(steps=4, batch_size=16, max_policy_age=1, warmup_steps=1),
        eval=EvalConfig(every=0, n=16),
        tracking=TrackingConfig(out_dir=str(tmp), wandb=False),
        placement=PlacementConfig(reference=True),
    )
    asyncio.set_event_loop(loop)
    run = Run(cfg, spawn=engine_pool)
    lab = dashboard(run)
    _ = lab.widget  # builds every panel and starts listening before the first step
    loop.run_until_complete(run.start())
    t0 = time.monotonic()
    try:
        yield run, lab, loop, t0
    finally:
        lab.close()
        loop.run_until_complete(run.shutdown())
        asyncio.set_event_loop(None)


async def until(run, pred, timeout=240.0):
    """Await (via the run's listener, no polling) until pred() holds; fail fast if the run fails or ends."""
    if pred():
        return
    fut = asyncio.get_running_loop().create_future()

    def check(msg):
        if fut.done():
            return
        if pred():
            fut.set_result(None)
        elif run.state in ("failed", "finished", "stopped"):
            fut.set_exception(AssertionError(f"run {run.state} before the condition held: {run.message}"))

    run.add_listener(check)
    try:
        await asyncio.wait_for(fut, timeout)
    finally:
        run.remove_listener(check)


@pytest.mark.integration
def test_reward_slider_sets_run_weights(live):
    run, lab, loop, _ = live
    slider = lab.rewards.sliders["answer_format"]
    slider.value = 0.35
    assert run.rewards.weights["answer_format"] == pytest.approx(0.35)
    assert run.events[-1]["kind"] == "reward_weights"
    lab.rewards.set_weight("no_such_reward", 1.0)  # shown in the panel, not raised
    assert "no_such_reward" in lab.rewards.last_error and "no_such_reward" not in run.rewards.weights


@pytest.mark.integration
def test_reward_registration_validates_first(live):
    run, lab, loop, _ = live
    loop.run_until_complete(until(run, lambda: len(run.rollouts) > 0))

    def digits_only(prompt, completion, target, **info):
        return 1.0 / (len(completion) - len(completion))  # ZeroDivisionError on every sample

    before = run.rewards.weights
    assert not lab.rewards.register("digits_only", digits_only, 0.5)
    assert "ZeroDivisionError" in lab.rewards.last_error and run.rewards.weights == before

    def short(prompt, completion, target, **info):
        return -len(completion) / 100.0

    lab.rewards.user_ns = {"short": short}
    assert lab.rewards.register_by_name("short", weight=0.05)
    assert run.rewards.weights["short"] == pytest.approx(0.05) and "short" in lab.rewards.sliders
    assert any(e["kind"] == "reward_added" and e["name"] == "short" for e in run.events)


@pytest.mark.integration
def test_loss_swap_from_panel_reaches_next_step(live):
    run, lab, loop, _ = live

    async def scenario():
        await until(run, lambda: run.step >= 1)
        lab.controls.pause_button.click()  # hold the run at a step boundary so "the next step" is well defined
        assert run.state == "paused" and not lab.controls.resume_button.disabled
        lab.loss.choice.value = "dapo"
        lab.loss.apply_button.click()
        outcome = await lab.loss.pending
        assert outcome["ok"], outcome
        assert "applies at step" in lab.loss.message.value and "dapo" in lab.loss.current.value
        lab.controls.resume_button.click()
        # the step's metrics row, not only run.step (which moves before the weight push and the row)
        await until(run, lambda: (run.metrics["step"] >= outcome["applies_at_step"]).any())
        return outcome

    outcome = loop.run_until_complete(scenario())
    df = run.metrics
    row = df[df["step"] == outcome["applies_at_step"]].iloc[0]
    assert row["loss_name"] == "dapo"
    assert any(e["kind"] == "loss_swapped" and e["loss"] == "dapo" for e in run.events)


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["nan", "vector"])
def test_bad_loss_is_refused_and_nothing_changes(live, kind):
    run, lab, loop, _ = live

    def nan_loss(logprobs_B_T, **_):
        return logprobs_B_T.sum() * float("nan"), {}

    def vector_loss(logprobs_B_T, **_):
        return logprobs_B_T.sum(-1), {}

    fn = nan_loss if kind == "nan" else vector_loss
    before = run.loss_name
    lab.loss.register(fn)
    outcome = loop.run_until_complete(lab.loss.apply_async())
    assert not outcome["ok"]
    assert ("non-finite" if kind == "nan" else "scalar") in outcome["reason"]
    assert lab.loss.message.value.startswith("<pre") and "refused:" in lab.loss.message.value
    assert run.loss_name == before


@pytest.mark.integration
def test_inspector_shows_tokens_with_exact_values(live):
    run, lab, loop, _ = live
    loop.run_until_complete(until(run, lambda: len(run.rollouts) > 0))
    insp = lab.inspector
    insp.refresh()
    assert len(insp.df) > 0 and insp.table.value.count("<tr class='fl-ep'") >= 1
    ep = run.rollouts.iloc[-1].to_dict()
    insp.show(int(ep["id"]))
    spans = re.findall(r'<span class="fl-tok" [^>]*title="([^"]*)"', insp.tokens.value)
    assert len(spans) == len(ep["completion_ids"]) > 0
    for i, t in enumerate(spans):
        lp = ep["generator_logprobs"][i]
        assert f"logprob {lp:.4f}" in t
        if ep["ref_logprobs"] is not None:
            d = ep["ref_logprobs"][i] - lp
            assert f"ref_logprob {ep['ref_logprobs'][i]:.4f}" in t and f"kl_k3 {math.exp(d) - d - 1:.4f}" in t
    insp.colour_by.value = "advantage"
    assert f"advantage {ep['advantage']:.4f}" in insp.tokens.value
    insp.correctness.value = "only right"
    assert all(insp.df["reward/exact_answer"] > 0.5) if len(insp.df) else True
    insp.correctness.value = "all"
    insp.sort_by.value, insp.ascending.value = "reward", True
    assert list(insp.df["reward"]) == sorted(insp.df["reward"])


@pytest.mark.integration
def test_metrics_image_after_steps_within_budget(live):
    run, lab, loop, t0 = live
    loop.run_until_complete(run.wait())
    loop.run_until_complete(lab.metrics.throttle.settled())
    elapsed = time.monotonic() - t0
    m = lab.metrics
    assert m.image.value[:8] == b"\x89PNG\r\n\x1a\n" and len(m.image.value) > 5000
    assert m._n_rows_drawn >= 1
    # The throttle's guarantee: every redraw but the first (fonts) and the last waited cost/2% after the previous.
    costs = [ms / 1e3 for ms in m.redraw_ms]
    print(f"\nredraws {len(costs)}, ms {[round(c * 1e3) for c in costs]}, cpu ms {[round(c) for c in m.redraw_cpu_ms]}, "
          f"run {elapsed:.0f} s")
    assert sum(costs[1:-1]) <= 0.02 * elapsed


@pytest.mark.integration
def test_text_summary_outside_a_notebook(live):
    run, lab, loop, _ = live
    text = repr(lab)
    assert lab._repr_mimebundle_() == {"text/plain": text}  # no kernel here: no widget payload
    assert f"step {run.step}/4" in text and run.state in text
    assert "loss→dapo" in text and "generator[0]" in text and "reward_mean" in text
    for panel in lab.panels:
        assert str(panel) and "Error" not in str(panel).splitlines()[0]
