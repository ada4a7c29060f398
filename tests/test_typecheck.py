"""The type checker over forgelab's contracts: mypy (pinned), configured in pyproject.toml's ``[tool.mypy]``.

`make test` and `make test-fast` run this file. `test_strict_packages_pass` checks the packages in ``STRICT``
with the project's configuration (strict, no explicit ``Any``); the probes plant wrongly typed engine calls in a
temporary module and show that the same configuration reports each one, on its line, with its error code, and
nothing on the correctly typed calls beside them: the checker sees through forgelab's typed routing and through
its stubs of Monarch (``typings/monarch``), which ship no type information of their own.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "pyproject.toml"

#: The packages held to the strict contract. Issue #38's goal is all four; a package joins STRICT when
#: `python -m mypy forgelab/<package>` reports no error (PENDING lists the others).
GOAL = ["forgelab/controller", "forgelab/engines", "forgelab/experiments", "forgelab/runtime"]
STRICT = ["forgelab/runtime", "forgelab/experiments", "forgelab/engines", "forgelab/controller"]
PENDING = [p for p in GOAL if p not in STRICT]


def _mypy(*args: str) -> tuple[int, str]:
    """Run mypy with the project's configuration from the repository root; (exit status, output)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(CONFIG), "--cache-dir", str(ROOT / ".mypy_cache"),
         "--no-color-output", "--no-error-summary", "--show-error-codes", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    return done.returncode, done.stdout + done.stderr


def test_config_is_strict_for_the_goal_packages() -> None:
    cfg = tomllib.loads(CONFIG.read_text())["tool"]["mypy"]
    assert cfg["strict"] is True and cfg["disallow_any_explicit"] is True
    assert sorted(cfg["files"]) == GOAL
    assert cfg["mypy_path"] == "typings" and (ROOT / "typings" / "monarch" / "actor" / "__init__.pyi").is_file()
    strict = [o for o in cfg["overrides"] if "forgelab.runtime.*" in o["module"]]
    assert len(strict) == 1
    assert sorted(strict[0]["module"]) == sorted(p.replace("/", ".") + ".*" for p in GOAL)
    for flag in ("disallow_any_explicit", "disallow_any_generics", "disallow_untyped_defs",
                 "disallow_incomplete_defs", "disallow_untyped_calls", "disallow_untyped_decorators",
                 "warn_return_any", "no_implicit_reexport"):
        assert strict[0][flag] is True, flag
    assert STRICT and set(STRICT) <= set(GOAL)


def test_no_skipped_package_is_imported_by_the_checked_code() -> None:
    """pyproject skips (does not read) some third-party packages to save a cold run's time: a module there types
    as ``Any``, so none may be imported by the strict packages (a name from it would be checked less)."""
    cfg = tomllib.loads(CONFIG.read_text())["tool"]["mypy"]
    skipped = [m for o in cfg["overrides"] if o.get("follow_imports") == "skip" for m in o["module"]]
    followed = [m for o in cfg["overrides"] if o.get("follow_imports") == "normal" for m in o["module"]]
    assert skipped and not any(m.startswith("forgelab") or m in ("torch.*", "transformers.*") for m in skipped)

    def is_skipped(name: str) -> bool:
        def match(pat: str) -> bool:
            return name == pat or (pat.endswith(".*") and (name == pat[:-2] or name.startswith(pat[:-1])))
        if name in followed:
            return False
        best = max((p for p in skipped + followed if match(p)), key=len, default=None)
        return best is not None and best in skipped

    bad = []
    for package in STRICT:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
                bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if is_skipped(n)]
    assert not bad, "the strict packages import packages pyproject's mypy config skips:\n" + "\n".join(bad)


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """ONE mypy run over the strict packages and every probe below (a cold run, as in a fresh clone, costs about
    100 CPU-seconds, most of it reading the types of torch, vLLM, transformers and openai): (the probes' folder,
    exit status, output). The probes are plain modules beside the packages, checked with the same configuration."""
    probes = tmp_path_factory.mktemp("typecheck_probes")
    (probes / "typecheck_probe.py").write_text(textwrap.dedent(PROBE))
    for name, (wrong, _) in GENERATOR_PROBES.items():
        (probes / f"probe_{name}.py").write_text(textwrap.dedent(GENERATOR_PROBE).replace("{wrong}", wrong))
    rc, out = _mypy(*STRICT, *sorted(str(p) for p in probes.glob("*.py")))
    return probes, rc, out


def test_strict_packages_pass(checked: tuple[Path, int, str]) -> None:
    probes, _, out = checked
    errors = [ln for ln in out.splitlines() if ": error:" in ln and not ln.startswith(str(probes))]
    assert not errors, f"mypy reports errors in {STRICT} (run `python -m mypy {' '.join(STRICT)}`):\n{out}"
    assert "error:" in out, "the probes' planted errors are missing: did mypy check anything?\n" + out


def test_every_ignore_in_the_strict_packages_names_its_code_and_says_why() -> None:
    """An ignore is for a third-party call the stubs cannot type: it names the error code and a reason."""
    bad = []
    for package in STRICT:
        for path in sorted((ROOT / package).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if "type: ignore" in line and not re.search(r"type: ignore\[[a-z-, ]+\]\s+#\s*\S", line):
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "ignores without an error code and a reason:\n" + "\n".join(bad)


# Each line marked `# E: <code>` must get exactly that error; every other line none. A call through the
# overloaded `call_one` / `route` (typed by the endpoint, or untyped by name) that matches neither is reported
# as `call-overload`, naming the argument types it got.
PROBE = '''
from __future__ import annotations

from dataclasses import dataclass

import torch
from monarch.actor import endpoint
from transformers import AutoTokenizer

from forgelab.engines.trainer import Trainer
from forgelab.runtime import ActorHandle, Component, Service


@dataclass(frozen=True)
class Batch:
    tokens_B_T: list[list[int]]


class Learner(Component):
    @endpoint
    async def train_step(self, batch: Batch, lr: float) -> float:
        return lr * len(batch.tokens_B_T)


async def typed(learner: ActorHandle[Learner], svc: Service[Learner], trainer: ActorHandle[Trainer]) -> float:
    batch = Batch([[1, 2]])
    a = await learner.call_one(Learner.train_step, batch, 0.1)
    b = await svc.route(Learner.train_step, batch, lr=0.1)
    c = await learner.actor.train_step.call_one(batch, 0.1)
    d = sum(await learner.call(Learner.train_step, batch, 0.1))
    e = await trainer.call_one(Trainer.set_lr, 1e-5)
    return a + b + c + d + e


async def wrong(learner: ActorHandle[Learner], svc: Service[Learner], trainer: ActorHandle[Trainer]) -> None:
    batch = Batch([[1, 2]])
    await learner.call_one(Learner.train_step, {"tokens_B_T": [[1, 2]]}, 0.1)  # E: call-overload
    await svc.route(Learner.train_step, batch, lr="0.1")  # E: arg-type
    await svc.session("episode-7").route(Learner.train_step, batch)  # E: call-overload
    await learner.actor.train_step.call_one([[1, 2]], 0.1)  # E: arg-type
    loss = await learner.call_one(Learner.train_step, batch, 0.1)
    name: str = loss  # E: assignment
    await trainer.call_one(Trainer.set_lr, "1e-5")  # E: call-overload
    await trainer.call_one(Trainer.train_step, 3)  # E: call-overload
    await learner.train_step.call_one(batch, 0.1)  # E: attr-defined
    await learner.call_one(Learner.no_such_endpoint, batch)  # E: attr-defined


def third_party(logits: torch.Tensor) -> None:
    total: str = logits.sum()  # E: assignment
    tokenizer = AutoTokenizer.from_pretrained("tiny")
    text: int = tokenizer.decode([1, 2])  # E: assignment
'''


def test_probe_wrongly_typed_engine_calls_fail_the_checker(checked: tuple[Path, int, str]) -> None:
    probes, rc, out = checked
    probe = probes / "typecheck_probe.py"
    want = {(n, m.group(1)) for n, line in enumerate(textwrap.dedent(PROBE).splitlines(), 1)
            if (m := re.search(r"# E: ([a-z-]+)$", line))}
    # the probe imports engines modules that are not yet strict-clean: only the probe's own lines count here
    got = {(int(m.group(1)), m.group(2)) for m in re.finditer(
        rf"^{re.escape(str(probe))}:(\d+): error: .*\[([a-z-]+)\]$", out, re.M)}
    assert rc != 0
    assert got == want, f"expected errors at {sorted(want)}, mypy said:\n{out}"


# The generator's typed contract (`forgelab.engines.generator_service`, `forgelab.generation`): right calls and
# the fakes' conformance to the Protocols pass; a list where a `GenerateRequest` goes and an int where a
# `WeightUpdate` goes fail with arg-type, each on its own probe.
GENERATOR_PROBE = '''
from forgelab.engines.generator_service import GeneratorService
from forgelab.generation import Envs, GenerateRequest, Generators
from forgelab.testing.fakes import FakeEnvs, FakeGenerators


async def calls(svc: GeneratorService) -> None:
    await svc.generate(GenerateRequest(prompts_P=[[1, 2]], n=2))
    {wrong}

fakes: Generators = FakeGenerators(1)
envs: Envs = FakeEnvs.__new__(FakeEnvs)
'''
GENERATOR_PROBES = {"right": ("", False), "prompts_list": ("await svc.generate([[1, 2]])", True),
                    "int_update": ("await svc.update_weights(3)", True)}


def test_type_checker_refuses_a_wrongly_typed_generator_call(checked: tuple[Path, int, str]) -> None:
    probes, _, out = checked
    for name, (_, fails) in GENERATOR_PROBES.items():
        errors = [ln for ln in out.splitlines() if ln.startswith(str(probes / f"probe_{name}.py")) and ": error:" in ln]
        assert bool(errors) == fails, (name, out)
        assert all("arg-type" in ln for ln in errors), errors
