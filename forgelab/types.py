"""Plain dataclasses that cross process boundaries.

`Completion` and `Episode` carry token ids and logprobs as Python lists (cheap
to pickle, no tensor storage to share) and are the token-in/token-out contract
between the generator, the controller and the trainer: nothing downstream
re-tokenizes text to train on it.

The trainer's contract (issue #38) follows: `TrainBatch` in (what
`forgelab.algos.batching.collate` builds), `StepMetrics`, `LossReport`,
`OptimReport`, `TokenValues`, `DryRunReport`, `WeightPush`, `SlotStep` out, `AdamParams` for
one optimizer step. Every tensor's name carries its shape (``B`` rows, ``L``
tokens, ``T = L - 1`` target positions: position ``t`` predicts
``tokens_B_L[:, t + 1]``) and its docstring the dtype. The trainer's endpoints
(`forgelab.engines.trainer.Trainer`) take and return them, and the controller
calls them with typed methods (`forgelab.engines.trainer_client`).

**Compatibility (one release).** The trainer's objects also answer
``obj["name"]`` / ``obj.get("name")`` with the keys the dict answers of earlier
releases had (`StepMetrics.as_row`), so code written against them keeps working;
new code reads the fields.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # torch is imported where a tensor is built, not by every reader of these types
    import torch


@dataclass
class Completion:
    """One sampled continuation of a prompt, exactly as the generator produced it.

    `logprobs[i]` is the sampling logprob (natural log, under the generator's
    weights `policy_version`) of `completion_ids[i]`.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length" | ...
    policy_version: int
    prompt: str = ""
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    token_versions: list[tuple[int, int]] = field(default_factory=list)
    """The policy version of each token, run-length: ``(version, first token index)`` pairs in order, the
    first at index 0 with `policy_version` (the oldest). One pair unless a weight update landed while this
    completion was generated (``generator.update_mode: inflight``); empty means all `policy_version`."""
    prompt_logprobs: list[float | None] | None = None
    """With prompt logprobs asked for (a sampling setting whose ``to_vllm`` sets ``prompt_logprobs=0``): the logprob of
    each prompt token given the ones before it (None for the first); None when not asked for."""
    top_logprobs: list[dict[int, float]] | None = None
    """With k > 0 top logprobs asked for (a sampling setting whose ``to_vllm`` sets ``logprobs=k``): for each
    completion token, the k most likely tokens at its position and their logprobs (the agent door's
    ``top_logprobs``); None when not asked for."""
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    """With prompt logprobs and k > 0 top logprobs asked for (the agent door's ``echo`` with ``logprobs=k``): for
    each prompt token, the k most likely tokens at its position and their logprobs (None for the first)."""


@dataclass
class Episode:
    """A scored completion on its way to the trainer.

    `loss_mask` (over `completion_ids`) is 1 on generated tokens and 0 on tokens
    an environment inserted (multi-turn); None means every completion token is
    generated. `generator_logprobs` has one entry per completion token (0.0 on
    environment tokens).
    """

    id: int
    group_id: int
    prompt_ids: list[int]
    completion_ids: list[int]
    generator_logprobs: list[float]
    policy_version: int
    reward: float = 0.0
    reward_parts: dict[str, float] = field(default_factory=dict)
    advantage: float = 0.0
    ref_logprobs: list[float] | None = None
    prompt: str = ""
    completion: str = ""
    target: str = ""
    task: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    finish_reason: str = ""
    loss_mask: list[int] | None = None
    teacher_logprobs: list[float] | None = None
    """On-policy distillation: the teacher's logprob of each completion token (None: no teacher)."""
    token_advantages: list[float] | None = None
    """A per-token advantage, one per completion token (None: `advantage` for every token). Distillation sets
    ``advantage + coef * (teacher_logprob - generator_logprob)`` (`forgelab.algos.advantages.distill_advantages`)."""
    train_values: dict[str, Any] | None = None
    """The trainer's per-token view once trained (`forgelab.algos.token_truth`): ``trainer_logprobs``,
    ``entropy``, ``is_weight`` (None: no IS), ``clipped`` (None: the loss's rule is unknown), one value per
    completion token, and ``step``, the step that trained it."""


# --- the trainer's contract (issue #38) --------------------------------------------------------

REQUIRED_BATCH_KEYS = ("tokens_B_L", "mask_B_T", "generator_logprobs_B_T", "advantages_B")


class _ByKey:
    """Read access by key (``obj["loss"]``, ``obj.get(...)``, ``in``, ``keys()``, ``items()``) for callers written
    against the dict answers of earlier releases; the keys are `_row()`'s."""

    def _row(self) -> Mapping[str, object]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def __getitem__(self, key: str) -> object:
        row = self._row()
        if key not in row:
            raise KeyError(f"{type(self).__name__} has no {key!r}; it has {sorted(row)}")
        return row[key]

    def get(self, key: str, default: object = None) -> object:
        return self._row().get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._row()

    def keys(self) -> Iterator[str]:
        return iter(self._row())

    def items(self) -> Iterator[tuple[str, object]]:
        return iter(self._row().items())


# --- inputs ------------------------------------------------------------------------------


@dataclass(kw_only=True)
class TrainBatch(_ByKey):
    """A padded training batch aligned to target positions (`forgelab.algos.batching.collate` builds it).

    Every rank of the trainer receives the whole batch; each trains its contiguous block of rows.
    """

    tokens_B_L: torch.Tensor
    """int64 ``[B, L]``: prompt then completion token ids, right-padded."""
    mask_B_T: torch.Tensor
    """float32 ``[B, T]``: 1.0 on trained completion tokens (times an episode's ``loss_mask``), 0 elsewhere."""
    generator_logprobs_B_T: torch.Tensor
    """float32 ``[B, T]``: the sampler's logprob of each target token (the "old" logprobs); 0 off the mask."""
    advantages_B: torch.Tensor
    """float32 ``[B]`` (one per sequence) or ``[B, T]`` (per token, on target positions; 0 off the mask)."""
    ref_logprobs_B_T: torch.Tensor | None = None
    """float32 ``[B, T]``: the reference model's logprobs (KL terms); None without a reference."""
    policy_version_B: torch.Tensor | None = None
    """int64 ``[B]``: the policy version each row was sampled with (bookkeeping; not read by the step)."""
    episode_id_B: torch.Tensor | None = None
    """int64 ``[B]``: each row's episode id (bookkeeping; not read by the step)."""
    loss_inputs_B_T: dict[str, torch.Tensor] = field(default_factory=dict)
    """Further per-token loss inputs by keyword (float32 ``[B, T]`` on target positions, e.g. a supervised
    loss's ``weights_B_T``): passed to the loss function as keyword arguments; empty for the RL losses."""

    @property
    def B(self) -> int:
        return int(self.tokens_B_L.shape[0])

    @property
    def T(self) -> int:
        return int(self.tokens_B_L.shape[1]) - 1

    def _row(self) -> Mapping[str, object]:
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "loss_inputs_B_T"}
        return {**row, **self.loss_inputs_B_T}

    @classmethod
    def coerce(cls, batch: "TrainBatch | Mapping[str, object]") -> "TrainBatch":
        """``batch`` as a `TrainBatch`; a mapping with the old dict keys (earlier releases' ``collate``, hand-built
        test batches) is converted, unknown tensor keys going to `loss_inputs_B_T`."""
        if isinstance(batch, TrainBatch):
            return batch
        if not isinstance(batch, Mapping):
            raise ValueError(f"train_step: batch must be a TrainBatch from forgelab.algos.batching.collate, "
                             f"got {type(batch).__name__}")
        missing = [k for k in REQUIRED_BATCH_KEYS if batch.get(k) is None]
        if missing:
            raise ValueError(f"train_step: batch lacks {missing}; build it with forgelab.algos.batching.collate")
        names = {f.name for f in dataclasses.fields(cls)} - {"loss_inputs_B_T"}
        known = {k: v for k, v in batch.items() if k in names}
        import torch

        extra = {k: v for k, v in batch.items() if k not in names and isinstance(v, torch.Tensor)}
        return cls(**known, loss_inputs_B_T=extra)  # type: ignore[arg-type]


class _AdamConfig(Protocol):
    """The optimizer fields of a `forgelab.config.components.TrainerConfig`."""

    lr: float
    betas: tuple[float, float] | list[float]
    eps: float
    weight_decay: float
    max_grad_norm: float | None


@dataclass(frozen=True, kw_only=True)
class AdamParams:
    """AdamW hyperparameters for one optimizer step (`Trainer.optim_step`), as Tinker's ``AdamParams``."""

    lr: float
    """Learning rate of this step (not scaled by the trainer's schedule)."""
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float | None = None
    """Clip the global gradient L2 norm to this before the step; None: no clipping."""

    def __post_init__(self) -> None:
        if not (self.lr >= 0.0 and self.eps > 0.0 and self.weight_decay >= 0.0
                and all(0.0 <= b < 1.0 for b in self.betas) and len(self.betas) == 2):
            raise ValueError(f"AdamParams: need lr >= 0, eps > 0, weight_decay >= 0 and two betas in [0, 1); "
                             f"got {self}")
        if self.grad_clip is not None and not self.grad_clip > 0.0:
            raise ValueError(f"AdamParams.grad_clip must be > 0 or None (no clipping), got {self.grad_clip}")

    @classmethod
    def from_config(cls, config: _AdamConfig, lr: float | None = None) -> "AdamParams":
        """The trainer config's hyperparameters (its peak lr unless ``lr``)."""
        b1, b2 = config.betas
        return cls(lr=float(config.lr if lr is None else lr), betas=(float(b1), float(b2)), eps=float(config.eps),
                   weight_decay=float(config.weight_decay), grad_clip=config.max_grad_norm)


# --- outputs -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LossReport(_ByKey):
    """What one `Trainer.forward_backward` did: the loss on its batch and the gradients accumulated so far.

    A skipped call (the loss raised or was not finite, or the accumulated gradients are not finite) discards the
    WHOLE accumulation window: every gradient accumulated since the last optimizer step is zeroed (``accumulated``
    is 0 after it), because a non-finite contribution cannot be taken back out of the sum. The optimizer step
    that follows then has nothing to apply and is itself skipped (no optimizer or schedule step).
    """

    loss: float
    """The loss of this batch (nan when skipped)."""
    loss_name: str
    grad_norm: float
    """Global L2 norm of the gradients accumulated so far (this call's included); nan when skipped."""
    accumulated: int
    """Forward-backward calls whose gradients await the next optimizer step (this one included; 0 when skipped)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The step's numbers: ``entropy``, ``n_tokens``, ``n_seqs``, the importance-sampling and sampler-mismatch
    metrics and the loss's own metrics, by name."""
    skipped: bool = False
    skip_reason: str = ""

    def _row(self) -> Mapping[str, object]:
        return {**self.metrics, "loss": self.loss, "grad_norm": self.grad_norm, "loss_name": self.loss_name,
                "accumulated": self.accumulated, "skipped": int(self.skipped),
                **({"skip_reason": self.skip_reason} if self.skipped else {})}


@dataclass(frozen=True, kw_only=True)
class OptimReport(_ByKey):
    """What one `Trainer.optim_step` did."""

    step: int
    """The trainer's optimizer step count after this call."""
    lr: float
    """The learning rate this step used (for a skipped step: the one it would have used)."""
    grad_norm: float
    """Global L2 norm of the applied gradients before clipping (nan when skipped)."""
    scheduled: bool
    """True when the trainer's schedule chose the hyperparameters (and advanced); False for a call's own."""
    skipped: bool = False
    skip_reason: str = ""


@dataclass(frozen=True, kw_only=True)
class StepMetrics(_ByKey):
    """What a fused `Trainer.train_step` did (= `forward_backward` then `optim_step`, bit for bit)."""

    step: int
    """The trainer's optimizer step count after this step (unchanged when skipped)."""
    lr: float
    """The learning rate the step used (or would have used)."""
    step_time_s: float
    skipped: bool = False
    skip_reason: str = ""
    loss: float = float("nan")
    grad_norm: float = float("nan")
    loss_name: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    """``entropy``, ``n_tokens``, ``n_seqs``, importance-sampling, sampler-mismatch and the loss's own metrics."""

    def as_row(self) -> dict[str, float | int | str]:
        """The flat metrics of earlier releases' dict answer (the metrics CSV's trainer columns):
        ``{**metrics, loss, grad_norm, lr, step, skipped, step_time_s, loss_name}``; a skipped step gives
        ``{skipped, skip_reason, step, lr, step_time_s}``."""
        if self.skipped:
            return {"skipped": 1, "skip_reason": self.skip_reason, "step": self.step, "lr": self.lr,
                    "step_time_s": self.step_time_s}
        return {**self.metrics, "loss": self.loss, "grad_norm": self.grad_norm, "lr": self.lr, "step": self.step,
                "skipped": 0, "step_time_s": self.step_time_s, "loss_name": self.loss_name}

    def scalars(self) -> dict[str, float]:
        """The numeric entries of `as_row` as floats (what a metrics row takes)."""
        return {k: float(v) for k, v in self.as_row().items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def _row(self) -> Mapping[str, object]:
        return self.as_row()

    @classmethod
    def fused(cls, fb: LossReport, opt: OptimReport | None, lr: float, step: int, step_time_s: float) -> "StepMetrics":
        """The fused step's answer from its two pieces' (``opt`` None: the forward-backward skipped)."""
        if fb.skipped or opt is None or opt.skipped:
            reason = fb.skip_reason if fb.skipped else (opt.skip_reason if opt is not None else "skipped")
            return cls(step=step, lr=lr, step_time_s=step_time_s, skipped=True, skip_reason=reason)
        return cls(step=opt.step, lr=opt.lr, step_time_s=step_time_s, loss=fb.loss, grad_norm=fb.grad_norm,
                   loss_name=fb.loss_name, metrics=dict(fb.metrics))


@dataclass(frozen=True, kw_only=True)
class TokenValues(_ByKey):
    """The trainer's view of every token of the last batch it trained (issue #28), CPU ``[B, T]`` tensors."""

    trainer_logprobs_B_T: torch.Tensor
    """float32: each target token's logprob under the weights being trained (before the update)."""
    entropy_B_T: torch.Tensor
    """float32: the policy's entropy at each position."""
    mask_B_T: torch.Tensor
    """float32: the batch's mask."""
    is_weights_B_T: torch.Tensor | None = None
    """float32: the importance weight used (None: no importance sampling)."""
    clipped_B_T: torch.Tensor | None = None
    """float32 0/1: whether the loss clipped the token (None: a loss whose clipping rule is unknown)."""


@dataclass(frozen=True, kw_only=True)
class DryRunReport(_ByKey):
    """`Trainer.dry_run_loss`: a loss tried on a batch with nothing changed after."""

    ok: bool
    reason: str = ""
    loss: float = float("nan")
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class WeightPush(_ByKey):
    """The trainer's answer to `Trainer.push_weights` (the controller's `forgelab.weights.sync.PushReport` is
    built from it). Times in milliseconds; indices are positions in the list of generators it was given."""

    version: int
    gather_ms: float = 0.0
    write_ms: float = 0.0
    send_ms: float = 0.0
    bytes: int = 0
    sent: int = 0
    failed: dict[int, str] = field(default_factory=dict)
    transport: str = "none"
    """"shm", "message", "mixed" or "none"."""
    transports: list[str | None] = field(default_factory=list)
    """Per generator: "shm", "message", or None when it failed."""
    fallback: dict[int, str] = field(default_factory=dict)
    """Generators that got a message instead of shared memory, and why."""

    @classmethod
    def of(cls, raw: "WeightPush | Mapping[str, object]", version: int = 0) -> "WeightPush":
        """``raw`` as a `WeightPush` (a mapping: the dict answer of earlier releases; ``version`` if it has none)."""
        if isinstance(raw, WeightPush):
            return raw
        names = {f.name for f in dataclasses.fields(cls)}
        fields_ = {"version": version, **{k: v for k, v in raw.items() if k in names}}
        return cls(**fields_)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True)
class SlotStep:
    """One LoRA slot's step in one trainer call (`forgelab.engines.trainer_slots`, ``train_export``): the fused
    step, the trained batch's token values, and the adapter after the step, exported for the generator (the
    controller hands it over: `forgelab.weights.sync.WeightSync.deliver_adapter`), so the trainer is not held
    while the generator loads it."""

    metrics: StepMetrics
    token_values: TokenValues | None = None
    """The batch's per-token values (None when the step was skipped)."""
    adapter: dict[str, torch.Tensor] | None = None
    """The adapter after the step, PEFT names, CPU copies (None when the step was skipped)."""
    version: int
    """The policy version the adapter is (the trainer's ``policy_version`` after the call)."""
    export_ms: float = 0.0
    """Time the trainer spent gathering the adapter (milliseconds)."""
