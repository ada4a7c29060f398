"""Trainer and ReferenceModel on real Monarch meshes (1 process, and 2 processes with FSDP2 over gloo).

One 1-process trainer, one 2-process trainer and one reference model are
spawned once for the module (spawning is the slow part) and shared by the
tests in file order; each test states what it needs and leaves the trainers
usable. Golden values come from independent computations: the other world
size, HF transformers, or logprobs fetched before the step.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from forgelab.engines.trainer import ReferenceConfig, ReferenceModel, Trainer, TrainerConfig
from numerics import EPS, check, max_abs, max_abs_diff, model_tol
from trainer_actors import WeightSink, random_batches, tiny_model_dir

integration = pytest.mark.integration
pytestmark = [pytest.mark.timeout(420), integration]



async def _gather(*coros):
    return await asyncio.gather(*coros)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def vocab(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["vocab_size"]


@pytest.fixture(scope="module")
def batches(vocab):
    return random_batches(vocab, 4, B=4, seed=0)


@pytest.fixture(scope="module")
def cfg(model_dir):
    # A large LR so 3 steps move the weights far beyond the comparison tolerance. AdamW's eps = lr: its update
    # lr * m / (sqrt(v) + eps) then changes by at most (lr / eps) * |dg| = |dg| when the gradient changes by dg;
    # with the default 1e-8, a gradient within rounding of zero moves its weight by up to lr either way, so two
    # float32 runs could never be compared weight by weight.
    return TrainerConfig(model_dir=model_dir, lr=1e-3, eps=1e-3, warmup_steps=1, total_steps=20, is_cap=2.0,
                         loss="grpo", loss_kwargs={"kl_coef": 0.05})


@pytest.fixture(scope="module")
def meshes(loop, cfg, model_dir):
    """(1-proc trainer, 2-proc trainer, reference model), spawned together.

    The 1-process trainer accumulates gradients over 1-row micro-batches, so
    comparing it with the 2-process one checks both paths at once. (A 1-row
    micro-batch has no prompt to share: that trainer never packs.)
    """
    handles = loop.run_until_complete(_gather(
        Trainer.options(procs=1).as_actor(replace(cfg, micro_batch_size=1)),
        Trainer.options(procs=2).as_actor(cfg),
        ReferenceModel.options(procs=1).as_actor(ReferenceConfig(model_dir=model_dir)),
    ))
    yield handles
    for h in handles:
        loop.run_until_complete(h.shutdown())


@pytest.fixture(scope="module")
def step0_logprobs(loop, meshes, batches):
    t1, t2, _ = meshes
    tokens = batches[0]["tokens_B_L"]
    return loop.run_until_complete(t1.call_one("logprobs", tokens)), loop.run_until_complete(t2.call("logprobs", tokens))


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _l2(a: dict, b: dict | None = None) -> float:
    """The L2 norm over every tensor of ``a`` (of ``a - b``), in float64."""
    return sum(float(((a[k].double() - (0 if b is None else b[k].double())) ** 2).sum()) for k in a) ** 0.5


def _metric_tol(model_dir: str, logprobs: torch.Tensor) -> float:
    """Relative bound for a GRPO step's loss and metrics from two float32 forwards of the same weights.

    kl_ref (a mean of exp(ref - lp) - (ref - lp) - 1 >= 0, which dominates these losses), the ratios
    exp(lp - gen) and the entropy are means over tokens of smooth functions of the logprobs: a logprob off
    by d moves exp(.) by a factor exp(d) ~ 1 + d, so their relative error is the logprobs' absolute error,
    bounded by the model's forward bound (numerics.model_tol) at the scale of these logprobs.
    """
    return model_tol(model_dir, max_abs(logprobs))


def test_config_validate_names_the_field(model_dir):
    for bad, field in [({"lr": -1.0}, "lr"), ({"loss": "nope"}, "loss"), ({"micro_batch_size": 0}, "micro_batch_size"),
                       ({"total_steps": 0, "warmup_steps": 5}, "total_steps"), ({"is_cap": 0.0}, "is_cap")]:
        with pytest.raises(ValueError, match=f"TrainerConfig.{field}="):
            TrainerConfig(model_dir=model_dir, **bad).validate()


@pytest.mark.numerics
def test_reference_matches_trainer_and_hf_at_step0(loop, meshes, batches, step0_logprobs, model_dir):
    from transformers import AutoModelForCausalLM

    from forgelab.algos.logprobs import gather_logprobs

    _, _, ref = meshes
    tokens = batches[0]["tokens_B_L"]
    ref_lp = loop.run_until_complete(ref.call_one("logprobs", tokens))
    lp1, lp2 = step0_logprobs
    assert ref_lp.dtype == torch.float32 and ref_lp.shape == (tokens.shape[0], tokens.shape[1] - 1)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(tokens[:, :-1]).logits
    hf_lp = gather_logprobs(logits, tokens[:, 1:])
    # Four float32 forwards of the same weights (the reference, 1 and 2 trainer processes, HF), each summing in
    # its own order (batch size and kernels differ): the model's forward bound at the scale of the logits and
    # logprobs compared (numerics.model_tol: 1.2e-3 for these logprobs down to -18, whose ulp is 1.9e-6).
    # A reference with the wrong weights is far outside it: its final norm left at init, 0.64; computing in
    # bfloat16, 0.21.
    tol = model_tol(model_dir, max(max_abs(logits), max_abs(hf_lp)))
    check(max_abs_diff(ref_lp, lp1), tol, "reference vs 1-process trainer logprobs")
    for lp in lp2:  # both FSDP ranks return the full batch
        check(max_abs_diff(lp, lp1), tol, "2-process vs 1-process trainer logprobs")
    check(max_abs_diff(hf_lp, ref_lp), tol, "HF vs reference logprobs")


@pytest.mark.numerics
def test_two_ranks_packing_shared_prompts_equal_one_plain_rank(loop, meshes, vocab, model_dir):
    """GRPO-style rows (each group's two episodes share a prompt): each FSDP2 rank of the 2-process trainer packs
    its group (share_prompts "auto"), the 1-process trainer runs the plain rows one by one; at step 0 (identical
    weights) the loss and every metric agree. Run as a dry run, so the trainers stay at step 0 for the tests below."""
    from forgelab.algos.packing import plan_shared_prefix, spans_from_mask
    from forgelab.engines.titan_forward import use_packing

    t1, t2, _ = meshes
    batch = random_batches(vocab, 1, B=4, seed=5, shared_prompts=True)[0]
    spans = spans_from_mask(batch["mask_B_T"])
    for rows in (slice(0, 2), slice(2, 4)):  # each rank's rows (contiguous blocks): the packed path is taken
        assert use_packing(plan_shared_prefix(batch["tokens_B_L"][rows], spans[rows]))
    r1, r2s = loop.run_until_complete(_gather(t1.call_one("dry_run_loss", "grpo", batch, {"kl_coef": 0.05}),
                                              t2.call("dry_run_loss", "grpo", batch, {"kl_coef": 0.05})))
    tol = _metric_tol(model_dir, loop.run_until_complete(t1.call_one("logprobs", batch["tokens_B_L"])))
    assert r1["ok"], r1
    for r2 in r2s:
        assert r2["ok"], r2
        check(abs(r1["loss"] - r2["loss"]), tol * max(1.0, abs(r1["loss"])), "loss, packed 2 ranks vs plain 1 rank")
        for key in ("entropy", "kl_ref", "is_weight_mean"):
            check(abs(r1["metrics"][key] - r2["metrics"][key]), tol * max(1.0, abs(r1["metrics"][key])), key)
        assert r1["metrics"]["n_tokens"] == r2["metrics"]["n_tokens"]
        # a token whose ratio is within rounding of the clip edge may count on either side: one token of slack
        check(abs(r1["metrics"]["clip_frac"] - r2["metrics"]["clip_frac"]), 1.0 / r1["metrics"]["n_tokens"],
              "clip_frac")


@pytest.mark.numerics
def test_one_vs_two_processes_same_loss_and_weights(loop, meshes, batches, step0_logprobs, cfg, model_dir):
    """Three GRPO steps on 1 process (1-row micro-batches) and on 2 FSDP2 processes: same metrics, same weights.

    Step 1 starts from the same weights: every metric within the forward bound (`_metric_tol`), the gradient
    norm too (its relative error: the logprobs' absolute error through exp, then the backward's own chain, which
    is below it). Each AdamW step with eps = lr moves the two copies apart by at most 2 * (lr / eps) * |dg|
    (m and v each carry the gradient; the clipped gradient's relative error is < 2 * tol, from the two chains,
    and its norm is at most max_grad_norm), plus one rounding of every weight (EPS * |w|). A later step's loss
    then also moves by at most grad_norm * |w1 - w2| (first order), the weights' measured gap.
    Dropping a rank's gradient moves the step-1 gradient norm by 42% (bound 0.12%) and puts the weights 0.15
    apart (L2) after one step (bound 4.8e-3).
    """
    t1, t2, _ = meshes
    initial = loop.run_until_complete(t1.call("get_hf_state_dict"))[0]
    gap, gap_tol = 0.0, 0.0
    for step, batch in enumerate(batches[:3], start=1):
        tol = _metric_tol(model_dir, loop.run_until_complete(t1.call_one("logprobs", batch["tokens_B_L"])))
        m1, m2s = loop.run_until_complete(_gather(t1.call_one("train_step", batch), t2.call("train_step", batch)))
        assert m1["skipped"] == 0 and m1["step"] == step, m1
        for m2 in m2s:  # ranks agree on the global metrics
            assert m2["skipped"] == 0 and m2["step"] == step
            check(abs(m1["loss"] - m2["loss"]), tol * max(1.0, abs(m1["loss"])) + m1["grad_norm"] * gap,
                  f"step {step} loss")
            if step == 1:
                for key in ("grad_norm", "entropy", "kl_ref", "is_weight_mean"):
                    check(abs(m1[key] - m2[key]), tol * max(1.0, abs(m1[key])), f"step 1 {key}")
                # a token whose ratio is within rounding of the clip edge may count on either side
                check(abs(m1["clip_frac"] - m2["clip_frac"]), 1.0 / m1["n_tokens"], "step 1 clip_frac")
            assert m1["lr"] == m2["lr"]
        sd1 = loop.run_until_complete(t1.call("get_hf_state_dict"))[0]
        sd2 = loop.run_until_complete(t2.call("get_hf_state_dict"))[0]
        gap = _l2(sd1, sd2)
        gap_tol += 2 * (m1["lr"] / cfg.eps) * 2 * tol * cfg.max_grad_norm + EPS * _l2(sd1)
        check(gap, gap_tol, f"|w(1 process) - w(2 processes)| (L2) after step {step}")
    assert _l2(sd1, initial) > 20 * gap_tol, "the weights did not move: the comparison would prove nothing"


@pytest.mark.numerics
def test_set_loss_takes_effect_at_the_next_step_only(loop, meshes, batches, model_dir):
    t1, _, _ = meshes

    def nll(logprobs_B_T, *, mask_B_T, **_):
        return -(logprobs_B_T * mask_B_T).sum() / mask_B_T.sum(), {"nll_marker": 1.0}

    async def scenario():
        # Sent in this order: the step already queued must still run the old loss.
        step_future = t1.actor.train_step.call_one(batches[0])
        set_future = t1.actor.set_loss.call_one(nll)
        before, name = await step_future, await set_future
        lp = await t1.call_one("logprobs", batches[1]["tokens_B_L"])
        after = await t1.call_one("train_step", batches[1])
        await t1.call_one("set_loss", "grpo", {"kl_coef": 0.05})
        return before, name, lp, after

    before, name, lp, after = loop.run_until_complete(scenario())
    assert name == "nll"
    assert "clip_frac" in before and "nll_marker" not in before
    mask = batches[1]["mask_B_T"]
    assert after["nll_marker"] == 1.0 and "clip_frac" not in after
    # the step's forward (entropy too, masked positions only) vs the logprobs endpoint's: a mean of logprobs is
    # within their absolute error, the forward bound
    check(abs(after["loss"] - float(-(lp * mask).sum() / mask.sum())), model_tol(model_dir, max_abs(lp)),
          "nll loss vs the mean of the logprobs")


def _nan_loss(logprobs_B_T, **_):
    return logprobs_B_T.sum() * float("nan"), {}


def _nan_grad_loss(logprobs_B_T, *, mask_B_T, **_):
    # sqrt'(0) = inf, times d(0 * logp)/dlogp = 0: a finite loss (0) with NaN gradients.
    return torch.sqrt(logprobs_B_T * 0.0).sum(), {}


def _raises_on_rank1(logprobs_B_T, *, mask_B_T, **_):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("boom on rank 1")
    return -(logprobs_B_T * mask_B_T).sum() / mask_B_T.sum(), {}


def test_faulty_loss_steps_are_skipped_bit_exactly(loop, meshes, batches):
    _, t2, _ = meshes
    before = loop.run_until_complete(t2.call("fingerprint"))
    assert all(fp["optim_entries"] > 0 for fp in before)  # a real optimizer state to protect
    for fn, reason in [(_nan_loss, "non-finite loss"), (_nan_grad_loss, "non-finite gradients"),
                       (_raises_on_rank1, "another rank")]:
        loop.run_until_complete(t2.call("set_loss", fn))
        results = loop.run_until_complete(t2.call("train_step", batches[2]))
        assert all(m["skipped"] == 1 for m in results), results
        assert reason in " ".join(m["skip_reason"] for m in results), results
        assert loop.run_until_complete(t2.call("fingerprint")) == before
    loop.run_until_complete(t2.call("set_loss", "grpo", {"kl_coef": 0.05}))
    ok = loop.run_until_complete(t2.call("train_step", batches[2]))
    assert all(m["skipped"] == 0 for m in ok)
    assert loop.run_until_complete(t2.call("fingerprint")) != before


def test_dry_run_loss_changes_nothing(loop, meshes, batches):
    _, t2, _ = meshes
    before = loop.run_until_complete(t2.call("fingerprint"))
    good = loop.run_until_complete(t2.call("dry_run_loss", "dapo", batches[1]))
    bad = loop.run_until_complete(t2.call("dry_run_loss", _nan_grad_loss, batches[1]))
    assert all(r["ok"] and math.isfinite(r["loss"]) for r in good), good
    assert good[0]["loss"] == good[1]["loss"]
    assert not any(r["ok"] for r in bad) and "non-finite gradients" in bad[0]["reason"]
    assert loop.run_until_complete(t2.call("fingerprint")) == before
    info = loop.run_until_complete(t2.call("info"))
    assert info[0]["loss"] == "grpo"  # a dry run does not swap the live loss


@pytest.mark.numerics
def test_save_load_resumes_exactly(loop, meshes, batches, tmp_path, model_dir):
    t1, t2, _ = meshes
    ckpt = str(tmp_path / "ckpt")
    loop.run_until_complete(t2.call("save", ckpt))
    first = loop.run_until_complete(t2.call("train_step", batches[3]))
    fp_first = loop.run_until_complete(t2.call("fingerprint"))
    loop.run_until_complete(t2.call("load", ckpt))
    again = loop.run_until_complete(t2.call("train_step", batches[3]))
    assert [m["loss"] for m in again] == [m["loss"] for m in first]  # bit-identical
    assert [m["lr"] for m in again] == [m["lr"] for m in first]
    assert loop.run_until_complete(t2.call("fingerprint")) == fp_first
    # DCP reshards: the 1-process trainer resumes the 2-process checkpoint too.
    info = loop.run_until_complete(t1.call_one("load", ckpt))
    assert info["step"] == first[0]["step"] - 1
    tol = _metric_tol(model_dir, loop.run_until_complete(t1.call_one("logprobs", batches[3]["tokens_B_L"])))
    resumed = loop.run_until_complete(t1.call_one("train_step", batches[3]))
    check(abs(resumed["loss"] - first[0]["loss"]), tol * max(1.0, abs(first[0]["loss"])),
          "1 process resuming the 2-process checkpoint: loss")


def test_push_weights_actor_to_actor(loop, meshes):
    _, t2, _ = meshes
    sink = loop.run_until_complete(WeightSink.options(procs=1).as_actor())
    try:
        timings = loop.run_until_complete(t2.call("push_weights", 7, [sink.actor]))
        version, got = loop.run_until_complete(sink.call_one("received"))
        expected = loop.run_until_complete(t2.call("get_hf_state_dict"))[0]
    finally:
        loop.run_until_complete(sink.shutdown())
    assert version == 7 and timings[0]["sent"] == 1 and not timings[0]["failed"]
    assert timings[0]["bytes"] == sum(v.numel() * v.element_size() for v in expected.values())
    assert got.keys() == expected.keys() and _max_diff(got, expected) == 0.0
    assert loop.run_until_complete(t2.call("info"))[0]["policy_version"] == 7


@pytest.mark.numerics
def test_loss_defined_in_main_runs_in_the_trainer(model_dir):
    script = os.path.join(os.path.dirname(__file__), "trainer_main_loss.py")
    proc = subprocess.run([sys.executable, script, model_dir], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    # the step's forward vs the logprobs endpoint's: a mean of logprobs is within their absolute error
    assert out["m1"]["from_main"] == 1.0 and out["m2"]["factor"] == 3.0
    check(abs(out["m1"]["loss"] - out["expected1"]), model_tol(model_dir, out["scale1"]), "nll loss from __main__")
    check(abs(out["m2"]["loss"] - out["expected2"]), 3.0 * model_tol(model_dir, out["scale2"]), "3 x nll loss")


def test_export_loads_in_vllm_and_real_generator_takes_pushed_weights(loop, meshes, tmp_path):
    from forgelab.engines.generator import Generator, GeneratorConfig

    _, t2, _ = meshes
    out = str(tmp_path / "export")
    loop.run_until_complete(t2.call("export_hf", out))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    gen = loop.run_until_complete(Generator.options(procs=1).as_actor(GeneratorConfig(model_dir=out, max_model_len=64)))
    try:
        timings = loop.run_until_complete(t2.call("push_weights", 8, [gen.actor]))
        assert timings[0]["sent"] == 1 and not timings[0]["failed"], timings[0]
        assert loop.run_until_complete(gen.call_one("version")) == 8
    finally:
        loop.run_until_complete(gen.shutdown())
