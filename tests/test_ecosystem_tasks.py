"""Tasks from the ecosystem: reasoning-gym as a data source with its own scorer, skyrl-gym environments through
`forgelab.envs.skyrl.SkyRLGymEnv` (issue 40, item 5; docs/ecosystem.md).

The fast tests judge forgelab's rewards against reasoning-gym's unmodified `score_answer` on a 200-item draw
and skyrl-gym's environments as skyrl-gym itself runs them; the integration test trains one step of a
skyrl-gym environment on real processes. Nothing is downloaded: both libraries generate locally, and the hubs
are switched off below.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import threading
import time

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")
skyrl_gym = pytest.importorskip("skyrl_gym")

from forgelab.config.run_config import ConfigError, ReasoningGymConfig, RolloutConfig, RunConfig  # noqa: E402
from forgelab.controller.reward_runner import configured_rewards, reward_weights  # noqa: E402
from forgelab.data.datasets import load_split  # noqa: E402
from forgelab.envs import make_env  # noqa: E402
from forgelab.rewards import REWARDS  # noqa: E402

integration = pytest.mark.integration


@pytest.fixture(autouse=True, scope="module")
def _offline():
    """No hub download, here or in the processes a run starts (they inherit the environment)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        yield

# The shipped tiny model's addition: two terms of up to two digits, "+" only (STACK_NOTES).
ARITH = {"min_terms": 2, "max_terms": 2, "max_digits": 2, "operators": ["+"], "allow_parentheses": False,
         "allow_negation": False}
N = 200


def _spec(**kw) -> ReasoningGymConfig:
    return ReasoningGymConfig(**{"name": "basic_arithmetic", "config": dict(ARITH), "seed": 7, "size": N,
                                 "prompt": "expression", **kw})


def _answers(oracle: str) -> list[str]:
    """Completions to score: right, right with whitespace, wrong, containing the oracle (partial credit in
    reasoning-gym's base scorer), empty, words."""
    wrong = str(int(oracle) + 1)
    return [oracle, f" {oracle}\n", wrong, oracle + "0", "1" + oracle, f"{oracle} {oracle}", "", "fifty"]


@pytest.fixture(scope="module")
def draw():
    """forgelab's 200 problems and reasoning-gym's own dataset object for the same task, seed and size."""
    split = load_split("reasoning_gym", eval_n=50, reasoning_gym=_spec())
    ds = reasoning_gym.create_dataset("basic_arithmetic", seed=7, size=N,
                                      **{k: tuple(v) if isinstance(v, list) else v for k, v in ARITH.items()})
    return split, ds


def test_problems_are_reasoning_gym_items_in_the_tiny_models_format(draw):
    split, ds = draw
    assert len(split.train) == N and len(split.heldout) == 50
    for i, p in enumerate(split.train):
        entry = ds[i]
        assert p.info["reasoning_gym"]["question"] == entry["question"] and p.target == entry["answer"]
        a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", p.prompt).groups())  # the toy addition's format
        # reasoning-gym draws an operand in [0, 10**max_digits], 100 included: 1 item of these 200 has one
        assert str(a + b) == entry["answer"] and max(a, b) <= 100
    train_q = {p.info["reasoning_gym"]["question"] for p in split.train}
    held_q = [p.info["reasoning_gym"]["question"] for p in split.heldout]
    assert not train_q & set(held_q) and len(set(held_q)) == len(held_q)  # held out: never trained, no repeats


@pytest.mark.parametrize("partial", [False, True])
def test_reward_agrees_with_score_answer_on_200_items(draw, partial):
    """(g) exact match is 1 exactly where score_answer gives 1.0; partial credit is score_answer's value. The
    reward is the one a run configures (`rollout.reasoning_gym.partial_credit`), scored through the run's
    composer on the problem as forgelab built it (the item round-tripped through JSON); the reference is
    reasoning-gym's `score_answer` on its own dataset object and item, given the completion stripped (the
    answer the final-answer-only format defines)."""
    split, ds = draw
    rollout = RolloutConfig(task="reasoning_gym", reasoning_gym=_spec(partial_credit=partial))
    assert reward_weights(rollout) == {("reasoning_gym_partial" if partial else "reasoning_gym"): 1.0}
    composer = configured_rewards(rollout)
    seen = {"one": 0, "between": 0, "zero": 0}
    for i, p in enumerate(split.train):
        for completion in _answers(ds[i]["answer"]):
            ref = ds.score_answer(completion.strip(), ds[i])
            got = composer.score(p.prompt, completion, p.target, **p.info)
            assert not got.failed, got.errors
            want = ref if partial else (1.0 if ref == 1.0 else 0.0)
            assert got.total == want, (i, completion, ref, got.total)
            seen["one" if ref == 1.0 else "zero" if ref == 0.0 else "between"] += 1
    assert seen["one"] == 2 * N and seen["between"] >= 2 * N, seen  # every kind of answer was judged


def test_answer_tag_and_foreign_problems():
    entry = json.loads(json.dumps(reasoning_gym.create_dataset("basic_arithmetic", seed=1, size=1)[0]))
    info = {"reasoning_gym": entry, "reasoning_gym_answer_tag": "answer"}
    oracle = entry["answer"]
    assert REWARDS["reasoning_gym"]("q", f"I think <answer> {oracle} </answer>", oracle, **info) == 1.0
    assert REWARDS["reasoning_gym"]("q", oracle, oracle, **info) == 0.0  # no tag: no answer
    with pytest.raises(ValueError, match=r"info\['reasoning_gym'\]"):
        REWARDS["reasoning_gym"]("2+2=", "4", "4")  # a toy problem has no reasoning-gym item


@pytest.mark.parametrize("section, key", [
    ({"name": "basic_arithmetc"}, r"rollout\.reasoning_gym\.name: .*did you mean 'basic_arithmetic'"),
    ({}, r"rollout\.reasoning_gym\.name: required"),
    ({"name": "basic_arithmetic", "config": {"max_digit": 2}}, r"rollout\.reasoning_gym\.config\.max_digit: not a parameter"),
    ({"name": "basic_arithmetic", "config": {"min_terms": 3, "max_terms": 2}}, r"rollout\.reasoning_gym\.config: .*max_terms"),
    ({"name": "basic_arithmetic", "size": 0}, r"rollout\.reasoning_gym\.size: must be a positive integer"),
    ({"name": "basic_arithmetic", "prompt": "expr"}, r"rollout\.reasoning_gym\.prompt: 'expr'"),
    ({"name": "leg_counting", "prompt": "expression"}, r"rollout\.reasoning_gym\.prompt: 'expression' needs"),
    ({"name": "basic_arithmetic", "sead": 1}, r"rollout\.reasoning_gym\.sead: unknown field; did you mean rollout\.reasoning_gym\.seed"),
    ({"name": "basic_arithmetic", "partial_credit": True}, r"rollout\.reasoning_gym\.partial_credit: true, but rollout\.rewards"),
])
def test_config_errors_name_the_bad_key(section, key):
    rollout = {"task": "reasoning_gym", "reasoning_gym": section}
    if section.get("partial_credit"):
        rollout["rewards"] = {"reasoning_gym": 1.0}
    with pytest.raises(ConfigError, match=key):
        RunConfig.from_dict({"rollout": rollout})


def test_reasoning_gym_section_needs_the_task():
    with pytest.raises(ConfigError, match=r"rollout\.reasoning_gym\.name: 'basic_arithmetic' is set but rollout\.task is 'addition'"):
        RunConfig.from_dict({"rollout": {"reasoning_gym": {"name": "basic_arithmetic"}}})
    with pytest.raises(ConfigError, match=r"rollout\.split"):
        RunConfig.from_dict({"rollout": {"task": "reasoning_gym", "split": "train",
                                         "reasoning_gym": {"name": "basic_arithmetic"}}})
    cfg = RunConfig.from_dict({"rollout": {"task": "reasoning_gym", "reasoning_gym": {"name": "basic_arithmetic",
                                                                                      "config": ARITH}}})
    assert cfg.rollout.reasoning_gym.config["operators"] == ["+"]


def test_a_run_trains_on_reasoning_gym_problems_with_their_scorer(tmp_path):
    """The run's loop (in-process fakes of generator and trainer): episodes come from reasoning-gym items, each
    one's reward is score_answer's verdict on its completion, and held-out accuracy uses the same scorer."""
    from forgelab.config.run_config import EvalConfig, PlacementConfig, TrackingConfig, TrainConfig
    from forgelab.run import Run
    from forgelab.testing.fakes import fake_spawn

    cfg = RunConfig(rollout=RolloutConfig(task="reasoning_gym", reasoning_gym=_spec(size=50), group_size=4,
                                          prompts_per_rollout=2, concurrency=2, max_tokens=6),
                    train=TrainConfig(steps=3, batch_size=8, warmup_steps=1), eval=EvalConfig(every=0, n=8),
                    tracking=TrackingConfig(out_dir=str(tmp_path), wandb=False), placement=PlacementConfig()).validate()
    run = Run(cfg, spawn=fake_spawn)

    async def go():
        await run.start()
        await asyncio.wait_for(run.wait(), 60)
        await run.shutdown()

    asyncio.run(go())
    assert run.state == "finished", run.message
    ro = run.rollouts
    ro = ro[ro["status"] == "trained"]  # scored episodes (those cancelled at the end never were)
    assert len(ro) == 24 and set(ro["task"]) == {"reasoning_gym/basic_arithmetic"}
    score = reasoning_gym.get_score_answer_fn("basic_arithmetic")
    items = {p.prompt: p.info["reasoning_gym"] for p in run.data.train}
    verdicts = [score(c.strip(), items[p]) for p, c in zip(ro["prompt"], ro["completion"])]
    assert list(ro["reward"]) == [1.0 if v == 1.0 else 0.0 for v in verdicts] and 0.0 in verdicts and 1.0 in verdicts
    assert (ro["reward/reasoning_gym"] == ro["reward"]).all()
    # the fake generator's greedy answer is the sum it reads in the prompt: every held-out item is right
    assert run.accuracy_history and run.accuracy_history[-1][1] == 1.0


# ------------------------------------------------------------------------------------------------ skyrl-gym


def _problem(prompt="12+45=", target="57"):
    from forgelab.data.tasks import Problem

    return Problem(prompt=prompt, target=target, task="addition")


def test_adapter_plays_skyrl_gyms_own_environment():
    """gsm8k_multi_turn, unmodified: the adapter hands over what skyrl-gym's own env produces, turn by turn."""
    env = make_env("skyrl_gym", {"env_id": "gsm8k_multi_turn", "extras": {"max_turns": 2}})
    ref = skyrl_gym.make("gsm8k_multi_turn", env_config={}, extras={
        "reward_spec": {"method": "rule", "ground_truth": "57"}, "extra_info": {}, "max_turns": 2})
    ref.init([{"role": "user", "content": "12+45="}])
    assert asyncio.run(env.reset(_problem())) == "12+45="

    async def play():
        first = await env.step("12")
        last = await env.step("#### 57")
        return first, last

    (obs, r1, done1, info1), (obs2, r2, done2, info2) = asyncio.run(play())
    ref1, ref2 = ref.step("12"), ref.step("#### 57")
    assert (obs, r1, done1) == (ref1["observations"][0]["content"], ref1["reward"], False) and info1["role"] == "user"
    assert (obs2, r2, done2) == (None, ref2["reward"], True) and r2 == 1.0
    assert info2["reward_parts"] == {"skyrl": 1.0} and info2["metrics"] == {"steps": 2.0}


class _WaitsForTheLoop(skyrl_gym.Env):
    """A skyrl-gym env whose step blocks until the event loop has run a coroutine: it deadlocks on the loop."""

    ran = threading.Event()

    def __init__(self, env_config=None, extras=None):
        pass

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        done = type(self).ran.wait(timeout=30)
        return {"observations": [], "reward": float(done), "done": True, "metadata": {}}


def test_adapter_keeps_blocking_calls_off_the_event_loop():
    skyrl_gym.register(id="forgelab-test-waits-for-loop", entry_point=_WaitsForTheLoop)
    env = make_env("skyrl_gym", {"env_id": "forgelab-test-waits-for-loop"})

    async def both():
        await env.reset(_problem())

        async def on_the_loop():
            await asyncio.sleep(0)
            _WaitsForTheLoop.ran.set()

        result, _ = await asyncio.gather(env.step("57"), on_the_loop())
        return result

    assert asyncio.run(both())[1] == 1.0  # the loop ran while step blocked its worker thread


def test_unknown_skyrl_env_is_a_config_error():
    with pytest.raises(ConfigError, match=r"rollout\.env_kwargs: .*unknown env_id 'gsm9k'"):
        RunConfig(rollout=RolloutConfig(env="skyrl_gym", env_kwargs={"env_id": "gsm9k"})).validate()


# ------------------------------------------------------------------------------------------------ integration


@integration
@pytest.mark.timeout(600)
def test_skyrl_gym_environment_trains_a_step(loop, grpo_config, tmp_path):
    """(i) skyrl-gym's gsm8k_multi_turn (unmodified) trains one GRPO step through the adapter on real processes:
    each episode is two assistant turns around skyrl-gym's own follow-up message, and its reward is what a
    fresh skyrl-gym env gives the same turns."""
    from forgelab.run import Run

    cfg = grpo_config(tmp_path, name="skyrl", steps=1, eval_n=2, reference=False, env="skyrl_gym",
                      env_kwargs={"env_id": "gsm8k_multi_turn", "extras": {"max_turns": 2}}, max_turns=2)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=16, warmup_steps=0,
                                                             loss_kwargs={"kl_coef": 0.0}),
                              rollout=dataclasses.replace(cfg.rollout, prompts_per_rollout=2, concurrency=1))
    run = Run(cfg.validate())
    try:
        t0 = time.monotonic()
        loop.run_until_complete(run.start())
        t1 = time.monotonic()
        loop.run_until_complete(run.wait())
        print(f"skyrl run: start {t1 - t0:.1f}s, one step and two evaluations {time.monotonic() - t1:.1f}s")
        assert run.state == "finished", run.message
        assert len(run.metrics) == 1 and run.buffer.check_accounting()["trained"] == 16
        ro = run.rollouts
        trained = ro[ro["status"] == "trained"]
        assert len(trained) == 16
        tok = run.tokenizer
        for _, row in trained.iterrows():
            turns = row["turns"]
            assert [t[2] for t in turns] == ["assistant", "user", "assistant"], turns
            says = [tok.decode(row["completion_ids"][s:e], skip_special_tokens=True) for s, e, _ in turns]
            ref = skyrl_gym.make("gsm8k_multi_turn", env_config={}, extras={
                "reward_spec": {"method": "rule", "ground_truth": row["target"]}, "extra_info": {}, "max_turns": 2})
            ref.init([{"role": "user", "content": row["prompt"]}])
            out1, out2 = ref.step(says[0]), ref.step(says[2])
            assert out1["observations"][0]["content"] in says[1]  # skyrl-gym's follow-up, as the user turn
            assert row["reward"] == pytest.approx(out1["reward"] + out2["reward"], abs=1e-12)
    finally:
        loop.run_until_complete(run.shutdown())
