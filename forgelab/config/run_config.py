"""Run configuration: small dataclasses, loadable from YAML, validated before any process starts.

    cfg = RunConfig.from_yaml("configs/addition.yaml")
    cfg = RunConfig(train=TrainConfig(steps=50), rollout=RolloutConfig(task="addition"))

Every error names the field (dotted path), the bad value and what to do.
A config is plain data: re-running a notebook cell builds a fresh one, and
nothing is held in module globals.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The checkpoint forgelab ships (made by `python -m forgelab.recipes.tiny_model`).
SHIPPED_MODEL = str(Path(__file__).resolve().parent.parent / "assets" / "tiny-llama")


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field."""


# The component sections (generator, trainer, reference, envs) are derived from the actors' own config
# dataclasses: see forgelab/config/sections.py. Importing them loads torch and monarch (~2 s).
from forgelab.config.components import LoraConfig  # noqa: E402
from forgelab.config.sections import (  # noqa: E402
    EnvsSection,
    GeneratorSection,
    ReferenceSection,
    TrainerSection,
    build_component,
    shared_owner,
)


@dataclass(kw_only=True)
class ModelConfig:
    path: str = SHIPPED_MODEL
    """HF checkpoint directory (config.json, safetensors, tokenizer). Default: the shipped tiny model."""
    dtype: str = "float32"
    """Weights dtype for generator, trainer and reference ("float32" or "bfloat16")."""
    max_model_len: int = 256
    """Longest prompt + completion, in tokens."""


@dataclass(kw_only=True)
class RolloutConfig:
    task: str = "addition"
    """A toy task name (see forgelab.data.tasks.TASKS) or a local .jsonl/.parquet file with prompt/target columns."""
    max_train_problems: int | None = None
    """At most this many training problems (a file's first training rows). None: every training row of a file;
    a toy task, which has no rows, generates 4000. The run reports the split it made (manifest, `data` event)."""
    heldout: int | float | str = 0.1
    """The held-out problems evaluation uses, for a file task: a fraction in (0, 1) of its rows (its last rows;
    files are expected to be pre-shuffled), a count of its last rows, or a second .jsonl/.parquet file (then
    every row of `task` trains). A toy task uses its own test split unless a file is given here."""
    group_size: int = 8
    """G: samples per prompt; advantages are computed within a group."""
    prompts_per_rollout: int = 8
    """P: prompts one rollout task generates at a time (P*G episodes)."""
    concurrency: int = 2
    """N: rollout tasks running at once in the controller."""
    max_tokens: int = 16
    """Longest completion, in tokens."""
    temperature: float = 1.0
    """Sampling temperature (1.0 = the policy itself)."""
    top_p: float = 1.0
    """Nucleus sampling; 1.0 samples from the full policy."""
    rewards: dict[str, float] | None = None
    """Reward function name -> weight (names from forgelab.rewards.library.REWARDS). With an env they are added to the
    environment's reward. None: {exact_answer: 1.0, answer_format: 0.1} for single-turn runs, none with an env."""
    reward_timeout_s: float = 5.0
    """A reward call that takes longer is a failure (the episode is dropped with reason)."""
    advantage: str = "grpo"
    """Advantage estimator: grpo (group z-score), dr_grpo (group mean) or rloo (leave-one-out)."""
    drop_zero_variance_groups: bool = False
    """Drop groups whose rewards are all equal (they carry no gradient); counted as dropped."""
    env: str | None = None
    """Multi-turn environment (a name in forgelab.envs.ENVS) or None for single-turn rollouts. With an env,
    each problem of `task` starts G episodes played by EnvActor replicas; the episode reward is the
    environment's plus `rewards` (none by default) and `max_tokens` bounds each assistant turn."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's factory."""
    max_turns: int = 4
    """With an env: most assistant turns per episode (prompt + all turns stay within model.max_model_len)."""
    env_step_timeout_s: float = 10.0
    """With an env: a reset/step that takes longer drops its episode with reason env_timeout."""


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 100
    """Optimizer steps to run."""
    batch_size: int = 64
    """Episodes per optimizer step (a multiple of group_size keeps groups whole)."""
    lr: float = 2e-4
    """Peak learning rate (AdamW)."""
    warmup_steps: int = 5
    """Linear warmup steps, then cosine decay to min_lr_ratio * lr at `steps`."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping threshold (global L2 norm)."""
    loss: str = "grpo"
    """Loss name in forgelab.algos.LOSSES (swap it live with run.set_loss)."""
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    """Hyper-parameters passed to the loss (e.g. eps_low, eps_high, kl_coef for grpo)."""
    is_cap: float | None = None
    """Truncated importance-sampling cap: multiply each token's loss by min(pi_trainer/pi_generator, is_cap).
    For ratio-based losses (grpo, dapo, dr_grpo, gspo, cispo) the ratio to the generator's logprobs already
    corrects for off-policy samples, so the default is None (diagnostics are still reported); set it (e.g. 2.0)
    for `reinforce`."""
    max_policy_age: int = 1
    """Staleness bound: episodes generated more than this many versions ago are evicted. 0 = synchronous on-policy."""
    max_buffer: int = 1024
    """Replay buffer bound in episodes; beyond it the oldest are dropped (reason buffer_full)."""
    max_consecutive_failures: int = 3
    """After this many skipped steps in a row (NaN loss, bad shape) the run pauses with a message."""
    seed: int = 0
    """Seed for data order, sampling of batches and the trainer."""


@dataclass(kw_only=True)
class PlacementConfig:
    generator_replicas: int = 1
    """vLLM generator replicas behind the generator service."""
    trainer_procs: int = 1
    """Trainer processes (FSDP2 ranks when > 1)."""
    reference: bool = True
    """Run a frozen reference model (needed for KL to the reference)."""
    reference_replicas: int = 1
    """Reference model replicas."""
    threads: int = 1
    """torch threads per process (keep 1 on small hosts: generator and trainer share the cores)."""
    with_gpus: bool = False
    """Place each process on its own GPU."""
    kv_cache_gib: float = 1.0
    """vLLM KV-cache size per generator on CPU hosts."""
    env_replicas: int = 1
    """EnvActor replicas playing multi-turn episodes (only with rollout.env)."""
    env_max_concurrent: int = 1024
    """Most episodes running at once in one EnvActor (asyncio tasks in one process)."""


@dataclass(kw_only=True)
class EvalConfig:
    every: int = 10
    """Held-out greedy accuracy every this many steps (0 = only at start and end)."""
    n: int = 200
    """Held-out problems evaluated."""


@dataclass(kw_only=True)
class TrackingConfig:
    out_dir: str = "runs"
    """Metrics CSV/Parquet, plots, checkpoints and the wandb run go to out_dir/name."""
    wandb: bool = True
    """Log to wandb (offline unless WANDB_MODE says otherwise / the user is logged in)."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0 = only when asked)."""


@dataclass(kw_only=True)
class HostsConfig:
    """Where the parts run: this host (the default) or host meshes of a `monarch.job` job.

        hosts:
          job: {kind: process, meshes: {gen: 1, train: 1}}   # two local "hosts" (subprocesses)
          generator: gen
          trainer: train

    A part whose mesh is null runs on this host. A service's replicas spread over its mesh's hosts.
    """

    job: dict[str, Any] | None = None
    """A `monarch.job` job: `kind` (process, local, ssh, slurm, kubernetes), `meshes` (name -> hosts) and the
    job's own arguments (see forgelab.runtime.placement.job_from_config). None: everything on this host."""
    generator: str | None = None
    """Host mesh (a name in job.meshes) of the generator replicas; None: this host."""
    trainer: str | None = None
    """Host mesh of the trainer; None: this host."""
    reference: str | None = None
    """Host mesh of the reference replicas; None: this host."""
    envs: str | None = None
    """Host mesh of the EnvActor replicas; None: this host."""
    trainer_hosts: int = 1
    """Hosts the trainer spans (placement.trainer_procs processes on each); > 1 needs trainer.master_addr
    to be rank 0's address reachable from the other hosts."""


@dataclass(kw_only=True)
class RunConfig:
    name: str = "forgelab"
    """Run name (directory under tracking.out_dir)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    generator: GeneratorSection = field(default_factory=GeneratorSection)
    """vLLM engine settings (every GeneratorConfig field not set by model/placement/rollout)."""
    trainer: TrainerSection = field(default_factory=TrainerSection)
    """Trainer settings (every TrainerConfig field not set by model/train)."""
    reference: ReferenceSection = field(default_factory=ReferenceSection)
    """Reference model settings (every ReferenceConfig field not set by model)."""
    envs: EnvsSection = field(default_factory=EnvsSection)
    """EnvActor settings (every EnvActorConfig field not set by model/placement/rollout)."""
    hosts: HostsConfig = field(default_factory=HostsConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (shared by trainer and generator); off by default."""

    # -- loading ---------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        cfg = _build(cls, data or {}, "")
        cfg.validate()
        return cfg

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> "RunConfig":
        """Read a YAML config; `overrides` are ``dotted.key=value`` strings (the CLI's ``--set``), each value
        parsed as YAML, applied before validation."""
        import yaml

        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level, got {type(data).__name__}")
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r}: expected dotted.key=value, e.g. train.steps=20")
            key, raw = item.split("=", 1)
            node = data
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node[leaf] = yaml.safe_load(raw)
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self, *, components: bool = False) -> str:
        """The whole resolved config as YAML (every default filled in); with `components`, also the
        config object each part is spawned with (shared values resolved), under `components:`."""
        import yaml

        data = self.to_dict()
        if components:
            data["components"] = {s: dataclasses.asdict(self.component(s)) for s in ("generator", "trainer", "reference", "envs")}
        plain = lambda v: {k: plain(x) for k, x in v.items()} if isinstance(v, dict) else (  # noqa: E731
            [plain(x) for x in v] if isinstance(v, (list, tuple)) else v)
        return yaml.safe_dump(plain(data), sort_keys=False)

    def component(self, section: str) -> Any:
        """The config object the `section` actor ("generator", "trainer", "reference", "envs") is spawned with."""
        return build_component(self, section)

    # -- validation ------------------------------------------------------
    def validate(self) -> "RunConfig":
        """Raise ConfigError naming the first bad field. Spawns nothing."""
        m, r, t, p, e = self.model, self.rollout, self.train, self.placement, self.eval
        mp = Path(m.path)
        if not (mp / "config.json").is_file():
            raise ConfigError(
                f"model.path: {m.path!r} is not an HF checkpoint directory (no config.json); "
                "point it at a directory with config.json, *.safetensors and tokenizer files"
            )
        if m.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"model.dtype: {m.dtype!r} is not one of float32, bfloat16, float16")
        _positive("model.max_model_len", m.max_model_len)

        from forgelab.data.tasks import TASKS

        if r.task not in TASKS and not (r.task.endswith((".jsonl", ".parquet")) and Path(r.task).is_file()):
            raise ConfigError(
                f"rollout.task: {r.task!r} is neither a toy task ({', '.join(sorted(TASKS))}) "
                "nor an existing .jsonl/.parquet file"
            )
        for name in ("group_size", "prompts_per_rollout", "concurrency", "max_tokens"):
            _positive(f"rollout.{name}", getattr(r, name))
        if r.max_train_problems is not None:
            _positive("rollout.max_train_problems", r.max_train_problems)
        if isinstance(r.heldout, str):
            if not (r.heldout.endswith((".jsonl", ".parquet")) and Path(r.heldout).is_file()):
                raise ConfigError(f"rollout.heldout: {r.heldout!r} is not an existing .jsonl/.parquet file; give a "
                                  "file, a fraction in (0, 1) of the task file's rows, or a count of its last rows")
        elif isinstance(r.heldout, bool) or not (0 < r.heldout < 1 or (r.heldout >= 1 and float(r.heldout).is_integer())):
            raise ConfigError(f"rollout.heldout: {r.heldout!r} is neither a fraction in (0, 1) nor a count >= 1 of "
                              "held-out rows nor a file")
        if r.group_size < 2:
            raise ConfigError(f"rollout.group_size: {r.group_size} < 2; group advantages need at least 2 samples per prompt")
        _finite_range("rollout.temperature", r.temperature, 0.0, 10.0)
        _finite_range("rollout.top_p", r.top_p, 1e-6, 1.0)
        _finite_range("rollout.reward_timeout_s", r.reward_timeout_s, 1e-3, 3600)
        if r.env is not None:
            from forgelab.envs import ENVS, make_env

            if r.env not in ENVS:
                raise ConfigError(
                    f"rollout.env: unknown environment {r.env!r}; known: {', '.join(sorted(ENVS))} "
                    "(add yours to forgelab.envs.ENVS), or null for single-turn rollouts"
                )
            if not isinstance(r.env_kwargs, dict):
                raise ConfigError(f"rollout.env_kwargs: expected a mapping, got {r.env_kwargs!r}")
            try:
                make_env(r.env, r.env_kwargs)
            except Exception as e:
                raise ConfigError(f"rollout.env_kwargs: {r.env!r} cannot be built with {r.env_kwargs!r}: {e}") from None
            _positive("rollout.max_turns", r.max_turns)
            _finite_range("rollout.env_step_timeout_s", r.env_step_timeout_s, 1e-3, 3600)
        from forgelab.rewards.library import REWARDS

        if r.rewards is not None and not r.rewards and r.env is None:
            raise ConfigError("rollout.rewards: empty; give at least one reward, e.g. {exact_answer: 1.0}")
        for name, w in (r.rewards or {}).items():
            if name not in REWARDS:
                raise ConfigError(
                    f"rollout.rewards: unknown reward {name!r}; known: {', '.join(sorted(REWARDS))} "
                    "(register your own with run.add_reward(name, fn, weight))"
                )
            _finite_range(f"rollout.rewards.{name}", w, -1e6, 1e6)
        from forgelab.algos import ADVANTAGES, LOSSES

        if r.advantage not in ADVANTAGES:
            raise ConfigError(f"rollout.advantage: unknown {r.advantage!r}; known: {', '.join(sorted(ADVANTAGES))}")
        if t.loss not in LOSSES:
            raise ConfigError(f"train.loss: unknown loss {t.loss!r}; known: {', '.join(sorted(LOSSES))}")
        from forgelab.algos.loss_checks import LossError, check_loss_kwargs

        try:
            check_loss_kwargs(t.loss, t.loss_kwargs)
        except LossError as e:
            raise ConfigError(f"train.loss_kwargs: {e}") from None
        kl = t.loss_kwargs.get("kl_coef", 0) if isinstance(t.loss_kwargs, dict) else 0
        if not p.reference and isinstance(kl, (int, float)) and kl > 0:
            raise ConfigError(f"train.loss_kwargs.kl_coef: {kl} needs the reference model, but placement.reference "
                              "is false; set placement.reference: true or kl_coef: 0")
        for name in ("steps", "batch_size", "max_buffer", "max_consecutive_failures"):
            _positive(f"train.{name}", getattr(t, name))
        if t.batch_size % r.group_size:
            raise ConfigError(
                f"train.batch_size: {t.batch_size} is not a multiple of rollout.group_size={r.group_size}; "
                "use a multiple so groups stay whole"
            )
        if t.max_buffer < t.batch_size:
            raise ConfigError(f"train.max_buffer: {t.max_buffer} < train.batch_size={t.batch_size}; the buffer must hold a batch")
        _finite_range("train.lr", t.lr, 0.0, 1.0, low_open=True)
        _nonneg("train.warmup_steps", t.warmup_steps)
        if t.warmup_steps >= t.steps:
            raise ConfigError(
                f"train.warmup_steps: {t.warmup_steps} >= train.steps={t.steps}; warmup must end before the last "
                "step (lower warmup_steps, e.g. 0)"
            )
        _finite_range("train.min_lr_ratio", t.min_lr_ratio, 0.0, 1.0)
        _nonneg("train.weight_decay", t.weight_decay)
        _finite_range("train.max_grad_norm", t.max_grad_norm, 0.0, 1e9, low_open=True)
        if t.is_cap is not None:
            _finite_range("train.is_cap", t.is_cap, 1.0, 1e9)
        _nonneg("train.max_policy_age", t.max_policy_age)
        for name in ("generator_replicas", "trainer_procs", "reference_replicas", "threads", "env_replicas",
                     "env_max_concurrent"):
            _positive(f"placement.{name}", getattr(p, name))
        _finite_range("placement.kv_cache_gib", p.kv_cache_gib, 0.0, 1024, low_open=True)
        if p.kv_cache_gib != int(p.kv_cache_gib):
            raise ConfigError(f"placement.kv_cache_gib: {p.kv_cache_gib} is not a whole number; vLLM on CPU takes "
                              "whole GiB (VLLM_CPU_KVCACHE_SPACE), e.g. 1 or 2")
        if p.with_gpus and self.hosts.job is not None:
            pass  # the job's hosts have their own GPUs: Monarch places processes on them
        elif p.with_gpus:
            try:
                import torch

                have = torch.cuda.device_count()
            except Exception:
                have = 0
            need = p.generator_replicas + p.trainer_procs + (p.reference_replicas if p.reference else 0)
            if need > have:
                raise ConfigError(
                    f"placement.with_gpus: this placement needs {need} GPUs (generator_replicas + trainer_procs "
                    f"+ reference_replicas) but this host has {have}; lower the counts or set with_gpus: false"
                )
        else:
            cores = os.cpu_count() or 1
            procs = p.generator_replicas + p.trainer_procs + (p.reference_replicas if p.reference else 0)
            if procs * p.threads > 8 * cores:
                raise ConfigError(
                    f"placement: {procs} processes x {p.threads} threads is far more than this host's {cores} cores; "
                    "lower generator_replicas / trainer_procs / threads"
                )
        _nonneg("eval.every", e.every)
        _positive("eval.n", e.n)
        _nonneg("tracking.checkpoint_every", self.tracking.checkpoint_every)
        try:
            self.lora.validate("lora")
        except ValueError as err:
            raise ConfigError(str(err)) from None
        self._validate_hosts()
        for section in ("generator", "trainer", "reference", "envs"):
            try:
                self.component(section).validate()
            except (ValueError, TypeError) as err:
                raise ConfigError(f"{section}: {err}") from None
        return self

    def _validate_hosts(self) -> None:
        from forgelab.runtime.placement import JOB_KINDS

        h = self.hosts
        _positive("hosts.trainer_hosts", h.trainer_hosts)
        used = {part: getattr(h, part) for part in ("generator", "trainer", "reference", "envs") if getattr(h, part)}
        if h.job is None:
            if used or h.trainer_hosts > 1:
                raise ConfigError(
                    f"hosts: {', '.join(f'hosts.{k}: {v!r}' for k, v in used.items()) or 'hosts.trainer_hosts > 1'} "
                    "names a host mesh but hosts.job is null; add e.g. hosts.job: {kind: process, meshes: {gen: 1}}"
                )
            return
        if not isinstance(h.job, dict) or h.job.get("kind") not in JOB_KINDS:
            raise ConfigError(f"hosts.job.kind: must be one of {', '.join(JOB_KINDS)}, got {getattr(h.job, 'get', dict().get)('kind')!r}")
        meshes = h.job.get("meshes")
        if not meshes:
            raise ConfigError("hosts.job.meshes: required, e.g. {gen: 1, train: 1} (mesh name -> hosts)")
        for part, mesh in used.items():
            if mesh not in meshes:
                near = difflib.get_close_matches(str(mesh), list(meshes), n=1)
                raise ConfigError(
                    f"hosts.{part}: {mesh!r} is not a mesh of hosts.job.meshes ({', '.join(map(str, meshes))})"
                    + (f"; did you mean {near[0]!r}?" if near else "")
                )


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            owner = shared_owner(cls, key)
            if owner is not None:
                raise ConfigError(f"{prefix}{key}: set by {owner} (one value for every component); set it there")
            near = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            raise ConfigError(
                f"{prefix}{key}: unknown field"
                + (f"; did you mean {prefix}{near[0]}?" if near else "")
                + f" (known fields of {prefix.rstrip('.') or 'the config'}: {', '.join(fields)})"
            )
        f = fields[key]
        sub = _dataclass_type(cls, f)
        if sub is not None:
            kwargs[key] = _build(sub, value, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, f, f"{prefix}{key}", cls)
    return cls(**kwargs)


def _dataclass_type(cls: type, f: dataclasses.Field) -> type | None:
    t = typing.get_type_hints(cls).get(f.name)
    return t if dataclasses.is_dataclass(t) else None


def _coerce(value: Any, f: dataclasses.Field, path: str, cls: type | None = None) -> Any:
    """Check `value` against the field's type annotation; YAML lists become tuples where a tuple is declared."""
    from forgelab.config.value_types import check_type

    t = typing.get_type_hints(cls).get(f.name, Any) if cls is not None else Any
    try:
        return check_type(value, t, path)
    except TypeError as err:
        raise ConfigError(str(err)) from None


def _positive(path: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{path}: must be a positive integer, got {value!r}")


def _nonneg(path: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or not math.isfinite(value):
        raise ConfigError(f"{path}: must be a non-negative number, got {value!r}")


def _finite_range(path: str, value: Any, lo: float, hi: float, low_open: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok:
        ok = (value > lo if low_open else value >= lo) and value <= hi
    if not ok:
        bound = f"({lo}, {hi}]" if low_open else f"[{lo}, {hi}]"
        raise ConfigError(f"{path}: must be a finite number in {bound}, got {value!r}")
