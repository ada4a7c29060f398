"""A ``tinker-cookbook==0.6.1`` recipe, unmodified, against forgelab's Tinker server (`forgelab.serve.tinker_api`).

One set of shared engines (2 LoRA slots, the shipped tiny model) and the server run in this process for the
module; the cookbook runs in the SDK's virtualenv (``.venv-tinker``, `make tinker-cookbook`,
requirements-tinker-cookbook.lock) as a subprocess: ``python -m tinker_cookbook.recipes.math_rl.train
env=arithmetic`` (its problems are generated locally), arguments only. The recipe's own creation of its training
client asks for ``train_unembed=True`` (the SDK's default; rl/train.py passes no argument for it), which this server
refuses (forgelab's LoRA does not adapt the output projection); its ``load_checkpoint_path`` argument starts it
from a saved state instead, here the fresh adapter of a forgelab client (which adapts no unembedding).

The same venv has torch, so the SDK's client-side ``forward_backward_custom`` and its ``RestClient`` checkpoint
calls run here too (tests/tinker_custom_client.py), against the same server.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from numerics import check, max_abs, max_abs_diff, model_tol

integration = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
SDK_PYTHON = ROOT / ".venv-tinker" / "bin" / "python"
COOKBOOK_STAMP = ROOT / ".venv-tinker" / ".forgelab-cookbook"  # `make tinker-cookbook` writes it last
RANK, STEPS = 8, 3
# A sampled token's logprob is above -LP_SCALE: 48 samples at temperature 1 draw a token of probability < e^-30
# with probability < 1e-11. The bound on two float32 forwards' logprobs is taken at this scale.
LP_SCALE = 30.0
CE_LR = 1e-3
"""The cross_entropy run's learning rate (small: its first step must stay where the loss is near linear)."""


@pytest.fixture(scope="module")
def served(loop: Any, tmp_path_factory: Any) -> Any:
    if not COOKBOOK_STAMP.exists():
        pytest.skip(f"{COOKBOOK_STAMP} is missing: `make tinker-cookbook` installs the cookbook into .venv-tinker "
                    "(make test does)")
    from forgelab.config.components import LoraConfig
    from forgelab.config.run_config import EvalConfig, RunConfig, TrackingConfig
    from forgelab.experiments.primitives import Primitives
    from forgelab.experiments.variants import SharedEngines
    from forgelab.serve.http import LoopbackServer
    from forgelab.serve.tinker_api import serve_primitives

    out = tmp_path_factory.mktemp("cookbook")
    cfg = RunConfig(name="cookbook", lora=LoraConfig(enabled=True, rank=RANK, alpha=16.0), eval=EvalConfig(every=0),
                    tracking=TrackingConfig(out_dir=str(out)))
    engines = SharedEngines(cfg, slots=2)
    prims = Primitives(engines, out / "ckpt")
    server = LoopbackServer("tinker")
    api = loop.run_until_complete(serve_primitives(prims, server))

    async def fresh_state() -> str:
        client = await prims.create_lora_training_client("init")
        try:
            await client.save_state("s0")
        finally:
            await client.close()
        return api.tinker_path("init", "s0", "weights")

    init = loop.run_until_complete(fresh_state())
    yield api, server, init, out
    loop.run_until_complete(api.close())
    loop.run_until_complete(server.stop())
    loop.run_until_complete(engines.shutdown())


def _recipe(loop: Any, served: Any, log: Path, *extra: str) -> tuple[int, str]:
    """Run the unmodified recipe while this process's loop serves its requests; its exit status and output."""
    api, server, _, _ = served
    args = ["-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", f"model_name={api.base_model}",
            "renderer_name=role_colon", f"lora_rank={RANK}", "group_size=4", "groups_per_batch=4",
            f"max_steps={STEPS}", f"base_url={api.base_url}", f"log_path={log}", "behavior_if_log_dir_exists=delete",
            "eval_every=0", *extra]
    env = {**os.environ, "TINKER_API_KEY": server.secret, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}

    async def run() -> tuple[int, bytes]:
        proc = await asyncio.create_subprocess_exec(str(SDK_PYTHON), *args, env=env, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=240)
        return proc.returncode or 0, out

    rc, out = loop.run_until_complete(run())
    return rc, out.decode(errors="replace")


def _ran(loop: Any, served: Any, name: str, *extra: str) -> dict[str, Any]:
    _, _, init, out = served
    log = out / name
    rc, text = _recipe(loop, served, log, f"load_checkpoint_path={init}", *extra)
    assert rc == 0, text[-6000:]
    metrics = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    checkpoints = [json.loads(line) for line in (log / "checkpoints.jsonl").read_text().splitlines()]
    return {"metrics": metrics, "checkpoints": checkpoints}


@pytest.fixture(scope="module")
def recipe(loop: Any, served: Any) -> dict[str, Any]:
    """The recipe's RL: ``importance_sampling`` on its group-centred rewards."""
    return _ran(loop, served, "math_rl", "loss_fn=importance_sampling", "save_every=2")


@pytest.fixture(scope="module")
def recipe_ce(loop: Any, served: Any) -> dict[str, Any]:
    """The recipe with ``loss_fn=cross_entropy`` (its datums carry no weights: every target token weighs 1), a
    checkpoint after every step."""
    return _ran(loop, served, "math_rl_ce", "loss_fn=cross_entropy", f"learning_rate={CE_LR}", "save_every=1")


def _steps(run: dict[str, Any]) -> list[dict[str, Any]]:
    steps = [m for m in run["metrics"] if "grad_norm:mean" in m]
    assert [m["step"] for m in steps] == list(range(STEPS))
    return steps


@integration
def test_recipe_default_creation_is_refused_naming_train_unembed(loop: Any, served: Any) -> None:
    """Without ``load_checkpoint_path`` the recipe creates a LoRA client with the SDK's ``train_unembed=True``
    (no recipe argument turns it off): the server refuses, and the SDK shows why."""
    _, _, _, out = served
    rc, text = _recipe(loop, served, out / "refused", "loss_fn=importance_sampling")
    assert rc != 0
    assert "train_unembed=True is not supported" in text, text[-3000:]


@integration
def test_recipe_rl_metrics_are_what_its_loss_says(recipe: dict[str, Any]) -> None:
    """The recipe exits 0 after its ``STEPS`` optimizer steps, and its own metrics (metrics.jsonl) are what its
    ``importance_sampling`` loss ``-sum exp(logp - q) * A`` says. The arithmetic environment rewards a sample
    ``0.1 * (format - 1) + correct``; the shipped tiny model (trained on ``<|user|>12+34=<|end|><|assistant|>``)
    answers the recipe's role-colon prompts with its end token at once (``optim/entropy``, the sampled tokens'
    mean -logprob, is about 1e-3), so no group is mixed (``by_group/frac_mixed`` 0, ``reward/total`` -0.1): every
    group-centred advantage (the cookbook's ``rewards - rewards.mean()`` in float32) is exactly 0, and so is the
    loss's gradient, the server's ``grad_norm``. A step with a mixed group has a gradient. The sampler's
    logprobs (vLLM) and the trainer's (forward_backward) are one function's: ``optim/kl_sample_train_v1``, a
    mean of their differences, is within the float32 bound of two forwards."""
    import torch

    from forgelab.config.run_config import SHIPPED_MODEL

    rewards = torch.tensor([-0.1] * 4)  # group_size=4 samples of one problem, as the cookbook centres them
    assert (rewards - rewards.mean()).abs().max().item() == 0.0
    for m in _steps(recipe):
        assert m["env/all/total_episodes"] == 16 and math.isfinite(m["grad_norm:mean"])
        if m["env/all/by_group/frac_mixed"] == 0.0:
            assert m["grad_norm:mean"] == 0.0, m
        else:
            assert m["grad_norm:mean"] > 0.0, m
        check(abs(m["optim/kl_sample_train_v1"]), model_tol(SHIPPED_MODEL, LP_SCALE),
              "the recipe's sampler-vs-trainer logprob gap (kl_sample_train)")
    assert recipe["checkpoints"][-1]["name"] == "final"


def _trained(api: Any, run: dict[str, Any], step: int) -> tuple[list[list[int]], list[list[float]]]:
    """The token sequences the recipe's ``forward_backward`` of optimizer step ``step`` sent, and the logprobs the
    server answered for them (before the update): the rollout rows its training client's records wrote on the
    server (`forgelab.experiments.primitive_records`, status ``trained``)."""
    import forgelab.lab

    model_id = run["checkpoints"][0]["state_path"].removeprefix("tinker://").split("/")[0]
    rollouts = forgelab.lab.open(Path(api.primitives.root) / model_id).run.rollouts
    rows = rollouts[(rollouts["status"] == "trained") & (rollouts["trained_step"] == step)]
    return ([list(p) + list(c) for p, c in zip(rows["prompt_ids"], rows["completion_ids"])],
            [list(x) for x in rows["trainer_logprobs"]])


@integration
def test_recipe_cross_entropy_steps_raise_what_they_trained_on(loop: Any, served: Any,
                                                               recipe_ce: dict[str, Any]) -> None:
    """With ``loss_fn=cross_entropy`` the recipe's loss is ``-sum logp`` over every target of its batch (prompt
    and sample: its datums carry no weights), which has a gradient whatever the rewards: ``grad_norm`` > 0 every
    step, and the sampler it saves after each step serves the trained weights (``kl_sample_train`` within the
    float32 bound). What the loss says the step does: its first optimizer step (AdamW from a fresh state moves
    each parameter by ``-lr * g / (|g| + eps)``, a descent direction, and ``CE_LR`` is small enough that the
    first-order decrease dominates) raises the summed logprob of the batch it trained on. Checked by forgelab,
    outside the recipe: the batch as the server recorded it, scored by a forgelab client holding the recipe's
    starting state, then its checkpoint ``000001``. The server's own report of that batch's logprobs (the
    records' ``trainer_logprobs``, before the update) agrees with the first score within the float32 bound."""
    from forgelab.config.run_config import SHIPPED_MODEL
    from forgelab.experiments.primitive_types import Datum, ModelInput

    api, _, init, _ = served
    for m in _steps(recipe_ce):
        assert m["grad_norm:mean"] > 0.0, m
        check(abs(m["optim/kl_sample_train_v1"]), model_tol(SHIPPED_MODEL, LP_SCALE),
              "the recipe's sampler-vs-trainer logprob gap (kl_sample_train)")
    first = next(c for c in recipe_ce["checkpoints"] if c["name"] == "000001")
    seqs, reported = _trained(api, recipe_ce, 1)
    assert len(seqs) == 16

    async def score() -> tuple[list[list[float]], list[list[float]]]:
        client = await api.primitives.create_lora_training_client("ce-score")
        data = [Datum(model_input=ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:]})
                for s in seqs]
        try:
            await client.load_state(api.local_path(init, "weights"), with_optimizer=False)
            before = [o["logprobs"].tolist() for o in (await client.forward(data)).loss_fn_outputs]
            await client.load_state(api.local_path(first["state_path"], "weights"), with_optimizer=False)
            after = [o["logprobs"].tolist() for o in (await client.forward(data)).loss_fn_outputs]
            return before, after
        finally:
            await client.close()

    before, after = loop.run_until_complete(score())
    assert sum(map(sum, after)) > sum(map(sum, before)), (sum(map(sum, before)), sum(map(sum, after)))
    for r, b in zip(reported, before):
        check(max_abs_diff(r, b), model_tol(SHIPPED_MODEL, max_abs(b)), "the server's logprobs of the batch")


@integration
def test_recipe_checkpoint_loads_back_into_forgelab(loop: Any, served: Any, recipe: dict[str, Any],
                                                    recipe_ce: dict[str, Any]) -> None:
    """The cross_entropy run's final checkpoint (``checkpoints.jsonl``; its weights moved): the server's sampler
    for its ``sampler_path`` (the one the recipe saved) and the same path loaded back through
    `Primitives.create_sampling_client` sample the same tokens with the same seed; a forgelab `TrainingClient`
    that loads its ``state_path`` gives those tokens' logprobs within the float32 bound of two forwards, and
    other logprobs than the recipe's starting state. The importance_sampling run's final state, whose steps had
    no gradient (above), gives the starting state's logprobs bit for bit (AdamW moves nothing without a gradient
    and without weight decay)."""
    from forgelab.config.run_config import SHIPPED_MODEL
    from forgelab.experiments.primitive_types import Datum, ModelInput, SamplingParams

    api, _, init, _ = served
    final = recipe_ce["checkpoints"][-1]
    assert final["name"] == "final"
    rl_final = recipe["checkpoints"][-1]
    prompt = [1, 27, 28, 21, 29, 30, 39]  # bos "12+34="
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7)

    async def go() -> tuple[Any, Any, list[list[float]]]:
        served_sampler = api.samplers[await api._sampler_for(final["sampler_path"], None)].client
        reported = await served_sampler.sample(prompt, 1, params)
        loaded = await api.primitives.create_sampling_client(api.local_path(final["sampler_path"]))
        again = await loaded.sample(prompt, 1, params)
        client = await api.primitives.create_lora_training_client("reloaded")
        full = prompt + list(reported.sequences[0].tokens)
        data = [Datum(model_input=ModelInput.from_ints(full[:-1]), loss_fn_inputs={"target_tokens": full[1:]})]
        scores = []
        try:
            for state in (final["state_path"], init, rl_final["state_path"]):
                await client.load_state(api.local_path(state, "weights"), with_optimizer=False)
                scores.append((await client.forward(data)).loss_fn_outputs[0]["logprobs"].tolist())
            return reported, again, scores
        finally:
            await client.close()

    reported, again, (fwd, start, rl) = loop.run_until_complete(go())
    seq, seq2 = reported.sequences[0], again.sequences[0]
    forward = fwd[-len(seq.tokens):]
    assert list(seq2.tokens) == list(seq.tokens) and len(seq.tokens) >= 1
    check(max_abs_diff(seq2.logprobs, seq.logprobs), model_tol(SHIPPED_MODEL, LP_SCALE),
          "the recipe's sampler vs the same checkpoint loaded back")
    check(max_abs_diff(forward, seq.logprobs), model_tol(SHIPPED_MODEL, LP_SCALE),
          "the recipe's sampler vs its state loaded into a forgelab TrainingClient")
    assert max_abs_diff(fwd, start) > model_tol(SHIPPED_MODEL, max_abs(start)), "the cross_entropy steps moved nothing"
    if all(m["grad_norm:mean"] == 0.0 for m in _steps(recipe)):
        assert rl == start


# --------------------------------------------- forward_backward_custom and checkpoints through the SDK, with torch
CUSTOM_CLIENT = Path(__file__).resolve().parent / "tinker_custom_client.py"
CUSTOM_LR = 1e-2
PROMPT = [1, 27, 28, 21, 29, 30, 39]  # bos "12+34="
# two sequences (a prompt and its answer; weights 0 on the prompt's targets, 1 and 0.5 on the answers')
CUSTOM_DATA = [(PROMPT + [30, 32, 24, 8], [0.0] * 6 + [1.0] * 4), ([1, 27, 21, 28, 8], [0.0, 0.0, 0.5, 0.5])]


def _custom_loss(data: Any, logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
    """tests/tinker_custom_client.py's loss, in process: ``-sum_i sum_t w_it * exp(logp_it)``."""
    import torch

    total = torch.zeros((), dtype=torch.float32)
    for d, lp in zip(data, logprobs):
        total = total - (d.loss_fn_inputs["weights"].float() * torch.exp(lp)).sum()
    return total, {"prob_sum": float(-total.detach())}


@pytest.fixture(scope="module")
def custom_run(loop: Any, served: Any) -> dict[str, Any]:
    """tests/tinker_custom_client.py against the server; a directory ``victim`` the outside paths would name."""
    api, server, _, out = served
    victim = Path(api.primitives.root).parent / "state" / "victim"  # what <root>/../state/victim names
    victim.mkdir(parents=True)
    (victim / "keep").write_text("outside the checkpoint root")
    spec = {"base_model": api.base_model, "rank": RANK, "lr": CUSTOM_LR, "data": CUSTOM_DATA,
            "outside": ["tinker://../weights/victim", "tinker://%2E%2E/weights/victim"]}
    env = {**os.environ, "TINKER_BASE_URL": api.base_url, "TINKER_API_KEY": server.secret, "TINKER_TELEMETRY": "0",
           "HF_HUB_OFFLINE": "1"}

    async def run() -> tuple[int, bytes, bytes]:
        proc = await asyncio.create_subprocess_exec(str(SDK_PYTHON), str(CUSTOM_CLIENT), json.dumps(spec), env=env,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=240)
        return proc.returncode or 0, stdout, stderr

    rc, stdout, stderr = loop.run_until_complete(run())
    assert rc == 0, stderr.decode()[-4000:]
    return {**json.loads(stdout.decode().strip().splitlines()[-1]), "victim": victim}


@integration
def test_sdk_forward_backward_custom_equals_primitives(loop: Any, served: Any, custom_run: dict[str, Any]) -> None:
    """The SDK's ``forward_backward_custom`` (torch in the client: a forward, the loss and its gradient there, then
    ``cross_entropy`` with weights ``-dC/dlogp``) and `TrainingClient.forward_backward_custom` in process on a
    fresh slot of the same engines are the same computation on the same numbers (float32 logprobs cross protobuf
    exactly; the loss and its gradient are the same torch ops on the same CPU build; the trainer runs the same
    batch): the forward's logprobs and the custom loss are bit-equal, and after one ``optim_step`` the adapter and
    AdamW state (`TrainingClient.fingerprint`, SHA-256) are identical."""
    from forgelab.experiments.primitive_types import AdamParams, Datum, ModelInput

    api, _, _, _ = served

    async def reference() -> tuple[Any, dict[str, object], dict[str, object]]:
        client = await api.primitives.create_lora_training_client("custom-reference")
        sdk_state = await api.primitives.create_lora_training_client("custom-sdk-state")
        try:
            data = [Datum(model_input=ModelInput.from_ints(t[:-1]), loss_fn_inputs={"target_tokens": t[1:],
                                                                                      "weights": w})
                    for t, w in CUSTOM_DATA]
            out = await client.forward_backward_custom(data, _custom_loss)
            await client.optim_step(AdamParams(learning_rate=CUSTOM_LR))
            await sdk_state.load_state(api.local_path(custom_run["state"], "weights"), with_optimizer=True)
            return out, await client.fingerprint(), await sdk_state.fingerprint()
        finally:
            await client.close()
            await sdk_state.close()

    ref, fp_ref, fp_sdk = loop.run_until_complete(reference())
    assert custom_run["loss_fn_outputs"] == [o["logprobs"].tolist() for o in ref.loss_fn_outputs]
    assert custom_run["metrics"]["loss:sum"] == ref.metrics["loss:sum"] < 0.0
    assert fp_sdk == fp_ref, (fp_sdk, fp_ref)


@integration
def test_sdk_lists_and_deletes_checkpoints(custom_run: dict[str, Any]) -> None:
    """``RestClient.list_checkpoints(model_id)`` shows the client's ``save_state`` and ``save_weights_for_sampler``
    checkpoints (type, ``tinker://`` path, size); ``delete_checkpoint_from_tinker_path`` removes the sampler's,
    which then is no longer listed, cannot be deleted again nor sampled from; a path that would leave the
    checkpoint root (``..``, plain or percent-encoded) is refused and the directory it names is still there."""
    listed = {c[0]: c for c in custom_run["listed"]}
    assert set(listed) == {"weights/custom", "sampler_weights/custom-sampler"}, custom_run["listed"]
    assert listed["weights/custom"][1:3] == ["training", custom_run["state"]]
    assert listed["sampler_weights/custom-sampler"][1:3] == ["sampler", custom_run["sampler"]]
    assert all(c[3] > 0 for c in custom_run["listed"])
    assert custom_run["after"] == [custom_run["state"]]
    errors = custom_run["errors"]
    assert "no checkpoint" in (errors["delete_again"] or ""), errors
    assert "no checkpoint" in (errors["sample_deleted"] or ""), errors
    outside = [v for k, v in errors.items() if ".." in k or "%2E" in k]
    assert len(outside) == 4 and all(e is not None for e in outside), errors
    assert (custom_run["victim"] / "keep").read_text() == "outside the checkpoint root"
