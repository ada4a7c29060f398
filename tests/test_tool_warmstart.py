"""The calculator-tool warm start: its transcripts are the runner's tokens, the recipe is deterministic,
the shipped warm start is what its card says, and GRPO from it learns to use the tool.

Golden token ids come from an independent computation: the tokenizer's chat template over the
whole conversation, and per-message prefixes of it for where the assistant's tokens are.
"""
from __future__ import annotations

import asyncio
import doctest
import json
import os
from dataclasses import asdict

import pytest
import torch

from forgelab.envs import ChatFormat
from forgelab.recipes import tool_warmstart as tw
from forgelab.recipes.tool_warmstart import IGNORE, TOOL_WARMSTART, ToolWarmstart
from forgelab.data.tasks import get_task

SMALL = {"addition": 24, "multistep": 16}
integration = pytest.mark.integration


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(TOOL_WARMSTART, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(TOOL_WARMSTART)


def render(tok, messages, generation_prompt=False):
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt),
                      add_special_tokens=False)


def golden(tok, messages):
    """(ids of the whole conversation, positions of assistant tokens: each message's content + its end token)."""
    ids = render(tok, messages)
    assistant = set()
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start, end = len(render(tok, messages[:i], True)), len(render(tok, messages[: i + 1]))
            assistant |= set(range(start, end))
    return ids, assistant


def test_doctests():
    result = doctest.testmod(tw, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_transcripts_are_the_runner_tokens_with_labels_on_assistant_tokens_only(hf):
    _, tok = hf
    r = ToolWarmstart(out="", n_train=SMALL)
    data = tw.training_data(r, ChatFormat(tok))
    problems = [p for name, k in SMALL.items() for p in get_task(name).make("train", k, r.seed)]
    n = len(problems)
    assert len(data.tool) == len(data.direct) == n
    first_labelled = {"tool": 0, "direct": 0}
    for kind, eps, labels in (("tool", data.tool, data.tool_labels_N_T), ("direct", data.direct, data.direct_labels_N_T)):
        for i, (ep, prob) in enumerate(zip(eps, problems)):
            expr, target = prob.prompt.removesuffix("="), prob.target
            messages = [{"role": "user", "content": prob.prompt}]
            if kind == "tool":
                messages += [{"role": "assistant", "content": f"<calc>{expr}</calc>"},
                             {"role": "tool", "content": f"<result>{target}</result>"}]
            messages += [{"role": "assistant", "content": target}]
            ids, assistant = golden(tok, messages)
            assert ep.prompt_ids + ep.completion_ids == ids
            assert ep.info["outcome"] == "done" and ep.reward_parts["correct"] == 1.0
            row = labels[i, : len(ids)].tolist()
            assert (labels[i, len(ids):] == IGNORE).all()
            first = len(ep.prompt_ids)  # the decision token: "<" of the call or the answer's first digit
            first_labelled[kind] += row[first] != IGNORE
            for pos, lab in enumerate(row):
                if pos in assistant and pos != first:
                    assert lab == ids[pos], (kind, ep.prompt, pos)
                elif pos not in assistant:
                    assert lab == IGNORE, (kind, ep.prompt, pos)
    frac_tool, frac_direct = tw.decision_fractions(r.call_rate, r.batch_tool, r.batch_direct)
    assert frac_direct == 1.0 and first_labelled["direct"] == n
    assert abs(first_labelled["tool"] / n - frac_tool) < 0.25  # a seeded coin per transcript


def test_generated_tool_episodes_are_the_chat_template_of_their_turns(hf):
    """What the warm-started policy produces through the runner has the layout it was trained on."""
    model, tok = hf
    probs = get_task("multistep").make("test", 24, 0) + get_task("addition").make("test", 24, 0)
    eps = tw.play_hf(model, tok, probs, temperature=1.0, samples=2, seed=1)
    called = [ep for ep in eps if ep.info["env_metrics"].get("used_tool") and ep.info["outcome"] == "done"]
    assert len(called) >= 5
    for ep in called:
        messages = [{"role": "user", "content": ep.prompt}]
        for start, end, role in ep.info["turns"]:
            seg = ep.completion_ids[start:end]
            if role == "assistant":
                assert seg[-1] == tok.eos_token_id  # finished turns: the end token was generated
                messages.append({"role": "assistant", "content": tok.decode(seg[:-1])})
            else:
                messages.append({"role": role, "content": ep.info["observations"][len(messages) // 2]})
        ids, assistant = golden(tok, messages)
        assert ep.prompt_ids + ep.completion_ids == ids
        mask_positions = {len(ep.prompt_ids) + i for i, m in enumerate(ep.loss_mask) if m}
        assert mask_positions == assistant


def test_recipe_is_deterministic_and_writes_a_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    r = dict(n_train=SMALL, steps=3, batch_tool=4, batch_direct=8, n_eval=0)
    cards = [tw.train(ToolWarmstart(out=str(tmp_path / k), **r)) for k in ("a", "b")]
    blobs = [(tmp_path / k / "model.safetensors").read_bytes() for k in ("a", "b")]
    assert blobs[0] == blobs[1]
    assert (tmp_path / "a" / "model.safetensors").read_bytes() != open(os.path.join(tw.SHIPPED, "model.safetensors"), "rb").read()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model_card.json",
                 "README.md"):
        assert (tmp_path / "a" / name).is_file(), name
    assert cards[0]["recipe"]["steps"] == 3 and "--steps 3" in cards[0]["command"]
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32)
    assert sum(p.numel() for p in m.parameters()) == 3_201_792


def test_shipped_warm_start_is_what_its_card_says(hf):
    model, tok = hf
    card = json.loads(open(os.path.join(TOOL_WARMSTART, "model_card.json")).read())
    assert os.path.getsize(os.path.join(TOOL_WARMSTART, "model.safetensors")) < 15 * 2**20
    assert card["command"] == "python -m forgelab.recipes.tool_warmstart --out forgelab/assets/tiny-llama-tool"
    defaults = {k: v for k, v in asdict(ToolWarmstart(out="")).items() if k not in ("out", "base")}
    assert card["recipe"] == defaults
    assert card["command"] in open(os.path.join(TOOL_WARMSTART, "README.md")).read()
    ev = card["eval"]
    # greedy statistics recomputed here (the card's numbers come from the same function on the machine that made it)
    for task in ("addition", "multistep"):
        probs = get_task(task).make("test", ev["n_per_task"], ev["seed"])
        st = tw.tool_use_stats(tw.play_hf(model, tok, probs))
        for k in ("tool_rate", "accuracy"):
            assert st[k] == pytest.approx(ev["after"][task]["greedy"][k], abs=0.02), (task, k)
    # the decision the recipe is for: the policy calls on some samples, not none and not all
    for task in ("addition", "multistep"):
        sampled = ev["after"][task]["sampled_t1_x4"]
        assert 0.1 < sampled["tool_rate"] < 0.5 and sampled["wellformed_rate"] > 0.8
        assert ev["before"][task]["sampled_t1_x4"]["tool_rate"] == 0.0


# ---------------------------------------------------------------------------------------------- integration

GRPO_STEPS = 40
HELDOUT = 64
"""Held-out problems played greedily before and after. The closest floor is the accuracy lift: measured 0.095 ->
0.75-0.815 on 200 (0.0625 before on these 64), a lift of >= 0.65 against the asserted 0.2; on 64 problems its
binomial standard error is sqrt(0.25 * 0.75 / 64 + 0.1 * 0.9 / 64) = 0.065, so the floor sits ~7 standard errors
below the weakest measured run (tool rate 0.945 vs 0.5: ~16; result use 0.84 vs 0.5: ~7; well-formed 0.97 vs 0.8:
~8). 200 problems cost ~10 s more (HF before, vLLM after) for no power the floors need."""


def grpo_config(out_dir):
    from forgelab.config.run_config import EvalConfig, ModelConfig, PlacementConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig

    return RunConfig(
        name="tool",
        model=ModelConfig(path=TOOL_WARMSTART),
        # multistep: answering directly is ~5 % right, so the tool is worth learning; 24 tokens fit a call
        rollout=RolloutConfig(task="multistep", env="calculator", group_size=8, prompts_per_rollout=8, concurrency=2,
                              max_tokens=24, max_turns=3),
        train=TrainConfig(steps=GRPO_STEPS, batch_size=64, lr=1e-4, warmup_steps=2, max_policy_age=1, seed=0),
        eval=EvalConfig(every=0, n=16),
        tracking=TrackingConfig(out_dir=str(out_dir), wandb=False),
        placement=PlacementConfig(reference=False),
    )


@integration
@pytest.mark.timeout(600)
def test_grpo_from_warm_start_learns_to_call_the_calculator_and_use_its_result(hf, tmp_path):
    """Claim: GRPO from the tool warm start (multistep in the calculator env, 3 turns of 24 tokens, batch 64,
    lr 1e-4, 40 steps) learns to call the calculator and answer with its result: in the rollouts (first vs last
    10 steps) reward, tool use and answer == result rise and the calls stay well-formed; greedily on 64
    held-out problems (`HELDOUT`) tool rate, well-formedness, result use and accuracy pass their floors; `Run.evaluate` in
    the env agrees with the env's own verdict and rises by 0.2.

    Not shortened (issue #39): at 24 steps, train.seed 0 / 1 (2026-11-27, load ~20) gave rollout tool use
    0.258 -> 0.656 / 0.195 -> 0.386 and held-out greedy accuracy 0.095 -> 0.705 / 0.575: seed 1 misses the
    tool-use floor max(0.5, first + 0.2)."""
    from forgelab.engines.generator import SamplingConfig
    from forgelab.run import Run

    model, tok = hf
    heldout = get_task("multistep").make("test", HELDOUT, 0)
    before = tw.tool_use_stats(tw.play_hf(model, tok, heldout))  # greedy, HF, the warm start's weights
    run = Run(grpo_config(tmp_path))

    async def main():
        try:
            await run.start()
            await run.wait()
            gens = [h.actor for h in run.generators.handles() if h is not None]
            groups = await run.envs.route("run_groups", "calculator", heldout, 1, gens,
                                          SamplingConfig(temperature=0.0, max_tokens=24), max_turns=3)
            # the run's own held-out problems, played the same way: scored by the env's "correct" part
            own = await run.envs.route("run_groups", "calculator", run.heldout, 1, gens,
                                       SamplingConfig(temperature=0.0, max_tokens=24), max_turns=3)
            return [ep for g in groups for ep in g], [ep for g in own for ep in g]
        finally:
            await run.shutdown()

    eps, own = asyncio.run(main())
    after = tw.tool_use_stats(eps)  # greedy, vLLM, the final policy
    assert run.state == "finished", run.message
    df = run.metrics
    assert len(df) == GRPO_STEPS
    cols = ["reward_mean", "env/used_tool", "env/tool_calls", "env/tool_calls_ok", "env/answer_is_result"]
    first, last = df[cols].iloc[:10].mean(), df[cols].iloc[-10:].mean()
    print(f"rollouts, first 10 steps: {first.round(3).to_dict()}\nrollouts, last 10 steps: {last.round(3).to_dict()}")
    print(f"held-out greedy before: {before}\nheld-out greedy after: {after}")
    # Measured in 4 runs (3 distinct: rollouts interleave differently under load), first -> last 10 steps:
    # reward 0.26-0.30 -> 0.55-0.68, tool calls per episode 0.19-0.26 -> 0.72-0.91 (0.95-0.97 of them
    # well-formed), answer == tool result 0.13-0.17 -> 0.52-0.65; held-out greedy tool rate 0.09 -> 0.945-1.0,
    # well-formed 0.72 -> 0.97-0.99, result use 0.61 -> 0.84-0.92, accuracy 0.095 -> 0.75-0.815.
    # The thresholds sit well below the weakest run.
    assert last["reward_mean"] > first["reward_mean"] + 0.1
    assert last["env/used_tool"] > max(0.5, first["env/used_tool"] + 0.2)
    assert last["env/tool_calls_ok"] > 0.85 * last["env/tool_calls"]
    assert last["env/answer_is_result"] > max(0.35, first["env/answer_is_result"] + 0.1)
    assert after["tool_rate"] > 0.5 and after["wellformed_rate"] > 0.8 and after["result_use_rate"] > 0.5
    assert after["accuracy"] > before["accuracy"] + 0.2
    # Run.evaluate plays an env run's held-out problems in the env and scores the last turn with the task
    # reward; the env's own verdict on the same problems (16) must agree, and the curve must show the gain.
    (_, acc_start), (_, acc_end) = run.accuracy_history[0], run.accuracy_history[-1]
    env_acc = tw.tool_use_stats(own)["accuracy"]
    print(f"Run.evaluate (env): {acc_start:.3f} -> {acc_end:.3f}; env verdict on the same problems {env_acc:.3f}")
    assert abs(acc_end - env_acc) <= 2 / len(own)
    assert acc_end > acc_start + 0.2
