"""A GSM8K-style dataset file trains through `Run` with the math rewards, logging to wandb offline.

One short run on real meshes is shared by the module: a synthetic file in
GSM8K's format (`question`, `answer` ending in `#### value`) sized for the
shipped model's character tokenizer and 256-token context, scored by
`math_answer` and `think_format`; wandb runs offline and its history is read
back with wandb's own reader (`wandb leet inspect --json`).
"""
import json
import math
import random
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

STEPS, BATCH = 3, 16
NAMES = ["Ann", "Bo", "Cy", "Di", "Ed", "Flo"]
THINGS = ["pens", "eggs", "cards", "shells"]


def write_gsm8k_file(path: Path, n: int = 40, seed: int = 0) -> Path:
    """`n` GSM8K-format rows; each question ends in the toy task's `a+b=` so the tiny model answers in digits."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(1, 60), rng.randint(1, 39)
            who, what = rng.choice(NAMES), rng.choice(THINGS)
            question = f"{who} has {a} {what} and gets {b} more. How many {what}? {a}+{b}="
            answer = f"{who} has {a} + {b} = {a + b} {what}.\n#### {a + b:,}"
            f.write(json.dumps({"question": question, "answer": answer}) + "\n")
    return path


def test_gsm8k_file_loads_with_the_column_mapping(tmp_path):
    from transformers import AutoTokenizer

    from forgelab.data.datasets import load_file, load_problems
    from forgelab.rewards.library import REWARDS

    path = write_gsm8k_file(tmp_path / "gsm8k_tiny.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    problems = load_file(path)
    assert len(problems) == 40
    for row, p in zip(rows, problems):
        assert p.prompt == row["question"]
        assert p.target == row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
        assert p.info["solution"] == row["answer"]
        assert REWARDS["math_answer"](p.prompt, f"<answer>{p.target}</answer>", row["answer"]) == 1.0
    tok = AutoTokenizer.from_pretrained("forgelab/assets/tiny-llama")
    longest = max(len(tok.apply_chat_template([{"role": "user", "content": p.prompt}], add_generation_prompt=True))
                  for p in problems)
    assert longest + 8 <= 256, longest  # prompt + max_tokens fit the context
    unk = tok.convert_tokens_to_ids(tok.unk_token)
    assert all(unk not in tok(p.prompt)["input_ids"] for p in problems)  # every character is in the vocabulary
    assert len(load_problems(str(path), "train", 0)) == 36 and len(load_problems(str(path), "test", 0)) == 4


@pytest.fixture(scope="module")
def gsm8k_run(loop, tmp_path_factory):
    from forgelab.config.run_config import EvalConfig, PlacementConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig
    from forgelab.run import Run

    tmp = tmp_path_factory.mktemp("gsm8k")
    data = write_gsm8k_file(tmp / "gsm8k_tiny.jsonl")
    cfg = RunConfig(
        name="gsm8k",
        rollout=RolloutConfig(task=str(data), group_size=4, prompts_per_rollout=4, concurrency=1, max_tokens=8,
                              rewards={"math_answer": 1.0, "think_format": 0.1}),
        train=TrainConfig(steps=STEPS, batch_size=BATCH, lr=1e-4, warmup_steps=1, max_policy_age=0, seed=0),
        eval=EvalConfig(every=0, n=4),
        tracking=TrackingConfig(out_dir=str(tmp / "runs"), wandb=True),
        placement=PlacementConfig(reference=False),
    )
    run = Run(cfg)
    loop.run_until_complete(run.start())
    loop.run_until_complete(run.wait())
    loop.run_until_complete(run.shutdown())  # finishes the wandb run: its log is complete only then
    yield run
    import wandb

    wandb.teardown()  # wandb keeps its service process (wandb-core) for the interpreter's life otherwise


def test_gsm8k_file_trains_through_run(gsm8k_run):
    run = gsm8k_run
    assert run.state == "finished", run.message
    df = run.metrics
    assert len(df) == STEPS
    assert df["loss"].map(math.isfinite).all() and df["grad_norm"].map(math.isfinite).all()
    assert run.episodes["trained"] == STEPS * BATCH
    for col in ("reward/math_answer", "reward/think_format"):
        assert col in df and df[col].between(0.0, 1.0).all(), col
    trained = run.rollouts[run.rollouts["status"] == "trained"]
    assert trained["prompt"].str.contains("How many").all()


def _wandb_history(run_dir: Path) -> list[dict]:
    """The history records of an offline wandb run, read by wandb's own reader (wandb-core's `leet inspect`)."""
    wandb_cli = shutil.which("wandb") or str(Path(__import__("sys").executable).parent / "wandb")
    out = subprocess.run([wandb_cli, "leet", "inspect", "--json", str(run_dir)], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [r["history"]["item"] for r in records if r.get("type") == "history"]


def test_wandb_offline_history_reads_back(gsm8k_run):
    run = gsm8k_run
    runs = sorted((run.out_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    assert list(runs[0].glob("run-*.wandb")), "no .wandb transaction log"
    history = _wandb_history(runs[0])
    df = run.metrics
    by_step = {int(h["_step"]): h for h in history if "loss" in h}
    assert sorted(by_step) == [int(s) for s in df["step"]]
    for _, row in df.iterrows():
        h = by_step[int(row["step"])]
        for key in ("loss", "reward_mean", "reward/math_answer"):
            assert h[key] == pytest.approx(float(row[key]), rel=1e-6, abs=1e-9), (row["step"], key)
