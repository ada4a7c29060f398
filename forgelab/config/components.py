"""The component configs: what the generator, trainer, reference model and environment actors are built from.

Plain dataclasses with no torch, vLLM or Monarch import, so `forgelab.config.run_config` (which
derives its YAML sections from them), `forgelab check` and `forgelab plan` load in
well under a second. The actor modules re-export them (`forgelab.engines.generator.GeneratorConfig`,
`forgelab.engines.trainer.TrainerConfig`, `forgelab.envs.actor.EnvActorConfig`).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Protocol

from forgelab.envs.episode import EnvActorConfig  # noqa: F401 -- re-exported: the envs section derives from it

__all__ = ["LOGPROBS_MODES", "PackedLossLike", "SamplingConfig", "GeneratorConfig", "WEIGHT_TRANSPORTS", "TrainerConfig",
           "ReferenceConfig", "TeacherConfig", "EnvActorConfig", "LoraConfig", "LORA_TARGETS", "LORA_REFERENCES", "check_lora_targets"]

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
UPDATE_MODES = ("drain", "inflight")
"""How a generator loads a weight push (`GeneratorConfig.update_mode`, forgelab.weights.receiver)."""


class PackedLossLike(Protocol):
    """A loss packed by value to cross a process boundary: `forgelab.engines.loss_specs.PackedLoss`, which
    `forgelab.engines.spawn.component_configs` puts in `TrainerConfig.loss` in place of a function (or of a
    notebook's own LOSSES entry). Written here as a protocol because this layer sits below the engines."""

    @property
    def name(self) -> str:
        """The loss's name (a function's ``__name__``, or the LOSSES key it was registered under)."""
        ...

    def unpack(self) -> Callable[..., object]:
        """The loss function, unpickled."""
        ...


# --- LoRA (shared by the trainer and the generator) -----------------------------

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections a LoRA adapter may target (HF and PEFT names); the default targets all of them."""
LORA_REFERENCES = ("base", "process")
_LORA_REFUSED = {
    "lm_head": "forgelab computes logprobs from lm_head.weight in chunks without calling its forward, so an "
               "adapter there would never be applied",
    "embed_tokens": "embedding adapters are not supported (PEFT's lora_embedding_A/B layout)",
}


def check_lora_targets(targets, where: str = "lora.targets") -> tuple[str, ...]:
    """``targets`` as a tuple, or ValueError naming the bad one and the valid names."""
    if isinstance(targets, str) or not isinstance(targets, (list, tuple)) or not targets:
        raise ValueError(f"{where}: expected a non-empty list of projection names from {list(LORA_TARGETS)}, "
                         f"got {targets!r}")
    for t in targets:
        if t in _LORA_REFUSED:
            raise ValueError(f"{where}: {t!r} cannot be a LoRA target: {_LORA_REFUSED[t]}; "
                             f"choose from {list(LORA_TARGETS)}")
        if t not in LORA_TARGETS:
            import difflib

            near = difflib.get_close_matches(str(t), LORA_TARGETS, n=1)
            raise ValueError(f"{where}: {t!r} is not a projection of the model"
                             + (f"; did you mean {near[0]!r}?" if near else "")
                             + f" (valid: {list(LORA_TARGETS)}, HF names as in PEFT)")
    if len(set(targets)) != len(targets):
        raise ValueError(f"{where}: {list(targets)} names a projection twice")
    return tuple(targets)


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds a rank-``rank`` adapter."""
    allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks
    for r in allowed:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank ({allowed[-1]})")


@dataclass(kw_only=True)
class LoraConfig:
    """LoRA adapters instead of full fine-tuning (forgelab.engines.lora_adapters); off unless ``enabled``.

    With LoRA the trainer trains (and checkpoints) only the adapters, a weight push sends only the adapter
    (PEFT format) and the generator serves it with vLLM's LoRA support on top of the unchanged base.
    """

    enabled: bool = False
    """Train LoRA adapters on a frozen base; False: full fine-tuning (nothing below is used)."""
    rank: int = 8
    """r: rank of each adapter (A is [r, in], B is [out, r])."""
    alpha: float = 16.0
    """Scaling numerator: the update is (alpha / rank) * B @ A."""
    dropout: float = 0.0
    """Probability of zeroing an adapter's input element in training forward passes (0: none)."""
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Projections that get an adapter in every layer (HF names); the output projection and embeddings cannot."""
    reference: str = "base"
    """"base": the reference logprobs are the base model's, computed by the trainer with the adapters off
    (no reference process is spawned); "process": a separate reference process (placement.reference), for a
    reference that is not the base."""

    def validate(self, where: str = "lora") -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"{where}.enabled must be true or false, got {self.enabled!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 1 <= self.rank <= 512:
            raise ValueError(f"{where}.rank must be an integer in [1, 512] (vLLM serves ranks up to 512), "
                             f"got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"{where}.alpha must be a positive number, got {self.alpha!r}")
        if not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1):
            raise ValueError(f"{where}.dropout must be in [0, 1), got {self.dropout!r}")
        check_lora_targets(self.targets, f"{where}.targets")
        if self.reference not in LORA_REFERENCES:
            raise ValueError(f"{where}.reference must be one of {LORA_REFERENCES}, got {self.reference!r}")


@dataclass(kw_only=True)
class SamplingConfig:
    """Sampling settings of one `generate` call (vLLM conventions)."""

    temperature: float = 1.0
    """Softmax temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables it."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or -1) disables it (vLLM 0.32 convention)."""
    max_tokens: int = 32
    """Most tokens generated per completion."""
    stop_token_ids: list[int] | None = None
    """Extra token ids that end a completion (the model's eos always does)."""
    min_tokens: int = 0
    """Fewest tokens generated before eos or a stop token may end a completion (vLLM ``min_tokens``)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit before sampling (vLLM ``logit_bias``), e.g. a negative one on eos
    for longer completions. Recorded logprobs stay the model's own (``raw_logprobs``)."""

    def validate(self, where: str = "SamplingConfig") -> None:
        if not self.temperature >= 0:
            raise ValueError(f"{where}.temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{where}.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"{where}.top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"{where}.max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.stop_token_ids is not None and not all(isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(f"{where}.stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"{where}.min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if self.logit_bias is not None and not (isinstance(self.logit_bias, dict) and all(
                isinstance(k, int) and isinstance(v, (int, float)) and math.isfinite(v) for k, v in self.logit_bias.items())):
            raise ValueError(f"{where}.logit_bias must map token ids (ints) to finite numbers, got {self.logit_bias!r}")

    def to_vllm(self, seed: int | None = None):
        """One-sample `vllm.SamplingParams` returning the sampled token's logprob.

        No `seed` by default: one fixed seed for every request makes them all replay the
        same random stream. Deterministic runs pass a different seed per sample instead.
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens,
            stop_token_ids=list(self.stop_token_ids or []),
            min_tokens=self.min_tokens,
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            logprobs=0,  # 0 extra top tokens: the sampled token's logprob only
            output_kind=RequestOutputKind.FINAL_ONLY,
            seed=seed,
        )


@dataclass(kw_only=True)
class GeneratorConfig:
    """How to build the generator's vLLM engine."""

    model_dir: str
    """HF checkpoint directory (config.json, *.safetensors, tokenizer)."""
    dtype: str = "float32"
    """Weights and activations dtype ("float32", "bfloat16", "float16")."""
    max_model_len: int = 512
    """Longest prompt + completion, in tokens."""
    kv_cache_gib: float = 1.0
    """CPU only: KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE, set before vLLM is imported)."""
    gpu_memory_utilization: float = 0.3
    """CUDA only: fraction of GPU memory vLLM may take (weights + KV cache)."""
    enforce_eager: bool = True
    """No torch.compile / CUDA graphs: starts in seconds; set False for speed on GPUs."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of shared prompt prefixes (a GRPO group shares its whole prompt)."""
    block_size: int | None = None
    """KV block size in tokens. Prefix caching shares whole blocks only, and vLLM's CPU
    default (128) is longer than the toy prompts, so None means 32 on CPU (the CPU
    attention kernel takes multiples of 32 only) and vLLM's default on CUDA."""
    max_num_seqs: int = 256
    """Most sequences in one engine step (the continuous batch)."""
    admission_window_ms: float = 2.0
    """Before a step, wait until no new request arrived for this long (at most 4 windows):
    Monarch hands an actor one call at a time, so concurrent calls trickle in and
    would otherwise each start their own step. 0 disables it."""
    device: str = "auto"
    """"auto" (cuda if available, else cpu), "cuda" or "cpu"."""
    logprobs_mode: str = "raw_logprobs"
    """"raw_logprobs": log pi(token) at temperature 1 (what RL wants);
    "processed_logprobs": after temperature / top-k / top-p."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Default sampling of `generate` calls that pass none."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """With ``lora.enabled``: vLLM serves LoRA adapters (a weight push sends the adapter only)."""
    max_loras: int = 1
    """With LoRA: most adapters in one engine batch (vLLM ``max_loras``)."""
    update_mode: str = "drain"
    """How a weight push is loaded (forgelab.weights.receiver). "drain": stop taking requests, let the running
    ones finish on the old weights, load, reset the prefix cache. "inflight": load between two engine steps
    while requests keep generating; a completion's later tokens come from the new weights (its
    `token_versions` say where) and the prefix cache is reset when the engine is next idle (until then new
    requests may reuse blocks computed by older weights: their logprobs are still the ones sampled with).
    Full weights only: LoRA adapter pushes always drain."""

    def validate(self) -> None:
        if not self.model_dir or not os.path.isfile(os.path.join(self.model_dir, "config.json")):
            raise ValueError(
                f"GeneratorConfig.model_dir={self.model_dir!r} is not an HF checkpoint directory "
                "(no config.json there); pass e.g. forgelab/assets/tiny-llama"
            )
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ValueError(f"GeneratorConfig.dtype must be float32, bfloat16, float16 or auto, got {self.dtype!r}")
        for name in ("max_model_len", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GeneratorConfig.{name} must be a positive integer, got {value!r}")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size < 1):
            raise ValueError(f"GeneratorConfig.block_size must be a positive integer or None, got {self.block_size!r}")
        if not self.admission_window_ms >= 0:
            raise ValueError(f"GeneratorConfig.admission_window_ms must be >= 0, got {self.admission_window_ms!r}")
        if not self.kv_cache_gib > 0:
            raise ValueError(f"GeneratorConfig.kv_cache_gib must be > 0 GiB, got {self.kv_cache_gib!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"GeneratorConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"GeneratorConfig.device must be auto, cpu or cuda, got {self.device!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"GeneratorConfig.logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        self.sampling.validate("GeneratorConfig.sampling")
        self.lora.validate("GeneratorConfig.lora")
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"GeneratorConfig.max_loras must be a positive integer, got {self.max_loras!r}")
        if self.update_mode not in UPDATE_MODES:
            raise ValueError(f"GeneratorConfig.update_mode (generator.update_mode) must be one of {UPDATE_MODES}, "
                             f"got {self.update_mode!r}")
        if self.update_mode == "inflight" and self.lora.enabled:
            raise ValueError("generator.update_mode 'inflight' loads full weights between engine steps; with LoRA "
                             "each request is bound to the adapter it started with (vLLM), so adapter pushes "
                             "cannot apply in flight: set generator.update_mode to 'drain' or turn lora off")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


# --- trainer and reference ---------------------------------------------------

WEIGHT_TRANSPORTS = ("auto", "message")
"""Names of forgelab.weights.sender.TRANSPORTS (kept here so configs load without torch; a test checks they agree)."""
SHARE_PROMPTS = ("auto", "on", "off")
"""Values of TrainerConfig/ReferenceConfig.share_prompts (forgelab.algos.packing)."""


@dataclass(kw_only=True)
class TrainerConfig:
    """Everything a `Trainer` needs; placement (procs, hosts, GPUs) is the caller's `options(...)`."""

    model_dir: str
    """HF model directory (config.json, safetensors, tokenizer) to start from."""
    dtype: str = "float32"
    """``"float32"``, ``"bfloat16"`` or ``"float16"``. On CUDA a 16-bit dtype trains with FSDP2 mixed precision
    (16-bit parameters in forward/backward, float32 master weights and gradient reductions); CPU trains in float32."""
    lr: float = 1e-5
    """Peak AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    warmup_steps: int = 0
    """Linear warmup from ``lr / warmup_steps`` to ``lr`` over this many steps."""
    total_steps: int | None = None
    """With a value: cosine decay from ``lr`` to ``min_lr_ratio * lr`` at this step; None: constant after warmup."""
    min_lr_ratio: float = 0.0
    """Final LR as a fraction of ``lr`` (cosine schedule only)."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this; None: no clipping (the norm is still reported)."""
    loss: str | Callable | PackedLossLike = "grpo"
    """A name in ``forgelab.algos.losses.LOSSES`` or a loss function (see that module for the signature); in the
    config a trainer process is spawned with, a function travels packed by value (a `PackedLossLike`)."""
    loss_kwargs: dict = field(default_factory=dict)
    """Hyperparameters passed to the loss (a built-in loss refuses unknown ones, naming them: forgelab.algos.loss_checks)."""
    is_cap: float | None = None
    """Truncated importance-sampling cap ``C`` (weights ``min(pi_trainer/pi_gen, C)``); None: off."""
    is_level: str = "token"
    """Truncated IS granularity: ``"token"``, ``"sequence"`` or ``"geometric"``."""
    micro_batch_size: int | None = None
    """Rows per forward/backward on each rank (gradient accumulation); None: all local rows at once."""
    logits_chunk: int = 256
    """Tokens projected onto the vocabulary at a time for logprobs/entropy (forward and backward): the trainer
    never holds more than this many rows of full-vocabulary logits (forgelab.algos.logprobs.chunked_logprobs_entropy)."""
    share_prompts: str = "auto"
    """Rows that share a prompt (a GRPO group) run it through the model once, packed with a dense attention mask
    (forgelab.algos.packing): ``"auto"`` packs when that runs at most 80 % of the plain batch's tokens, ``"on"``
    always, ``"off"`` never. Logprobs and gradients are the same either way, up to float rounding."""
    max_pack_len: int = 1024
    """Longest packed sequence (prompt + completions); a larger group is split over several packs."""
    seed: int = 0
    """Seeds torch, python and numpy on every rank."""
    device: str = "auto"
    """``"auto"`` (CUDA when visible, else CPU), ``"cpu"`` or ``"cuda"``."""
    pg_timeout_s: float = 60.0
    """Process-group timeout: a collective waiting on a dead or absent peer fails after this."""
    master_port: int | None = None
    """TCP port of the process-group rendezvous (rank 0's host); None: `Trainer.options(...).as_actor` picks a free one."""
    master_addr: str = "127.0.0.1"
    """Address of rank 0 for the rendezvous (change it for multi-host meshes)."""
    weight_transport: str = "auto"
    """How `push_weights` reaches generators: ``"auto"`` writes the weights once to a shared-memory
    file and sends each generator a small handle, falling back to messages for generators that
    cannot see the file (another host); ``"message"`` sends the tensors in every generator's message."""
    shm_dir: str | None = None
    """Folder (a tmpfs) for ``"auto"``'s per-trainer weights directory; None: ``/dev/shm`` (no fast path
    when it is missing). The directory is removed when the trainer process exits."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """With ``lora.enabled``: train LoRA adapters on the frozen base (forgelab.engines.lora_adapters)."""
    activation_checkpointing: bool | str = "auto"
    """Keep only each decoder block's input for backward and recompute the block there: activation memory
    drops from every layer's intermediates to one block's, for about one more forward pass per step.
    ``"auto"``: on with LoRA (the frozen base has no gradients or optimizer state, so the activations are
    most of what a LoRA step adds: on the Qwen3-0.6B shape at 4 x 256 tokens they are ~4 GiB of a 9 GiB
    peak), off for full fine-tuning (where weights, gradients and AdamW dominate); True / False force it."""

    def checkpoints_activations(self) -> bool:
        """Whether the trainer recomputes each block in backward (`activation_checkpointing` resolved)."""
        if self.activation_checkpointing == "auto":
            return bool(self.lora.enabled)
        return bool(self.activation_checkpointing)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        def bad(name: str, why: str) -> None:
            raise ValueError(f"TrainerConfig.{name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.model_dir, str) or not self.model_dir:
            bad("model_dir", "must be a HF model directory path")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0 and math.isfinite(self.lr)):
            bad("lr", "must be a positive finite number")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            bad("betas", "must be two numbers in [0, 1)")
        if not self.eps > 0:
            bad("eps", "must be positive")
        if self.weight_decay < 0:
            bad("weight_decay", "must be >= 0")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            bad("warmup_steps", "must be an int >= 0")
        if self.total_steps is not None and (not isinstance(self.total_steps, int) or self.total_steps <= self.warmup_steps):
            bad("total_steps", f"must be None or an int > warmup_steps ({self.warmup_steps})")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            bad("min_lr_ratio", "must be in [0, 1]")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            bad("max_grad_norm", "must be positive or None")
        if isinstance(self.loss, str):
            from forgelab.algos.losses import LOSSES

            if self.loss not in LOSSES:
                bad("loss", f"is not a registered loss; choose one of {sorted(LOSSES)} or pass a function")
        elif not callable(self.loss) and not hasattr(self.loss, "unpack"):  # a function or a PackedLoss
            bad("loss", "must be a loss name or a callable")
        if not isinstance(self.loss_kwargs, dict):
            bad("loss_kwargs", "must be a dict")
        if self.is_cap is not None and not self.is_cap > 0:
            bad("is_cap", "must be positive or None (off)")
        if self.is_level not in ("token", "sequence", "geometric"):
            bad("is_level", "must be 'token', 'sequence' or 'geometric'")
        if self.micro_batch_size is not None and (not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 1):
            bad("micro_batch_size", "must be None or a positive int")
        if self.device not in ("auto", "cpu", "cuda"):
            bad("device", "must be 'auto', 'cpu' or 'cuda'")
        if self.share_prompts not in SHARE_PROMPTS:
            bad("share_prompts", f"must be one of {SHARE_PROMPTS}")
        if not isinstance(self.max_pack_len, int) or self.max_pack_len < 2:
            bad("max_pack_len", "must be an int >= 2 (tokens)")
        if not self.pg_timeout_s > 0:
            bad("pg_timeout_s", "must be positive (seconds)")
        if self.master_port is not None and not (isinstance(self.master_port, int) and 0 < self.master_port < 65536):
            bad("master_port", "must be None or a TCP port number")
        if not (isinstance(self.activation_checkpointing, bool) or self.activation_checkpointing == "auto"):
            bad("activation_checkpointing", "must be true, false or 'auto' (on with LoRA, off otherwise)")
        if self.weight_transport not in WEIGHT_TRANSPORTS:
            bad("weight_transport", f"must be one of {WEIGHT_TRANSPORTS}")
        if self.shm_dir is not None and not os.path.isdir(self.shm_dir):
            bad("shm_dir", "must be None (/dev/shm) or an existing folder, ideally a tmpfs")
        self.lora.validate("TrainerConfig.lora")


@dataclass(kw_only=True)
class ReferenceConfig:
    """A frozen reference policy (for KL penalties)."""

    model_dir: str
    """HF model directory, usually the trainer's starting point."""
    dtype: str = "float32"
    """Compute dtype on CUDA (the trainer's forward dtype, so logprobs match); CPU computes in float32."""
    device: str = "auto"
    """``"auto"``, ``"cpu"`` or ``"cuda"``."""
    micro_batch_size: int | None = None
    """Rows per forward pass; None: the whole request at once."""
    share_prompts: str = "auto"
    """Rows that share a prompt (a GRPO group) run it through the model once, packed with a dense attention mask
    (forgelab.algos.packing): ``"auto"`` packs when that runs at most 80 % of the plain batch's tokens, ``"on"``
    always, ``"off"`` never. Logprobs and gradients are the same either way, up to float rounding."""
    max_pack_len: int = 1024
    """Longest packed sequence (prompt + completions); a larger group is split over several packs."""

    def validate(self) -> None:
        if not isinstance(self.model_dir, str) or not self.model_dir:
            raise ValueError(f"ReferenceConfig.model_dir={self.model_dir!r}: must be a HF model directory path")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"ReferenceConfig.device={self.device!r}: must be 'auto', 'cpu' or 'cuda'")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"ReferenceConfig.micro_batch_size={self.micro_batch_size!r}: must be None or >= 1")
        if self.share_prompts not in SHARE_PROMPTS:
            raise ValueError(f"ReferenceConfig.share_prompts={self.share_prompts!r}: must be one of {SHARE_PROMPTS}")
        if not isinstance(self.max_pack_len, int) or self.max_pack_len < 2:
            raise ValueError(f"ReferenceConfig.max_pack_len={self.max_pack_len!r}: must be an int >= 2 (tokens)")


@dataclass(kw_only=True)
class TeacherConfig:
    """On-policy distillation's teacher (`teacher:` in YAML): a frozen model that scores every token the
    student samples. Each token's advantage gains ``coef * (teacher logprob - student logprob)`` (the negative
    per-token reverse KL; `forgelab.algos.advantages.distill_advantages`), added to the reward advantage;
    ``rollout.advantage: none`` distils alone. `run.set_distill_coef` changes ``coef`` live.

    The teacher runs in a logprob service like the reference's (the same actor); when `model_dir` is the
    run's own model and a reference process runs, the reference's process serves it (no second process).
    The teacher and the student must share a tokenizer (checked at start)."""

    model_dir: str | None = None
    """HF model directory of the teacher; None: no teacher (no distillation)."""
    coef: float = 1.0
    """Weight of the per-token distillation term (the reward advantage's weight is 1); live via run.set_distill_coef."""
    replicas: int = 1
    """Teacher service replicas (a process each), placed like the reference's (`hosts.reference`'s mesh)."""
    device: str = "auto"
    """``"auto"``, ``"cpu"`` or ``"cuda"``."""
    micro_batch_size: int | None = None
    """Rows per forward pass; None: the whole request at once."""
    share_prompts: str = "auto"
    """As `ReferenceConfig.share_prompts`."""

    @property
    def enabled(self) -> bool:
        return self.model_dir is not None

    def reference_config(self, dtype: str) -> ReferenceConfig:
        """The config of the logprob service that serves this teacher."""
        return ReferenceConfig(model_dir=str(self.model_dir), dtype=dtype, device=self.device,
                               micro_batch_size=self.micro_batch_size, share_prompts=self.share_prompts)

    def validate(self, student_dir: str) -> None:
        """Raise ValueError naming the field; with a teacher, its directory and tokenizer are checked against
        the student's (`student_dir`)."""
        if not self.enabled:
            return
        if not isinstance(self.model_dir, str) or not os.path.isfile(os.path.join(self.model_dir, "config.json")):
            raise ValueError(f"teacher.model_dir={self.model_dir!r}: not an HF model directory (no config.json); "
                             "point it at a checkpoint, e.g. one `forgelab.recipes.distill_teacher()` made")
        if not (isinstance(self.coef, (int, float)) and math.isfinite(self.coef)):
            raise ValueError(f"teacher.coef={self.coef!r}: must be a finite number")
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"teacher.replicas={self.replicas!r}: must be an int >= 1")
        self.reference_config("float32").validate()
        from forgelab.data.tokenizer import tokenizer_mismatch

        why = tokenizer_mismatch(student_dir, self.model_dir)
        if why is not None:
            raise ValueError(f"teacher.model_dir={self.model_dir!r} does not share the student's tokenizer "
                             f"({student_dir!r}): {why}. The teacher scores the student's token ids, so both must "
                             "use one tokenizer: pick a teacher trained from the same base or tokenizer")


# --- environment actors ---------------------------------------------------------

