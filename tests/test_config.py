"""A bad config fails before any process starts, naming the field."""
import json

import pytest

from forgelab.config.run_config import ConfigError, RunConfig


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(d)


def cfg(model_dir, **sections):
    data = {"model": {"path": model_dir}}
    for k, v in sections.items():
        data.setdefault(k, {}).update(v)
    return data


def test_defaults_validate(model_dir):
    c = RunConfig.from_dict(cfg(model_dir))
    assert c.train.loss == "grpo" and c.rollout.task == "addition"


@pytest.mark.parametrize(
    "sections, field",
    [
        ({"train": {"loss": "ppo2"}}, "train.loss"),
        ({"train": {"batch_size": -4}}, "train.batch_size"),
        ({"train": {"batch_size": 60}}, "train.batch_size"),  # not a multiple of group_size 8
        ({"rollout": {"group_size": 1}}, "rollout.group_size"),
        ({"rollout": {"task": "sudoku"}}, "rollout.task"),
        ({"rollout": {"rewards": {"nope": 1.0}}}, "rollout.rewards"),
        ({"rollout": {"temperature": float("nan")}}, "rollout.temperature"),
        ({"train": {"lr": 0}}, "train.lr"),
        ({"train": {"max_policy_age": -1}}, "train.max_policy_age"),
        ({"placement": {"generator_replicas": 0}}, "placement.generator_replicas"),
        ({"placement": {"with_gpus": True}}, "placement.with_gpus"),  # no GPU on this host
        ({"placement": {"generator_replicas": 40, "threads": 4}}, "placement"),
        ({"train": {"stepz": 3}}, "train.stepz"),
        ({"train": {"steps": 3, "warmup_steps": 5}}, "train.warmup_steps"),
        ({"train": {"steps": "many"}}, "train.steps"),
    ],
)
def test_bad_field_is_named(model_dir, sections, field):
    with pytest.raises(ConfigError) as e:
        RunConfig.from_dict(cfg(model_dir, **sections))
    assert str(e.value).startswith(field), str(e.value)


def test_missing_model_dir(tmp_path):
    with pytest.raises(ConfigError, match=r"^model\.path: .*no config\.json"):
        RunConfig.from_dict({"model": {"path": str(tmp_path / "absent")}})


def test_yaml_errors(tmp_path, model_dir):
    p = tmp_path / "c.yaml"
    p.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        RunConfig.from_yaml(p)
    with pytest.raises(ConfigError, match="does not exist"):
        RunConfig.from_yaml(tmp_path / "nope.yaml")
    p.write_text(f"model: {{path: {model_dir}}}\ntrain: {{steps: 7, loss: dapo}}\n")
    c = RunConfig.from_yaml(p)
    assert (c.train.steps, c.train.loss) == (7, "dapo")


def test_cli_check_reports_bad_config(tmp_path, model_dir, capsys):
    from forgelab.cli import main

    p = tmp_path / "c.yaml"
    p.write_text(f"model: {{path: {model_dir}}}\ntrain: {{loss: nope}}\n")
    assert main(["check", str(p)]) == 2
    assert "train.loss" in capsys.readouterr().err
    assert main(["check", str(p), "--set", "train.loss=dapo"]) == 0


def test_cli_check_prints_the_resolved_nested_config(tmp_path, model_dir, capsys):
    import yaml

    from forgelab.cli import main

    p = tmp_path / "c.yaml"
    p.write_text(f"model: {{path: {model_dir}, dtype: bfloat16}}\ngenerator: {{max_num_seqs: 64}}\n"
                 "trainer: {micro_batch_size: 8, betas: [0.9, 0.95]}\n")
    assert main(["check", str(p), "--components"]) == 0
    first, rest = capsys.readouterr().out.split("\n", 1)
    assert first.startswith("config ok:")
    shown = yaml.safe_load(rest.split("\nmemory plan")[0])  # the config, then `forgelab plan`'s table
    assert shown["generator"]["max_num_seqs"] == 64 and shown["generator"]["enforce_eager"] is True  # default filled
    assert shown["trainer"]["micro_batch_size"] == 8 and shown["trainer"]["betas"] == [0.9, 0.95]
    # components: what each part is spawned with, shared values resolved from model / train
    assert shown["components"]["trainer"]["dtype"] == shown["components"]["reference"]["dtype"] == "bfloat16"
    assert shown["components"]["trainer"]["total_steps"] == shown["train"]["steps"]
    # the printed config (without components) loads back to the same config
    del shown["components"]
    assert RunConfig.from_dict(shown) == RunConfig.from_yaml(p)


def test_unknown_key_names_its_dotted_path_and_the_nearest_valid_key(model_dir):
    with pytest.raises(ConfigError, match=r"^train\.warmup_step: unknown field; did you mean train\.warmup_steps\?"):
        RunConfig.from_dict(cfg(model_dir, train={"warmup_step": 1}))
    with pytest.raises(ConfigError, match=r"^generator\.sampling\.top_kk: unknown field; did you mean generator\.sampling\.top_k\?"):
        RunConfig.from_dict(cfg(model_dir, generator={"sampling": {"top_kk": 3}}))
    with pytest.raises(ConfigError, match=r"^placment: unknown field; did you mean placement\?"):
        RunConfig.from_dict({**cfg(model_dir), "placment": {}})


def test_hosts_section(model_dir):
    job = {"kind": "process", "meshes": {"gen": 1, "train": 1}}
    c = RunConfig.from_dict(cfg(model_dir, hosts={"job": job, "generator": "gen", "trainer": "train"}))
    assert (c.hosts.generator, c.hosts.trainer, c.hosts.reference) == ("gen", "train", None)
    with pytest.raises(ConfigError, match=r"hosts\.job\.kind: must be one of"):
        RunConfig.from_dict(cfg(model_dir, hosts={"job": {"kind": "mainframe", "meshes": {"gen": 1}}}))
    with pytest.raises(ConfigError, match=r"hosts\.job\.meshes: required"):
        RunConfig.from_dict(cfg(model_dir, hosts={"job": {"kind": "process"}}))
    with pytest.raises(ConfigError, match=r"hosts\.generator: 'gen' names a host mesh but hosts\.job is null"):
        RunConfig.from_dict(cfg(model_dir, hosts={"generator": "gen"}))


@pytest.mark.parametrize("path", sorted(__import__("pathlib").Path(__file__).resolve().parents[1].glob("configs/*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    RunConfig.from_yaml(path)


@pytest.mark.parametrize("name", ["forgelab.config.value_types", "forgelab.engines.precision"])
def test_doctests_of_config_helpers(name):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, name


def test_config_loads_without_the_engines():
    # RunConfig's sections come from the component configs; those live in a module with no torch,
    # vLLM or Monarch import, so `forgelab check` and `forgelab plan` start in well under a second.
    import subprocess
    import sys

    code = ("import sys, forgelab.config.run_config; heavy = [m for m in ('torch', 'vllm', 'monarch', 'torchtitan') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_weight_transport_names_match_the_senders_registry():
    from forgelab.config.components import WEIGHT_TRANSPORTS
    from forgelab.weights.sender import TRANSPORTS

    assert WEIGHT_TRANSPORTS == tuple(TRANSPORTS)
