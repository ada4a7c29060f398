"""The main job end to end on real meshes: a short seeded GRPO run raises mean reward.

One run is shared by the module (spawning vLLM + torchtitan + reference costs
~30 s on 2 cores); each test checks one promise of the public API on it.
"""
import json
import math
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def finished_run(loop, engine_pool, grpo_config, tmp_path_factory):
    from forgelab.run import Run

    run = Run(grpo_config(tmp_path_factory.mktemp("run")), spawn=engine_pool)
    loop.run_until_complete(run.start())
    loop.run_until_complete(run.wait())
    yield run
    loop.run_until_complete(run.shutdown())


def test_run_finishes_and_raises_reward(finished_run):
    run = finished_run
    assert run.state == "finished", run.message
    df = run.metrics
    assert len(df) == run.config.train.steps
    # 60 steps of batch 64 at lr 1e-4 lift mean reward by ~0.05 (demo runs); the std of a 15-step mean
    # is ~0.013, so "last 15 above first 15" fails by chance well under 1% of the time.
    first, last = df["reward_mean"].iloc[:15].mean(), df["reward_mean"].iloc[-15:].mean()
    print(f"mean reward first 15 steps {first:.3f}, last 15 steps {last:.3f}; accuracy {run.accuracy_history}")
    assert last > first, f"mean reward did not rise: first 15 steps {first:.3f}, last 15 {last:.3f}"
    # Held-out greedy accuracy on the same 200 problems before and after: a paired difference, whose
    # standard error is sqrt(q / 200) for a share q of problems that flip either way. The learning signal
    # is the reward rise above; this checks training did not damage the model. Assuming q <= 0.3 (an
    # assumption, not measured: 60 small steps flip far fewer), the SE is <= 0.039, so a model that did not
    # get worse fails the 0.1 margin (2.6 SE) with probability <= 0.5%. (It used to require a strict
    # rise: close to a coin flip whenever the true rise was small.)
    before, after = run.accuracy_history[0][1], run.accuracy_history[-1][1]
    assert after > before - 0.1, run.accuracy_history
    for col in ("loss", "grad_norm", "entropy", "kl_ref", "policy_age_mean", "tokens_per_s", "step_time_s",
                "reward/exact_answer", "reward/answer_format"):
        assert col in df and df[col].notna().all(), col


def test_episode_accounting(finished_run):
    run = finished_run
    c = run.episodes
    run.buffer.check_accounting()
    assert c["trained"] == run.config.train.steps * run.config.train.batch_size
    assert c["generated"] == c["trained"] + c["evicted"] + c["dropped"] + c["buffered"] + c["in_flight"]
    statuses = run.rollouts["status"]
    assert (statuses == "trained").sum() > 0


def test_staleness_bound_holds(finished_run):
    df = finished_run.metrics
    assert df["policy_age_max"].max() <= finished_run.config.train.max_policy_age


def test_rollouts_carry_tokens_and_logprobs(finished_run):
    ro = finished_run.rollouts
    row = ro[ro["status"] == "trained"].iloc[-1]
    assert len(row["completion_ids"]) == len(row["generator_logprobs"]) == len(row["ref_logprobs"])
    assert all(lp <= 0.0 for lp in row["generator_logprobs"])
    # token-in/token-out: the text is the decoding of exactly the generated ids
    tok = finished_run.tokenizer
    assert tok.decode(row["completion_ids"], skip_special_tokens=True) == row["completion"]


def test_tracking_files(finished_run):
    out = finished_run.out_dir
    assert (out / "metrics.csv").is_file()
    assert (out / "learning_curve.png").stat().st_size > 1000
    lines = (out / "metrics.csv").read_text().splitlines()
    assert len(lines) == finished_run.config.train.steps + 1


def test_cli_runs_a_small_config(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "name: cli\n"
        "rollout: {task: addition, group_size: 4, prompts_per_rollout: 4, concurrency: 1, max_tokens: 6}\n"
        "train: {steps: 3, batch_size: 16, warmup_steps: 1, max_policy_age: 0}\n"
        "placement: {reference: false}\n"
        f"eval: {{every: 0, n: 16}}\ntracking: {{out_dir: {tmp_path}, wandb: false}}\n"
    )
    p = subprocess.run([sys.executable, "-m", "forgelab.cli", "run", str(cfg)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    last = json.loads(p.stdout.strip().splitlines()[-1])
    assert last["steps"] == 3 and last["episodes"]["trained"] == 48
    assert 0.0 <= last["accuracy_after"] <= 1.0 and not math.isnan(last["accuracy_before"])
