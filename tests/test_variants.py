"""LoRA variants on one set of engines (`forgelab.SharedEngines`): slots in the trainer, adapters per slot in vLLM.

The in-process tests drive a `SlotTable` over one `TrainerState`: interleaved slots step exactly as separate
trainers (the same float32 operations on the same values: compared bit for bit). The integration tests share
ONE engines (one SlotGenerator, one SlotTrainer) for the whole module: a synchronous LoRA parent forked at
step 2 into three variants (no override, lr x2, dapo with the format reward off), all four training at once;
then a variant is detached and a fork reuses its slot; two more forks train side by side, one with a reward
that starts raising.
"""
from __future__ import annotations

import asyncio
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_actors import random_batches, tiny_model_dir

integration = pytest.mark.integration

FORK_AT, STEPS, BATCH = 2, 5, 16


# ------------------------------------------------------------------------------------------- in process
def _fingerprints(table, slot):
    table.activate(slot)
    return table.state.fingerprint()


def test_interleaved_slots_step_exactly_as_separate_trainers(tmp_path):
    """Two slots (grpo lr 1e-3; dapo lr 3e-3) stepped alternately on one TrainerState, a third slot copied from
    the first mid-way, and a slot whose loss is NaN: each slot's adapters, AdamW state, schedule and step equal
    (SHA-256 of the tensors) those of a trainer that ran its batches alone. Equal by construction: the same
    float32 operations on the same values in the same order (a swap copies tensors bit for bit), so any slip
    (a moment left from another slot, a schedule or loss not swapped) changes a hash."""
    import torch.distributed as dist

    from forgelab.config.components import LoraConfig, TrainerConfig
    from forgelab.engines.trainer_slots import SlotTable
    from forgelab.engines.trainer_state import TrainerState

    created = not dist.is_initialized()
    lora = LoraConfig(enabled=True, rank=4, alpha=8.0)
    model = tiny_model_dir(str(tmp_path))
    cx = TrainerConfig(model_dir=model, lr=1e-3, device="cpu", warmup_steps=1, total_steps=6,
                       loss_kwargs={"kl_coef": 0.05}, lora=lora)
    cy = TrainerConfig(model_dir=model, lr=3e-3, device="cpu", warmup_steps=1, total_steps=6,
                       loss="dapo", lora=lora)
    cn = TrainerConfig(model_dir=model, lr=1e-3, device="cpu", lora=lora,
                       loss=lambda lp, **kw: (lp.sum() * float("nan"), {}))
    b = random_batches(105, 4, B=4, seed=1, with_ref=False)
    try:
        shared = TrainerState.create(cx, 0, 1)
        fresh = shared.fingerprint()  # the adapters every slot starts from (seed 0 for all three configs)
        table = SlotTable(shared)
        table.new("x", cx), table.new("y", cy), table.new("n", cn)
        got = {}
        table.activate("x"), shared.train_step(b[0])
        table.activate("y"), shared.train_step(b[1])
        table.activate("n")
        skipped = shared.train_step(b[0])
        table.copy("x", "z")
        table.activate("x"), shared.train_step(b[2])
        table.activate("z"), shared.train_step(b[3])
        table.activate("y"), shared.train_step(b[3])
        got = {s: _fingerprints(table, s) for s in ("x", "y", "z", "n")}
        alone = {}
        for name, cfg, seq in (("x", cx, (0, 2)), ("y", cy, (1, 3)), ("z", cx, (0, 3))):
            st = TrainerState.create(cfg, 0, 1)
            for i in seq:
                st.train_step(b[i])
            alone[name] = st.fingerprint()
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
    assert skipped["skipped"] == 1 and "loss" in skipped["skip_reason"]
    for s in ("x", "y", "z"):
        assert got[s] == alone[s], s
    assert got["x"]["lr"] != got["y"]["lr"] and got["x"]["step"] == got["y"]["step"] == 2
    assert got["n"]["params"] == fresh["params"] and got["n"]["step"] == 0  # the NaN slot moved nothing
    with pytest.raises(KeyError, match="does not exist"):
        table.activate("nope")


def test_a_slot_step_is_one_call_and_swaps_only_when_the_slot_changes(tmp_path):
    """`train_export` in a slot (`slot_call`, as `SlotTrainer.in_slot` runs it) is the whole controller step in
    one call: it equals `train_step` then `token_values` then the adapter export of a trainer stepping alone
    (SHA-256 of the state; the adapter and token values tensor for tensor); calls in the slot already active
    swap nothing, a call in another slot swaps once. A skipped step exports nothing and keeps the version."""
    import torch
    import torch.distributed as dist

    from forgelab.config.components import LoraConfig, TrainerConfig
    from forgelab.engines.contracts import SlotStep
    from forgelab.engines.trainer_slots import SlotTrainer, slot_call
    from forgelab.engines.trainer_state import TrainerState

    created = not dist.is_initialized()
    lora = LoraConfig(enabled=True, rank=4, alpha=8.0)
    model = tiny_model_dir(str(tmp_path))
    cx = TrainerConfig(model_dir=model, lr=1e-3, device="cpu", warmup_steps=1, total_steps=6, loss="dapo", lora=lora)
    cn = TrainerConfig(model_dir=model, lr=1e-3, device="cpu", lora=lora,
                       loss=lambda lp, **kw: (lp.sum() * float("nan"), {}))
    b = random_batches(105, 3, B=4, seed=2, with_ref=False)
    try:
        actor = SlotTrainer(cx)
        actor.state = TrainerState.create(cx, 0, 1)
        table = actor.slot_table()
        table.new("x", cx), table.new("y", cx), table.new("n", cn)

        async def go():
            out = [await slot_call(actor, "x", "train_export", (b[0], 1), {}),
                   await slot_call(actor, "x", "train_export", (b[1], 2), {})]
            swaps_same = table.swaps
            out.append(await slot_call(actor, "y", "train_export", (b[0], 1), {}))
            skipped = await slot_call(actor, "n", "train_export", (b[0], 1), {})
            return out, swaps_same, skipped

        (x1, x2, y1), swaps_same, skipped = asyncio.run(go())
        got = _fingerprints(table, "x")
        alone = TrainerState.create(cx, 0, 1)
        alone.train_step(b[0])
        alone.train_step(b[1])
        values, adapter = alone.token_values, alone.push_state_dict()
        want = alone.fingerprint()
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
    assert all(isinstance(o, SlotStep) for o in (x1, x2, y1, skipped))
    assert swaps_same == 1 and table.swaps == 4  # x (first; its second call none), y, n, x again (fingerprint)
    assert table.calls == {"train_export": 4}
    assert got == want and x2.version == 2 and x2.metrics.step == 2
    assert x2.adapter.keys() == adapter.keys() and all(torch.equal(x2.adapter[k], adapter[k]) for k in adapter)
    assert torch.equal(x2.token_values.trainer_logprobs_B_T, values.trainer_logprobs_B_T)
    assert skipped.metrics.skipped and skipped.adapter is None and skipped.version == 0


def test_no_base_pass_when_the_loss_does_not_read_the_reference(tmp_path):
    """A LoRA trainer's batch without reference logprobs gets the base's (adapters off) only when the loss reads
    them: grpo at kl_coef 0.05 runs one base pass a step, dapo (kl_coef 0) none; and dapo's step is the same
    (SHA-256 of the state) as when the batch carries the base's logprobs computed beforehand (the old path)."""
    import dataclasses

    import torch.distributed as dist

    from forgelab.config.components import LoraConfig, TrainerConfig
    from forgelab.engines.contracts import check_batch
    from forgelab.engines.trainer_state import TrainerState

    created = not dist.is_initialized()
    lora = LoraConfig(enabled=True, rank=4, alpha=8.0)
    model = tiny_model_dir(str(tmp_path))
    cd = TrainerConfig(model_dir=model, lr=1e-3, device="cpu", loss="dapo", lora=lora)
    cg = TrainerConfig(model_dir=model, lr=1e-3, device="cpu", loss_kwargs={"kl_coef": 0.05}, lora=lora)
    b = random_batches(105, 2, B=4, seed=3, with_ref=False)
    try:
        dapo = TrainerState.create(cd, 0, 1)
        for batch in b:
            dapo.train_step(batch)
        skipped_base = dapo.base_passes
        grpo = TrainerState.create(cg, 0, 1)
        for batch in b:
            grpo.train_step(batch)
        old = TrainerState.create(cd, 0, 1)
        for batch in b:
            batch = check_batch(batch)
            ref = old.base_logprobs(batch.tokens_B_L, None) * (batch.mask_B_T != 0)
            old.train_step(dataclasses.replace(batch, ref_logprobs_B_T=ref))
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
    assert skipped_base == 0 and dapo.info()["base_passes"] == 0
    assert grpo.base_passes == len(b)
    assert dapo.fingerprint() == old.fingerprint()


def test_a_run_in_a_slot_makes_one_trainer_call_a_step_and_serves_a_version_once_the_generator_has_it(tmp_path):
    """The controller's side, on fakes: a run whose weight sync serves a slot (its generators have one) and whose
    trainer exports its step (`train_export`) makes exactly one trainer call per trained step (no train_step,
    token_values or push_weights), hands each adapter to every generator replica itself, and opens admission
    for version v (``buffer.served_version``) only after the replicas loaded v: every load sees v - 1 served,
    and every rollout was generated at a version its replica had loaded."""
    from forgelab.config.run_config import EvalConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig
    from forgelab.engines.contracts import SlotStep, TrainBatch
    from forgelab.run import Run
    from forgelab.testing.fakes import FakeParts, FakeTrainer, fake_generators

    class ExportingTrainer(FakeTrainer):
        def __init__(self):
            super().__init__()
            self.calls: list[str] = []

        async def train_step(self, batch):
            self.calls.append("train_step")
            return await super().train_step(batch)

        async def token_values(self):
            self.calls.append("token_values")
            return None

        async def push_weights(self, version, generators, transport=None):
            self.calls.append("push_weights")
            return await super().push_weights(version, generators, transport)

        async def train_export(self, batch: TrainBatch, version: int) -> SlotStep:
            self.calls.append("train_export")
            m = await FakeTrainer.train_step(self, batch)
            return SlotStep(metrics=m, adapter=None if m.skipped else {"a": __import__("torch").ones(2)},
                            version=version)

    served_at_load: list[tuple[int, int]] = []  # (version loaded, buffer.served_version at that moment)

    class Loader:
        def __init__(self, gen):
            self.gen = gen

        async def call(self, update):
            await asyncio.sleep(0.01)  # a load takes a while: nothing may be served at v before it ends
            served_at_load.append((update.version, run.buffer.served_version))
            assert update.slot == "slot7" and set(update.tensors) == {"a"}
            self.gen.version = update.version
            self.gen.loaded.append(update.version)
            return update.version

    async def spawn(cfg):
        gens = held["gens"] = fake_generators(cfg, 2)
        gens.slot = "slot7"
        for g in gens.replicas:
            g.update_adapter_slot = Loader(g)
        return FakeParts(generators=gens, trainer=trainer)

    trainer, held = ExportingTrainer(), {}
    cfg = RunConfig(name="slotted", rollout=RolloutConfig(task="addition", group_size=4, prompts_per_rollout=2,
                                                         concurrency=2, max_tokens=6),
                    train=TrainConfig(steps=5, batch_size=8, warmup_steps=1, max_policy_age=1),
                    eval=EvalConfig(every=0, n=8), tracking=TrackingConfig(out_dir=str(tmp_path), wandb=False))
    run = Run(cfg, spawn=spawn)

    async def go():
        await run.start()
        await asyncio.wait_for(run.wait(), 60)
        await run.shutdown()

    asyncio.run(go())
    assert run.state == "finished" and run.step == run.version == 5, run.message
    assert trainer.calls == ["train_export"] * 5
    assert sorted(served_at_load) == sorted((v, v - 1) for v in range(1, 6) for _ in range(2))
    assert [g.loaded for g in held["gens"].replicas] == [[1, 2, 3, 4, 5]] * 2
    # a completion carries the version its replica had loaded when it took the request in (the fake's rule)
    assert set(run.rollouts["policy_version"]) <= set(range(0, 6))


# ------------------------------------------------------------------------------------------- real processes
def _config(name: str, out_dir: Path, steps: int = STEPS):
    from forgelab.config.components import LoraConfig
    from forgelab.config.run_config import EvalConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig

    return RunConfig(name=name, lora=LoraConfig(enabled=True, rank=8, alpha=16.0),
                     rollout=RolloutConfig(task="addition", group_size=8, prompts_per_rollout=2, concurrency=2,
                                           max_tokens=8),
                     train=TrainConfig(steps=steps, batch_size=BATCH, lr=2e-3, warmup_steps=1, max_policy_age=0,
                                       seed=3, loss_kwargs={"kl_coef": 0.02}),
                     eval=EvalConfig(every=0, n=8), tracking=TrackingConfig(out_dir=str(out_dir), wandb=True))


@pytest.fixture(scope="module")
def engines(loop, tmp_path_factory):
    from forgelab.experiments.variants import SharedEngines

    out = tmp_path_factory.mktemp("variants")
    eng = SharedEngines(_config("base", out), slots=4)
    eng.out = out
    yield eng
    loop.run_until_complete(eng.shutdown())
    import wandb

    wandb.teardown()


@pytest.fixture(scope="module")
def swept(loop, engines):
    """The parent and its three variants, all finished (processes kept), and the trainer's pids."""
    from forgelab.run import Run

    parent = Run(_config("base", engines.out), spawn=engines)

    async def go():
        await parent.start()
        await parent.until(step=FORK_AT)
        kids = await engines.sweep(parent, {"same": {}, "lr2": {"lr": 4e-3},
                                            "dapo": {"loss": "dapo", "reward_weights": {"answer_format": 0.0}}})
        await asyncio.gather(parent.wait(), *(k.wait() for k in kids.values()))
        return kids

    kids = loop.run_until_complete(go())
    runs = {"base": parent, **kids}
    engines.swept_stats = loop.run_until_complete(engines.slot_stats())  # before the tests below add calls
    pids = loop.run_until_complete(engines.parts.trainer.pids())
    at = {json.loads((k.out_dir / "origin.json").read_text())["step"] for k in kids.values()}
    assert len(at) == 1  # the parent stayed paused through the sweep: one parent state for all
    yield runs, pids, at.pop()


@integration
def test_four_variants_train_on_shared_engines_as_their_overrides_say(swept, engines):
    import pandas as pd

    runs, _, fs = swept
    for name, r in runs.items():
        assert r.state == "finished" and r.step == STEPS, (name, r.state, r.message)
        assert r.parts.pool is engines
    assert sorted(p.slot for p in (r.parts for r in runs.values())) == ["slot0", "slot1", "slot2", "slot3"]
    m = {n: pd.read_csv(r.out_dir / "metrics.csv").set_index("step") for n, r in runs.items()}
    after = list(range(fs + 1, STEPS + 1))
    assert after
    # lr x2, schedule position kept: 4e-3 * f(s) is exactly 2 x (2e-3 * f(s)) in float64 (a power-of-two scale)
    assert [m["lr2"].loc[s, "lr"] for s in after] == [2 * m["base"].loc[s, "lr"] for s in after]
    assert (m["dapo"].loc[after, "loss_name"] == "dapo").all() and (m["base"].loc[after, "loss_name"] == "grpo").all()
    assert (m["dapo"].loc[:fs, "loss_name"] == "grpo").all()
    # each run's trained episodes were scored with its own reward weights
    for name, w_fmt in (("base", 0.1), ("dapo", 0.0)):
        df = runs[name].rollouts
        df = df[(df["status"] == "trained") & (df["policy_version"] >= fs)]
        expect = df["reward/exact_answer"] + w_fmt * df["reward/answer_format"]
        assert len(df) and (df["reward"] - expect).abs().max() < 1e-12, name
    # the services panel: which run sits in which slot, and each run's own served version
    from forgelab.lab.summary import services_lines

    text = "\n".join(services_lines(runs["lr2"]))
    assert f"shared engines {engines.name}: this run in {runs['lr2'].parts.slot}; 4/4 slots used" in text, text
    assert f"version {STEPS}" in text, text
    # every run's completions carry its own version; all four trained on one trainer process
    for name, r in runs.items():
        versions = set(r.rollouts["policy_version"])  # a fork trains first on the parent's buffered episodes
        assert versions <= set(range(0 if name == "base" else fs, STEPS + 1)) and STEPS - 1 in versions, (name, versions)


@integration
def test_each_variant_step_is_one_trainer_call_and_swaps_stay_near_one_a_step(swept, engines):
    """Four variants stepping at once on one trainer: every trained step was one `train_export` call (no
    train_step, token_values or push_weights per step; a fork's restore pushes once); the trainer swapped slots
    at most 1.1 times a step, plus two per fork (its calls in the parent's slot, then in the child's: checkpoint,
    restore, overrides; 14 steps and 3 forks here: 21.4, where three calls a step would swap about 3 times a
    step); the dapo variant (kl_coef 0) ran no base pass: the base passes are the grpo runs' steps."""
    runs, _, fs = swept
    t = engines.swept_stats["trainer"]
    steps = sum(r.step - (0 if n == "base" else fs) for n, r in runs.items())
    forks = len(runs) - 1
    assert t["calls"]["train_export"] == steps, t["calls"]
    assert not {"train_step", "token_values"} & set(t["calls"]), t["calls"]
    assert t["calls"].get("push_weights", 0) <= forks, t["calls"]
    assert t["swaps"] <= 1.1 * steps + 2 * forks, (t["swaps"], steps, t["calls"])
    assert t["base_passes"] == steps - (STEPS - fs), (t["base_passes"], steps)


@integration
def test_no_override_fork_matches_its_parent_in_sync_mode(swept):
    """max_policy_age 0, seeded samples: the fork without overrides trains as its parent does after the fork.
    Both generate their batches concurrently in one vLLM batch (with the other variants' requests); the
    trainer steps them one after the other in one process."""
    import pandas as pd

    from forgelab.experiments.replay import compare_metrics

    runs, _, fs = swept
    a = pd.read_csv(runs["base"].out_dir / "metrics.csv")
    b = pd.read_csv(runs["same"].out_dir / "metrics.csv")
    diffs = compare_metrics(a[a["step"] > fs], b[b["step"] > fs])
    assert diffs == [], diffs[:8]


def _wandb_history(run_dir: Path) -> list[dict]:
    """An offline wandb run's history, read by wandb's own reader (as tests/test_real_data_run.py does)."""
    wandb_cli = shutil.which("wandb") or str(Path(sys.executable).parent / "wandb")
    out = subprocess.run([wandb_cli, "leet", "inspect", "--json", str(run_dir)], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    return [json.loads(x)["history"]["item"] for x in out.splitlines()
            if x.startswith("{") and json.loads(x).get("type") == "history"]


@integration
def test_each_variant_keeps_its_own_logs_manifest_and_accounting(loop, swept, engines):
    from forgelab.controller.rollout_log import read_rollouts

    runs, _, fs = swept
    for name, r in runs.items():
        c = r.episodes
        assert c["generated"] == c["trained"] + c["evicted"] + c["dropped"] + c["buffered"] + c["in_flight"], (name, c)
        assert c["trained"] == STEPS * BATCH, (name, c)  # a fork carries its parent's counts on
        r.records.flush()
        log = read_rollouts(r.out_dir)
        trained_here = (STEPS - (0 if name == "base" else fs)) * BATCH
        assert (log["status"] == "trained").sum() == trained_here, (name, log["status"].value_counts())
        if name == "base":  # every episode it closed is in its log
            assert len(log) == c["trained"] + c["evicted"] + c["dropped"], (name, len(log), c)
        kinds = [e["kind"] for e in (json.loads(x) for x in (r.out_dir / "events.jsonl").read_text().splitlines())]
        assert "spawned" in kinds and kinds[-1] == "finished", (name, kinds[-3:])
        assert ("forked_from" in kinds) == (name != "base")
        if name != "base":  # the fork copied the trainer's slot in memory: the fork checkpoint has no trainer/
            origin = json.loads((r.out_dir / "origin.json").read_text())
            assert origin["trainer_state"].startswith("copied in memory"), origin
            assert (Path(origin["checkpoint"]) / "controller.json").is_file()
            assert not (Path(origin["checkpoint"]) / "trainer").exists()
        man = json.loads((r.out_dir / "manifest.json").read_text())
        assert man["shared_engines"]["engines"] == engines.name and man["shared_engines"]["slot"] == r.parts.slot
        assert "replay the whole sweep" in man["shared_engines"]["replay"]
    for name, r in runs.items():  # wandb: one run per variant, every step logged (complete once finished)
        r.tracker.finish()
        wdirs = sorted((r.out_dir / "wandb").glob("offline-run-*"))
        assert len(wdirs) == 1, (name, wdirs)
        steps = sorted({int(h["_step"]) for h in _wandb_history(wdirs[0]) if "loss" in h})
        first = fs + 1 if name != "base" else 1
        assert steps[-1] == STEPS and set(range(first, STEPS + 1)) <= set(steps), (name, steps)


async def _close(*rs):
    await asyncio.gather(*(r.shutdown() for r in rs))


@integration
def test_detaching_a_variant_frees_its_slot_and_the_next_fork_reuses_it(loop, swept, engines):
    """Detaching "dapo" frees its slot (the processes stay: same trainer pids); the next fork takes that slot
    and trains there."""
    runs, pids, _ = swept

    async def go():
        freed = runs["dapo"].parts.slot
        await engines.detach(runs["dapo"])
        assert runs["dapo"].parts is None and engines.free_slots() == [freed]
        again = await runs["base"].fork(name="again", steps=STEPS + 2)
        try:
            assert again.parts.slot == freed and engines.free_slots() == []  # the slot "dapo" left
            await again.wait()
        except BaseException:
            await again.shutdown()
            raise
        return again

    again = loop.run_until_complete(go())
    try:
        assert loop.run_until_complete(engines.parts.trainer.pids()) == pids  # no process started
        assert again.state == "finished" and again.step == STEPS + 2, again.message
    finally:
        loop.run_until_complete(_close(again))
    assert len(engines.free_slots()) == 1


@integration
def test_a_variant_whose_reward_raises_is_paused_alone(loop, swept, engines):
    """Two forks train beside each other; one's reward starts raising on every episode: `SharedEngines.watch` pauses
    it alone (its message names the reward), the other trains to its end on the same processes."""
    runs, _, _ = swept
    boom = {"on": False}

    def flaky(prompt: str, completion: str, target: str, **info) -> float:
        if boom["on"]:
            raise RuntimeError("flaky reward: service down")
        return 0.0

    async def go():
        await engines.detach(runs["lr2"])
        good = await runs["base"].fork(name="good", steps=STEPS + 3)
        bad = await runs["base"].fork(name="bad", steps=STEPS + 3, rewards={"flaky": flaky})
        engines.watch(bad, rollouts=1)
        boom["on"] = True
        try:
            await bad.until(predicate=lambda r: r.state != "running", timeout=300)
            await good.wait()
        except BaseException:
            await _close(good, bad)
            raise
        return good, bad

    good, bad = loop.run_until_complete(go())
    try:
        assert good.state == "finished" and good.step == STEPS + 3, good.message
        assert bad.state == "paused" and "failed their reward" in bad.message and "flaky" in bad.message, bad.message
        assert bad.step < STEPS + 3 and runs["same"].state == "finished"
        assert any(e["kind"] == "reward_error" for e in bad.events)
    finally:
        loop.run_until_complete(_close(good, bad))
    assert len(engines.free_slots()) == 2
