"""Adapter slots in the trainer: several runs' LoRA adapters, optimizer states and run states in one process.

    table = SlotTable(state)                  # the trainer's fresh adapters become the template of new slots
    table.new("a", trainer_config)            # a run attaches: its own adapters (fresh), optimizer, schedule, loss
    table.copy("a", "b")                      # a fork: b starts from a's exact state (no disk)
    await slot_call(actor, "b", "train_step", (batch,), {})   # b's tensors in the model, then the step
    await TrainerClient(SlotTrainerHandle(handle, "b")).train_step(batch)   # the same, typed, from the controller
    await TrainerClient(SlotTrainerHandle(handle, "b")).train_export(batch, 4)  # SlotStep: step, values, adapter
    table.free("b")

What it really is: one model, one AdamW, one LR schedule (`TrainerState`); a slot is a saved copy of
everything that belongs to one run: the adapter parameters (the base is frozen and shared), the AdamW
moments and step counts, the schedule's position and its shape (lr, warmup, total steps), the loss (with a
pending swap), step, policy version, the trainer config (seed, clipping, IS cap), the last step's token
values, and the gradients a `forward_backward` accumulated (a slot's window stays open across other slots' calls). `activate` swaps a slot in: the active slot's adapter values are copied out, the requested one's copied in
(adapter-sized copies: 0.4 MiB per slot on the shipped model's rank-8 adapters); the AdamW moments and step
counts, and the gradients, are not copied but handed over (each slot owns its tensors: the optimizer's
per-parameter state entries are moved out of and into ``optimizer.state``, the update runs in place on them),
and a call in the slot already active swaps nothing. The trainer actor delivers
one call at a time, so a call runs entirely in its slot; a NaN loss or a raising loss skips that slot's step
only (`TrainerState.train_step`'s fault rule), the others' state is untouched.

A controller step is one call (``train_export``: the fused step, the batch's token values and the adapter
exported, a `SlotStep`); the controller hands the adapter to the generator itself
(`forgelab.weights.sync.WeightSync.deliver_adapter`), so no slot waits for another's adapter to load.
`SlotTable.calls` counts the calls per endpoint, ``swaps`` the swaps.

Steps run one slot after another (N slots: N trainer steps); the base forward and backward are not shared
between slots in one pass (mLoRA-style per-row adapters are not implemented here).
"""
from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, SupportsFloat, SupportsInt, TypedDict, cast

import torch
from monarch.actor import endpoint

from forgelab.engines.contracts import SlotStep, TrainBatch, WeightPush
from forgelab.engines.trainer import Trainer
from forgelab.engines.trainer_client import SlotList
from forgelab.engines.trainer_optim import set_schedule_peak
from forgelab.engines.trainer_state import TrainerState

if TYPE_CHECKING:
    from forgelab.config.components import TrainerConfig
    from forgelab.engines.generator_slots import SlotGenerator

__all__ = ["SlotTable", "SlotTrainer", "SavedSlot", "slot_call", "set_peak_lr", "SLOT_CALLS"]

#: Trainer endpoints that run inside a slot (`Trainer.in_slot`); anything else is refused.
SLOT_CALLS = frozenset({"train_step", "train_export", "forward_backward", "optim_step", "forward_logprobs", "token_values", "set_loss", "dry_run_loss", "compare_losses", "logprobs",
                        "base_logprobs", "info", "fingerprint", "save", "load", "set_lr", "export_adapter",
                        "export_hf", "push_weights"})


class SavedSlot(TypedDict):
    """One slot while another is active: deep copies of what belongs to its run."""

    params: list[torch.Tensor]
    """The adapter parameters, in ``TrainerState.params`` order."""
    grads: list[torch.Tensor | None]
    """Their accumulated gradients (None: none yet), an open ``forward_backward`` window's."""
    optim: list[dict[str, object] | None]
    """Per parameter (``TrainerState.params`` order), its ``optimizer.state`` entry: the AdamW moments and step
    count, the slot's own tensors (None: no step yet)."""
    groups: list[dict[str, object]]
    """The optimizer's param groups without their params: lr, betas, eps, weight decay, initial lr."""
    sched: dict[str, object]
    """``scheduler.state_dict()``: the schedule's position and shape."""
    run: dict[str, object]
    """The run fields, as `TrainerState.swap_run_state` returns and installs them."""


def set_peak_lr(state: TrainerState, lr: float) -> float:
    """Make ``lr`` the peak learning rate of ``state`` (a `TrainerState`) from now on, keeping the schedule's
    position; returns the current lr."""
    from dataclasses import replace

    state.config = replace(state.config, lr=float(lr))
    return set_schedule_peak(state.optimizer, state.scheduler, lr)


def _copy_run(run: Mapping[str, object]) -> dict[str, object]:
    """``run`` (`TrainerState.swap_run_state`'s fields) with its mutable values copied: the loss keywords (a
    dict, or None: empty) and the trainer config."""
    kwargs = run["loss_kwargs"]
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"LoRA slot: loss_kwargs must be a dict, got {type(kwargs).__name__}")
    return {**run, "loss_kwargs": dict(kwargs or {}), "config": copy.deepcopy(run["config"])}


def _groups(state: TrainerState) -> list[dict[str, object]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in state.optimizer.param_groups]


def _capture(state: TrainerState) -> SavedSlot:
    """A deep copy of the active slot's tensors and run fields (the trainer keeps them)."""
    return {"params": [p.detach().clone() for p in state.params],
            "grads": [None if p.grad is None else p.grad.detach().clone() for p in state.params],
            "optim": [copy.deepcopy(state.optimizer.state[p]) if p in state.optimizer.state else None
                      for p in state.params],
            "groups": copy.deepcopy(_groups(state)),
            "sched": copy.deepcopy(state.scheduler.state_dict()),
            "run": _copy_run(state.swap_run_state(None))}


def _take(state: TrainerState) -> SavedSlot:
    """The active slot out of the trainer: its adapter values copied, its AdamW state entries and gradients
    moved out (the next `_install` gives the trainer another slot's); no deep copy."""
    opt = state.optimizer
    saved: SavedSlot = {"params": [p.detach().clone() for p in state.params],
                        "grads": [p.grad for p in state.params],
                        "optim": [opt.state.pop(p, None) for p in state.params],
                        "groups": _groups(state),
                        "sched": copy.deepcopy(state.scheduler.state_dict()),  # a few numbers; lists it keeps
                        "run": state.swap_run_state(None)}
    for p in state.params:
        p.grad = None
    return saved


def _install(state: TrainerState, saved: SavedSlot) -> None:
    """``saved`` becomes the trainer's: adapter values copied in, AdamW state entries, gradients, hyperparameters,
    schedule and run fields handed over (``saved`` is the slot's own: `SlotTable` drops it after)."""
    with torch.no_grad():
        for p, t in zip(state.params, saved["params"]):
            p.copy_(t)
    opt = state.optimizer
    for p, entry in zip(state.params, saved["optim"]):
        opt.state.pop(p, None)
        if entry is not None:
            opt.state[p] = entry
    for group, hyper in zip(opt.param_groups, saved["groups"]):
        group.update(hyper)
    for p, grad in zip(state.params, saved.get("grads") or [None] * len(state.params)):
        p.grad = grad  # an open forward_backward window goes on
    state.scheduler.load_state_dict(saved["sched"])
    state.swap_run_state(saved["run"])


class SlotTable:
    """The slots of one trainer process. Args: state: its `TrainerState` (LoRA), whose current adapters (fresh,
    as `add_adapters` drew them) are the template every new slot starts from."""

    def __init__(self, state: TrainerState):
        if getattr(state, "lora", None) is None:
            raise ValueError("LoRA slots need a LoRA trainer (lora.enabled): a full-parameter run keeps its own "
                             "processes")
        self.state = state
        self.fresh = _capture(state)
        self.saved: dict[str, SavedSlot] = {}
        self.active: str | None = None
        self.swaps = 0
        self.swap_s = 0.0
        self.calls: Counter[str] = Counter()
        """Calls run in a slot, by endpoint name (`slot_call`)."""

    @property
    def names(self) -> list[str]:
        return sorted({*self.saved, *([self.active] if self.active else [])})

    def _check(self, slot: str, exists: bool = True) -> None:
        present = slot == self.active or slot in self.saved
        if exists and not present:
            raise KeyError(f"LoRA slot {slot!r} does not exist (slots: {self.names}); attach a run to create it")
        if not exists and present:
            raise ValueError(f"LoRA slot {slot!r} is in use; free it first")

    def activate(self, slot: str) -> None:
        """Put ``slot``'s adapters, optimizer, schedule and run state into the trainer (no-op if it is there)."""
        self._check(slot)
        if slot == self.active:
            return
        t0 = time.perf_counter()
        if self.active is not None:
            self.saved[self.active] = _take(self.state)
        else:  # a freed slot's values may still be in the trainer: nothing of theirs may reach this one's
            self.state.optimizer.state.clear()
            for p in self.state.params:
                p.grad = None
        _install(self.state, self.saved.pop(slot))
        self.active = slot
        self.swaps += 1
        self.swap_s += time.perf_counter() - t0

    def new(self, slot: str, config: TrainerConfig) -> SlotList:
        """A new slot from the fresh adapters, with ``config``'s (a `TrainerConfig`) loss, lr and schedule."""
        from forgelab.engines.loss_specs import resolve_loss
        from forgelab.engines.trainer_optim import WarmupCosine

        self._check(slot, exists=False)
        if config.lora != self.state.config.lora:
            raise ValueError(f"LoRA slot {slot!r}: lora config {config.lora} differs from the shared trainer's "
                             f"{self.state.config.lora}; variants on shared engines use the same adapter shape")
        saved = copy.deepcopy(self.fresh)
        sched = torch.optim.lr_scheduler.LambdaLR(  # a throwaway optimizer: only the schedule's state is kept
            torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=config.lr),
            WarmupCosine(config.warmup_steps, config.total_steps, config.min_lr_ratio))
        saved["sched"] = sched.state_dict()
        for g in saved["groups"]:
            g.update(lr=float(sched.get_last_lr()[0]), initial_lr=float(config.lr), betas=tuple(config.betas),
                     eps=config.eps, weight_decay=config.weight_decay)
        name, fn = resolve_loss(config.loss)
        saved["run"] = {**saved["run"], "loss_spec": config.loss, "loss_name": name, "loss_fn": fn,
                        "loss_kwargs": dict(config.loss_kwargs), "pending": None, "step": 0, "policy_version": 0,
                        "config": copy.deepcopy(config), "token_values": None,
                        "accumulated": 0, "accum_norm": float("nan"), "total_norm": None}
        saved["grads"] = [None] * len(saved["params"])
        self.saved[slot] = saved
        return {"slot": slot, "slots": self.names}

    def copy(self, src: str, dst: str) -> SlotList:
        """``dst`` becomes an exact copy of ``src`` (adapters, optimizer, schedule, loss, step, version)."""
        self._check(src)
        self._check(dst, exists=False)
        self.saved[dst] = _capture(self.state) if src == self.active else copy.deepcopy(self.saved[src])
        return {"slot": dst, "slots": self.names}

    def free(self, slot: str) -> SlotList:
        """Forget ``slot`` (its run detached)."""
        self._check(slot)
        if slot == self.active:
            self.active = None  # the model keeps its tensors until another slot is activated
        else:
            del self.saved[slot]
        return {"slot": slot, "slots": self.names}

    def stats(self) -> dict[str, object]:
        return {"slots": self.names, "active": self.active, "swaps": self.swaps, "swap_s": self.swap_s,
                "calls": dict(self.calls), "base_passes": self.state.base_passes}


def _set_lr(state: TrainerState, lr: object) -> float:
    """`Trainer.set_lr` in a slot."""
    if not isinstance(lr, SupportsFloat):
        raise TypeError(f"set_lr: lr must be a number, got {type(lr).__name__}")
    return set_peak_lr(state, float(lr))


def _compare_losses(state: TrainerState, specs: object, batch: object) -> dict[str, object]:
    """`Trainer.compare_losses` in a slot."""
    from forgelab.engines.loss_compare import compare_on_state

    if not isinstance(specs, Sequence):
        raise TypeError(f"compare_losses: specs must be a list of losses, got {type(specs).__name__}")
    if not isinstance(batch, (TrainBatch, Mapping)):
        raise TypeError(f"compare_losses: batch must be a TrainBatch, got {type(batch).__name__}")
    return compare_on_state(state, specs, batch)


async def _push_slot(actor: Trainer, slot: str, version: object, generators: object, transport: object = None
                     ) -> WeightPush:
    """The active slot's adapter (PEFT names) to each generator mesh's ``update_adapter_slot(slot, version, ...)``:
    only this slot's adapter changes there; the other slots' requests go on. Adapters travel as messages.
    ``version``: an int; ``generators``: a list of `SlotGenerator` meshes, or of handles whose ``actor`` is one
    (as `Trainer.push_weights`); ``transport`` is accepted for that endpoint's signature and unused."""
    import asyncio

    if not isinstance(version, SupportsInt) or not isinstance(generators, Sequence):
        raise TypeError(f"push_weights: expected (version: int, generators: list), got "
                        f"({type(version).__name__}, {type(generators).__name__})")

    state = actor.state
    t0 = time.perf_counter()
    sd = state.push_state_dict()
    gather_ms = (time.perf_counter() - t0) * 1e3
    send_ms, sent = 0.0, 0
    failed: dict[int, str] = {}
    transports: list[str | None] = []
    if state.rank == 0 and generators:
        t1 = time.perf_counter()
        # Monarch meshes are opaque at run time; typed as the actor class, as `ProcMesh.spawn` types them
        meshes = [cast("SlotGenerator", getattr(g, "actor", g)) for g in generators]
        results = await asyncio.gather(*(m.update_adapter_slot.call(slot, int(version), sd) for m in meshes),
                                       return_exceptions=True)
        send_ms = (time.perf_counter() - t1) * 1e3
        for i, r in enumerate(results):
            if isinstance(r, BaseException):
                failed[i] = f"{type(r).__name__}: {str(r)[-800:]}"
                transports.append(None)
            else:
                sent += 1
                transports.append("message")
    state.policy_version = int(version)
    return WeightPush(version=int(version), gather_ms=gather_ms, send_ms=send_ms,
                      bytes=sum(v.numel() * v.element_size() for v in sd.values()), sent=sent, failed=failed,
                      transport="message" if sent else "none", transports=transports)


def _train_export(state: TrainerState, batch: object, version: object) -> SlotStep:
    """One controller step of the active slot in one call: `TrainerState.train_step`, the batch's token values,
    and (step not skipped) the adapter exported as ``version`` (an int), copied so the next slot's swap cannot
    reach it."""
    if not isinstance(version, SupportsInt) or not isinstance(batch, (TrainBatch, Mapping)):
        raise TypeError(f"train_export: expected (batch: TrainBatch, version: int), got "
                        f"({type(batch).__name__}, {type(version).__name__})")
    m = state.train_step(batch)
    if m.skipped:
        return SlotStep(metrics=m, version=state.policy_version)
    t0 = time.perf_counter()
    adapter = {k: v.clone() for k, v in state.push_state_dict().items()}
    state.policy_version = int(version)
    return SlotStep(metrics=m, token_values=state.token_values, adapter=adapter, version=int(version),
                    export_ms=(time.perf_counter() - t0) * 1e3)


async def slot_call(actor: SlotTrainer, slot: str, name: str, args: tuple[object, ...], kwargs: dict[str, object]
                    ) -> object:
    """Trainer endpoint ``name`` run with ``slot`` active (`Trainer.in_slot`); ``actor`` is the Trainer actor.

    ``args`` and ``kwargs`` are the endpoint's own arguments, typed where `forgelab.engines.trainer_client.TrainerClient`
    sends them; here they are checked at run time (a call by name, as Monarch delivers it)."""
    if name not in SLOT_CALLS:
        raise ValueError(f"Trainer.in_slot: {name!r} does not run in a LoRA slot (those that do: {sorted(SLOT_CALLS)})")
    table = actor.slot_table()
    table.activate(slot)
    table.calls[name] += 1
    state = actor.state
    if name == "train_export":
        return _train_export(state, *args, **kwargs)
    if name == "token_values":
        return state.token_values
    if name == "set_lr":
        return _set_lr(state, *args, **kwargs)
    if name == "compare_losses":
        return _compare_losses(state, *args, **kwargs)
    if name == "push_weights":
        return await _push_slot(actor, slot, *args, **kwargs)
    return getattr(state, name)(*args, **kwargs)  # a TrainerState method: the endpoint of that name delegates to it


class SlotTrainer(Trainer):
    """A `Trainer` holding several runs in LoRA slots (`SlotTable`); a run's calls go through `in_slot`."""

    slots: SlotTable | None = None

    def slot_table(self) -> SlotTable:
        """This process's slots (made on first use; a `reinit` starts a new table from its fresh adapters)."""
        table = self.slots
        if table is None or table.state is not self.state:
            self.slots = table = SlotTable(self.state)
        return table

    @endpoint
    async def in_slot(self, slot: str, name: str, args: Sequence[object] = (),
                      kwargs: Mapping[str, object] | None = None) -> object:
        """Endpoint ``name`` (one of `SLOT_CALLS`) run with ``slot``'s adapters, optimizer and run state."""
        return await slot_call(self, slot, name, tuple(args), dict(kwargs or {}))

    @endpoint
    async def slot_new(self, slot: str, config: TrainerConfig) -> SlotList:
        """A new slot from the fresh adapters with ``config``'s (a `TrainerConfig`) loss, lr and schedule."""
        config.validate()
        return self.slot_table().new(slot, config)

    @endpoint
    async def slot_copy(self, src: str, dst: str) -> SlotList:
        """``dst`` becomes an exact copy of ``src`` (a fork into a slot, no disk)."""
        return self.slot_table().copy(src, dst)

    @endpoint
    async def slot_free(self, slot: str) -> SlotList:
        return self.slot_table().free(slot)

    @endpoint
    async def slot_stats(self) -> dict[str, object]:
        return self.slot_table().stats()
