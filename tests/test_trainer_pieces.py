"""The trainer's step in pieces (`forward_backward`, `optim_step`) against the fused `train_step`, through real
actors and the typed client (`forgelab.engines.trainer_client.TrainerClient`), on the shipped model.

Bit-identical by construction, and checked as such (``==`` on floats, SHA-256 of every parameter and optimizer
tensor): the pieces run the same float32 operations on the same values in the same order as the fused step, so
any slip (a loss swap landing elsewhere, a clipping norm or an lr taken from the wrong place, a slot's
gradients lost on a swap) changes a bit. No tolerance is needed and none is used.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
from dataclasses import replace

import pytest
import torch

from forgelab.config.components import LoraConfig
from forgelab.engines.loss_specs import pack_loss
from forgelab.engines.slot_parts import SlotTrainerHandle
from forgelab.engines.trainer import Trainer, TrainerConfig
from forgelab.engines.trainer_client import TrainerClient
from forgelab.engines.trainer_slots import SlotTrainer
from forgelab.types import AdamParams, StepMetrics
from trainer_actors import random_batches, tiny_model_dir

pytestmark = [pytest.mark.timeout(420), pytest.mark.integration]

# the keys of train_step's dict answer before issue #38: the metrics CSV's trainer columns
OLD_ROW_KEYS = {"loss", "grad_norm", "lr", "step", "skipped", "step_time_s", "loss_name", "entropy", "n_tokens",
                "n_seqs"}


async def _gather(*coros):
    return await asyncio.gather(*coros)


def _nan_loss():
    def nan_loss(lp, **kw):
        return lp.sum() * float("nan"), {}
    return pack_loss(nan_loss)  # by value: the trainer process does not import this test


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def batches(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    return random_batches(vocab, 3, B=4, seed=3)


def _cfg(model_dir, **kw):
    # lr 1e-3 with eps 1e-3 and clipping at 0.05 (below the tiny model's gradient norms): the clipped path runs
    return TrainerConfig(model_dir=model_dir, lr=1e-3, eps=1e-3, warmup_steps=2, total_steps=10, is_cap=2.0,
                         max_grad_norm=0.05, loss="grpo", loss_kwargs={"kl_coef": 0.05}, **kw)


def _same_step(m: StepMetrics, fb, opt) -> None:
    assert not (m.skipped or fb.skipped or opt.skipped), (m, fb, opt)
    assert m.loss == fb.loss and m.grad_norm == fb.grad_norm == opt.grad_norm and m.loss_name == fb.loss_name
    assert m.metrics == fb.metrics
    assert (m.step, m.lr) == (opt.step, opt.lr) and opt.scheduled


def test_fused_step_equals_forward_backward_then_optim_step(loop, model_dir, batches):
    """Two trainers from one config: one takes fused steps, the other the pieces; after every step their loss,
    metrics, token values, parameters, AdamW state and schedule are bit-identical. A loss swap lands at the same
    step on both (the first forward_backward of a window), and the pieces' fault rule holds: a skipped
    forward_backward discards the window, the optim_step after it is skipped, nothing changes."""
    cfg = _cfg(model_dir, micro_batch_size=2)  # two micro-batches per rank: the recompute path of the step
    handles = loop.run_until_complete(_gather(Trainer.options(procs=1).as_actor(cfg),
                                                     Trainer.options(procs=1).as_actor(cfg)))
    fused, pieces = (TrainerClient(h) for h in handles)

    async def steps():
        for i, b in enumerate(batches):
            if i == 2:  # a swap promised to the next step reaches both at its start
                assert await fused.set_loss("dapo") == await pieces.set_loss("dapo") == "dapo"
            m = await fused.train_step(b)
            fb = await pieces.forward_backward(b)
            assert fb.accumulated == 1
            opt = await pieces.optim_step(None)
            _same_step(m, fb, opt)
            assert m.loss_name == ("dapo" if i == 2 else "grpo")
            assert set(m.as_row()) >= OLD_ROW_KEYS and m["loss"] == m.loss  # the CSV columns of before
            assert await fused.fingerprint() == await pieces.fingerprint()
            tv_f, tv_p = await fused.token_values(), await pieces.token_values()
            assert torch.equal(tv_f.trainer_logprobs_B_T, tv_p.trainer_logprobs_B_T)
            assert torch.equal(tv_f.entropy_B_T, tv_p.entropy_B_T)
        lp = await pieces.forward_logprobs(batches[0])  # forward only: nothing moves
        assert lp.shape == batches[0].mask_B_T.shape and bool((lp[batches[0].mask_B_T == 0] == 0).all())
        assert await fused.fingerprint() == await pieces.fingerprint()

        before = await pieces.fingerprint()
        assert not (await pieces.forward_backward(batches[0])).skipped
        bad = await pieces.forward_backward(batches[1], _nan_loss())
        assert bad.skipped and bad.accumulated == 0 and "nan_loss" in bad.skip_reason
        opt = await pieces.optim_step(None)
        assert opt.skipped and "no gradients accumulated" in opt.skip_reason
        assert await pieces.fingerprint() == before  # the window was discarded: no optimizer or schedule step
        # and the same batch steps the same on both afterwards (no gradient was left behind)
        _same_step(await fused.train_step(batches[0]), await pieces.forward_backward(batches[0]),
                   await pieces.optim_step(None))
        assert await fused.fingerprint() == await pieces.fingerprint()

    try:
        loop.run_until_complete(steps())
    finally:
        for h in handles:
            loop.run_until_complete(h.shutdown())


def test_optim_step_with_its_own_hyperparameters_leaves_the_schedule(loop, model_dir, batches):
    """`optim_step(AdamParams(...))` steps with exactly those hyperparameters: the configured ones at the
    scheduled lr give the scheduled step's weights and AdamW state bit for bit, while the schedule stays put
    (its state and the lr of the next scheduled step are those of before)."""
    cfg = _cfg(model_dir)
    handles = loop.run_until_complete(_gather(Trainer.options(procs=1).as_actor(cfg),
                                                     Trainer.options(procs=1).as_actor(cfg)))
    scheduled, own = (TrainerClient(h) for h in handles)

    async def steps():
        before = (await own.fingerprint())[0]
        m = await scheduled.train_step(batches[0])
        await own.forward_backward(batches[0])
        opt = await own.optim_step(AdamParams.from_config(cfg, lr=m.lr))
        assert not opt.scheduled and opt.lr == m.lr and opt.grad_norm == m.grad_norm
        a, b = (await scheduled.fingerprint())[0], (await own.fingerprint())[0]
        assert (a["params"], a["optim"], a["step"]) == (b["params"], b["optim"], b["step"])
        assert b["scheduler"] == before["scheduler"] and b["lr"] == before["lr"] != a["lr"]
        with pytest.raises(ValueError, match="AdamParams"):
            AdamParams(lr=-1.0)

    try:
        loop.run_until_complete(steps())
    finally:
        for h in handles:
            loop.run_until_complete(h.shutdown())


def test_a_lora_slot_steps_the_same_fused_or_in_pieces(loop, model_dir, batches):
    """Two LoRA slots of one SlotTrainer from one config (adapter dropout on: the RNG path): slot "a" takes fused
    steps, slot "b" the pieces, with "a"'s step run while "b"'s window is open (its accumulated gradients
    travel with the slot). After each step both slots' adapters, AdamW state and schedule are bit-identical."""
    cfg = _cfg(model_dir, lora=LoraConfig(enabled=True, rank=4, alpha=8.0, dropout=0.1))
    handle = loop.run_until_complete(SlotTrainer.options(procs=1).as_actor(cfg))
    trainer = TrainerClient(handle)
    fused, pieces = TrainerClient(SlotTrainerHandle(handle, "a")), TrainerClient(SlotTrainerHandle(handle, "b"))

    async def steps():
        assert (await trainer.slot_new("a", cfg))["slots"] == ["a"]
        assert (await trainer.slot_new("b", cfg))["slots"] == ["a", "b"]
        assert await fused.fingerprint() == await pieces.fingerprint()
        for b in batches:
            fb = await pieces.forward_backward(b)
            m = await fused.train_step(b)  # slot a in, slot b (with its gradients) out and back
            opt = await pieces.optim_step(None)
            _same_step(m, fb, opt)
            assert math.isfinite(m.loss) and m.metrics["n_tokens"] > 0
            assert await fused.fingerprint() == await pieces.fingerprint()
        assert (await trainer.slot_stats())["swaps"] >= 3 * len(batches)

    try:
        loop.run_until_complete(steps())
    finally:
        loop.run_until_complete(handle.shutdown())


def test_old_dict_batches_and_answers_still_work(loop, model_dir, batches):
    """One release of compatibility: a dict batch (the old `collate` answer) is accepted by the endpoint, and the
    typed answers read by key as the old dicts did."""
    handle = loop.run_until_complete(Trainer.options(procs=1).as_actor(_cfg(model_dir)))
    try:
        as_dict = {k: v for k, v in batches[0].items()}
        m = loop.run_until_complete(handle.call_one("train_step", as_dict))
        assert isinstance(m, StepMetrics) and m["skipped"] == 0 and m.get("loss") == m.loss
        assert replace(m, step_time_s=0.0).as_row()["step"] == 1
    finally:
        loop.run_until_complete(handle.shutdown())
