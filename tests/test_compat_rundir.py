"""A run directory written by forgelab 893000f still loads, resumes and replays with today's code (issue #38).

tests/data/rundir_893000f/compat was made once, at 893000f, by tests/data/make_rundir_893000f.py (in-process
fakes; a custom reward and a custom loss defined in that script, pickled by value into the event log and the
checkpoints, each calling a forgelab function pickled by module path). Modules move (issue #38 renames
`controller/fncode.py`, `plan.py`, ...): this test fails when a move breaks what old directories recorded.
The directory is copied first, so no test writes into tests/data.
"""
from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch

from forgelab.testing.fakes import fake_spawn

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data" / "rundir_893000f"
COMMIT = "893000f08fc28468a9cdc99c6f1e07f1a5f9add6"


@pytest.fixture
def old_dir(tmp_path, monkeypatch) -> Path:
    """A copy of the 893000f run directory; the working directory is the repository root, as when it was
    written (its config names the model as forgelab/assets/tiny-llama, relative)."""
    shutil.copytree(DATA, tmp_path / "old")
    monkeypatch.chdir(REPO)
    return tmp_path / "old" / "compat"


def _events(run_dir: Path) -> list[dict]:
    from forgelab.controller.events import EventLog

    return EventLog.read(run_dir)


def test_old_records_load_and_their_code_runs(old_dir):
    """The manifest, event log and both checkpoints read back; the recorded custom functions unpickle with
    today's code (their by-path references into forgelab resolve) and compute what they computed."""
    from forgelab.algos import LOSSES
    from forgelab.controller.checkpoint import code_records, resolve
    from forgelab.controller.function_code import restore_fn
    from forgelab.controller.provenance import read_manifest
    from forgelab.rewards import REWARDS

    m = read_manifest(old_dir)
    assert m["forgelab"]["git"]["commit"] == COMMIT and m["config"]["name"] == "compat"
    assert resolve(old_dir / "checkpoints").name == "step_000006"
    events = _events(old_dir)
    added = [e for e in events if e["kind"] == "reward_added"]
    swapped = [e for e in events if e["kind"] == "loss_swapped"]
    assert [e["name"] for e in added] == ["short"] and [e["loss"] for e in swapped] == ["scaled_grpo"]
    records = [added[0]["code"], swapped[0]["code"]]
    state = json.loads((old_dir / "checkpoints" / "step_000003" / "controller.json").read_text())
    records += [r["fn"] for r in state["rewards"] if r["name"] == "short"]
    assert [label for label, _ in code_records(old_dir / "checkpoints" / "step_000003")] == [
        "loss 'scaled_grpo'", "reward 'exact_answer'", "reward 'answer_format'", "reward 'short'"]

    short = restore_fn(records[0], REWARDS, what="reward 'short'", trusted=True)
    again = restore_fn(records[2], REWARDS, what="reward 'short'", trusted=True)
    for fn in (short, again):  # "1.0 when the extracted answer has at most 2 characters"
        assert fn("", "12", "12") == 1.0 and fn("", "12345", "12345") == 0.0
    scaled = restore_fn(records[1], LOSSES, what="loss 'scaled_grpo'", trusted=True)
    g = torch.Generator().manual_seed(0)
    B, T = 3, 5
    args = dict(generator_logprobs_B_T=-torch.rand(B, T, generator=g), advantages_B=torch.randn(B, generator=g),
                mask_B_T=torch.ones(B, T))
    logprobs_B_T = -torch.rand(B, T, generator=g)
    loss, metrics = scaled(logprobs_B_T, scale=0.5, **args)
    ref, _ = LOSSES["grpo"](logprobs_B_T, **args)
    # the recorded function is GRPO's loss times 0.5: one float32 multiplication by a power of two, exact
    assert loss.item() == 0.5 * ref.item() and metrics["loss_scale"] == 0.5


def test_old_checkpoint_resumes_and_trains_as_the_original(old_dir, tmp_path):
    """Resumed from its step-3 checkpoint (custom reward inside), the run trains steps 4-6 exactly as the
    original did (the fakes are deterministic given the episode seeds)."""
    from forgelab.config import RunConfig
    from forgelab.controller.provenance import read_manifest
    from forgelab.experiments.replay import compare_metrics
    from forgelab.run import Run

    cfg = RunConfig.from_dict(read_manifest(old_dir)["config"])
    cfg.name, cfg.tracking.out_dir, cfg.tracking.checkpoint_every = "compat-resumed", str(tmp_path / "runs"), 0
    run = Run(cfg, spawn=fake_spawn, resume_from=old_dir / "checkpoints" / "step_000003")

    async def go():
        await run.start()
        assert run.step == 3 and run.version == 3
        assert run.rewards.weights == {"exact_answer": 1.0, "answer_format": 0.1, "short": 0.5}
        await asyncio.wait_for(run.wait(), 60)
        await run.shutdown()

    asyncio.run(go())
    assert run.state == "finished", run.message
    resumed = [e for e in run.events if e["kind"] == "resumed_from_checkpoint"]
    assert len(resumed) == 1 and resumed[0]["fingerprint_match"] is True
    original = pd.read_csv(old_dir / "metrics.csv")
    again = pd.read_csv(run.out_dir / "metrics.csv")
    assert list(again[again["step"] > 3]["step"]) == [4, 5, 6]
    assert compare_metrics(original[original["step"] > 3], again[again["step"] > 3]) == []
    assert (again[again["step"] > 3]["reward/short"].notna()).all()  # scored with the restored custom reward


def test_old_run_replays_exactly(old_dir, tmp_path):
    """The replay rebuilds the recorded custom reward and loss from the 893000f event log, re-applies them where
    they took effect and reproduces every learning metric."""
    from forgelab.run import Run

    # the directory records this venv's package versions and 893000f's built-in code hashes: a later lock or
    # an edited built-in is reported in notes, not what this test guards (it guards the module moves)
    report = asyncio.run(Run.replay(old_dir, out_dir=tmp_path / "replays", spawn=fake_spawn, trusted=True,
                                    allow_mismatch=True))
    assert report.steps == 6 and report.ok, str(report)
    assert [e["kind"] for e in report.changes_applied] == ["reward_added", "loss_swapped"]
    before, after = _events(old_dir), _events(report.replay_dir)
    for kind, key in (("loss_swapped", "applies_at_step"), ("reward_effective", "first_episode")):
        assert [e[key] for e in after if e["kind"] == kind] == [e[key] for e in before if e["kind"] == kind]
    # the functions re-applied are the recorded code (same bytecode hash), not something rebuilt from a name
    for kind in ("reward_added", "loss_swapped"):
        (old,), (new,) = ([e["code"] for e in ev if e["kind"] == kind] for ev in (before, after))
        assert new["code_sha256"] == old["code_sha256"] and new["source"] == old["source"]


@pytest.mark.parametrize("old, new", [("forgelab.plan", "forgelab.memory_plan"),
                                      ("forgelab.controller.fncode", "forgelab.controller.function_code")])
def test_renamed_module_paths_still_import_with_a_warning(old, new):
    """Issue #38's module renames keep the old path for one release: the same module object (so a pickle or
    record naming a private name of the old path loads too), with a DeprecationWarning."""
    import importlib
    import sys

    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(new)


@pytest.mark.parametrize("package", ["forgelab", "forgelab.experiments", "forgelab.experiments.variants"])
def test_renamed_public_names_still_resolve_with_a_warning(package):
    import importlib

    from forgelab.experiments.variants import SharedEngines

    mod = importlib.import_module(package)
    with pytest.warns(DeprecationWarning, match="SharedEngines"):
        assert mod.Engines is SharedEngines
    assert "Engines" not in getattr(mod, "__all__", ())
