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
import os
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

#: The checkpoint forgelab ships (made by `python -m forgelab.recipes.tiny_model`).
from forgelab.config.value_types import (ConfigError, build_section, finite_range,  # noqa: E402
                                          non_negative, positive_int)

SHIPPED_MODEL = str(Path(__file__).resolve().parent.parent / "assets" / "tiny-llama")
"""The shipped tiny model's directory (3.2 M parameters, character tokenizer): `model.path`'s default."""



# The component sections (generator, trainer, reference, envs) are derived from the actors' own config
# dataclasses: see forgelab/config/sections.py. Importing them loads torch and monarch (~2 s).
from forgelab.config.components import LoraConfig, TeacherConfig  # noqa: E402
from forgelab.config.deadlines import WatchdogConfig  # noqa: E402
from forgelab.config.sections import (  # noqa: E402
    EnvsSection,
    GeneratorSection,
    ReferenceSection,
    TrainerSection,
    build_component,
)


@dataclass(kw_only=True)
class ModelConfig:
    """The model every part loads: checkpoint, dtype, context length (`model:` in YAML)."""

    path: str = SHIPPED_MODEL
    """HF checkpoint directory (config.json, safetensors, tokenizer). Default: the shipped tiny model."""
    dtype: str = "float32"
    """Weights dtype for generator, trainer and reference ("float32" or "bfloat16")."""
    max_model_len: int = 256
    """Longest prompt + completion, in tokens."""


@dataclass(kw_only=True)
class ReasoningGymConfig:
    """A reasoning-gym task as the run's problems (`rollout.reasoning_gym:`, used with `rollout.task:
    reasoning_gym`; forgelab.data.reasoning_gym_source, docs/ecosystem.md). Generated locally from the seed."""

    name: str | None = None
    """The reasoning-gym task (a name in reasoning_gym.factory.DATASETS, e.g. basic_arithmetic)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The task's parameters (its config class's fields, e.g. max_digits, operators); lists become tuples."""
    seed: int = 0
    """reasoning-gym's seed of the training items."""
    size: int = 1000
    """Training items drawn."""
    heldout_seed: int | None = None
    """Seed of the held-out draw (items also in training are removed); None: seed + size (reasoning-gym seeds
    item i with seed + i, so nearby seeds repeat training items)."""
    prompt: str = "question"
    """The prompt text: "question" (the item's question) or "expression" (an arithmetic item's expression,
    spaces removed, then "=": "12+45=", the shipped tiny model's format)."""
    answer_tag: str | None = None
    """None: the whole completion is the answer; a tag name (e.g. "answer"): the text of its last <tag>...</tag>."""
    partial_credit: bool = False
    """The default reward: false, `reasoning_gym` (1.0 exactly where the task's score_answer gives 1.0); true,
    `reasoning_gym_partial` (score_answer's value, which credits answers containing the oracle: "570" scores
    0.67 for 57). Held-out accuracy always uses exact match."""


@dataclass(kw_only=True)
class RolloutConfig:
    """How episodes are made: the data, the group size, sampling, rewards, environment (`rollout:`)."""

    task: str = "addition"
    """A toy task name (see forgelab.data.tasks.TASKS), `reasoning_gym` (the task in `reasoning_gym`) or a dataset: a .jsonl/.parquet/.csv/.json file or a
    save_to_disk directory, and from Python a `datasets.Dataset` / `DatasetDict`. Columns: `prompt` (text or chat
    messages), optional `target`, any others (passed to the rewards; forgelab.data.datasets)."""
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    """With `task: reasoning_gym`: which reasoning-gym task, its parameters, seed and size."""
    split: str | None = None
    """The split of a DatasetDict `task` that trains (required for one: never implied); None otherwise."""
    system_prompt: str | None = None
    """A system message put before every prompt of a dataset task (rendered by the model's chat template)."""
    max_train_problems: int | None = None
    """At most this many training problems (a file's first rows). None: every training row of a file; a toy task
    generates 4000. The run reports its split at start (`data` event) and in manifest.json (`data_split`)."""
    heldout: int | float | str = 0.1
    """Held-out problems of a dataset task: a fraction in (0, 1) of its rows (its last ones), a count of its last
    rows, another split's name (a DatasetDict), or a second dataset (file, directory or, from Python, a Dataset;
    then all of `task` trains). A toy task uses its test split unless a dataset is given."""
    group_size: int = 8
    """G: samples per prompt; advantages are computed within a group."""
    prompts_per_rollout: int = 8
    """P: prompts one rollout task generates at a time (P*G episodes)."""
    concurrency: int = 2
    """N: rollout tasks running at once in the controller. 0 (only with ``door.enabled``): no native rollouts, the
    agent door's sessions (`Run.play_agents`) are the only episodes trained on."""
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
    """Drop groups whose rewards are all equal (they carry no gradient); counted as dropped. With a teacher
    (coefficient not 0) such a group is kept: its tokens still carry the distillation signal (metrics column
    ``episodes_zero_variance_kept``)."""
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
    """The optimisation: steps, batch, learning rate, loss, staleness bound, seed (`train:`)."""

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
    loss: str | Callable = "grpo"
    """A name in forgelab.algos.LOSSES or a loss function (it reaches the trainer by value); run.set_loss swaps it."""
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
    """How many processes of each part, and where: replicas, threads, GPUs (`placement:`)."""

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
    """Held-out greedy evaluation: how often and on how many problems (`eval:`)."""

    every: int = 10
    """Held-out greedy accuracy every this many steps (0 = only at start and end)."""
    n: int = 200
    """Held-out problems evaluated."""


@dataclass(kw_only=True)
class TrackingConfig:
    """Where a run writes: its directory, wandb, checkpoints (`tracking:`)."""

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
class DoorConfig:
    """The agent door (`door:`): an OpenAI-compatible endpoint over the run's generator on loopback, whose
    sessions become token-exact episodes (docs/agents.md). Off by default."""

    enabled: bool = False
    """Serve the door once the run's processes are up (``run.openai_base_url``, ``run.door_key``)."""
    port: int = 0
    """Loopback port; 0 lets the OS pick a free one."""
    model_name: str = ""
    """The model id `GET /v1/models` lists and requests name; "" means the run's name."""
    idle_timeout_s: float = 600.0
    """A session with no call (and no reward) for this long expires: its episodes are dropped
    (``session_expired``); a group waiting this long for its last sessions is buffered as it is."""
    max_sessions: int = 1024
    """Most sessions open at once; a new one beyond it gets 429 with Retry-After."""
    max_segments: int = 8
    """Most segments (episodes) one session may record (each edit of history starts one)."""
    max_n: int = 16
    """Largest ``n`` (choices per call) accepted."""
    max_concurrent_calls: int = 1024
    """Most calls generating at once through the door; one more gets 429 with Retry-After (never an unbounded
    queue)."""
    group_size: int | None = None
    """Sessions rewarded under one group key that form a group (advantages are normalised over it); None:
    ``rollout.group_size``."""
    retry_after_s: float = 1.0
    """The Retry-After (seconds) of a 429."""
    tool_dialect: str = "auto"
    """How the model writes tool calls (`forgelab.serve.tools.DIALECTS`): "calc" (tiny-llama-tool's
    ``<calc>``/``<result>``), "hermes" (``<tool_call>`` JSON: Qwen2.5/Qwen3), "none" (``tools`` refused), or "auto"
    (hermes when the chat template writes ``<tool_call>``, else calc when it renders a tool role)."""
    rewards: dict[str, float] | None = None
    """Reward functions (names in `forgelab.rewards.library.REWARDS`, or ``package.module:function``) and their
    weights that score a session's final transcript when its reward comes as a target (the reward route's
    ``{"target": "46"}``, or an agent of `Run.play_agents` returning a string) instead of a number; None: rewards
    are numbers only (docs/agents.md)."""


@dataclass(kw_only=True)
class RunConfig:
    """A whole run's configuration, validated before anything starts (`RunConfig.from_yaml`, `validate`)."""

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
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """On-policy distillation's teacher (off by default): a per-token advantage toward its logprobs."""
    door: DoorConfig = field(default_factory=DoorConfig)
    """The agent door: an OpenAI-compatible endpoint whose sessions become episodes (off by default)."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """When a call or weight push that stopped answering or progressing is declared stuck (docs/hangs.md)."""

    # -- loading ---------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        cfg = build_section(cls, data or {}, "")
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
        """The config as plain data. A dataset object given from Python (rollout.task / rollout.heldout) appears
        as its description, which a YAML config cannot load back (save it with save_to_disk for that)."""
        from forgelab.data.sources import describe_source, is_dataset

        r = self.rollout
        if is_dataset(r.task) or is_dataset(r.heldout):
            plain = {k: f"<{describe_source(getattr(r, k))}>" for k in ("task", "heldout") if is_dataset(getattr(r, k))}
            return dataclasses.asdict(dataclasses.replace(self, rollout=dataclasses.replace(r, **plain)))
        return dataclasses.asdict(self)

    def to_yaml(self, *, components: bool = False) -> str:
        """The whole resolved config as YAML (every default filled in); with `components`, also the
        config object each part is spawned with (shared values resolved), under `components:`."""
        import yaml

        data = self.to_dict()
        if components:
            data["components"] = {s: dataclasses.asdict(self.component(s)) for s in ("generator", "trainer", "reference", "envs")}
        plain = lambda v: {k: plain(x) for k, x in v.items()} if isinstance(v, dict) else (  # noqa: E731
            [plain(x) for x in v] if isinstance(v, (list, tuple)) else
            f"<function {getattr(v, '__qualname__', type(v).__name__)}>" if callable(v) else v)  # a loss given as code
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
        positive_int("model.max_model_len", m.max_model_len)

        from forgelab.data.datasets import check_split_fields
        from forgelab.data.tasks import TASKS

        from forgelab.data.reasoning_gym_source import TASK_NAME as RG_TASK

        rg_on = r.task == RG_TASK
        if rg_on:
            self._validate_reasoning_gym()
        elif r.reasoning_gym.name is not None:
            raise ConfigError(f"rollout.reasoning_gym.name: {r.reasoning_gym.name!r} is set but rollout.task is "
                              f"{r.task!r}; set rollout.task: {RG_TASK} to train on it, or remove the name")
        if not rg_on and isinstance(r.task, str) and r.task not in TASKS and not Path(r.task).exists():
            raise ConfigError(f"rollout.task: {r.task!r} is neither a toy task ({', '.join(sorted(TASKS))}) nor an "
                              "existing dataset (.jsonl/.parquet/.csv/.json file, save_to_disk directory)" + (
                                  "; a dataset object from Python is recorded by its description only: save it "
                                  "with save_to_disk and give the directory" if r.task.startswith("<Dataset") else ""))
        for name in ("group_size", "prompts_per_rollout", "max_tokens"):
            positive_int(f"rollout.{name}", getattr(r, name))
        if r.concurrency == 0 and not self.door.enabled:
            raise ConfigError("rollout.concurrency: 0 (no native rollouts) needs door.enabled: the agent door's "
                              "sessions are then the only episodes; give a positive count otherwise")
        if r.concurrency != 0:
            positive_int("rollout.concurrency", r.concurrency)
        try:
            check_split_fields(r.max_train_problems, r.heldout, None if rg_on else r.task, r.split)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if r.group_size < 2:
            raise ConfigError(f"rollout.group_size: {r.group_size} < 2; group advantages need at least 2 samples per prompt")
        finite_range("rollout.temperature", r.temperature, 0.0, 10.0)
        finite_range("rollout.top_p", r.top_p, 1e-6, 1.0)
        finite_range("rollout.reward_timeout_s", r.reward_timeout_s, 1e-3, 3600)
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
            positive_int("rollout.max_turns", r.max_turns)
            finite_range("rollout.env_step_timeout_s", r.env_step_timeout_s, 1e-3, 3600)
        from forgelab.rewards.library import resolve_reward

        if r.rewards is not None and not r.rewards and r.env is None:
            raise ConfigError("rollout.rewards: empty; give at least one reward, e.g. {exact_answer: 1.0}")
        for name, w in (r.rewards or {}).items():
            try:
                resolve_reward(name)  # a REWARDS name or package.module:function (a TRL-style one is adapted)
            except KeyError as e:
                raise ConfigError(f"rollout.rewards: {e.args[0]} (or register your own with run.add_reward(name, "
                                  "fn, weight))") from None
            finite_range(f"rollout.rewards.{name}", w, -1e6, 1e6)
        from forgelab.algos import ADVANTAGES, LOSSES

        if r.advantage not in ADVANTAGES:
            raise ConfigError(f"rollout.advantage: unknown {r.advantage!r}; known: {', '.join(sorted(ADVANTAGES))}")
        if not (callable(t.loss) or isinstance(t.loss, str) and t.loss in LOSSES):
            raise ConfigError(f"train.loss: unknown loss {t.loss!r}; known: {', '.join(sorted(LOSSES))}, or a function")
        from forgelab.algos.loss_checks import LossError, check_loss_kwargs, without_reference

        try:
            check_loss_kwargs(t.loss, t.loss_kwargs)
        except LossError as e:
            raise ConfigError(f"train.loss_kwargs: {e}") from None
        if not p.reference:  # an explicit kl_coef > 0 is refused; a default one is set to 0 with a message
            try:
                without_reference(t.loss, t.loss_kwargs)
            except LossError as e:
                raise ConfigError(f"train.loss_kwargs.{e}") from None
        for name in ("steps", "batch_size", "max_buffer", "max_consecutive_failures"):
            positive_int(f"train.{name}", getattr(t, name))
        if t.batch_size % r.group_size:
            raise ConfigError(
                f"train.batch_size: {t.batch_size} is not a multiple of rollout.group_size={r.group_size}; "
                "use a multiple so groups stay whole"
            )
        if t.max_buffer < t.batch_size:
            raise ConfigError(f"train.max_buffer: {t.max_buffer} < train.batch_size={t.batch_size}; the buffer must hold a batch")
        finite_range("train.lr", t.lr, 0.0, 1.0, low_open=True)
        non_negative("train.warmup_steps", t.warmup_steps)
        if t.warmup_steps >= t.steps:
            raise ConfigError(
                f"train.warmup_steps: {t.warmup_steps} >= train.steps={t.steps}; warmup must end before the last "
                "step (lower warmup_steps, e.g. 0)"
            )
        finite_range("train.min_lr_ratio", t.min_lr_ratio, 0.0, 1.0)
        non_negative("train.weight_decay", t.weight_decay)
        finite_range("train.max_grad_norm", t.max_grad_norm, 0.0, 1e9, low_open=True)
        if t.is_cap is not None:
            finite_range("train.is_cap", t.is_cap, 1.0, 1e9)
        non_negative("train.max_policy_age", t.max_policy_age)
        for name in ("generator_replicas", "trainer_procs", "reference_replicas", "threads", "env_replicas",
                     "env_max_concurrent"):
            positive_int(f"placement.{name}", getattr(p, name))
        finite_range("placement.kv_cache_gib", p.kv_cache_gib, 0.0, 1024, low_open=True)
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
        non_negative("eval.every", e.every)
        positive_int("eval.n", e.n)
        non_negative("tracking.checkpoint_every", self.tracking.checkpoint_every)
        try:
            self.lora.validate("lora")
        except ValueError as err:
            raise ConfigError(str(err)) from None
        try:
            self.teacher.validate(m.path)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        self._validate_hosts()
        self._validate_door()
        self.watchdog.validate()
        for section in ("generator", "trainer", "reference", "envs"):
            try:
                self.component(section).validate()
            except (ValueError, TypeError) as err:
                raise ConfigError(f"{section}: {err}") from None
        return self

    def _validate_door(self) -> None:
        d = self.door
        if not isinstance(d.enabled, bool):
            raise ConfigError(f"door.enabled: expected true or false, got {d.enabled!r}")
        if isinstance(d.port, bool) or not isinstance(d.port, int) or not 0 <= d.port <= 65535:
            raise ConfigError(f"door.port: {d.port!r} is not a port number (0 lets the OS pick one)")
        if not isinstance(d.model_name, str):
            raise ConfigError(f"door.model_name: expected a string (\"\" for the run's name), got {d.model_name!r}")
        if not isinstance(d.tool_dialect, str) or not d.tool_dialect:
            raise ConfigError(f"door.tool_dialect: expected a dialect name (calc, hermes, auto or none; "
                              f"forgelab.serve.tools.DIALECTS), got {d.tool_dialect!r}")
        if d.rewards is not None:
            from forgelab.rewards.library import resolve_reward

            if not isinstance(d.rewards, dict) or not d.rewards:
                raise ConfigError(f"door.rewards: expected a mapping of reward names to weights, e.g. "
                                  f"{{exact_answer: 1.0}}, or null; got {d.rewards!r}")
            for name, w in d.rewards.items():
                try:
                    resolve_reward(name)
                except KeyError as e:
                    raise ConfigError(f"door.rewards: {e.args[0]}") from None
                finite_range(f"door.rewards.{name}", w, -1e6, 1e6)
        finite_range("door.idle_timeout_s", d.idle_timeout_s, 0.0, 7 * 24 * 3600, low_open=True)
        finite_range("door.retry_after_s", d.retry_after_s, 0.0, 3600, low_open=True)
        for name in ("max_sessions", "max_segments", "max_n", "max_concurrent_calls"):
            positive_int(f"door.{name}", getattr(d, name))
        if d.group_size is not None:
            positive_int("door.group_size", d.group_size)
    def _validate_reasoning_gym(self) -> None:
        from forgelab.data.reasoning_gym_source import check_reasoning_gym

        r = self.rollout
        try:
            check_reasoning_gym(r.reasoning_gym)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if r.split is not None:
            raise ConfigError(f"rollout.split: {r.split!r} given, but reasoning-gym tasks have no splits (held-out "
                              "items are a second draw: rollout.reasoning_gym.heldout_seed); remove rollout.split")
        if r.heldout != 0.1:
            raise ConfigError(f"rollout.heldout: {r.heldout!r} given, but a reasoning-gym task's held-out items are a "
                              "second draw (rollout.reasoning_gym.heldout_seed, eval.n of them); remove rollout.heldout")
        if r.reasoning_gym.partial_credit and r.rewards is not None and "reasoning_gym" in r.rewards:
            raise ConfigError("rollout.reasoning_gym.partial_credit: true, but rollout.rewards names the exact-match "
                              "reward reasoning_gym; name reasoning_gym_partial there (or remove rollout.rewards)")

    def _validate_hosts(self) -> None:
        from forgelab.runtime.placement import JOB_KINDS

        h = self.hosts
        positive_int("hosts.trainer_hosts", h.trainer_hosts)
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
