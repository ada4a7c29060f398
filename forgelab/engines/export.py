"""Export a saved run offline: the LoRA adapter (PEFT format) or a HF model directory, with no actor running.

    export_checkpoint("runs/NAME")                    # LoRA run: runs/NAME/export/adapter (PEFT)
    export_checkpoint("runs/NAME", merge=True)        # the base with the adapter merged (a HF directory)
    forgelab export RUN_DIR [--merge] [--out DIR]     # the same, from a shell

``path`` is a run directory (its ``checkpoints/LATEST``), a checkpoint directory (``controller.json`` and
``trainer/``) or a trainer checkpoint itself. The trainer's checkpoint records what it holds: a LoRA
checkpoint the adapters (with the base's path and content hash, checked here too), a full one every weight.
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, cast

if TYPE_CHECKING:
    from forgelab.engines.lora_adapters import LoraRecord

__all__ = ["trainer_checkpoint", "export_checkpoint"]


class ExportSummary(TypedDict):
    """What `export_checkpoint` wrote."""

    kind: str
    """``"adapter"``, ``"merged"`` or ``"model"``."""
    out: str
    checkpoint: str
    step: int | None
    base: str
    parameters: int


def trainer_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The trainer checkpoint (DCP directory) under a run directory, a checkpoint directory or itself."""
    p = Path(path)
    if (p / "checkpoints" / "LATEST").is_file():
        p = p / "checkpoints"
    if (p / "LATEST").is_file():
        p = p / (p / "LATEST").read_text().strip()
    if (p / "trainer").is_dir():
        p = p / "trainer"
    if not (p / "trainer_rank0.pkl").is_file():
        hint = (" (the run saved no checkpoint: call run.save_checkpoint() or set tracking.checkpoint_every)"
                if (Path(path) / "manifest.json").is_file() else "")
        raise FileNotFoundError(f"{str(path)!r} holds no forgelab trainer checkpoint{hint}")
    return p


def _model_path(trainer_dir: Path, lora: LoraRecord | None) -> str:
    if lora:
        return lora["base_path"]
    import json

    for up in (trainer_dir.parent.parent.parent, trainer_dir.parent.parent):  # RUN/checkpoints/step_N/trainer
        manifest = up / "manifest.json"
        if manifest.is_file():
            return str(json.loads(manifest.read_text())["config"]["model"]["path"])
    raise FileNotFoundError(f"{trainer_dir}: a full-weights checkpoint outside a run directory names no model "
                            "(no manifest.json above it); export it from its run directory")


def export_checkpoint(path: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, *,
                      merge: bool = False) -> ExportSummary:
    """Write a checkpoint's adapter (PEFT) or, with ``merge`` or for a full run, its HF model; returns a summary.

    ``out`` defaults to ``<checkpoint>/../../export/{adapter,merged,model}`` (next to the run's checkpoints).
    """
    import torch
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from forgelab.engines.lora_adapters import adapter_config, adapter_state_dict, add_adapters, base_hash, merged_hf_state_dict, peft_tensors
    from forgelab.engines.titan import build_from_hf, save_hf, to_hf_state_dict
    from forgelab.weights.adapter import write_adapter

    trainer_dir = trainer_checkpoint(path)
    with open(trainer_dir / "trainer_rank0.pkl", "rb") as f:
        extra: object = pickle.load(f)
    if not isinstance(extra, dict):
        raise ValueError(f"{trainer_dir}: trainer_rank0.pkl holds a {type(extra).__name__}, not a trainer record")
    lora = cast("LoraRecord | None", extra.get("lora"))  # `checkpoint_record`'s dict; None for full weights
    step = cast("int | None", extra.get("step"))
    model_dir = _model_path(trainer_dir, lora)
    kind = "merged" if lora and merge else ("adapter" if lora else "model")
    out = Path(out) if out else trainer_dir.parent.parent.parent / "export" / kind
    model, ckpt = build_from_hf(model_dir)
    if lora:
        if base_hash(model_dir) != lora["base_sha256"]:
            raise ValueError(f"{trainer_dir}: the adapters were trained on a base with sha256 "
                             f"{lora['base_sha256'][:12]}, but {model_dir!r} now holds another")
        from forgelab.config.components import LoraConfig

        cfg = LoraConfig(**lora["config"])
        add_adapters(model, ckpt, cfg, seed=0)
        state = {"model": adapter_state_dict(model)}
    else:
        state = {"model": model.state_dict()}
    dcp_load(state, checkpoint_id=str(trainer_dir))  # in place; single process, no process group needed
    if not lora:
        # in place into the state dict's tensors, which are not all the model's: the fused QKV module's
        # state dict splits its `wqkv` into new wq/wk/wv tensors (a save hook), so they reach the model only
        # through load_state_dict (its merge hook), as the trainer's own load does; without it q/k/v stayed
        # the base's in every full export
        model.load_state_dict(state["model"])
    with torch.no_grad():
        if kind == "adapter":
            tensors = peft_tensors(model, ckpt)
            write_adapter(str(out), tensors, adapter_config(cfg, model_dir))
            n = sum(t.numel() for t in tensors.values())
        else:
            sd = merged_hf_state_dict(model, ckpt, cfg) if lora else to_hf_state_dict(model, ckpt)
            save_hf(str(out), sd, ckpt)
            n = sum(t.numel() for t in sd.values())
    return {"kind": kind, "out": str(out), "checkpoint": str(trainer_dir), "step": step,
            "base": model_dir, "parameters": int(n)}
