"""What a primitives client did, written as a run directory the lab reads (`forgelab.lab.open(client.out_dir)`).

A `TrainingClient` (`forgelab.experiments.primitives`) has no run loop, so nothing else records it. Its
`ClientRecords` keeps, under ``<root>/<client>/`` (beside its ``state/`` and ``sampler/`` checkpoints):

- ``metrics.csv``: a row per `optim_step` (``step``, ``loss`` = the sum of ``loss:sum`` over the step's
  ``forward_backward`` calls, ``loss_name``, ``sequences``, ``tokens``, ``lr``, ``grad_norm``, ``version`` = the
  step, and every other metric the losses reported, averaged over the calls);
- ``rollouts/``: every sequence it trained on (status ``trained``: the target tokens, the sampler's logprobs when
  the datum carried them, the trainer's logprobs before the update, its advantages), and every sequence a
  sampler of this client drew (status ``sampled``), in the rollout log's format (`RolloutRecorder`), so the
  rollout inspector and its token view show them;
- ``events.jsonl``: created, checkpoints saved and loaded, samplers made, closed.

Nothing is dropped: rows wait in memory until the next `optim_step`, `close`, `flush`, or `SAMPLED_FLUSH`
sampled rows write them.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from forgelab.controller.events import EventLog
from forgelab.controller.rollout_log import RolloutRecorder
from forgelab.types import Episode

__all__ = ["ClientRecords"]

SAMPLED_FLUSH = 256
"""Sampled rows that make a rollout part at once (a client that samples but never steps still shows them)."""


@dataclass
class _Window:
    """The ``forward_backward`` calls since the last optimizer step."""

    loss: float = 0.0
    loss_names: list[str] = field(default_factory=list)
    sequences: int = 0
    tokens: int = 0
    metrics: dict[str, list[float]] = field(default_factory=dict)


class ClientRecords:
    """A training client's run directory (see the module).

    Args:
        out_dir: ``<root>/<client>``.
        name: the client's name (the manifest's run name).
        base_model: the model the adapter is trained on (in the manifest).
        config: the engines' `RunConfig` as a dict (the lab's timeline reads model, rollout and train from it);
            ``name`` and ``train.loss`` (``"primitives"``: each call names its own) are set here.
    """

    def __init__(self, out_dir: Path, name: str, base_model: str, config: Mapping[str, object] | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        cfg = json.loads(json.dumps(dict(config or {}), default=str))
        cfg["name"] = name
        cfg.setdefault("model", {"path": base_model})
        cfg.setdefault("rollout", {"rewards": {}})
        cfg["train"] = {**cfg.get("train", {}), "steps": 0, "loss": "primitives"}
        manifest = {"kind": "primitives client", "base_model": base_model, "config": cfg}
        (self.out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        self.events = EventLog(self.out_dir, append=True)
        self.rollouts = RolloutRecorder(self.out_dir)
        self.rows: list[dict[str, object]] = []
        self._window = _Window()
        self._next_id = 0
        self.step = 0
        self.events.emit("client_created", name=name, base_model=base_model)

    # ------------------------------------------------------------------ training
    def trained(self, data: Sequence[Mapping[str, torch.Tensor]], inputs: Sequence[list[int]],
                trainer_logprobs: Sequence[torch.Tensor], loss_name: str, metrics: Mapping[str, float]) -> None:
        """One ``forward_backward``: its loss and metrics join the window; each datum becomes a ``trained`` row.

        ``data[i]`` is datum ``i``'s ``loss_fn_inputs`` (``target_tokens`` and the loss's inputs), ``inputs[i]``
        its input token ids, ``trainer_logprobs[i]`` the trainer's logprobs of its targets before the update."""
        w = self._window
        w.loss += float(metrics.get("loss:sum", 0.0))
        w.loss_names.append(loss_name)
        w.sequences += len(data)
        for key, value in metrics.items():
            if key != "loss:sum":
                w.metrics.setdefault(key.split(":")[0], []).append(float(value))
        episodes = []
        for fields, ids, lp in zip(data, inputs, trainer_logprobs):
            targets = [int(t) for t in fields["target_tokens"].tolist()]
            # the positions the loss trains: its weights; without them, cross_entropy trains every target (weight 1),
            # the other losses where the advantages are not 0
            weights = fields.get("weights")
            if weights is None and loss_name not in ("cross_entropy", "custom"):
                weights = fields.get("advantages")
            on = [1] * len(targets) if weights is None else [int(x != 0) for x in weights.tolist()]
            first = on.index(1) if 1 in on else len(on)  # the prompt: the inputs up to the first trained target
            w.tokens += sum(on)
            sampler_lp = fields.get("logprobs")
            adv = fields.get("advantages")
            episodes.append(Episode(
                id=self._id(), group_id=self.step, prompt_ids=ids[:first + 1], completion_ids=targets[first:],
                generator_logprobs=([] if sampler_lp is None else [float(x) for x in sampler_lp[first:].tolist()]),
                policy_version=self.step, advantage=0.0 if adv is None else float(adv[first:].sum()),
                loss_mask=on[first:], task=f"primitives:{loss_name}",
                token_advantages=None if adv is None else [float(x) for x in adv[first:].tolist()],
                train_values={"trainer_logprobs": [float(x) for x in lp[first:].tolist()], "step": self.step + 1}))
        self.rollouts.on_close(episodes, "trained")

    def stepped(self, step: int, lr: float, grad_norm: float) -> dict[str, object]:
        """One `optim_step`: the window becomes a metrics row (written now, with the waiting rollout rows)."""
        w, self._window = self._window, _Window()
        names = sorted(set(w.loss_names))
        row: dict[str, object] = {"step": step, "version": step, "loss": w.loss,
                                  "loss_name": "+".join(names), "forward_backward_calls": len(w.loss_names),
                                  "sequences": w.sequences, "tokens": w.tokens, "lr": lr, "grad_norm": grad_norm}
        row.update({k: sum(v) / len(v) for k, v in sorted(w.metrics.items())})
        self.step = step
        self.rows.append(row)
        self.flush()
        return row

    # ------------------------------------------------------------------ sampling, checkpoints
    def sampled(self, prompt_ids: Sequence[int], sequences: Sequence[tuple[list[int], list[float], str]],
                sampler: str) -> None:
        """A sampler of this client drew ``sequences`` (tokens, logprobs, stop reason) for ``prompt_ids``."""
        group = self._next_id
        self.rollouts.on_close([Episode(
            id=self._id(), group_id=group, prompt_ids=list(prompt_ids), completion_ids=list(tokens),
            generator_logprobs=list(lps), policy_version=self.step, finish_reason=stop, task=f"sampler:{sampler}")
            for tokens, lps, stop in sequences], "sampled")
        if len(self.rollouts.pending) >= SAMPLED_FLUSH:
            self.rollouts.flush()

    def event(self, kind: str, **fields: object) -> None:
        self.events.emit(kind, step=self.step, **fields)

    def flush(self) -> None:
        """Write the metrics rows and the waiting rollout rows."""
        import pandas as pd

        if self.rows:
            pd.DataFrame(self.rows).to_csv(self.out_dir / "metrics.csv", index=False)
        self.rollouts.flush()

    def _id(self) -> int:
        self._next_id += 1
        return self._next_id
