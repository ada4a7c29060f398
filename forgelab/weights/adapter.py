"""LoRA adapters in PEFT's format: the names, shapes and directory that vLLM and `peft` load.

    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": A_r_in, ...lora_B: B_out_r}
    write_adapter(out_dir, tensors, peft_config(rank=8, alpha=16, targets=("q_proj", ...)))
    vllm:  LoRARequest("run-v3", 3, out_dir)          peft:  PeftModel.from_pretrained(hf_base, out_dir)

What an adapter really is: for each targeted projection ``W [out, in]`` of each layer,
``W x + scaling * B (A x)`` with ``A [r, in]``, ``B [out, r]`` and ``scaling = alpha / r``;
merged, ``W + scaling * B @ A``. Pure functions over tensors and files: no model, no actor.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from forgelab.config.components import LORA_TARGETS as HF_TARGETS  # the projections an adapter may target

__all__ = ["HF_TARGETS", "HF_MODULE", "peft_name", "hf_weight_name", "parse_peft_name", "adapter_shapes",
           "check_adapter", "peft_config", "write_adapter", "read_adapter", "merge_adapter"]

#: HF sub-module of each target within a decoder layer.
HF_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}

_PEFT_RE = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")


def peft_name(layer: int, target: str, which: str) -> str:
    """PEFT's tensor name of ``lora_{which}`` (``"A"`` or ``"B"``) of ``target`` in decoder layer ``layer``."""
    return f"base_model.model.model.layers.{layer}.{HF_MODULE[target]}.{target}.lora_{which}.weight"


def hf_weight_name(layer: int, target: str) -> str:
    """The HF checkpoint name of the base weight an adapter on ``target`` of ``layer`` updates."""
    return f"model.layers.{layer}.{HF_MODULE[target]}.{target}.weight"


def parse_peft_name(name: str) -> tuple[int, str, str]:
    """``(layer, target, "A" | "B")`` of a PEFT tensor name; ValueError naming it when it is not one."""
    m = _PEFT_RE.match(name)
    if m is None or m.group(3) not in HF_TARGETS or HF_MODULE[m.group(3)] != m.group(2):
        raise ValueError(f"{name!r} is not a PEFT LoRA tensor name such as {peft_name(0, 'q_proj', 'A')!r}")
    return int(m.group(1)), m.group(3), m.group(4)


def adapter_shapes(base_shapes: dict[str, tuple[int, ...]], targets: tuple[str, ...] | list[str],
                   rank: int) -> dict[str, tuple[int, ...]]:
    """PEFT name -> shape of every adapter tensor, from the base checkpoint's HF shapes (`checkpoint_shapes`)."""
    out: dict[str, tuple[int, ...]] = {}
    layers = sorted({int(m.group(1)) for k in base_shapes if (m := re.match(r"^model\.layers\.(\d+)\.", k))})
    for layer in layers:
        for target in targets:
            w = base_shapes.get(hf_weight_name(layer, target))
            if w is None:
                raise ValueError(f"LoRA target {target!r}: the base checkpoint has no {hf_weight_name(layer, target)}")
            out_f, in_f = w
            out[peft_name(layer, target, "A")] = (rank, in_f)
            out[peft_name(layer, target, "B")] = (out_f, rank)
    return out


def check_adapter(tensors: Any, expected: dict[str, tuple[int, ...]]) -> list[str]:
    """Problems with a PEFT-named adapter against ``expected`` shapes (empty list: fine): the same checks as a
    full weight update's (`forgelab.weights.checks.check_named_tensors`)."""
    from forgelab.weights.checks import check_named_tensors

    return check_named_tensors(tensors, expected, naming="PEFT", what="an adapter")


def peft_config(*, rank: int, alpha: float, targets: tuple[str, ...] | list[str], dropout: float = 0.0,
                base_model: str | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` of a plain LoRA adapter (what `peft` writes for a ``LoraConfig``)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(rank), "lora_alpha": float(alpha),
        "lora_dropout": float(dropout), "target_modules": sorted(targets), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "layers_to_transform": None, "inference_mode": True,
        "base_model_name_or_path": base_model,
    }


def write_adapter(out_dir: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> str:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``out_dir`` (made if missing)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
              os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir


def read_adapter(adapter_dir: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, config)`` of a PEFT adapter directory."""
    from safetensors.torch import load_file

    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        config = json.load(f)
    return load_file(os.path.join(adapter_dir, "adapter_model.safetensors")), config


def merge_adapter(hf_state_dict: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
                  scaling: float) -> dict[str, torch.Tensor]:
    """A copy of ``hf_state_dict`` with every adapter merged in: ``W + scaling * B @ A`` (float64 product, cast back)."""
    out = dict(hf_state_dict)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        layer, target, which = parse_peft_name(name)
        pairs.setdefault((layer, target), {})[which] = t
    for (layer, target), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter of layer {layer} {target} has only lora_{next(iter(ab))}")
        key = hf_weight_name(layer, target)
        w = out[key]
        delta = scaling * (ab["B"].double() @ ab["A"].double())
        out[key] = (w.double() + delta).to(w.dtype)
    return out
