"""A pooled engine set handed from one user to the next carries nothing over (issue 39).

Claim: after `ProcessPool` re-initialises a set that a run trained on and changed live (loss and its kwargs,
learning rate, an added reward, a generator test hook, weights pushed at later versions), the set's state equals
what the same processes held when freshly spawned: the trainer's parameter and optimizer-state checksums,
schedule, step, lr, loss, policy version and adapter flag; the generators' served versions; and the generators'
seeded completions and their logprobs (the served weights), bit for bit. The fresh values are taken from the
same set right after its cold spawn, before any run used it; the pids show it is the same processes.

Real processes (the shipped model, no reference: the engine key several modules share). The test also prints the
resident memory of one set (the test pool's cap is sized by it; `tests/conftest.py` ENGINE_POOL_MAX_IDLE).

The same for a LoRA set (adapters on the frozen base; the generator serves pushed adapters by name): after an
asynchronous LoRA run with live changes (max_policy_age 1, a loss swap, an lr change, an added reward, held-out
evals, adapters pushed at later versions), the re-initialised set equals its cold spawn (trainer checksums and
info, versions, seeded completions: the served adapter is B = 0 again), and a short synchronous LoRA run (its
learning metrics are a function of the seed) trains exactly as the same run did on the set before the
asynchronous run (every learning column: losses, rewards, KL, grad norms; `compare_metrics`).
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]  # token ids: the generator takes them as they are


def _config(out_dir, name, steps=3, lora=False, max_policy_age=0):
    from forgelab.config.components import LoraConfig
    from forgelab.config.run_config import EvalConfig, PlacementConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig

    return RunConfig(
        name=name,
        rollout=RolloutConfig(task="addition", group_size=8, prompts_per_rollout=2, concurrency=2, max_tokens=8),
        train=TrainConfig(steps=steps, batch_size=16, lr=2e-3 if lora else 1e-4, warmup_steps=1 if lora else 2,
                          max_policy_age=max_policy_age, seed=5, loss_kwargs={"kl_coef": 0.02} if lora else {}),
        eval=EvalConfig(every=0, n=8),
        tracking=TrackingConfig(out_dir=str(out_dir), wandb=False),
        placement=PlacementConfig() if lora else PlacementConfig(reference=False),  # LoRA: the base is the reference
        lora=LoraConfig(enabled=True, rank=8, alpha=16.0) if lora else LoraConfig(),
    )


def short_reward(prompt, completion, target, **info):
    return 1.0 if len(completion.strip()) <= 3 else 0.0


async def _state(parts) -> dict[str, object]:
    from forgelab.engines.generator import SamplingConfig
    from forgelab.generation import GenerateRequest

    trainer = parts.trainer
    groups = await parts.generators.generate(GenerateRequest(
        prompts_P=[PROMPT], n=3, sampling=SamplingConfig(temperature=1.0, max_tokens=8), seeds_P_G=[[11, 12, 13]]))
    return {"fingerprint": (await trainer.call("fingerprint"))[0], "info": (await trainer.call("info"))[0],
            "versions": await parts.generators.versions(),
            "completions": [(c.completion_ids, c.logprobs, c.policy_version) for c in groups[0]]}


async def _read_set(pool, cfg) -> tuple[dict[str, object], dict[str, list[int]], tuple[int, int]]:
    """A set acquired from `pool` for `cfg`: its state (`_state`), its process ids and the pool's (spawned,
    reused) counts; then given back to the pool."""
    parts = await pool.acquire(cfg)
    try:
        return await _state(parts), await pool.pids(parts), (pool.spawned, pool.reused)
    finally:
        await parts.shutdown()


def _rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


@pytest.fixture(scope="module")
def handed_over(loop, tmp_path_factory):
    from forgelab.engines.pool import ProcessPool
    from forgelab.run import Run

    out = tmp_path_factory.mktemp("reuse")
    pool = ProcessPool(max_idle=1)  # its own pool: the first state must be a cold spawn's
    run = loop.run_until_complete
    try:
        fresh, fresh_pids, counts = run(_read_set(pool, _config(out, "fresh")))  # back to the pool, idle
        assert counts == (1, 0)
        w = {"fresh": fresh, "fresh_pids": fresh_pids}
        w["rss_mib"] = _rss_mib([p for ps in w["fresh_pids"].values() for p in ps])
        print(f"\none pooled engine set (generator, trainer; no reference): {w['rss_mib']:.0f} MiB resident")

        user = Run(_config(out, "user"), spawn=pool)

        async def use() -> None:
            await user.start()
            await user.until(step=1)
            await user.set_loss("dapo", eps_high=0.28)
            await user.trainer.call("set_lr", 5e-4)
            user.add_reward("short", short_reward, 0.5)
            await user.wait()
            await user.parts.generators.fanout("corrupt_next_logprob", 0, 1.0)  # armed, never consumed

        run(use())
        w["user"] = {"state": user.state, "message": user.message, "step": user.step,
                     "info": run(user.trainer.call("info"))[0]}
        run(user.shutdown())
        assert pool.reused == 1 and len(pool.idle) == 1

        w["next"], w["next_pids"], w["pool"] = run(_read_set(pool, _config(out, "next")))
        yield w
    finally:
        run(pool.shutdown())


@pytest.mark.integration
def test_user_changed_the_set(handed_over):
    """The first user really trained and changed what the next one must not see."""
    u = handed_over["user"]
    assert u["state"] == "finished" and u["step"] == 3, u["message"]
    assert u["info"]["loss"] == "dapo" and u["info"]["loss_kwargs"] == {"eps_high": 0.28}
    assert u["info"]["step"] == 3 and u["info"]["policy_version"] != handed_over["fresh"]["info"]["policy_version"]


@pytest.mark.integration
def test_handed_over_set_equals_a_fresh_spawn(handed_over):
    w = handed_over
    assert w["pool"] == (1, 2) and w["next_pids"] == w["fresh_pids"]  # the same processes, re-initialised twice
    fresh, nxt = w["fresh"], w["next"]
    assert nxt["fingerprint"] == fresh["fingerprint"]  # parameters, optimizer state, schedule, step, lr
    assert nxt["info"] == fresh["info"]  # step, policy version, loss and kwargs, LoRA flag
    assert nxt["versions"] == fresh["versions"]
    assert nxt["completions"] == fresh["completions"]  # the served weights, and no logprob hook left armed


@pytest.fixture(scope="module")
def lora_handed_over(loop, tmp_path_factory):
    import pandas as pd

    from forgelab.engines.pool import ProcessPool
    from forgelab.run import Run

    out = tmp_path_factory.mktemp("reuse-lora")
    pool = ProcessPool(max_idle=1)  # its own pool: the first state must be a cold spawn's
    run = loop.run_until_complete
    try:
        fresh, fresh_pids, _ = run(_read_set(pool, _config(out, "lora-fresh", lora=True)))
        w = {"fresh": fresh, "fresh_pids": fresh_pids}

        def synchronous(name: str) -> pd.DataFrame:
            r = Run(_config(out, name, steps=2, lora=True), spawn=pool)
            try:
                run(r.start())
                run(r.wait())
                assert r.state == "finished", r.message
            finally:
                run(r.shutdown())
            return pd.read_csv(r.out_dir / "metrics.csv")

        w["before"] = synchronous("lora-sync-before")
        user = Run(_config(out, "lora-user", steps=4, lora=True, max_policy_age=1), spawn=pool)

        async def use() -> None:
            await user.start()
            await user.until(step=1)
            await user.set_loss("dapo", eps_high=0.28)
            await user.trainer.call("set_lr", 5e-3)
            user.add_reward("short", short_reward, 0.5)
            await user.wait()
            await user.evaluate()  # held-out greedy answers from the last adapter

        run(use())
        w["user"] = {"state": user.state, "message": user.message, "step": user.step,
                     "info": run(user.trainer.call("info"))[0], "versions": run(user.parts.generators.versions())}
        run(user.shutdown())
        w["after"] = synchronous("lora-sync-after")
        w["next"], w["next_pids"], w["pool"] = run(_read_set(pool, _config(out, "lora-next", lora=True)))
        yield w
    finally:
        run(pool.shutdown())


@pytest.mark.integration
def test_lora_set_after_an_asynchronous_run_equals_a_fresh_spawn(lora_handed_over):
    from forgelab.experiments.replay import compare_metrics

    w = lora_handed_over
    u = w["user"]
    assert u["state"] == "finished" and u["step"] == 4, u["message"]  # the user really trained and changed it
    assert u["info"]["lora"] is True
    assert u["info"]["loss"] == "dapo" and u["info"]["loss_kwargs"] == {"eps_high": 0.28}
    assert all(v == 4 for v in u["versions"]), u["versions"]  # adapters pushed at later versions
    assert w["pool"] == (1, 4) and w["next_pids"] == w["fresh_pids"]  # one spawn, re-initialised four times
    assert w["next"] == w["fresh"]  # adapters and optimizer (checksums), info, versions, the served adapter
    assert list(w["after"]["step"]) == [1, 2]
    assert compare_metrics(w["before"], w["after"]) == []  # losses, rewards, KL, grad norms: bit for bit


def test_max_idle_closes_the_longest_idle_set_first():
    """The pool's memory cap, without processes: returned sets beyond ``max_idle`` are stopped oldest first;
    ``close_idle`` stops the rest; a negative cap is refused."""
    from forgelab.engines.pool import PooledParts, ProcessPool

    stopped: list[str] = []

    class Set(PooledParts):
        async def stop_processes(self) -> None:
            stopped.append(self.label)

    async def healthy(parts) -> bool:
        return True

    async def scenario() -> None:
        pool = ProcessPool(max_idle=2)
        pool._healthy = healthy  # the stubs have no processes to ask
        sets = []
        for label in "abc":
            s = Set(generators=None, trainer=None, reference=None, pool=pool, key={})
            s.label = label
            pool.busy.append(s)
            sets.append(s)
        for s in sets:
            await s.shutdown()  # back to the pool
        assert stopped == ["a"] and [s.label for s in pool.idle] == ["b", "c"]
        assert await pool.close_idle() == 2 and stopped == ["a", "b", "c"] and pool.idle == []

    asyncio.run(scenario())
    with pytest.raises(ValueError, match="max_idle"):
        ProcessPool(max_idle=-1)
