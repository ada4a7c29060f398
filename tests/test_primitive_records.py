"""A primitives client's run directory (`forgelab.experiments.primitive_records`), read back by the lab's
`RecordedRun` as any run directory is: no processes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from forgelab.controller.recorded import RecordedRun
from forgelab.experiments.primitive_records import ClientRecords


def _fields(tokens: list[int], weights: list[float], logprobs: list[float] | None = None) -> dict[str, torch.Tensor]:
    f = {"target_tokens": torch.tensor(tokens[1:]), "weights": torch.tensor(weights)}
    if logprobs is not None:
        f["logprobs"] = torch.tensor(logprobs)
    return f


def test_steps_rows_and_token_split(tmp_path: Path) -> None:
    from forgelab.config.run_config import RunConfig

    rec = ClientRecords(tmp_path / "sft", "sft", "tiny", RunConfig().to_dict())
    tokens = [1, 4, 33, 21, 31, 39, 32, 27, 8]  # prompt of 6, answer of 3
    weights = [0.0] * 5 + [1.0] * 3
    lp = torch.linspace(-3, -1, 8)
    rec.trained([_fields(tokens, weights)], [tokens[:-1]], [lp], "cross_entropy", {"loss:sum": 2.5})
    rec.trained([_fields(tokens, weights)], [tokens[:-1]], [lp], "cross_entropy", {"loss:sum": 1.5, "n:sum": 4.0})
    row = rec.stepped(1, 1e-3, 0.7)
    assert row["loss"] == 4.0 and row["forward_backward_calls"] == 2 and row["sequences"] == 2 and row["tokens"] == 6
    rec.sampled(tokens[:6], [([32, 27, 8], [-0.1, -0.2, -0.3], "stop"), ([5, 8], [-1.0, -2.0], "stop")], "v1")
    rec.flush()

    run = RecordedRun(tmp_path / "sft")
    assert run.step == 1 and run.name == "sft" and list(run.metrics["loss"]) == [4.0]
    trained = run.rollouts[run.rollouts["status"] == "trained"]
    assert len(trained) == 2
    first = trained.iloc[0]
    assert list(first["prompt_ids"]) == tokens[:6] and list(first["completion_ids"]) == tokens[6:]
    assert list(first["trainer_logprobs"]) == pytest.approx(lp[5:].tolist())
    assert list(first["loss_mask"]) == [1, 1, 1]
    sampled = run.rollouts[run.rollouts["status"] == "sampled"]
    assert [list(x) for x in sampled["completion_ids"]] == [[32, 27, 8], [5, 8]]
    assert set(sampled["group_id"]) == {int(sampled["group_id"].iloc[0])}  # one prompt: one group

    import forgelab.lab

    view = forgelab.lab.open(tmp_path / "sft")
    view._build()  # the whole view builds headless (timeline, metrics, inspector) from the client's manifest
    assert "primitives" in view.timeline.html()


def test_events_and_nothing_lost_between_steps(tmp_path: Path) -> None:
    rec = ClientRecords(tmp_path / "c", "c", "tiny")
    tokens = [1, 2, 3, 4]
    rec.trained([_fields(tokens, [0.0, 1.0, 1.0], [0.0, -0.5, -0.7])], [tokens[:-1]], [torch.zeros(3)],
                "importance_sampling", {"loss:sum": -1.0})
    rec.event("checkpoint_saved", path="x")
    rec.flush()  # no optim_step yet: the trained row is still written
    run = RecordedRun(tmp_path / "c")
    assert len(run.rollouts) == 1 and list(run.rollouts.iloc[0]["generator_logprobs"]) == pytest.approx([-0.5, -0.7])
    assert [e["kind"] for e in run.events] == ["client_created", "checkpoint_saved"]
    assert not len(run.metrics)  # no step taken: no metrics row
