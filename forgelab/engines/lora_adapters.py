"""LoRA on the trainer's torchtitan model: adapters beside the frozen base, per HF projection.

    adapters = add_adapters(model, ckpt, lora_config, seed=0)   # freezes the base; before FSDP
    with adapters_disabled(model):                               # the base model: the free reference
        ref_logprobs_B_T = model_logprobs(model, tokens_B_L)   # forgelab.engines.titan_forward
    tensors = peft_tensors(model, ckpt)                          # PEFT names, HF row order (collective)

What it really is: each targeted linear layer ``W`` gets a forward hook that adds
``scaling * B(A(dropout(x)))`` to its output, ``A [r, in]`` (PEFT's kaiming-uniform init, seeded),
``B [out, r]`` zeros, ``scaling = alpha / r``; every other parameter stops requiring grad, so the
optimizer, the gradient norm and the checkpoint see the adapters only.

Choices made explicit (torchtitan's ``LoRAConverter`` leaves them implicit):

- **Per projection, not per fused matrix.** forgelab fuses q/k/v into one ``wqkv``; an adapter on it
  keeps one ``(A, B)`` per projection (``q_proj``, ``k_proj``, ``v_proj``), placed into the fused
  output layout, so it is exactly PEFT's per-projection adapter and targets may pick any subset.
  llama3 rows of q/k are stored in torchtitan's RoPE order: `peft_tensors` permutes B's rows to HF's.
- **Not the output projection.** forgelab's chunked logprobs read ``lm_head.weight`` directly and never
  call its forward: an adapter there would silently do nothing, so ``lm_head`` (and ``embed_tokens``)
  are refused with an error, as is any name that is not a projection.
- **Dropout** (``dropout > 0``) masks the adapter's input only while `dropout_seed` is set (the trainer
  sets it per micro-batch from the seed and step, so the no-grad and the backward pass of one
  micro-batch draw the same mask); logprobs for rollouts, the reference and evaluation never drop.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, TypedDict, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from forgelab.config.components import LoraConfig, check_lora_targets
from forgelab.weights.adapter import HF_TARGETS, peft_config, peft_name

if TYPE_CHECKING:
    from forgelab.engines.titan import TitanCheckpoint

__all__ = ["TITAN_MODULE", "LoRAAdapter", "check_targets", "add_adapters", "adapters", "adapters_disabled",
           "dropout_seed", "is_adapter_key", "adapter_state_dict", "peft_tensors", "adapter_config", "base_hash",
           "merged_hf_state_dict", "step_dropout", "export_adapter", "checkpoint_model_state", "checkpoint_record",
           "check_checkpoint_record"]

#: HF projection name -> (torchtitan module path inside a decoder layer, part of a fused qkv or None).
TITAN_MODULE = {
    "q_proj": ("attention.qkv_linear.wqkv", "q"), "k_proj": ("attention.qkv_linear.wqkv", "k"),
    "v_proj": ("attention.qkv_linear.wqkv", "v"), "o_proj": ("attention.wo", None),
    "gate_proj": ("feed_forward.w1", None), "up_proj": ("feed_forward.w3", None),
    "down_proj": ("feed_forward.w2", None),
}


class AdapterShape(TypedDict):
    """A LoRA checkpoint's adapter config: every field of `LoraConfig` (``asdict``); rank and targets must match
    the trainer's."""

    enabled: bool
    rank: int
    alpha: float
    dropout: float
    targets: list[str]
    reference: str


class LoraRecord(TypedDict):
    """What a LoRA checkpoint records of its adapters and base (`checkpoint_record`)."""

    config: AdapterShape
    base_path: str
    base_sha256: str


def check_targets(targets: object, where: str = "lora.targets") -> tuple[str, ...]:
    """The targets as a tuple, or ValueError naming the bad one (`forgelab.config.components.check_lora_targets`)."""
    return check_lora_targets(targets, where)


class LoRAAdapter(nn.Module):
    """The low-rank update of one linear layer (one or, for fused qkv, several projections).

    Args:
        in_features: the layer's input size.
        outs: HF projection name -> its output rows (one entry, or q/k/v of a fused layer).
        rank, alpha: ``scaling = alpha / rank``.
        dropout: probability of zeroing an input element (only while ``dropout_seed`` is set).
        fused: ``(n_kv_heads, heads_per_kv, head_dim)`` when the layer is torchtitan's fused qkv.
    """

    layer: int
    """The decoder layer it sits in (set by `add_adapters`)."""

    def __init__(self, in_features: int, outs: dict[str, int], *, rank: int, alpha: float, dropout: float = 0.0,
                 fused: tuple[int, int, int] | None = None):
        super().__init__()
        self.A = nn.ParameterDict({t: nn.Parameter(torch.empty(rank, in_features)) for t in outs})
        self.B = nn.ParameterDict({t: nn.Parameter(torch.zeros(n, rank)) for t, n in outs.items()})
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.dropout, self.fused, self.outs = float(dropout), fused, dict(outs)
        self.enabled = True
        self.dropout_seed: int | None = None

    def delta(self, x_BTI: torch.Tensor) -> torch.Tensor:
        """``scaling * B (A x)`` in the layer's output layout."""
        if self.dropout > 0 and self.dropout_seed is not None:
            g = torch.Generator(device=x_BTI.device).manual_seed(self.dropout_seed)
            keep = torch.empty(x_BTI.shape, device=x_BTI.device).bernoulli_(1 - self.dropout, generator=g)
            x_BTI = x_BTI * keep.to(x_BTI.dtype) / (1 - self.dropout)
        parts = {t: F.linear(F.linear(x_BTI, self.A[t]), self.B[t]) * self.scaling for t in self.outs}
        if self.fused is None:
            return next(iter(parts.values()))
        n_kv, hpk, hd = self.fused
        lead = x_BTI.shape[:-1]
        zeros = {"q_proj": (n_kv, hpk, hd), "k_proj": (n_kv, 1, hd), "v_proj": (n_kv, 1, hd)}
        blocks = [parts[t].reshape(*lead, *shape) if t in parts else x_BTI.new_zeros(*lead, *shape)
                  for t, shape in zeros.items()]
        return torch.cat(blocks, dim=-2).reshape(*lead, n_kv * (hpk + 2) * hd)  # torchtitan's fused row layout


def _hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
    lora = module.lora
    assert isinstance(lora, LoRAAdapter)  # the hook is registered only beside its adapter (add_adapters)
    return out + lora.delta(args[0]) if lora.enabled else out


def _attention_shape(ckpt: TitanCheckpoint) -> tuple[int, int, int]:
    hf = ckpt.hf_config
    n_heads = int(hf["num_attention_heads"])
    n_kv = int(hf.get("num_key_value_heads") or n_heads)
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // n_heads)
    return n_heads, n_kv, head_dim


def add_adapters(model: nn.Module, ckpt: TitanCheckpoint, lora: LoraConfig, *, seed: int = 0) -> int:
    """Add LoRA adapters for ``lora.targets`` to every decoder layer and freeze everything else.

    ``lora``: rank, alpha, dropout, targets (HF names, `check_targets`). Call before FSDP sharding;
    every rank draws the same A (seeded by ``seed``). Returns the number of adapter parameters.
    """
    targets = check_targets(list(lora.targets))
    n_heads, n_kv, hd = _attention_shape(ckpt)
    for p in model.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(int(seed) + 0x10FA)
    n = 0
    blocks = model.layers
    if not isinstance(blocks, (nn.ModuleDict, nn.ModuleList)):
        raise TypeError(f"add_adapters: model.layers is a {type(blocks).__name__}, not a ModuleDict or ModuleList")
    layers: Iterable[tuple[str | int, nn.Module]] = (
        blocks.items() if isinstance(blocks, nn.ModuleDict) else enumerate(blocks))
    for layer_id, layer in layers:
        by_module: dict[str, dict[str, int | None]] = {}
        for t in HF_TARGETS:  # fixed order: the same init draws whatever the order of lora.targets
            if t in targets:
                path, part = TITAN_MODULE[t]
                out = {"q": n_heads * hd, "k": n_kv * hd, "v": n_kv * hd}[part] if part else None
                by_module.setdefault(path, {})[t] = out
        for path, outs in by_module.items():
            linear = layer.get_submodule(path)
            in_features, out_features = _features(linear)
            fused = (n_kv, n_heads // n_kv, hd) if path.endswith("wqkv") else None
            sizes = {t: (o if o is not None else out_features) for t, o in outs.items()}
            adapter = LoRAAdapter(in_features, sizes, rank=int(lora.rank), alpha=float(lora.alpha),
                                  dropout=float(lora.dropout), fused=fused)
            adapter.layer = int(layer_id)
            for t in adapter.A:  # PEFT's init of A: kaiming-uniform with a = sqrt(5)
                bound = 1.0 / math.sqrt(in_features)  # = gain * sqrt(3 / fan_in) for a = sqrt(5)
                with torch.no_grad():
                    adapter.A[t].copy_(torch.rand(adapter.A[t].shape, generator=g) * 2 * bound - bound)
            weight = linear.weight
            assert isinstance(weight, torch.Tensor)
            adapter.to(device=weight.device, dtype=weight.dtype)
            linear.lora = adapter
            linear.register_forward_hook(_hook)
            n += sum(p.numel() for p in adapter.parameters())
    return n


def _features(linear: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a torchtitan linear layer."""
    in_features, out_features = getattr(linear, "in_features"), getattr(linear, "out_features")
    assert isinstance(in_features, int) and isinstance(out_features, int), (in_features, out_features)
    return in_features, out_features


def adapters(model: nn.Module) -> list[LoRAAdapter]:
    """Every adapter of ``model`` (empty for a model without LoRA)."""
    return [m for m in model.modules() if isinstance(m, LoRAAdapter)]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model inside the block: every adapter's update is skipped (exactly the base forward)."""
    found = adapters(model)
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a in found:
            a.enabled = True


@contextlib.contextmanager
def dropout_seed(model: nn.Module, seed: int | None) -> Iterator[None]:
    """Adapter dropout on inside the block, each adapter's mask drawn from ``seed`` and its own index."""
    found = adapters(model)
    for i, a in enumerate(found):
        a.dropout_seed = None if seed is None else (int(seed) * 1_000_003 + i) % (2**62)
    try:
        yield
    finally:
        for a in found:
            a.dropout_seed = None


def is_adapter_key(key: str) -> bool:
    """Whether a torchtitan state-dict key is an adapter tensor."""
    return ".lora.A." in key or ".lora.B." in key


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter entries of ``model.state_dict()`` (DTensors stay sharded: what a checkpoint saves)."""
    return {k: v for k, v in model.state_dict().items() if is_adapter_key(k)}


_KEY_RE = re.compile(r"^layers\.(\d+)\..*\.lora\.(A|B)\.(\w+)$")


def _hf_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """torchtitan llama3's RoPE row order -> HF's (`Llama3StateDictAdapter._permute`), any column count."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols).clone()


def peft_tensors(model: nn.Module, ckpt: TitanCheckpoint) -> dict[str, torch.Tensor]:
    """Every adapter tensor, full (DTensors gathered: collective under FSDP), PEFT-named, HF row order, CPU."""
    from torch.distributed.tensor import DTensor

    n_heads, n_kv, _ = _attention_shape(ckpt)
    out: dict[str, torch.Tensor] = {}
    for key, v in adapter_state_dict(model).items():
        m = _KEY_RE.match(key)
        if m is None:
            raise ValueError(f"adapter key {key!r} has no layer index: cannot name it in PEFT's format")
        layer, which, target = int(m.group(1)), m.group(2), m.group(3)
        t = (v.full_tensor() if isinstance(v, DTensor) else v).detach().to("cpu")
        if which == "B" and ckpt.family == "llama3" and target in ("q_proj", "k_proj"):
            t = _hf_permute(t, n_heads if target == "q_proj" else n_kv)
        out[peft_name(layer, target, which)] = t.contiguous()
    return out


def adapter_config(lora: LoraConfig, base_model: str | None = None) -> dict[str, object]:
    """``adapter_config.json`` for ``lora`` (rank, alpha, dropout, targets)."""
    return peft_config(rank=int(lora.rank), alpha=float(lora.alpha), dropout=float(lora.dropout),
                       targets=tuple(lora.targets), base_model=base_model)


_HASHES: dict[tuple[str, tuple[str, ...], tuple[tuple[int, int], ...]], str] = {}  # (path, names, sizes, mtimes) -> hex: a trainer saving every few steps hashes once


def base_hash(model_dir: str) -> str:
    """SHA-256 over the base checkpoint's config.json and safetensors files (names and bytes), hex."""
    names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors") or n == "config.json")
    stats = [os.stat(os.path.join(model_dir, n)) for n in names]
    key = (os.path.abspath(model_dir), tuple(names), tuple((s.st_size, s.st_mtime_ns) for s in stats))
    if key in _HASHES:
        return _HASHES[key]
    h = hashlib.sha256()
    for name in names:
        h.update(name.encode() + b"\0")
        with open(os.path.join(model_dir, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def merged_hf_state_dict(model: nn.Module, ckpt: TitanCheckpoint, lora: LoraConfig) -> dict[str, torch.Tensor]:
    """The base's HF weights with the adapters merged in (``W + scaling * B @ A``): what ``export --merge``
    writes and what the generator computes with the adapter. Collective under FSDP (gathers every parameter)."""
    from forgelab.engines.titan import full_state_dict, titan_to_hf
    from forgelab.weights.adapter import merge_adapter

    full = full_state_dict(model)
    base = titan_to_hf({k: v for k, v in full.items() if not is_adapter_key(k)}, ckpt)
    return merge_adapter(base, peft_tensors(model, ckpt), float(lora.alpha) / int(lora.rank))


def step_dropout(model: nn.Module, lora: LoraConfig | None, seed: int, step: int, rank: int, micro_index: int
                 ) -> AbstractContextManager[None]:
    """Adapter dropout for one micro-batch's training forward passes; a no-op without LoRA dropout.

    The mask's seed depends on (seed, step, rank, micro-batch) only: the no-grad pass 1 and the backward
    pass 2 of a micro-batch draw the same mask, and a resumed run draws the same masks."""
    if lora is None or not lora.dropout:
        return contextlib.nullcontext()
    return dropout_seed(model, ((int(seed) * 1_000_003 + step) * 1_009 + rank) * 1_013 + micro_index)


def export_adapter(model: nn.Module, ckpt: TitanCheckpoint, lora: LoraConfig | None, path: str, *, write: bool = True) -> str:
    """Write the adapter as a PEFT directory (``write``: this rank writes; every rank gathers). LoRA only."""
    from forgelab.weights.adapter import write_adapter

    if lora is None:
        raise ValueError("export_adapter: this trainer has no LoRA adapters; use export_hf")
    tensors = peft_tensors(model, ckpt)
    if write:
        write_adapter(path, tensors, adapter_config(lora, ckpt.model_dir))
    return path


def checkpoint_model_state(model: nn.Module, lora: LoraConfig | None) -> dict[str, torch.Tensor]:
    """What a trainer checkpoint holds of the model: every parameter, or with LoRA the adapters only."""
    return model.state_dict() if lora is None else adapter_state_dict(model)


def checkpoint_record(lora: LoraConfig, model_dir: str) -> LoraRecord:
    """Saved with a LoRA checkpoint: the adapters' config and the base they sit on (path, sha256 of its files)."""
    from dataclasses import asdict

    config = cast(AdapterShape, asdict(lora))  # every field of the LoraConfig, as AdapterShape lists them
    return {"config": config, "base_path": os.path.abspath(model_dir), "base_sha256": base_hash(model_dir)}


def check_checkpoint_record(saved: LoraRecord | None, mine: LoraRecord | None, path: str) -> None:
    """Refuse a checkpoint whose adapters (or lack of them) or base do not match this trainer's."""
    if (saved is None) != (mine is None):
        has = "LoRA adapters only" if saved is not None else "full weights"
        raise ValueError(f"{path!r} holds {has}, but this trainer is "
                         f"{'a LoRA' if mine is not None else 'a full fine-tuning'} trainer; "
                         "resume with the lora config the checkpoint was saved with")
    if saved is None:
        return
    assert mine is not None  # both or neither (above)
    if saved["base_sha256"] != mine["base_sha256"]:
        raise ValueError(f"{path!r} holds LoRA adapters trained on the base at {saved['base_path']!r} "
                         f"(sha256 {saved['base_sha256'][:12]}), but this trainer's base "
                         f"{mine['base_path']!r} has sha256 {mine['base_sha256'][:12]}: adapters only make "
                         "sense on their own base; set model.path to it")
    def shape(c: AdapterShape) -> tuple[int, list[str]]:
        return c["rank"], sorted(c["targets"])

    if shape(saved["config"]) != shape(mine["config"]):
        raise ValueError(f"{path!r} holds rank-{saved['config']['rank']} adapters on {saved['config']['targets']}, "
                         f"this trainer has rank {mine['config']['rank']} on {mine['config']['targets']}")
