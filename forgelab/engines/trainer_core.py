"""The trainer's state and step, without actors: model, optimizer, schedule, loss, checkpoints.

`forgelab.engines.trainer.Trainer` is a thin Monarch actor around `TrainerState`;
this module can be driven from any process group (a test under torchrun, a
single process). See `forgelab.engines.trainer` for the normalisation across ranks
and the fault rule; the code implementing both is `TrainerState.forward_loss_backward`.
"""
from __future__ import annotations

import math
import os
import pickle
import random
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["TrainerState", "WarmupCosine", "PackedLoss", "pack_loss", "resolve_loss", "check_tokens", "resolve_device"]

from forgelab.engines.trainer_support import (  # noqa: F401  (re-exported: forgelab.engines.trainer imports them from here)
    PackedLoss, WarmupCosine, local_tensor, rendezvous, rng_state, set_rng_state, sha256_hex, check_batch, check_spans,
    check_tokens, pack_loss, resolve_device, resolve_loss, sum_of_squares, token_values_of,
)

_EXTRA_FILE = "trainer_rank{}.pkl"


class SkipStep(Exception):
    """A step that must not change anything (see the fault rule)."""


class TrainerState:
    """Model, optimizer, schedule and loss of one trainer rank. Every method is collective over the group."""

    # -- construction ------------------------------------------------------------

    @classmethod
    def create(cls, config: Any, rank: int, world: int) -> "TrainerState":
        """Initialise the process group, build and shard the model, and the optimizer and schedule."""
        self = cls()
        self.config, self.rank, self.world = config, rank, world
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._init_process_group()
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        np.random.seed(config.seed)

        from forgelab.engines.titan import build_from_hf, checkpoint_blocks

        model, self.ckpt = build_from_hf(config.model_dir, device=self.device)
        self.lora = config.lora if config.lora.enabled else None
        if self.lora is not None:  # adapters on the frozen base (forgelab.engines.lora); before sharding
            from forgelab.engines.lora import add_adapters

            add_adapters(model, self.ckpt, self.lora, seed=config.seed)
        if config.checkpoints_activations():
            checkpoint_blocks(model)
        from forgelab.engines.precision import needs_mixed_precision

        if world > 1 or needs_mixed_precision(getattr(config, "dtype", "float32"), self.device.type):
            self._shard(model)  # FSDP2; with one rank too when model.dtype asks for 16-bit compute on CUDA
        self.model = model.train()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, betas=tuple(config.betas), eps=config.eps,
            weight_decay=config.weight_decay, foreach=True,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, WarmupCosine(config.warmup_steps, config.total_steps, config.min_lr_ratio)
        )
        self.step = 0
        self.policy_version = 0
        self.loss_spec, self.loss_name, self.loss_fn = None, "", None
        self._apply_loss(config.loss, dict(config.loss_kwargs))
        self._pending: tuple[Any, str, Callable, dict] | None = None
        return self

    def _init_process_group(self) -> None:
        timeout = timedelta(seconds=self.config.pg_timeout_s)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if dist.is_initialized():
            return
        if self.world == 1:
            # No peer: an in-memory store needs no port.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
            return
        if self.config.master_port is None:
            raise ValueError(
                "TrainerConfig.master_port is None with a multi-process trainer: spawn it with "
                "Trainer.options(procs=...).as_actor(config), which picks a free port, or set master_port"
            )
        store, pg_options = rendezvous(self.config.master_addr, self.config.master_port, self.rank, self.world,
                                        timeout, backend)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world, timeout=timeout,
                                pg_options=pg_options)

    def _shard(self, model: torch.nn.Module) -> None:
        """FSDP2 with torchtitan's decoder wrapping (one unit per block), fp32, gradients SUMMED over ranks."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule
        from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
        from torchtitan.distributed.utils import set_spmd_backend

        set_spmd_backend("partial_dtensor")
        mesh = init_device_mesh(self.device.type, (self.world,), mesh_dim_names=("fsdp",))
        from forgelab.engines.precision import fsdp_dtypes

        param_dtype, reduce_dtype = fsdp_dtypes(getattr(self.config, "dtype", "float32"), self.device.type)
        apply_fsdp_to_decoder(model, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype, pp_enabled=False)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # gloo has no AVG/PREMUL_SUM; and each rank's gradient is already its
                # share of the global loss's gradient, so the reduction is a plain sum.
                module.set_force_sum_reduction_for_comms(True)
                module.set_gradient_divide_factor(1.0)

    # -- loss swapping -------------------------------------------------------------

    def _apply_loss(self, spec: Any, kwargs: dict) -> None:
        self.loss_name, self.loss_fn = resolve_loss(spec)
        self.loss_spec, self.loss_kwargs = spec, kwargs

    def next_loss(self) -> tuple[str, Callable, dict]:
        """``(name, function, kwargs)`` of the loss the next `train_step` runs: a pending swap's, else the current."""
        if self._pending is not None:
            _, name, fn, kwargs = self._pending
            return name, fn, dict(kwargs)
        return self.loss_name, self.loss_fn, dict(self.loss_kwargs)

    def set_loss(self, spec: Any, loss_kwargs: dict | None) -> str:
        if loss_kwargs is not None and not isinstance(loss_kwargs, dict):
            raise ValueError(f"set_loss: loss_kwargs must be a dict or None, got {type(loss_kwargs).__name__}")
        name, fn = resolve_loss(spec)  # fail now, not at the next step
        self._pending = (spec, name, fn, dict(loss_kwargs or {}))
        return name

    def swap_run_state(self, saved: dict | None) -> dict:
        """This rank's run fields (loss, pending swap, step, version, config, token values), then ``saved``'s
        installed (None: kept): what a LoRA slot owns beside its tensors (`forgelab.engines.lora_slots`)."""
        names = {k: k for k in ("loss_spec", "loss_name", "loss_fn", "loss_kwargs", "step", "policy_version", "config")}
        names["pending"] = "_pending"
        mine = {k: getattr(self, a) for k, a in names.items()} | {"token_values": getattr(self, "token_values", None)}
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
                 spans_B_2: torch.Tensor | None = None):
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
        if dummy:  # an empty view still back-propagates (zeros) through the model
            return logprobs_R_T[:0], (None if entropy_R_T is None else entropy_R_T[:0])
        return logprobs_R_T, entropy_R_T

    def _all_gather_rows(self, local_R_T: torch.Tensor, B: int) -> torch.Tensor:
        """Concatenate every rank's rows (contiguous blocks) into ``[B, T]``."""
        if self.world == 1:
            return local_R_T
        sizes = [len(b) for b in torch.arange(B).tensor_split(self.world)]
        pad = max(sizes)
        buf = torch.zeros((pad, *local_R_T.shape[1:]), dtype=local_R_T.dtype, device=local_R_T.device)
        buf[: local_R_T.shape[0]] = local_R_T
        out = [torch.empty_like(buf) for _ in range(self.world)]
        dist.all_gather(out, buf)
        return torch.cat([o[:n] for o, n in zip(out, sizes)])

    def _any(self, flag: bool) -> bool:
        if self.world == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def sum_across_ranks(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(t)
        return t.tolist()

    # -- the step ------------------------------------------------------------------

    def forward_loss_backward(self, batch: dict, fn: Callable, name: str, kwargs: dict) -> tuple[float, dict, float]:
        """Accumulate ``dL/dtheta`` of the global-batch loss into ``.grad``; ``(loss, metrics, grad_norm)``.

        Raises `SkipStep` (on every rank together) when the loss or the gradients are unusable.
        """
        from forgelab.algos.importance import truncated_is_weights
        from forgelab.algos.losses import validate_loss_output
        from forgelab.algos.packing import spans_from_mask

        dev = self.device
        tokens = batch["tokens_B_L"]
        B = tokens.shape[0]
        mask_B_T = batch["mask_B_T"].float().to(dev)
        gen_B_T = batch["generator_logprobs_B_T"].float().to(dev)
        adv_B = batch["advantages_B"].float().to(dev)
        ref = batch.get("ref_logprobs_B_T")
        ref_B_T = None if ref is None else ref.float().to(dev)
        micro = self._micro_batches(B)
        rows = torch.cat(micro)
        spans_B_2 = spans_from_mask(batch["mask_B_T"].cpu())  # only masked positions enter the loss
        ref_from_base = ref_B_T is None and self.lora is not None and self.lora.reference == "base"
        if ref_from_base:  # LoRA: a batch without reference logprobs gets the base model's (adapters off)
            ref_B_T = self.base_logprobs(tokens, spans_B_2).to(dev)

        # Pass 1: this rank's logprobs (keeping the graph when there is one micro-batch).
        graphs, parts, ents = [], [], []
        keep_graph = len(micro) == 1
        for i, mb in enumerate(micro):
            with torch.set_grad_enabled(keep_graph), self._dropout(i):
                lp, ent = self._forward(tokens, mb, need_entropy=True, spans_B_2=spans_B_2)
            graphs.append(lp if keep_graph else None)
            parts.append(lp.detach())
            ents.append(ent)
        local_lp = torch.cat(parts)
        ent_local = torch.cat(ents)
        m_local = mask_B_T[rows]
        e_sum, e_cnt = self.sum_across_ranks([float((ent_local * m_local).sum()), float(m_local.sum())])
        metrics: dict[str, Any] = {"entropy": e_sum / max(e_cnt, 1.0), "n_tokens": e_cnt, "n_seqs": float(B),
                                   **({"ref_from_base": 1.0} if ref_from_base else {})}

        # The loss of the global batch, identical on every rank.
        lp_leaf = self._all_gather_rows(local_lp, B).detach().requires_grad_(True)
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
                     ref_logprobs_B_T=ref_B_T, is_weights_B_T=is_w, **kwargs)
            loss_t, loss_metrics = validate_loss_output(out, name, require_grad=True)
            metrics.update(loss_metrics)
            loss_t.backward()
            grad_B_T = lp_leaf.grad if lp_leaf.grad is not None else torch.zeros_like(lp_leaf)
        except Exception as e:  # a user's loss may raise anything: it must skip, not desynchronise ranks
            reason = f"loss {name!r}: {type(e).__name__}: {e}".strip()
        if self._any(bool(reason)):
            raise SkipStep(reason or "another rank's loss failed")
        loss_value = float(loss_t.detach())
        self.token_values = token_values_of(lp_leaf.detach(), self._all_gather_rows(ent_local, B), gen_B_T, mask_B_T,
                                            adv_B, is_w, name, kwargs, metrics)  # per token, and mismatch metrics

        # Pass 2: back-propagate this rank's slice of dL/dlogprobs through the model.
        for i, mb in enumerate(micro):
            # the adapter-dropout mask of pass 1, also for blocks recomputed in backward (activation checkpointing)
            with self._dropout(i):
                lp = graphs[i] if keep_graph else self._forward(tokens, mb, need_entropy=False, spans_B_2=spans_B_2)[0]
                if len(mb) == 0:
                    lp.sum().backward()  # zero-valued: keeps this rank in the FSDP reduce-scatter
                else:
                    lp.backward(grad_B_T[mb].to(dev))
        del graphs

        grad_norm = self._grad_norm()
        if self._any(not math.isfinite(grad_norm)):
            raise SkipStep(f"non-finite gradients (grad_norm={grad_norm}) from loss {name!r}")
        return loss_value, metrics, grad_norm

    def _dropout(self, micro_index: int):
        """Adapter dropout for one micro-batch's training passes (`forgelab.engines.lora.step_dropout`)."""
        from forgelab.engines.lora import step_dropout

        return step_dropout(self.model, self.lora, self.config.seed, self.step, self.rank, micro_index)

    def base_logprobs(self, tokens_B_L: Any, spans_B_2: Any = None) -> torch.Tensor:
        """`logprobs` of the base model (adapters off): the free reference, every row on every rank. LoRA only."""
        from forgelab.engines.lora import adapters_disabled

        if self.lora is None:
            raise ValueError("base_logprobs: this trainer has no LoRA adapters; its base is its policy "
                             "(use a ReferenceModel for a frozen copy)")
        with adapters_disabled(self.model):
            return self.logprobs(tokens_B_L, spans_B_2)

    def _grad_norm(self) -> float:
        """The global L2 norm of the gradients (float64 sum of squares: `sum_of_squares`)."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return 0.0
        sharded = [g for g in grads if isinstance(g, DTensor)]  # FSDP2: Shard(0), each element on one rank
        sq = sum_of_squares([g for g in grads if not isinstance(g, DTensor)]).to(self.device)
        sq_sharded = sum_of_squares(sharded).to(self.device)
        if sharded and self.world > 1:
            dist.all_reduce(sq_sharded)
        total = (sq + sq_sharded).sqrt()
        self._total_norm = total.to(grads[0].dtype)
        return float(total)

    def train_step(self, batch: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        if self._pending is not None:  # the step boundary: a swap never lands mid-step
            spec, name, fn, kwargs = self._pending
            self.loss_spec, self.loss_name, self.loss_fn, self.loss_kwargs = spec, name, fn, kwargs
            self._pending = None
        batch = check_batch(batch)
        lr = float(self.optimizer.param_groups[0]["lr"])
        try:
            loss, metrics, grad_norm = self.forward_loss_backward(batch, self.loss_fn, self.loss_name, self.loss_kwargs)
        except SkipStep as skip:
            self.optimizer.zero_grad(set_to_none=True)
            return {"skipped": 1, "skip_reason": str(skip), "step": self.step, "lr": lr,
                    "step_time_s": time.perf_counter() - t0}
        if self.config.max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.config.max_grad_norm, self._total_norm, foreach=True)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {**metrics, "loss": loss, "grad_norm": grad_norm, "lr": lr, "step": self.step, "skipped": 0,
                "step_time_s": time.perf_counter() - t0, "loss_name": self.loss_name}

    def dry_run_loss(self, spec: Any, batch: Any, loss_kwargs: dict | None) -> dict[str, Any]:
        name, fn = resolve_loss(spec)
        batch = check_batch(batch)
        rng = rng_state()
        try:
            loss, metrics, _ = self.forward_loss_backward(batch, fn, name, dict(loss_kwargs or {}))
            result = {"ok": True, "reason": "", "loss": loss, "metrics": metrics}
        except SkipStep as skip:
            result = {"ok": False, "reason": str(skip), "loss": float("nan"), "metrics": {}}
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            set_rng_state(rng)
        return result

    def logprobs(self, tokens_B_L: Any, spans_B_2: Any = None) -> torch.Tensor:
        tokens_B_L = check_tokens(tokens_B_L)
        B = tokens_B_L.shape[0]
        spans_B_2 = check_spans(spans_B_2, tokens_B_L)
        with torch.no_grad():
            parts = [self._forward(tokens_B_L, mb, need_entropy=False, spans_B_2=spans_B_2)[0]
                     for mb in self._micro_batches(B)]
        return self._all_gather_rows(torch.cat(parts), B).float().cpu()

    # -- weights and checkpoints --------------------------------------------------------

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full HF-named weights (with LoRA: the base with the adapters merged in). Collective."""
        from forgelab.engines.lora import merged_hf_state_dict
        from forgelab.engines.titan import to_hf_state_dict

        return to_hf_state_dict(self.model, self.ckpt) if self.lora is None else merged_hf_state_dict(
            self.model, self.ckpt, self.lora)

    def push_state_dict(self) -> dict[str, torch.Tensor]:
        """What a weight push sends: the full HF weights, or with LoRA only the adapter (PEFT names). Collective."""
        from forgelab.engines.lora import peft_tensors

        return self.hf_state_dict() if self.lora is None else peft_tensors(self.model, self.ckpt)

    def export_adapter(self, path: str) -> str:
        """Write the adapter as a PEFT directory (rank 0 writes; every rank gathers). LoRA only."""
        from forgelab.engines.lora import export_adapter

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

    def _optim_sd(self) -> tuple[dict, bool]:
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
        import torch.distributed.checkpoint as dcp

        from forgelab.engines.lora import checkpoint_model_state, checkpoint_record

        osd, fresh = self._optim_sd()
        dcp.save({"model": checkpoint_model_state(self.model, self.lora), "optim": osd}, checkpoint_id=path)
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

    def load(self, path: str) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        from forgelab.engines.lora import check_checkpoint_record, checkpoint_model_state, checkpoint_record

        own = os.path.join(path, _EXTRA_FILE.format(self.rank))
        extra_path = own if os.path.exists(own) else os.path.join(path, _EXTRA_FILE.format(0))
        if not os.path.exists(extra_path):
            raise FileNotFoundError(f"{path!r} is not a forgelab trainer checkpoint (no {_EXTRA_FILE.format(0)})")
        with open(extra_path, "rb") as f:
            extra = pickle.load(f)
        check_checkpoint_record(extra.get("lora"), self.lora and checkpoint_record(self.lora, self.config.model_dir), path)
        model_sd = checkpoint_model_state(self.model, self.lora)
        osd, _ = self._optim_sd()
        state = {"model": model_sd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        missing, unexpected = self.model.load_state_dict(state["model"], strict=self.lora is None)
        assert not unexpected, unexpected
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        if extra["optim_fresh"]:
            self.optimizer.state.clear()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.load_state_dict(extra["scheduler"])
        self.step, self.policy_version = extra["step"], extra["policy_version"]
        self._apply_loss(extra["loss"], extra["loss_kwargs"])
        self._pending = None
        set_rng_state(extra["rng"])
        return self.info()

    def fingerprint(self) -> dict[str, Any]:
        params = [local_tensor(v) for _, v in sorted(self.model.state_dict().items())]
        opt = []
        for p in self.params:
            for k, v in sorted(self.optimizer.state.get(p, {}).items()):
                opt.append(local_tensor(v) if isinstance(v, torch.Tensor) else torch.tensor(float(v)))
        return {
            "params": sha256_hex(params), "optim": sha256_hex(opt), "optim_entries": len(opt),
            "scheduler": repr(sorted(self.scheduler.state_dict().items())), "step": self.step,
            "lr": float(self.optimizer.param_groups[0]["lr"]),
        }

    def info(self) -> dict[str, Any]:
        n_params = sum(p.numel() for p in self.model.parameters())  # DTensor numel is the global size
        return {"rank": self.rank, "world": self.world, "device": str(self.device), "step": self.step,
                "policy_version": self.policy_version, "loss": self.loss_name, "loss_kwargs": dict(self.loss_kwargs),
                "family": self.ckpt.family, "params": int(n_params),
                "trainable_params": int(sum(p.numel() for p in self.params)), "lora": self.lora is not None}
