"""Losses as they travel to the trainer: by name (every process knows the built-ins) or by value (cloudpickle).

    spec = shipped_loss("grpo")          # "grpo"; a notebook's own function -> PackedLoss
    name, fn = resolve_loss(spec)        # in the trainer process

`PackedLoss` is pickled into trainer checkpoints (``trainer_rank*.pkl``) under this module's path; the
checkpoints of earlier releases name ``forgelab.engines.trainer_support``, which still re-exports it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    import torch

__all__ = ["PackedLoss", "pack_loss", "shipped_loss", "resolve_loss", "as_loss_spec", "LossSpec", "LossFunction"]


class LossFunction(Protocol):
    """A loss as the trainer calls it (`forgelab.algos.losses`): ``fn(logprobs_B_T, generator_logprobs_B_T=...,
    advantages_B=..., mask_B_T=..., ref_logprobs_B_T=..., is_weights_B_T=..., **loss_inputs, **loss_kwargs)``,
    returning ``(loss, metrics)``, checked at run time (`forgelab.algos.loss_checks.validate_loss_output`)."""

    def __call__(self, logprobs_B_T: torch.Tensor, /, **inputs: object) -> object: ...


@dataclass(frozen=True)
class PackedLoss:
    """A loss function serialised by value with cloudpickle (survives any process boundary or a checkpoint)."""

    name: str
    payload: bytes

    def unpack(self) -> LossFunction:
        import cloudpickle  # type: ignore[import-untyped]  # cloudpickle ships no type information

        fn: LossFunction = cloudpickle.loads(self.payload)
        return fn


def pack_loss(fn: LossFunction) -> PackedLoss:
    """Serialise ``fn`` by value (closures and ``__main__`` definitions included)."""
    import cloudpickle

    if not callable(cast(object, fn)):  # callers across a process or a notebook are not type-checked
        raise TypeError(f"pack_loss: expected a loss function, got {type(fn).__name__}")
    return PackedLoss(name=getattr(fn, "__name__", type(fn).__name__), payload=cloudpickle.dumps(fn))


def shipped_loss(spec: "LossSpec") -> "str | PackedLoss":
    """A loss as it must travel to the trainer process: a built-in by name (every process knows it); anything
    else by value: a function, or a name the controller's `LOSSES` has but the trainer's does not (added or
    replaced in a notebook), packed under that name. An unknown name raises ``ValueError``."""
    from forgelab.algos.losses import BUILTIN_LOSSES, LOSSES

    if isinstance(spec, PackedLoss):
        return spec
    if isinstance(spec, str):
        if spec not in LOSSES:
            raise ValueError(f"unknown loss {spec!r}; registered losses: {sorted(LOSSES)} (or pass a function)")
        if LOSSES[spec] is BUILTIN_LOSSES.get(spec):
            return spec
        return dataclasses.replace(pack_loss(LOSSES[spec]), name=spec)
    return pack_loss(spec)


def resolve_loss(spec: object) -> tuple[str, LossFunction]:
    """``(name, function)`` for a loss name in ``LOSSES``, a function, or a `PackedLoss` (anything else: ``TypeError``)."""
    from forgelab.algos.losses import LOSSES

    if isinstance(spec, PackedLoss):
        return spec.name, spec.unpack()
    if isinstance(spec, str):
        if spec not in LOSSES:
            raise ValueError(f"unknown loss {spec!r}; registered losses: {sorted(LOSSES)} (or pass a function)")
        return spec, LOSSES[spec]
    if callable(spec):
        return getattr(spec, "__name__", type(spec).__name__), spec
    raise TypeError(f"a loss must be a name in LOSSES, a function or a PackedLoss, got {type(spec).__name__}")




LossSpec = str | PackedLoss | LossFunction
"""A loss as a caller names it: a name in ``forgelab.algos.losses.LOSSES``, a function, or a `PackedLoss`."""


def as_loss_spec(spec: object) -> LossSpec:
    """``spec`` checked to be a `LossSpec` (a ``TrainerConfig.loss``, typed in the config layer, which cannot
    name `PackedLoss`); anything else: ``TypeError``, as `resolve_loss` raises it."""
    if isinstance(spec, (str, PackedLoss)):
        return spec
    if callable(spec):
        return spec
    raise TypeError(f"a loss must be a name in LOSSES, a function or a PackedLoss, got {type(spec).__name__}")
