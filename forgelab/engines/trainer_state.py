"""The trainer's state and step, without actors: model, optimizer, schedule, loss, checkpoints.

`forgelab.engines.trainer.Trainer` is a thin Monarch actor around `TrainerState`;
this module can be driven from any process group (a test under torchrun, a
single process). See `forgelab.engines.trainer` for the normalisation across ranks
and the fault rule; the code implementing both is `TrainerState.forward_loss_backward`.

The step comes in pieces and fused, and the fused one IS the pieces in sequence:

    fb = state.forward_backward(batch)        # LossReport; gradients accumulate in .grad across calls
    opt = state.optim_step(None)              # OptimReport; None: the configured schedule and clipping
    m = state.train_step(batch)               # StepMetrics = forward_backward, then optim_step(None)

An accumulation window opens at the first `forward_backward` after an optimizer step (a pending loss swap
lands there, so a window never mixes losses) and closes at `optim_step`, which zeroes the gradients.
Fault rule for the pieces: a skipped `forward_backward` discards the whole window (see `LossReport`), and an
`optim_step` with nothing accumulated is skipped (no optimizer or schedule step).
"""
from __future__ import annotations

import math
import os
import pickle
import random
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["TrainerState", "SkipStep"]

from forgelab.runtime import liveness
from forgelab.engines.contracts import (
    AdamParams, DryRunReport, LossReport, OptimReport, StepMetrics, TokenValues, TrainBatch, check_batch, check_spans,
    check_tokens, token_values_of,
)
from forgelab.engines.loss_specs import LossFunction, LossSpec, PackedLoss, as_loss_spec, pack_loss, resolve_loss
from forgelab.engines.trainer_dist import (
    all_gather_rows, any_rank, init_process_group, resolve_device, rng_state, set_rng_state, shard_model,
    state_fingerprint, sum_across_ranks,
)
from forgelab.engines.trainer_optim import WarmupCosine, adam_hyperparameters, global_grad_norm

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import OptimizerStateType

    from forgelab.config.components import LoraConfig, TrainerConfig
    from forgelab.engines.titan import TitanCheckpoint

PendingLoss = tuple[LossSpec, str, LossFunction, dict[str, object]]
"""A `set_loss` waiting for the next accumulation window: ``(spec, name, function, kwargs)``."""

_EXTRA_FILE = "trainer_rank{}.pkl"


class SkipStep(Exception):
    """A step that must not change anything (see the fault rule)."""


class TrainerState:
    """Model, optimizer, schedule and loss of one trainer rank. Every method is collective over the group."""

    config: TrainerConfig
    rank: int
    world: int
    device: torch.device
    ckpt: TitanCheckpoint
    lora: LoraConfig | None
    """The adapters' config (LoRA on the frozen base), None for full fine-tuning."""
    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    """The trainable parameters (with LoRA: the adapters'), what the optimizer and clipping see."""
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    step: int
    policy_version: int
    loss_spec: LossSpec
    loss_name: str
    loss_fn: LossFunction
    loss_kwargs: dict[str, object]
    _pending: PendingLoss | None
    token_values: TokenValues | None
    accumulated: int
    _accum_norm: float
    _total_norm: torch.Tensor | None
    """The accumulated gradients' global norm as the tensor clipping takes (set by `forward_loss_backward`)."""
    base_passes: int
    """Forward passes of the base with the adapters off (`base_logprobs`: the free reference of a LoRA run), in
    this process since `create`; a loss that does not read the reference (kl_coef 0) runs none."""

    # -- construction ------------------------------------------------------------

    @classmethod
    def create(cls, config: "TrainerConfig", rank: int, world: int) -> "TrainerState":
        """Initialise the process group, build and shard the model, and the optimizer and schedule."""
        self = cls()
        self.config, self.rank, self.world = config, rank, world
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        init_process_group(config, self.device, rank, world)
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        np.random.seed(config.seed)

        from forgelab.engines.titan import build_from_hf, checkpoint_blocks

        model, self.ckpt = build_from_hf(config.model_dir, device=self.device)
        self.lora = config.lora if config.lora.enabled else None
        if self.lora is not None:  # adapters on the frozen base (forgelab.engines.lora_adapters); before sharding
            from forgelab.engines.lora_adapters import add_adapters

            add_adapters(model, self.ckpt, self.lora, seed=config.seed)
        if config.checkpoints_activations():
            checkpoint_blocks(model)
        from forgelab.engines.precision import needs_mixed_precision

        if world > 1 or needs_mixed_precision(getattr(config, "dtype", "float32"), self.device.type):
            shard_model(model, self.device, world, getattr(config, "dtype", "float32"))  # FSDP2; with one rank too when model.dtype asks for 16-bit compute on CUDA
        self.model = model.train()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, betas=(config.betas[0], config.betas[1]), eps=config.eps,
            weight_decay=config.weight_decay, foreach=True,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, WarmupCosine(config.warmup_steps, config.total_steps, config.min_lr_ratio)
        )
        self.step = 0
        self.policy_version = 0
        self._apply_loss(as_loss_spec(config.loss), dict(config.loss_kwargs))
        self._pending = None
        self.token_values = None
        self.accumulated = 0  # forward_backward calls whose gradients await optim_step
        self._accum_norm = float("nan")  # the accumulated gradients' global norm (also in _total_norm)
        self.base_passes = 0
        return self

    # -- loss swapping -------------------------------------------------------------

    def _apply_loss(self, spec: LossSpec, kwargs: dict[str, object]) -> None:
        self.loss_name, self.loss_fn = resolve_loss(spec)
        self.loss_spec, self.loss_kwargs = spec, kwargs

    def next_loss(self) -> tuple[str, LossFunction, dict[str, object]]:
        """``(name, function, kwargs)`` of the loss the next `train_step` runs: a pending swap's, else the current."""
        if self._pending is not None:
            _, name, fn, kwargs = self._pending
            return name, fn, dict(kwargs)
        return self.loss_name, self.loss_fn, dict(self.loss_kwargs)

    def set_loss(self, spec: LossSpec, loss_kwargs: dict[str, object] | None) -> str:
        # the endpoint's callers are not all type-checked (a notebook, an older controller): check at run time
        if loss_kwargs is not None and not isinstance(cast(object, loss_kwargs), dict):
            raise ValueError(f"set_loss: loss_kwargs must be a dict or None, got {type(loss_kwargs).__name__}")
        name, fn = resolve_loss(spec)  # fail now, not at the next step
        self._pending = (spec, name, fn, dict(loss_kwargs or {}))
        return name

    def swap_run_state(self, saved: Mapping[str, object] | None) -> dict[str, object]:
        """This rank's run fields (loss, pending swap, step, version, config, token values), then ``saved``'s
        installed (None: kept): what a LoRA slot owns beside its tensors (`forgelab.engines.trainer_slots`)."""
        names = {k: k for k in ("loss_spec", "loss_name", "loss_fn", "loss_kwargs", "step", "policy_version", "config",
                                "token_values", "accumulated")}
        names |= {"pending": "_pending", "accum_norm": "_accum_norm", "total_norm": "_total_norm"}
        mine = {k: getattr(self, a, None) for k, a in names.items()}
        for k, v in (saved or {}).items():
            setattr(self, names.get(k, k), v)
        return mine

    # -- row planning ----------------------------------------------------------------

    def _micro_batches(self, B: int) -> list[torch.Tensor]:
        """This rank's row indices per micro-batch; every rank gets the same number (FSDP collectives pair up)."""
        blocks = torch.arange(B).tensor_split(self.world)
        mine = blocks[self.rank]
        size = getattr(self.config, "micro_batch_size", None) or max(1, max(len(b) for b in blocks))
        n_micro = max(1, math.ceil(max(len(b) for b in blocks) / size))
        return [mine[i * size:(i + 1) * size] for i in range(n_micro)]

    def _forward(self, tokens_B_L: torch.Tensor, rows: torch.Tensor, *, need_entropy: bool,
                 spans_B_2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logprobs_R_T, entropy_R_T or None)`` for ``rows``; an empty row set runs one dummy row so collectives match.

        The model stops at its final hidden states; logprobs and entropy are
        projected ``logits_chunk`` rows at a time (`forgelab.algos.logprobs.chunked_logprobs_entropy`),
        so no ``[R, T, V]`` logits exist, in the forward or the backward pass. With ``spans_B_2``
        (`forgelab.algos.packing`) only those positions are computed, rows sharing a prompt run it
        once (``share_prompts``), and every other position is 0.
        """
        from forgelab.engines.titan_forward import model_logprobs_entropy

        dummy = len(rows) == 0
        sel = tokens_B_L[:1] if dummy else tokens_B_L[rows]
        spans = None if dummy or spans_B_2 is None else spans_B_2[rows]
        logprobs_R_T, entropy_R_T = model_logprobs_entropy(
            self.model, sel.to(self.device), need_entropy=need_entropy, chunk=getattr(self.config, "logits_chunk", None),
            spans_B_2=spans, share_prompts=getattr(self.config, "share_prompts", "off"),
            max_pack_len=getattr(self.config, "max_pack_len", None),
        )
        if entropy_R_T is not None:
            entropy_R_T = entropy_R_T.detach()
        liveness.bump("trainer_forwards")  # progress the watchdog sees inside a long step (forgelab.runtime.watchdog)
        if dummy:  # an empty view still back-propagates (zeros) through the model
            return logprobs_R_T[:0], (None if entropy_R_T is None else entropy_R_T[:0])
        return logprobs_R_T, entropy_R_T

    def sum_across_ranks(self, values: list[float]) -> list[float]:
        return sum_across_ranks(values, self.world, self.device)

    # -- the step ------------------------------------------------------------------

    def forward_loss_backward(self, batch: TrainBatch, fn: LossFunction, name: str, kwargs: dict[str, object]
                              ) -> tuple[float, dict[str, float], float]:
        """Accumulate ``dL/dtheta`` of the global-batch loss into ``.grad``; ``(loss, metrics, grad_norm)``, the
        norm being that of everything in ``.grad`` (earlier accumulated gradients included).

        Raises `SkipStep` (on every rank together) when the loss or the gradients are unusable.
        """
        from forgelab.algos.importance import truncated_is_weights
        from forgelab.algos.loss_checks import reads_reference
        from forgelab.algos.losses import validate_loss_output
        from forgelab.algos.packing import spans_from_mask

        dev = self.device
        tokens = batch.tokens_B_L
        B = tokens.shape[0]
        mask_B_T = batch.mask_B_T.float().to(dev)
        gen_B_T = batch.generator_logprobs_B_T.float().to(dev)
        adv_B = batch.advantages_B.float().to(dev)
        ref = batch.ref_logprobs_B_T
        ref_B_T = None if ref is None else ref.float().to(dev)
        extra = {k: v.float().to(dev) for k, v in batch.loss_inputs_B_T.items()}  # e.g. a supervised loss's weights
        micro = self._micro_batches(B)
        rows = torch.cat(micro)
        spans_B_2 = spans_from_mask(batch.mask_B_T.cpu())  # only masked positions enter the loss
        # LoRA: a batch without reference logprobs gets the base model's (adapters off), unless the loss's value
        # and gradient do not read them (a built-in loss at kl_coef 0: dapo's default); no kl_ref metric then
        ref_from_base = (ref_B_T is None and self.lora is not None and self.lora.reference == "base"
                         and reads_reference(fn, kwargs))
        if ref_from_base:
            ref_B_T = self.base_logprobs(tokens, spans_B_2).to(dev)

        # Pass 1: this rank's logprobs (keeping the graph when there is one micro-batch).
        graphs: list[torch.Tensor | None] = []
        parts: list[torch.Tensor] = []
        ents: list[torch.Tensor] = []
        keep_graph = len(micro) == 1
        for i, mb in enumerate(micro):
            with torch.set_grad_enabled(keep_graph), self._dropout(i):
                lp, ent = self._forward(tokens, mb, need_entropy=True, spans_B_2=spans_B_2)
            graphs.append(lp if keep_graph else None)
            parts.append(lp.detach())
            assert ent is not None  # asked for (need_entropy)
            ents.append(ent)
        local_lp = torch.cat(parts)
        ent_local = torch.cat(ents)
        m_local = mask_B_T[rows]
        e_sum, e_cnt = self.sum_across_ranks([float((ent_local * m_local).sum()), float(m_local.sum())])
        metrics: dict[str, float] = {"entropy": e_sum / max(e_cnt, 1.0), "n_tokens": e_cnt, "n_seqs": float(B),
                                   **({"ref_from_base": 1.0} if ref_from_base else {})}

        # The loss of the global batch, identical on every rank.
        lp_leaf = all_gather_rows(local_lp, B, self.world).detach().requires_grad_(True)
        reason = ""
        loss_t = None
        try:
            is_w = None
            if self.config.is_cap is not None:
                is_w, is_metrics = truncated_is_weights(
                    lp_leaf.detach(), gen_B_T, mask_B_T, self.config.is_cap, level=self.config.is_level
                )
                metrics.update(is_metrics)
            out = fn(lp_leaf, generator_logprobs_B_T=gen_B_T, advantages_B=adv_B, mask_B_T=mask_B_T,
                     ref_logprobs_B_T=ref_B_T, is_weights_B_T=is_w, **extra, **kwargs)
            loss_t, loss_metrics = validate_loss_output(out, name, require_grad=True)
            metrics.update(loss_metrics)
            loss_t.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
            grad_B_T = lp_leaf.grad if lp_leaf.grad is not None else torch.zeros_like(lp_leaf)
        except Exception as e:  # a user's loss may raise anything: it must skip, not desynchronise ranks
            reason = f"loss {name!r}: {type(e).__name__}: {e}".strip()
        if any_rank(self.world, self.device, bool(reason)):
            raise SkipStep(reason or "another rank's loss failed")
        assert loss_t is not None  # no rank failed, so this one's loss ran
        loss_value = float(loss_t.detach())
        self.token_values = token_values_of(lp_leaf.detach(), all_gather_rows(ent_local, B, self.world), gen_B_T, mask_B_T,
                                            adv_B, is_w, name, kwargs, metrics)  # per token, and mismatch metrics

        # Pass 2: back-propagate this rank's slice of dL/dlogprobs through the model.
        for i, mb in enumerate(micro):
            # the adapter-dropout mask of pass 1, also for blocks recomputed in backward (activation checkpointing)
            with self._dropout(i):
                graph = graphs[i]  # None unless keep_graph
                lp = graph if graph is not None else self._forward(tokens, mb, need_entropy=False,
                                                                   spans_B_2=spans_B_2)[0]
                if len(mb) == 0:
                    lp.sum().backward()  # type: ignore[no-untyped-call]  # torch: unannotated; zero-valued: keeps this rank in the FSDP reduce-scatter
                else:
                    lp.backward(grad_B_T[mb].to(dev))  # type: ignore[no-untyped-call]  # torch: unannotated
            liveness.bump("trainer_backwards")  # progress the watchdog sees inside a long step
        del graphs

        grad_norm, self._total_norm = global_grad_norm(self.params, self.device, self.world)
        if any_rank(self.world, self.device, not math.isfinite(grad_norm)):
            raise SkipStep(f"non-finite gradients (grad_norm={grad_norm}) from loss {name!r}")
        return loss_value, metrics, grad_norm

    def _dropout(self, micro_index: int) -> AbstractContextManager[None]:
        """Adapter dropout for one micro-batch's training passes (`forgelab.engines.lora_adapters.step_dropout`)."""
        from forgelab.engines.lora_adapters import step_dropout

        return step_dropout(self.model, self.lora, self.config.seed, self.step, self.rank, micro_index)

    def base_logprobs(self, tokens_B_L: object, spans_B_2: object = None) -> torch.Tensor:
        """`logprobs` of the base model (adapters off): the free reference, every row on every rank. LoRA only."""
        from forgelab.engines.lora_adapters import adapters_disabled

        if self.lora is None:
            raise ValueError("base_logprobs: this trainer has no LoRA adapters; its base is its policy "
                             "(use a ReferenceModel for a frozen copy)")
        self.base_passes += 1
        with adapters_disabled(self.model):
            return self.logprobs(tokens_B_L, spans_B_2)

    def _open_window(self) -> None:
        """The first forward-backward after an optimizer step: a pending loss swap lands here (never mid-window)."""
        if self.accumulated == 0 and self._pending is not None:
            spec, name, fn, kwargs = self._pending
            self.loss_spec, self.loss_name, self.loss_fn, self.loss_kwargs = spec, name, fn, kwargs
            self._pending = None

    def _discard_window(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.accumulated, self._accum_norm = 0, float("nan")

    def forward_backward(self, batch: "TrainBatch | Mapping[str, object]", loss: LossSpec | None = None,
                         loss_kwargs: Mapping[str, object] | None = None) -> LossReport:
        """Add the gradient of ``loss`` on ``batch`` to the accumulated gradients (until `optim_step`).

        ``loss`` None: the trainer's current loss with its keywords (a pending `set_loss` lands at the first
        call of a window); else that loss (a name, a function, a `PackedLoss`) with ``loss_kwargs`` for this call
        only. The sum over calls is the gradient of the sum of their losses. A skipped call discards the
        window (`LossReport`).
        """
        self._open_window()
        batch = check_batch(batch)
        if loss is None:
            name, fn, kwargs = self.loss_name, self.loss_fn, dict(self.loss_kwargs)
            if loss_kwargs is not None:
                kwargs = dict(loss_kwargs)
        else:
            name, fn = resolve_loss(loss)
            kwargs = dict(loss_kwargs or {})
        try:
            value, metrics, grad_norm = self.forward_loss_backward(batch, fn, name, kwargs)
        except SkipStep as skip:
            self._discard_window()
            return LossReport(loss=float("nan"), loss_name=name, grad_norm=float("nan"), accumulated=0,
                              skipped=True, skip_reason=str(skip))
        self.accumulated += 1
        self._accum_norm = grad_norm
        return LossReport(loss=value, loss_name=name, grad_norm=grad_norm, accumulated=self.accumulated,
                          metrics=metrics)

    def optim_step(self, adam: AdamParams | None = None) -> OptimReport:
        """One AdamW step on the accumulated gradients, which are then zeroed.

        ``adam`` None: the configured schedule's lr, the config's betas, eps, weight decay and clipping
        (`TrainerConfig.max_grad_norm`), and the schedule advances. With ``adam``: exactly its hyperparameters
        for this step (clipping at ``adam.grad_clip``); the schedule does not move. With nothing accumulated the
        step is skipped (no optimizer or schedule step).
        """
        lr = float(self.optimizer.param_groups[0]["lr"] if adam is None else adam.lr)
        if self.accumulated == 0:
            return OptimReport(step=self.step, lr=lr, grad_norm=float("nan"), scheduled=adam is None, skipped=True,
                               skip_reason="no gradients accumulated: call forward_backward first (a skipped "
                                           "forward_backward discards the window)")
        grad_norm, clip = self._accum_norm, (self.config.max_grad_norm if adam is None else adam.grad_clip)
        if clip is not None and self._total_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(self.params, clip, self._total_norm, foreach=True)
        if adam is None:
            self.optimizer.step()
            self.scheduler.step()
        else:
            with adam_hyperparameters(self.optimizer, adam):
                self.optimizer.step()
        self._discard_window()
        self.step += 1
        liveness.bump("train_steps")
        return OptimReport(step=self.step, lr=lr, grad_norm=grad_norm, scheduled=adam is None)

    def train_step(self, batch: "TrainBatch | Mapping[str, object]") -> StepMetrics:
        """The fused step: `forward_backward` with the current loss, then `optim_step(None)`, bit for bit.

        Gradients accumulated by earlier `forward_backward` calls are part of it (the window closes here)."""
        t0 = time.perf_counter()
        lr = float(self.optimizer.param_groups[0]["lr"])
        fb = self.forward_backward(batch)
        opt = None if fb.skipped else self.optim_step(None)
        return StepMetrics.fused(fb, opt, lr, self.step, time.perf_counter() - t0)

    def require_closed_window(self, what: str) -> None:
        if self.accumulated:
            raise RuntimeError(f"{what}: {self.accumulated} forward_backward call(s) have gradients waiting for "
                               "optim_step; it would zero them. Call optim_step first")

    def dry_run_loss(self, spec: LossSpec, batch: "TrainBatch | Mapping[str, object]",
                     loss_kwargs: Mapping[str, object] | None) -> DryRunReport:
        self.require_closed_window("dry_run_loss")
        name, fn = resolve_loss(spec)
        batch = check_batch(batch)
        rng = rng_state()
        try:
            loss, metrics, _ = self.forward_loss_backward(batch, fn, name, dict(loss_kwargs or {}))
            result = DryRunReport(ok=True, loss=loss, metrics=metrics)
        except SkipStep as skip:
            result = DryRunReport(ok=False, reason=str(skip))
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            set_rng_state(rng)
        return result

    def forward_logprobs(self, batch: "TrainBatch | Mapping[str, object]") -> torch.Tensor:
        """The current policy's ``logprobs_B_T`` (float32, CPU, no grad) on ``batch``'s trained positions (0
        elsewhere): a forward only, nothing changes (accumulated gradients included)."""
        from forgelab.algos.packing import spans_from_mask

        batch = check_batch(batch)
        return self.logprobs(batch.tokens_B_L, spans_from_mask(batch.mask_B_T.cpu())) * (batch.mask_B_T != 0)

    def logprobs(self, tokens_B_L: object, spans_B_2: object = None) -> torch.Tensor:
        tokens_B_L = check_tokens(tokens_B_L)
        B = tokens_B_L.shape[0]
        spans_B_2 = check_spans(spans_B_2, tokens_B_L)
        with torch.no_grad():
            parts = [self._forward(tokens_B_L, mb, need_entropy=False, spans_B_2=spans_B_2)[0]
                     for mb in self._micro_batches(B)]
        return all_gather_rows(torch.cat(parts), B, self.world).float().cpu()

    # -- weights and checkpoints --------------------------------------------------------

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full HF-named weights (with LoRA: the base with the adapters merged in). Collective."""
        from forgelab.engines.lora_adapters import merged_hf_state_dict
        from forgelab.engines.titan import to_hf_state_dict

        return to_hf_state_dict(self.model, self.ckpt) if self.lora is None else merged_hf_state_dict(
            self.model, self.ckpt, self.lora)

    def push_state_dict(self) -> dict[str, torch.Tensor]:
        """What a weight push sends: the full HF weights, or with LoRA only the adapter (PEFT names). Collective."""
        from forgelab.engines.lora_adapters import peft_tensors

        return self.hf_state_dict() if self.lora is None else peft_tensors(self.model, self.ckpt)

    def export_adapter(self, path: str) -> str:
        """Write the adapter as a PEFT directory (rank 0 writes; every rank gathers). LoRA only."""
        from forgelab.engines.lora_adapters import export_adapter

        export_adapter(self.model, self.ckpt, self.lora, path, write=self.rank == 0)
        if self.world > 1:
            dist.barrier()
        return path

    def export_hf(self, path: str) -> str:
        from forgelab.engines.titan import save_hf

        sd = self.hf_state_dict()
        if self.rank == 0:
            save_hf(path, sd, self.ckpt)
        if self.world > 1:
            dist.barrier()
        return path

    def _optim_sd(self) -> tuple[OptimizerStateType, bool]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        fresh = not self.optimizer.state
        osd = get_optimizer_state_dict(self.model, self.optimizer)
        if fresh:
            # get_optimizer_state_dict initialises an empty AdamW state with a zero-lr
            # step (step count 1): undo it, or saving before the first step would
            # change the bias correction of every later step.
            self.optimizer.state.clear()
        return osd, fresh

    def save(self, path: str) -> str:
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        from forgelab.engines.lora_adapters import checkpoint_model_state, checkpoint_record

        osd, fresh = self._optim_sd()
        dcp_save({"model": checkpoint_model_state(self.model, self.lora), "optim": osd}, checkpoint_id=path)
        loss_spec = self.loss_spec
        if not isinstance(loss_spec, (str, PackedLoss)):
            loss_spec = pack_loss(loss_spec)
        extra = {
            "scheduler": self.scheduler.state_dict(), "step": self.step, "policy_version": self.policy_version,
            "optim_fresh": fresh, "loss": loss_spec, "loss_kwargs": self.loss_kwargs, "world": self.world,
            "rng": rng_state(), "lora": self.lora and checkpoint_record(self.lora, self.config.model_dir),
        }
        with open(os.path.join(path, _EXTRA_FILE.format(self.rank)), "wb") as f:
            pickle.dump(extra, f)
        if self.world > 1:
            dist.barrier()
        return path

    def load(self, path: str, with_optimizer: bool = True) -> dict[str, object]:
        """Restore a `save` checkpoint; ``with_optimizer`` False: the weights and the rest, but the AdamW moments
        start fresh (as a checkpoint saved before any step)."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        from forgelab.engines.lora_adapters import check_checkpoint_record, checkpoint_model_state, checkpoint_record

        own = os.path.join(path, _EXTRA_FILE.format(self.rank))
        extra_path = own if os.path.exists(own) else os.path.join(path, _EXTRA_FILE.format(0))
        if not os.path.exists(extra_path):
            raise FileNotFoundError(f"{path!r} is not a forgelab trainer checkpoint (no {_EXTRA_FILE.format(0)})")
        with open(extra_path, "rb") as f:
            extra = pickle.load(f)
        mine = None if self.lora is None else checkpoint_record(self.lora, self.config.model_dir)
        check_checkpoint_record(extra.get("lora"), mine, path)
        model_sd = checkpoint_model_state(self.model, self.lora)
        osd, _ = self._optim_sd()
        state = {"model": model_sd, "optim": osd}
        dcp_load(state, checkpoint_id=path)
        loaded_model, loaded_optim = state["model"], state["optim"]
        assert isinstance(loaded_model, dict) and isinstance(loaded_optim, dict)  # DCP loads into the dicts given
        missing, unexpected = self.model.load_state_dict(loaded_model, strict=self.lora is None)
        assert not unexpected, unexpected
        set_optimizer_state_dict(self.model, self.optimizer, loaded_optim)
        if extra["optim_fresh"] or not with_optimizer:
            self.optimizer.state.clear()
        self._discard_window()
        self.scheduler.load_state_dict(extra["scheduler"])
        self.step, self.policy_version = extra["step"], extra["policy_version"]
        self._apply_loss(extra["loss"], extra["loss_kwargs"])
        self._pending = None
        set_rng_state(extra["rng"])
        return self.info()

    def fingerprint(self) -> dict[str, object]:
        """SHA-256 of this rank's parameters and optimizer state, the schedule, step and lr (`state_fingerprint`)."""
        return {**state_fingerprint(self.model, self.params, self.optimizer, self.scheduler), "step": self.step}

    def info(self) -> dict[str, object]:
        n_params = sum(p.numel() for p in self.model.parameters())  # DTensor numel is the global size
        return {"rank": self.rank, "world": self.world, "device": str(self.device), "step": self.step,
                "policy_version": self.policy_version, "loss": self.loss_name, "loss_kwargs": dict(self.loss_kwargs),
                "family": self.ckpt.family, "params": int(n_params),
                "trainable_params": int(sum(p.numel() for p in self.params)), "lora": self.lora is not None,
                "base_passes": self.base_passes}
