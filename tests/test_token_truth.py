"""Token-level truth on real processes (issue #28): the trainer's per-token view of every trained episode is
recorded beside the generator's, the step's mismatch metrics come from exactly those values, and a corrupted
generator logprob is the top mismatch the inspector shows.

One synchronous run of the shipped model (max_policy_age 0: the trainer's pre-update weights at step s are the
weights that sampled the episodes it trains then; at step 1, the shipped checkpoint itself).
"""
from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.integration

SHIFT_INDEX, SHIFT = 2, 3.0


@pytest.fixture(scope="module")
def truth_run(loop, tmp_path_factory, engine_pool):
    from forgelab.config import RunConfig
    from forgelab.controller.rollout_log import read_rollouts
    from forgelab.run import Run

    cfg = RunConfig.from_dict({
        "name": "truth",
        "rollout": {"task": "addition", "group_size": 8, "prompts_per_rollout": 8, "concurrency": 1, "max_tokens": 8},
        "train": {"steps": 3, "batch_size": 64, "warmup_steps": 1, "max_policy_age": 0,
                  "loss_kwargs": {"kl_coef": 0.0}},
        "placement": {"reference": False},
        "eval": {"every": 0, "n": 8},
        "tracking": {"wandb": False, "out_dir": str(tmp_path_factory.mktemp("truth"))},
    })
    run = Run(cfg, spawn=engine_pool)  # the worker's warm processes when an earlier module left a set

    async def go():
        await run.start()
        await run.until(step=1, timeout=600)
        # the next completion with more than SHIFT_INDEX tokens records token SHIFT_INDEX's logprob + SHIFT
        await run.parts.generators.fanout("corrupt_next_logprob", SHIFT_INDEX, SHIFT)
        await run.wait()

    try:
        loop.run_until_complete(go())
        yield run, read_rollouts(run.out_dir)
    finally:
        loop.run_until_complete(run.shutdown())


def _trained(log, step=None):
    rows = log[log["status"] == "trained"]
    return rows if step is None else rows[rows["trained_step"] == step]


def test_every_trained_token_has_the_trainers_values(truth_run):
    run, log = truth_run
    assert run.state == "finished", run.message
    trained = _trained(log)
    assert len(trained) == 3 * 64 and set(trained["trained_step"]) == {1, 2, 3}
    for _, r in trained.iterrows():
        n = len(r["completion_ids"])
        for col in ("trainer_logprobs", "entropy", "clipped"):
            assert r[col] is not None and len(r[col]) == n, col
        assert all(e >= 0 for e in r["entropy"]) and set(map(int, r["clipped"])) <= {0, 1}


def test_the_recorded_trainer_logprob_equals_an_independent_forward_of_the_pre_update_weights(truth_run):
    """Step 1 trained on the shipped checkpoint's weights: HF transformers on that checkpoint must give the
    recorded trainer logprobs. Bound: two float32 forwards of one decoder (tests/numerics.py `model_tol`: the
    layers' chained reductions plus the logsumexp, at the logprobs' magnitude), while reading the logprob after
    the update or one position off moves it by 1e-2 or more."""
    from numerics import check, max_abs, max_abs_diff, model_tol
    from transformers import AutoModelForCausalLM

    from forgelab.algos.logprobs import gather_logprobs

    run, log = truth_run
    hf = AutoModelForCausalLM.from_pretrained(run.config.model.path, dtype=torch.float32)
    for _, r in _trained(log, step=1).head(16).iterrows():
        ids = torch.tensor([list(r["prompt_ids"]) + list(r["completion_ids"])])
        with torch.no_grad():
            lp = gather_logprobs(hf(ids[:, :-1]).logits, ids[:, 1:])[0]
        P, C = len(r["prompt_ids"]), len(r["completion_ids"])
        want = lp[P - 1: P - 1 + C]
        tol = model_tol(run.config.model.path, max(1.0, max_abs(want)))
        assert tol < 1e-3  # well below what a wrong position or post-update weights would give
        check(max_abs_diff(list(r["trainer_logprobs"]), want), tol, f"episode {r['id']}: trainer vs HF logprobs")


def test_the_step_mismatch_metrics_equal_a_hand_computation_from_the_recorded_columns(truth_run):
    run, log = truth_run
    metrics = run.metrics.set_index("step")
    for step in (1, 2, 3):
        d = []
        for _, r in _trained(log, step).iterrows():
            mask = r["loss_mask"] if r["loss_mask"] is not None else [1] * len(r["completion_ids"])
            d += [t - g for t, g, m in zip(r["trainer_logprobs"], r["generator_logprobs"], mask) if m]
        assert d
        want = {"mismatch/abs_mean": sum(abs(x) for x in d) / len(d),
                "mismatch/k3": sum(math.expm1(x) - x for x in d) / len(d),
                "mismatch/frac_over": sum(abs(x) > 0.1 for x in d) / len(d),
                "mismatch/max": max(abs(x) for x in d)}
        for k, v in want.items():  # the same float64 arithmetic on the same float32 values; only the order differs
            assert metrics.loc[step, k] == pytest.approx(v, rel=1e-12, abs=1e-15), (step, k)


def test_a_corrupted_generator_logprob_is_the_top_mismatch_in_the_inspector(truth_run):
    import forgelab.lab
    from forgelab.lab.inspector import RolloutInspector
    from forgelab.lab.tokens import token_rows

    run, log = truth_run
    for source in (run, forgelab.lab.open(run.out_dir).run):  # live, and read back from the run directory
        insp = RolloutInspector(source)
        insp.widget  # built headless
        insp.status.value, insp.sort_by.value, insp.ascending.value = "trained", "mismatch_max", False
        top = insp.filtered().iloc[0]
        assert top["mismatch_max"] == pytest.approx(SHIFT, abs=1e-3)
        rows = token_rows(top.to_dict())
        worst = max(rows, key=lambda r: abs(r["mismatch"]) if not math.isnan(r["mismatch"]) else -1)
        assert worst["i"] == SHIFT_INDEX and worst["mismatch"] == pytest.approx(-SHIFT, abs=1e-3)
        # every other trained episode agrees with the sampler to float32 rounding
        rest = insp.filtered().iloc[1:]
        assert (rest["mismatch_max"] < 1e-2).all()
    assert run.metrics["mismatch/max"].max() == pytest.approx(SHIFT, abs=1e-3)
