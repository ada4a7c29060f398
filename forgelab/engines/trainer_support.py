"""Trainer helpers that hold no state: LR schedule, loss resolution, batch checks, RNG state, rendezvous.

Split out of `forgelab.engines.trainer_core` (which holds `TrainerState`, the model
and its step); everything here is importable without building a model.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["token_values_of", "WarmupCosine", "PackedLoss", "pack_loss", "shipped_loss", "resolve_loss", "check_tokens", "check_batch",
           "resolve_device", "REQUIRED_BATCH_KEYS"]

REQUIRED_BATCH_KEYS = ("tokens_B_L", "mask_B_T", "generator_logprobs_B_T", "advantages_B")


class WarmupCosine:
    """LR multiplier for step ``s``: linear warmup to 1, then cosine to ``min_ratio`` at ``total_steps`` (1 if None).

    >>> f = WarmupCosine(warmup_steps=2, total_steps=4, min_ratio=0.0)
    >>> [round(f(s), 3) for s in range(5)]
    [0.5, 1.0, 0.5, 0.0, 0.0]
    """

    def __init__(self, warmup_steps: int, total_steps: int | None, min_ratio: float):
        self.warmup_steps, self.total_steps, self.min_ratio = warmup_steps, total_steps, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.total_steps is None:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps + 1) / (self.total_steps - self.warmup_steps))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class PackedLoss:
    """A loss function serialised by value with cloudpickle (survives any process boundary or a checkpoint)."""

    name: str
    payload: bytes

    def unpack(self) -> Callable:
        import cloudpickle

        return cloudpickle.loads(self.payload)


def pack_loss(fn: Callable) -> PackedLoss:
    """Serialise ``fn`` by value (closures and ``__main__`` definitions included)."""
    import cloudpickle

    if not callable(fn):
        raise TypeError(f"pack_loss: expected a loss function, got {type(fn).__name__}")
    return PackedLoss(name=getattr(fn, "__name__", type(fn).__name__), payload=cloudpickle.dumps(fn))


def shipped_loss(spec: Any) -> "str | PackedLoss":
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


def resolve_loss(spec: Any) -> tuple[str, Callable]:
    """``(name, function)`` for a loss name in ``LOSSES``, a function, or a `PackedLoss`."""
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


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> CUDA device 0 when visible (each process sees its own GPU), else CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", 0) if name == "cuda" else torch.device("cpu")


def check_tokens(tokens_B_L: Any) -> torch.Tensor:
    if not isinstance(tokens_B_L, torch.Tensor) or tokens_B_L.dim() != 2 or tokens_B_L.shape[1] < 2:
        raise ValueError(
            f"tokens_B_L must be an int tensor [B, L] with L >= 2, got "
            f"{tuple(tokens_B_L.shape) if isinstance(tokens_B_L, torch.Tensor) else type(tokens_B_L).__name__}"
        )
    if tokens_B_L.is_floating_point():
        raise ValueError(f"tokens_B_L must hold integer token ids, got dtype {tokens_B_L.dtype}")
    return tokens_B_L.long()


def check_spans(spans_B_2: Any, tokens_B_L: torch.Tensor) -> torch.Tensor | None:
    """None, or ``[B, 2]`` int spans ``(prompt length, length)`` per row of ``tokens_B_L`` (`forgelab.algos.packing`)."""
    if spans_B_2 is None:
        return None
    spans_B_2 = torch.as_tensor(spans_B_2)
    B, L = tokens_B_L.shape
    if spans_B_2.shape != (B, 2) or spans_B_2.is_floating_point():
        raise ValueError(f"spans_B_2 must be an int tensor [B, 2] = [{B}, 2] of (prompt length, length) per row, "
                         f"got {tuple(spans_B_2.shape)} {spans_B_2.dtype}")
    s, e = spans_B_2[:, 0], spans_B_2[:, 1]
    bad = ~(((s >= 1) & (s < e) & (e <= L)) | ((s == 0) & (e == 0)))
    if bool(bad.any()):
        b = int(bad.nonzero()[0])
        raise ValueError(f"spans_B_2 row {b} is ({int(s[b])}, {int(e[b])}); need 1 <= prompt length < length <= L "
                         f"= {L}, or (0, 0) for a row with nothing to compute")
    return spans_B_2.long().cpu()


def check_batch(batch: Any) -> dict[str, Any]:
    """Validate a collated batch (``forgelab.algos.batching.collate``); raise ``ValueError`` naming the problem."""
    if not isinstance(batch, dict):
        raise ValueError(f"train_step: batch must be a dict from forgelab.algos.batching.collate, got {type(batch).__name__}")
    missing = [k for k in REQUIRED_BATCH_KEYS if batch.get(k) is None]
    if missing:
        raise ValueError(f"train_step: batch lacks {missing}; build it with forgelab.algos.batching.collate")
    tokens = check_tokens(batch["tokens_B_L"])
    B, L = tokens.shape
    want = {"mask_B_T": (B, L - 1), "generator_logprobs_B_T": (B, L - 1), "advantages_B": (B,)}
    if batch.get("ref_logprobs_B_T") is not None:
        want["ref_logprobs_B_T"] = (B, L - 1)
    if batch["advantages_B"].dim() == 2:  # per token (on-policy distillation), aligned to targets
        want["advantages_B"] = (B, L - 1)
    for key, shape in want.items():
        if tuple(batch[key].shape) != shape:
            raise ValueError(
                f"train_step: batch[{key!r}] has shape {tuple(batch[key].shape)}, expected {shape} for "
                f"tokens_B_L {(B, L)} (per-token tensors are aligned to targets, T = L - 1)"
            )
    return {**batch, "tokens_B_L": tokens}


def sha256_hex(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(str((tuple(t.shape), t.dtype)).encode())
        if t.numel():
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def sum_of_squares(tensors: list[torch.Tensor], piece: int = 1 << 16) -> torch.Tensor:
    """``sum(t**2)`` over ``tensors`` (their local shards for DTensors) as a float64 scalar, without float64 copies.

    A single fp32 norm of a real vocabulary's embedding gradient (155 M elements) is ~7e-5 off (the grad_norm
    metric then differed by 4e-5 between 1 and 2 FSDP ranks); fp32 norms of ``piece``-element views, combined
    in float64, are ~2e-7 off at the same speed.
    """
    parts = [p for t in tensors for p in local_tensor(t).reshape(-1).split(piece)]
    if not parts:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack(torch._foreach_norm(parts, 2.0)).double().pow(2).sum()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rendezvous(addr: str, port: int, rank: int, world: int, timeout: timedelta, backend: str):
    """The process group's TCPStore and options, listening on `addr` only (docs/security.md).

    torch's TCPStore server binds every interface whatever host name it is
    given, so rank 0 binds the socket itself and hands it over. With a
    loopback `addr` (one host) gloo's pair sockets are pinned to loopback too;
    by default gloo binds the address the host name resolves to.
    """
    import ipaddress
    import socket

    fd = None
    if rank == 0:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
        fd = sock.detach()  # the store's server owns it from here
    store = dist.TCPStore(addr, port, world, rank == 0, timeout, master_listen_fd=fd)
    pg_options = None
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        loopback = False
    if backend == "gloo" and loopback:
        pg_options = dist.ProcessGroupGloo._Options()
        pg_options._devices = [dist.ProcessGroupGloo.create_device(hostname=addr)]
    return store, pg_options


def token_values_of(trainer_logprobs_B_T: torch.Tensor, entropy_B_T: torch.Tensor, generator_logprobs_B_T: torch.Tensor,
                    mask_B_T: torch.Tensor, advantages: torch.Tensor, is_weights_B_T: torch.Tensor | None,
                    loss_name: str, loss_kwargs: dict, metrics: dict) -> dict[str, torch.Tensor | None]:
    """The trainer's view of every token of the batch it trains (issue #28): its logprob under the weights
    being trained (before the update), its entropy, the importance weight used (None: no IS), whether the loss
    clipped it (None: a loss whose rule is unknown) and the mask; adds the sampler-vs-trainer mismatch to
    `metrics` (`forgelab.algos.token_truth`). CPU float32 ``[B, T]`` tensors, sent back with the step's metrics."""
    from forgelab.algos.token_truth import clipped_tokens, sampler_mismatch

    lp, gen, mask = trainer_logprobs_B_T.float().cpu(), generator_logprobs_B_T.float().cpu(), mask_B_T.float().cpu()
    metrics.update(sampler_mismatch(gen, lp, mask))
    clipped = clipped_tokens(loss_name, loss_kwargs, torch.where(mask != 0, lp - gen, 0.0), advantages.cpu(), mask)
    return {"trainer_logprobs_B_T": lp, "entropy_B_T": entropy_B_T.detach().float().cpu(),
            "is_weights_B_T": None if is_weights_B_T is None else is_weights_B_T.detach().float().cpu(),
            "clipped_B_T": None if clipped is None else clipped.float(), "mask_B_T": mask}
