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

from numerics import check, max_abs_diff, model_tol

integration = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
SDK_PYTHON = ROOT / ".venv-tinker" / "bin" / "python"
RANK, STEPS = 8, 3
# A sampled token's logprob is above -LP_SCALE: 48 samples at temperature 1 draw a token of probability < e^-30
# with probability < 1e-11. The bound on two float32 forwards' logprobs is taken at this scale.
LP_SCALE = 30.0


@pytest.fixture(scope="module")
def served(loop: Any, tmp_path_factory: Any) -> Any:
    if not SDK_PYTHON.exists():
        pytest.skip(f"{SDK_PYTHON} is missing: `make tinker-cookbook` builds it (make test does)")
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
    """Run the unmodified recipe while this process's loop serves its requests; its exit status and stderr."""
    api, server, _, _ = served
    args = ["-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", f"model_name={api.base_model}",
            "renderer_name=role_colon", f"lora_rank={RANK}", "loss_fn=importance_sampling", "group_size=4",
            "groups_per_batch=4", f"max_steps={STEPS}", f"base_url={api.base_url}", f"log_path={log}",
            "behavior_if_log_dir_exists=delete", "eval_every=0", "save_every=2", *extra]
    env = {**os.environ, "TINKER_API_KEY": server.secret, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}

    async def run() -> tuple[int, bytes]:
        proc = await asyncio.create_subprocess_exec(str(SDK_PYTHON), *args, env=env, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=240)
        return proc.returncode or 0, out

    rc, out = loop.run_until_complete(run())
    return rc, out.decode(errors="replace")


@pytest.fixture(scope="module")
def recipe(loop: Any, served: Any) -> dict[str, Any]:
    _, _, init, out = served
    log = out / "math_rl"
    rc, text = _recipe(loop, served, log, f"load_checkpoint_path={init}")
    assert rc == 0, text[-6000:]
    metrics = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    checkpoints = [json.loads(line) for line in (log / "checkpoints.jsonl").read_text().splitlines()]
    return {"metrics": metrics, "checkpoints": checkpoints}


@integration
def test_recipe_default_creation_is_refused_naming_train_unembed(loop: Any, served: Any) -> None:
    """Without ``load_checkpoint_path`` the recipe creates a LoRA client with the SDK's ``train_unembed=True``
    (no recipe argument turns it off): the server refuses, and the SDK shows why."""
    _, _, _, out = served
    rc, text = _recipe(loop, served, out / "refused")
    assert rc != 0
    assert "train_unembed=True is not supported" in text, text[-3000:]


@integration
def test_recipe_metrics_move_as_its_loss_says(recipe: dict[str, Any]) -> None:
    """The recipe exits 0 after its ``STEPS`` optimizer steps, and its own metrics (metrics.jsonl) are what its
    ``importance_sampling`` loss ``-sum exp(logp - q) * A`` says. The arithmetic environment rewards a sample
    ``0.1 * (format - 1) + correct``; the shipped tiny model (trained on ``12+34=``) answers the recipe's chat
    prompts with neither the format nor the sum, so a step whose ``env/all/format`` and ``env/all/correct`` are 0
    rewards every sample -0.1, its group-centred advantages (the cookbook's ``rewards - rewards.mean()`` in float32)
    are exactly 0, and the loss's gradient, the server's ``grad_norm``, is exactly 0; a step with any other reward
    has a gradient. The sampler's logprobs (vLLM) and the trainer's (forward_backward) are one function's:
    ``optim/kl_sample_train_v1``, a mean of their differences, is within the float32 bound of two forwards."""
    import torch

    from forgelab.config.run_config import SHIPPED_MODEL

    rewards = torch.tensor([-0.1] * 4)  # group_size=4 samples of one problem, as the cookbook centres them
    assert (rewards - rewards.mean()).abs().max().item() == 0.0
    steps = [m for m in recipe["metrics"] if "grad_norm:mean" in m]
    assert [m["step"] for m in steps] == list(range(STEPS))
    for m in steps:
        assert m["env/all/total_episodes"] == 16 and math.isfinite(m["grad_norm:mean"])
        if m["env/all/format"] == 0.0 and m["env/all/correct"] == 0.0:
            assert m["env/all/reward/total"] == pytest.approx(-0.1, abs=1e-12) and m["grad_norm:mean"] == 0.0, m
        else:
            assert m["grad_norm:mean"] > 0.0, m
        check(abs(m["optim/kl_sample_train_v1"]), model_tol(SHIPPED_MODEL, LP_SCALE),
              "the recipe's sampler-vs-trainer logprob gap (kl_sample_train_v1)")
    assert recipe["checkpoints"][-1]["name"] == "final"


@integration
def test_recipe_checkpoint_loads_back_into_forgelab(loop: Any, served: Any, recipe: dict[str, Any]) -> None:
    """The recipe's final checkpoint (``checkpoints.jsonl``): the server's sampler for its ``sampler_path`` (the one
    the recipe saved) and the same path loaded back through `Primitives.create_sampling_client` sample the same
    tokens with the same seed; a forgelab `TrainingClient` that loads its ``state_path`` gives those tokens'
    logprobs within the float32 bound of two forwards. When no step had a gradient (see above), AdamW moved nothing
    (no gradient, no weight decay): the final state's logprobs are bit-equal to the fresh adapter's it started from."""
    from forgelab.config.run_config import SHIPPED_MODEL
    from forgelab.experiments.primitive_types import Datum, ModelInput, SamplingParams

    api, _, init, _ = served
    final = recipe["checkpoints"][-1]
    prompt = [1, 27, 28, 21, 29, 30, 39]  # bos "12+34="
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7)

    async def go() -> tuple[Any, Any, list[float], list[float]]:
        served_sampler = api.samplers[await api._sampler_for(final["sampler_path"], None)].client
        reported = await served_sampler.sample(prompt, 1, params)
        loaded = await api.primitives.create_sampling_client(api.local_path(final["sampler_path"]))
        again = await loaded.sample(prompt, 1, params)
        client = await api.primitives.create_lora_training_client("reloaded")
        try:
            await client.load_state(api.local_path(final["state_path"], "weights"), with_optimizer=False)
            tokens = list(reported.sequences[0].tokens)
            full = prompt + tokens
            data = [Datum(model_input=ModelInput.from_ints(full[:-1]),
                          loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)})]
            fwd = (await client.forward(data)).loss_fn_outputs[0]["logprobs"].tolist()
            await client.load_state(api.local_path(init, "weights"), with_optimizer=False)
            start = (await client.forward(data)).loss_fn_outputs[0]["logprobs"].tolist()
            return reported, again, fwd, start
        finally:
            await client.close()

    reported, again, fwd, start = loop.run_until_complete(go())
    forward = fwd[-len(reported.sequences[0].tokens):]
    seq, seq2 = reported.sequences[0], again.sequences[0]
    assert list(seq2.tokens) == list(seq.tokens) and len(seq.tokens) >= 1
    check(max_abs_diff(seq2.logprobs, seq.logprobs), model_tol(SHIPPED_MODEL, LP_SCALE),
          "the recipe's sampler vs the same checkpoint loaded back")
    check(max_abs_diff(forward, seq.logprobs), model_tol(SHIPPED_MODEL, LP_SCALE),
          "the recipe's sampler vs its state loaded into a forgelab TrainingClient")
    if all(m["grad_norm:mean"] == 0.0 for m in recipe["metrics"] if "grad_norm:mean" in m):
        assert fwd == start


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
