"""Every field of every component config is reachable from YAML, and reaches the actor that uses it.

`VALUES` holds one non-default YAML value per component-config field, at the RunConfig path that sets it
(a field shared by several components, like the model path, is set in one place). The pure tests check
that the table covers every field (a field added to a component config fails here until it gets a value)
and that each value arrives in the config object built for the component. The integration tests check
it on the config object the spawned actor actually received (`received_config` endpoint):

- CPU-runnable values: one real `spawn_parts` (generator, trainer, reference, env actor all set up);
- values that need hardware this machine lacks (CUDA devices, compiled vLLM, bf16 FSDP2): the actor
  classes are constructed on a real Monarch process with those configs, without running `setup()`
  (which would build the engine on a missing GPU), and the received config is compared.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import typing
from pathlib import Path

import pytest
import yaml

from forgelab.config.run_config import SHIPPED_MODEL, ConfigError, RunConfig
from forgelab.config.sections import COMPONENTS, SHARED

integration = pytest.mark.integration

# (component section, component field path) -> (RunConfig path that sets it, YAML value). Values run on CPU.
# "<model>" is replaced by a copy of the shipped model (the path must differ from the default).
VALUES: dict[tuple[str, str], tuple[str, typing.Any]] = {
    ("generator", "model_dir"): ("model.path", "<model>"),
    ("generator", "dtype"): ("model.dtype", "float32"),  # default: the non-default value is in HARDWARE
    ("generator", "max_model_len"): ("model.max_model_len", 192),
    ("generator", "kv_cache_gib"): ("placement.kv_cache_gib", 2.0),  # whole GiB: vLLM CPU rejects 0.5
    ("generator", "gpu_memory_utilization"): ("generator.gpu_memory_utilization", 0.85),
    ("generator", "enforce_eager"): ("generator.enforce_eager", True),  # HARDWARE: False (compile, CUDA graphs)
    ("generator", "enable_prefix_caching"): ("generator.enable_prefix_caching", False),
    ("generator", "block_size"): ("generator.block_size", 64),
    ("generator", "max_num_seqs"): ("generator.max_num_seqs", 48),
    ("generator", "admission_window_ms"): ("generator.admission_window_ms", 1.5),
    ("generator", "device"): ("generator.device", "cpu"),
    ("generator", "logprobs_mode"): ("generator.logprobs_mode", "processed_logprobs"),
    ("generator", "sampling.temperature"): ("rollout.temperature", 0.9),
    ("generator", "sampling.top_p"): ("rollout.top_p", 0.95),
    ("generator", "sampling.top_k"): ("generator.sampling.top_k", 20),
    ("generator", "sampling.max_tokens"): ("rollout.max_tokens", 12),
    ("generator", "sampling.stop_token_ids"): ("generator.sampling.stop_token_ids", [3, 4]),
    ("generator", "sampling.min_tokens"): ("generator.sampling.min_tokens", 2),
    ("generator", "sampling.logit_bias"): ("generator.sampling.logit_bias", {2: -3.0}),
    ("generator", "max_loras"): ("generator.max_loras", 2),
    ("generator", "lora.enabled"): ("lora.enabled", True),
    ("generator", "lora.rank"): ("lora.rank", 4),
    ("generator", "lora.alpha"): ("lora.alpha", 8.0),
    ("generator", "lora.dropout"): ("lora.dropout", 0.1),
    ("generator", "lora.targets"): ("lora.targets", ["q_proj", "v_proj"]),
    ("generator", "lora.reference"): ("lora.reference", "process"),
    ("trainer", "model_dir"): ("model.path", "<model>"),
    ("trainer", "dtype"): ("model.dtype", "float32"),
    ("trainer", "lr"): ("train.lr", 3e-4),
    ("trainer", "betas"): ("trainer.betas", [0.85, 0.95]),
    ("trainer", "eps"): ("trainer.eps", 1e-7),
    ("trainer", "weight_decay"): ("train.weight_decay", 0.01),
    ("trainer", "warmup_steps"): ("train.warmup_steps", 2),
    ("trainer", "total_steps"): ("train.steps", 7),
    ("trainer", "min_lr_ratio"): ("train.min_lr_ratio", 0.2),
    ("trainer", "max_grad_norm"): ("train.max_grad_norm", 0.5),
    ("trainer", "loss"): ("train.loss", "dapo"),
    ("trainer", "loss_kwargs"): ("train.loss_kwargs", {"eps_high": 0.3}),
    ("trainer", "is_cap"): ("train.is_cap", 2.0),
    ("trainer", "is_level"): ("trainer.is_level", "sequence"),
    ("trainer", "micro_batch_size"): ("trainer.micro_batch_size", 4),
    ("trainer", "logits_chunk"): ("trainer.logits_chunk", 128),
    ("trainer", "share_prompts"): ("trainer.share_prompts", "on"),
    ("trainer", "max_pack_len"): ("trainer.max_pack_len", 512),
    ("trainer", "seed"): ("train.seed", 7),
    ("trainer", "device"): ("trainer.device", "cpu"),
    ("trainer", "pg_timeout_s"): ("trainer.pg_timeout_s", 30.0),
    ("trainer", "master_port"): ("trainer.master_port", 29533),  # one rank: never bound
    ("trainer", "master_addr"): ("trainer.master_addr", "localhost"),
    ("trainer", "weight_transport"): ("trainer.weight_transport", "message"),
    ("trainer", "shm_dir"): ("trainer.shm_dir", "<tmp>"),
    ("trainer", "activation_checkpointing"): ("trainer.activation_checkpointing", True),
    ("trainer", "lora.enabled"): ("lora.enabled", True),
    ("trainer", "lora.rank"): ("lora.rank", 4),
    ("trainer", "lora.alpha"): ("lora.alpha", 8.0),
    ("trainer", "lora.dropout"): ("lora.dropout", 0.1),
    ("trainer", "lora.targets"): ("lora.targets", ["q_proj", "v_proj"]),
    ("trainer", "lora.reference"): ("lora.reference", "process"),
    ("reference", "model_dir"): ("model.path", "<model>"),
    ("reference", "dtype"): ("model.dtype", "float32"),
    ("reference", "device"): ("reference.device", "cpu"),
    ("reference", "micro_batch_size"): ("reference.micro_batch_size", 2),
    ("reference", "share_prompts"): ("reference.share_prompts", "off"),
    ("reference", "max_pack_len"): ("reference.max_pack_len", 256),
    ("envs", "model_dir"): ("model.path", "<model>"),
    ("envs", "max_concurrent"): ("placement.env_max_concurrent", 64),
    ("envs", "limits.max_turns"): ("rollout.max_turns", 3),
    ("envs", "limits.max_total_tokens"): ("model.max_model_len", 192),
    ("envs", "limits.step_timeout_s"): ("rollout.env_step_timeout_s", 7.5),
    ("envs", "coalesce_ms"): ("envs.coalesce_ms", 2.5),
    ("envs", "max_batch"): ("envs.max_batch", 128),
}

# Values that need hardware this machine lacks: checked on the received config, no engine built.
HARDWARE: dict[str, typing.Any] = {
    "model.dtype": "bfloat16",
    "generator.device": "cuda",
    "generator.enforce_eager": False,
    "generator.gpu_memory_utilization": 0.9,
    "trainer.device": "cuda",
    "reference.device": "cuda",
}

# The run around the values: a multi-turn env (so the env actor spawns), a tiny batch.
BASE = {"name": "reach", "rollout": {"env": "echo", "group_size": 2}, "train": {"batch_size": 4},
        "tracking": {"wandb": False}}


def _component_fields(cls: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _component_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def _get(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _set(data: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    for p in parents:
        data = data.setdefault(p, {})
    data[last] = value


@pytest.fixture(scope="module")
def model_copy(tmp_path_factory) -> str:
    """The shipped model under another path (symlinked files)."""
    d = tmp_path_factory.mktemp("model")
    for f in Path(SHIPPED_MODEL).iterdir():
        (d / f.name).symlink_to(f)
    return str(d)


def _yaml(tmp: Path, model: str, overrides: dict | None = None) -> Path:
    data = yaml.safe_load(yaml.safe_dump(BASE))
    for (_, _), (path, value) in VALUES.items():
        value = {"<model>": model, "<tmp>": str(tmp)}.get(value, value) if isinstance(value, str) else value
        _set(data, path, value)
    for path, value in (overrides or {}).items():
        _set(data, path, value)
    _set(data, "tracking.out_dir", str(tmp / "runs"))
    p = tmp / "reach.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _expected(section: str, field_path: str, model: str, tmp: Path, overrides: dict | None = None):
    path, value = VALUES[(section, field_path)]
    value = (overrides or {}).get(path, value)
    value = {"<model>": model, "<tmp>": str(tmp)}.get(value, value) if isinstance(value, str) else value
    return tuple(value) if field_path == "betas" else value


# ------------------------------------------------------------------ pure: YAML -> component config
#: Values that cannot join VALUES' one config (they conflict with another of its values): each reaches its
#: component in a config of its own (test_values_that_conflict_reach_alone).
ALONE = {
    # in-flight weight loads are refused with LoRA, which VALUES turns on
    ("generator", "update_mode"): ("generator.update_mode", "inflight"),
}


def test_table_covers_every_field_of_every_component_config():
    fields = {(s, f) for s, cls in COMPONENTS.items() for f in _component_fields(cls)}
    covered = set(VALUES) | set(ALONE)
    missing, stale = sorted(fields - covered), sorted(covered - fields)
    assert not missing, f"component config fields with no YAML value in VALUES: {missing}"
    assert not stale, f"VALUES names fields the component configs no longer have: {stale}"


def test_values_differ_from_defaults_unless_hardware_sets_them():
    default = RunConfig()
    for (section, field_path), (path, _) in VALUES.items():
        value = _expected(section, field_path, "<m>", Path("/nonexistent"))
        if path in HARDWARE:
            value = HARDWARE[path]
        assert _get(default.component(section), field_path) != value, (section, field_path)


def test_shared_fields_are_set_where_the_table_says():
    for (section, field_path), (path, _) in VALUES.items():
        owner = SHARED[section]
        for part in field_path.split("."):
            owner = owner.get(part) if isinstance(owner, dict) else None
        assert path == (owner if isinstance(owner, str) else f"{section}.{field_path}"), (section, field_path)


@pytest.mark.parametrize("hardware", [False, True], ids=["cpu", "hardware"])
def test_every_yaml_value_reaches_its_component_config(tmp_path, model_copy, hardware):
    over = HARDWARE if hardware else None
    cfg = RunConfig.from_yaml(_yaml(tmp_path, model_copy, over))
    for (section, field_path) in VALUES:
        got = _get(cfg.component(section), field_path)
        assert got == _expected(section, field_path, model_copy, tmp_path, over), (section, field_path, got)
    assert cfg.component("trainer").dtype == ("bfloat16" if hardware else "float32")


def test_values_that_conflict_reach_alone():
    default = RunConfig()
    for (section, field_path), (path, value) in ALONE.items():
        data: dict = {}
        _set(data, path, value)
        assert _get(default.component(section), field_path) != value, (section, field_path)
        assert _get(RunConfig.from_dict(data).component(section), field_path) == value, (section, field_path)


def test_component_configs_are_fresh_objects(tmp_path, model_copy):
    cfg = RunConfig.from_yaml(_yaml(tmp_path, model_copy))
    t = cfg.component("trainer")
    t.loss_kwargs["eps_high"] = 9.0
    assert cfg.train.loss_kwargs == {"eps_high": 0.3}  # no aliasing between the RunConfig and an actor's config


def test_python_sections_and_errors():
    from forgelab.config.run_config import GeneratorSection, TrainerSection

    cfg = RunConfig(generator=GeneratorSection(max_num_seqs=32), trainer=TrainerSection(micro_batch_size=8))
    assert cfg.validate().component("generator").max_num_seqs == 32
    assert cfg.component("trainer").micro_batch_size == 8
    with pytest.raises(ConfigError, match=r"generator\.max_num_seq: unknown field; did you mean generator\.max_num_seqs\?"):
        RunConfig.from_dict({"generator": {"max_num_seq": 8}})
    with pytest.raises(ConfigError, match=r"placement\.kv_cache_gib: 0\.5 is not a whole number"):
        RunConfig.from_dict({"placement": {"kv_cache_gib": 0.5}})
    with pytest.raises(ConfigError, match=r"trainer\.lr: set by train\.lr"):
        RunConfig.from_dict({"trainer": {"lr": 0.1}})
    with pytest.raises(ConfigError, match=r"trainer\.betas: expected 2 values"):
        RunConfig.from_dict({"trainer": {"betas": [0.9]}})
    with pytest.raises(ConfigError, match=r"^trainer: TrainerConfig\.is_level"):
        RunConfig.from_dict({"trainer": {"is_level": "paragraph"}})
    with pytest.raises(ConfigError, match=r"hosts\.trainer: 'trainr' is not a mesh .*did you mean 'train'"):
        RunConfig.from_dict({"hosts": {"job": {"kind": "process", "meshes": {"gen": 1, "train": 1}}, "trainer": "trainr"}})


def test_fsdp_mixed_precision_policy_for_bf16_on_cuda():
    import torch

    from forgelab.engines.precision import fsdp_dtypes, needs_mixed_precision

    assert fsdp_dtypes("bfloat16", "cuda") == (torch.bfloat16, torch.float32)
    assert needs_mixed_precision("bfloat16", "cuda") and not needs_mixed_precision("bfloat16", "cpu")
    assert fsdp_dtypes("float32", "cuda") == (torch.float32, torch.float32)


# ------------------------------------------------------------------ real actors
def _check_received(section: str, received, cfg: RunConfig, model: str, tmp: Path, over: dict | None) -> None:
    assert received == cfg.component(section), section
    for (s, field_path) in VALUES:
        if s == section:
            assert _get(received, field_path) == _expected(s, field_path, model, tmp, over), (s, field_path)


@integration
def test_spawned_parts_receive_every_cpu_value(loop, tmp_path, model_copy):
    from forgelab.engines.spawn import spawn_parts

    cfg = RunConfig.from_yaml(_yaml(tmp_path, model_copy))

    async def body():
        parts = await spawn_parts(cfg)
        try:
            pids = {"trainer": await parts.trainer.pids(), **{n: [pid for r in getattr(parts, n).status() for pid in r.pids]
                                                              for n in ("generators", "reference", "envs")}}
            return {
                "startup": (parts.startup, pids, {pid: _affinities(pid) for ps in pids.values() for pid in ps}),
                "generator": await parts.generators.fanout("received_config"),
                "trainer": await parts.trainer.call("received_config"),
                "reference": await parts.reference.fanout("received_config"),
                "envs": await parts.envs.fanout("received_config"),
            }
        finally:
            await parts.shutdown()

    got = loop.run_until_complete(body())
    for section in ("generator", "trainer", "reference", "envs"):
        assert len(got[section]) == 1
        _check_received(section, got[section][0], cfg, model_copy, tmp_path, None)
    # the critical path first (forgelab.runtime.startup_cpus): the generator launched first; the trainer, the
    # reference and the env actor (every thread) on the other cores while it started, all back after
    record, pids, now = got["startup"]
    base = frozenset(os.sched_getaffinity(0))
    assert record.launches[0] == ("critical", "Generator"), record.launches
    if record.note:  # fewer than 2 cores: nothing restricted, and the record says why
        assert len(base) < 2, record.note
    else:
        others = {pid for n in ("trainer", "reference", "envs") for pid in pids[n]}
        assert others <= set(record.pinned), (pids, record.pinned)
        for pid in others:
            assert set(record.pinned[pid].values()) == {record.others}, (pid, record.pinned[pid])
        assert not set(pids["generators"]) & set(record.pinned)
    for pid, threads in now.items():
        assert set(threads.values()) == {base}, (pid, threads)


def _affinities(pid: int) -> dict[int, frozenset[int]]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = frozenset(os.sched_getaffinity(int(tid)))
        except OSError:  # the thread ended in between
            pass
    return out


@integration
def test_actors_receive_hardware_values_without_building_engines(loop, tmp_path, model_copy):
    from monarch.actor import this_host

    from forgelab.envs.actor import EnvActor
    from forgelab.engines.generator import Generator
    from forgelab.engines.trainer import ReferenceModel, Trainer

    cfg = RunConfig.from_yaml(_yaml(tmp_path, model_copy, HARDWARE))
    classes = {"generator": Generator, "trainer": Trainer, "reference": ReferenceModel, "envs": EnvActor}

    async def body():
        procs = this_host().spawn_procs(per_host={"procs": 1})
        try:
            # Constructed with the config (it is validated there); setup(), which builds on the device, is not run.
            actors = {s: procs.spawn(f"reach_{s}", cls, cfg.component(s)) for s, cls in classes.items()}
            return {s: await a.received_config.call_one() for s, a in actors.items()}
        finally:
            await procs.stop()

    got = loop.run_until_complete(body())
    for section, received in got.items():
        _check_received(section, received, cfg, model_copy, tmp_path, HARDWARE)
    assert got["trainer"].dtype == got["reference"].dtype == got["generator"].dtype == "bfloat16"
    assert got["trainer"].device == "cuda" and got["generator"].enforce_eager is False
