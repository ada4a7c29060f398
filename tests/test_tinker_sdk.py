"""Tinker's REST API (`forgelab.serve.tinker_api`) against the unmodified ``tinker==0.38.0`` SDK.

One set of shared engines (2 LoRA slots, the shipped tiny model) and the server run in this process for the
module; the SDK runs in its own virtualenv (``.venv-tinker``, `make tinker-venv`, requirements-tinker.lock) as a
subprocess, tests/tinker_sdk_client.py: a plain Tinker program that creates a LoRA training client, takes K
``cross_entropy`` steps on one batch, saves weights for a sampler, samples with logprobs, scores the samples
with ``forward``, and records the errors of a wrong key, ``train_unembed`` and an unsupported loss.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from numerics import check, max_abs, max_abs_diff, model_tol

integration = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
SDK_PYTHON = ROOT / ".venv-tinker" / "bin" / "python"
CLIENT = Path(__file__).resolve().parent / "tinker_sdk_client.py"
RANK, K, LR = 8, 5, 2e-3
PROMPT = [1, 27, 28, 21, 29, 30, 39]  # bos "12+34="
# two sequences (a prompt and its answer; weights 0 on the prompt's targets, 1 on the answer's)
SEQS = [(PROMPT, [30, 32, 24, 8]), ([1, 27, 21], [28, 8])]


def _batch() -> list[tuple[list[int], list[float]]]:
    return [(p + a, [0.0] * (len(p) - 1) + [1.0] * len(a)) for p, a in SEQS]


# ------------------------------------------------------------------------------------------- in process
class _FakeClient:
    def __init__(self) -> None:
        self.closed = False

    async def close(self) -> None:
        self.closed = True


def _fake_api(tmp_path: Path, **options: Any) -> Any:
    """A `TinkerAPI` over `Primitives` whose engines are never started: its slots are `_FakeClient`s."""
    from types import SimpleNamespace

    from forgelab.config.components import LoraConfig
    from forgelab.config.run_config import RunConfig
    from forgelab.experiments.primitives import Primitives
    from forgelab.serve.tinker_api import TinkerAPI

    class FakePrimitives(Primitives):
        async def create_lora_training_client(self, name: str | None = None) -> Any:
            self.path(name or "x")
            return _FakeClient()

    cfg = RunConfig(name="fake", lora=LoraConfig(enabled=True, rank=RANK))
    return TinkerAPI(FakePrimitives(SimpleNamespace(config=cfg), tmp_path), **options)


def test_requests_of_a_model_run_in_seq_order(tmp_path: Path) -> None:
    """Requests arriving as seq 3, 2, 1 run as 1, 2, 3 (each after the previous one finished); a retried seq gets
    the future it already has; a request whose predecessor never arrives fails after ``gap_s``, naming it."""
    from forgelab.serve.tinker_api import _Model

    async def main() -> tuple[list[int], list[str], str]:
        api = _fake_api(tmp_path, gap_s=0.2)
        m = _Model("m", "s", _FakeClient())
        ran: list[int] = []

        def work(seq: int) -> Any:
            async def go() -> int:
                ran.append(seq)
                await asyncio.sleep(0)  # let the others try to jump the queue
                return seq
            return go

        futs = [api._in_order(m, seq, work(seq))["request_id"] for seq in (3, 2, 1)]
        again = api._in_order(m, 2, work(2))["request_id"]
        assert again == futs[1]
        await asyncio.gather(*(api.futures[f].task for f in futs))
        lonely = api._in_order(m, 6, work(6))["request_id"]  # 4 and 5 never come
        with pytest.raises(LookupError) as err:
            await api.futures[lonely].task
        return ran, futs, str(err.value)

    ran, _, err = asyncio.run(main())
    assert ran == [1, 2, 3]
    assert "seq_id 6 waited" in err and "seq_id 4, which never arrived" in err


def test_refusals_and_session_timeout(tmp_path: Path) -> None:
    """``create_model`` refuses another base model, full fine-tuning, another rank and ``train_unembed``, naming
    what is served; ``tinker://`` paths resolve only to existing checkpoints inside the root; a session whose
    heartbeats stopped longer than ``session_timeout_s`` ago loses its models when a model is next created."""
    from forgelab.serve.tinker_api import UserError, _Session

    api = _fake_api(tmp_path, session_timeout_s=60.0)
    lora = {"rank": RANK, "train_unembed": False}
    api._check_lora(lora, None)
    for bad, says in [(None, "full fine-tuning"), ({**lora, "rank": 4}, f"rank={RANK}"),
                      ({"rank": RANK}, "train_unembed=False"), ({**lora, "seed": 99}, "seed=0")]:
        with pytest.raises(UserError, match=says):
            api._check_lora(bad, None)
    with pytest.raises(UserError, match="is not served here"):
        api._check_base("Qwen/Qwen3-8B")
    api._check_base(api.base_model)
    for path, says in [("tinker://../weights/s1", "plain name"), ("tinker://m/weights/a/b", "not a weights"),
                       ("/etc/passwd", "not a weights"), ("tinker://m/weights/s1", "no checkpoint")]:
        with pytest.raises(ValueError, match=says):
            api.local_path(path, "weights")
    (tmp_path / "m" / "state" / "s1").mkdir(parents=True)
    assert api.local_path("tinker://m/weights/s1", "weights") == str(tmp_path / "m" / "state" / "s1")

    async def main() -> tuple[Any, Any]:
        old = api.sessions["old"] = _Session("old", time.monotonic())
        first = await api._new_model(old, 0)
        old.last_seen -= 61.0  # its heartbeats stopped 61 s ago
        new = api.sessions["new"] = _Session("new", time.monotonic())
        await api._new_model(new, 0)
        return first, new

    first, new = asyncio.run(main())
    assert first.client.closed and "old" not in api.sessions and first.model_id not in api.models
    assert list(api.models) == ["new:train:0"] and new.models == ["new:train:0"]


@pytest.fixture(scope="module")
def served(loop: Any, tmp_path_factory: Any) -> Any:
    if not SDK_PYTHON.exists():
        pytest.skip(f"{SDK_PYTHON} is missing: `make tinker-venv` builds the SDK's virtualenv (make test does)")
    from forgelab.config.components import LoraConfig
    from forgelab.config.run_config import EvalConfig, RunConfig, TrackingConfig
    from forgelab.experiments.primitives import Primitives
    from forgelab.experiments.variants import SharedEngines
    from forgelab.serve.http import LoopbackServer
    from forgelab.serve.tinker_api import serve_primitives

    out = tmp_path_factory.mktemp("tinker")
    cfg = RunConfig(name="tinker", lora=LoraConfig(enabled=True, rank=RANK, alpha=16.0), eval=EvalConfig(every=0),
                    tracking=TrackingConfig(out_dir=str(out)))
    engines = SharedEngines(cfg, slots=3)  # the SDK script holds three clients at once (A, B, A resumed)
    prims = Primitives(engines, out / "ckpt")
    server = LoopbackServer("tinker")
    api = loop.run_until_complete(serve_primitives(prims, server))
    yield api, server
    loop.run_until_complete(api.close())
    loop.run_until_complete(server.stop())
    loop.run_until_complete(engines.shutdown())


@pytest.fixture(scope="module")
def sdk_run(loop: Any, served: Any) -> dict[str, Any]:
    """The client's JSON. It runs while this process's loop serves its requests (awaited, not blocked on)."""
    api, server = served
    spec = {"model": api.base_model, "rank": RANK, "data": _batch(), "steps": K, "lr": LR, "prompt": PROMPT,
            "text": "12+34=", "outside": "x"}
    env = {**os.environ, "TINKER_BASE_URL": api.base_url, "TINKER_API_KEY": server.secret, "TINKER_TELEMETRY": "0",
           "HF_HUB_OFFLINE": "1"}

    async def run() -> tuple[int, bytes, bytes]:
        proc = await asyncio.create_subprocess_exec(str(SDK_PYTHON), str(CLIENT), json.dumps(spec), env=env,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=240)
        return proc.returncode or 0, stdout, stderr

    rc, stdout, stderr = loop.run_until_complete(run())
    assert rc == 0, stderr.decode()[-4000:]
    return dict(json.loads(stdout.decode().strip().splitlines()[-1]))


@integration
def test_sdk_loss_equals_primitives_and_decreases(loop: Any, served: Any, sdk_run: dict[str, Any]) -> None:
    """The SDK's first ``loss:sum`` and per-datum logprobs are bit-equal to the same datums' ``forward_backward``
    through `Primitives` on a fresh slot of the same engines (the same path: the same adapter template, the
    same batch, the same trainer call; only the transport differs, and float32 logprobs and float64 metrics
    cross protobuf exactly). K optimizer steps on the batch lower ``loss:sum`` every step."""
    from forgelab.experiments.primitive_types import Datum, ModelInput

    api, _ = served
    assert sdk_run["version"] == "0.38.0"

    async def reference() -> Any:
        client = await api.primitives.create_lora_training_client("reference")
        try:
            data = [Datum(model_input=ModelInput.from_ints(t[:-1]), loss_fn_inputs={"target_tokens": t[1:],
                                                                                      "weights": w})
                    for t, w in _batch()]
            return await client.forward_backward(data, "cross_entropy")
        finally:
            await client.close()

    ref = loop.run_until_complete(reference())
    losses = sdk_run["losses"]
    assert losses[0] == ref.metrics["loss:sum"]
    assert sdk_run["logprobs"] == [o["logprobs"].tolist() for o in ref.loss_fn_outputs]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


@integration
def test_sdk_save_state_and_resume_continue_exactly(served: Any, sdk_run: dict[str, Any]) -> None:
    """``save_state`` gives a ``tinker://`` path; one more step from there (its loss, and the loss after it:
    the weights and AdamW moments it moved) is bit-identical three ways: straight on, after
    ``load_state_with_optimizer`` on the same client, and on a new client from
    ``create_training_client_from_state_with_optimizer``."""
    assert sdk_run["state"].startswith("tinker://") and sdk_run["state"].endswith("/weights/s1")
    first, again, other = sdk_run["resume"]
    assert first == again == other, sdk_run["resume"]
    assert first[1] < first[0]


@integration
def test_sdk_samples_logprobs_equal_a_forward(served: Any, sdk_run: dict[str, Any]) -> None:
    """The sampler from ``save_weights_and_get_sampling_client`` (vLLM with the adapter) returns each sampled
    token's logprob; the trainer's ``forward`` of prompt + sample under the same adapter gives the same numbers
    within the float32 bound of two forwards of the model (numerics.model_tol at the logprobs' scale). An
    ``importance_sampling`` forward-backward on a sample with its own logprobs (on-policy) gives ``-n``."""
    from forgelab.config.run_config import SHIPPED_MODEL

    samples = sdk_run["samples"]
    assert len(samples) == 2
    for s in samples:
        assert 1 <= len(s["tokens"]) <= 6 and len(s["logprobs"]) == len(s["tokens"]) == len(s["forward"])
        assert s["stop"] in ("stop", "length")
        check(max_abs_diff(s["logprobs"], s["forward"]), model_tol(SHIPPED_MODEL, max_abs(s["forward"])),
              "sampled logprobs vs the trainer's forward")
    # importance_sampling on the first sample, on-policy: -sum_i exp(logp_i - q_i) over its n tokens, each
    # |logp_i - q_i| <= tol (the bound just checked), so |loss + n| <= n * expm1(tol), plus float32 rounding of
    # n terms near 1 (n ulps of n)
    n = len(samples[0]["tokens"])
    tol = model_tol(SHIPPED_MODEL, max_abs(samples[0]["forward"]))
    check(abs(sdk_run["importance_sampling"] + n), n * math.expm1(tol) + n * n * 2.0 ** -23,
          "on-policy importance_sampling loss vs -n")


@integration
def test_sdk_sees_refusals(served: Any, sdk_run: dict[str, Any]) -> None:
    """A wrong key is refused (401, naming the run's key); the SDK's default ``train_unembed=True`` and the
    ``dro`` loss answer errors naming what is supported; a ``tinker://`` path that would leave the checkpoint
    root is refused; the tokenizer loads from the local model path."""
    assert sdk_run["wrong_key"] is not None and "wrong key" in sdk_run["wrong_key"], sdk_run["wrong_key"]
    assert "train_unembed" in (sdk_run["unembed"] or ""), sdk_run["unembed"]
    assert "'dro' is not supported" in (sdk_run["bad_loss"] or "") and "cross_entropy" in sdk_run["bad_loss"]
    assert "a checkpoint name must be a plain name" in (sdk_run["outside"] or ""), sdk_run["outside"]
    assert sdk_run["tokenized"] == PROMPT[1:]



@integration
def test_sdk_clients_appear_in_the_lab(served: Any, sdk_run: dict[str, Any]) -> None:
    """A REST-driven client keeps the run directory a notebook client does (`forgelab.experiments.primitive_records`):
    the lab opens it; its first K metrics rows carry the SDK's K ``loss:sum`` values exactly, and the two
    sequences its sampler drew are ``sampled`` rows of its rollout table."""
    import forgelab.lab

    api, _ = served
    dirs = [d for d in Path(api.primitives.root).iterdir() if (d / "metrics.csv").is_file()]
    views = [forgelab.lab.open(d) for d in dirs]
    mine = [v for v in views if list(v.run.metrics["loss"][:K]) == sdk_run["losses"]]
    assert len(mine) == 1, [(d.name, list(v.run.metrics["loss"])) for d, v in zip(dirs, views)]
    rollouts = mine[0].run.rollouts
    sampled = rollouts[rollouts["status"] == "sampled"]
    assert [list(t) for t in sampled["completion_ids"]] == [s["tokens"] for s in sdk_run["samples"]]
    assert (rollouts["status"] == "trained").sum() >= K * len(_batch())


@integration
def test_another_clients_steps_leave_b_alone(served: Any, sdk_run: dict[str, Any]) -> None:
    """Client B (one step of its own first) around all of client A's work (K + 2 steps, a resume, sampling): B's
    adapter as ``save_weights_for_sampler`` writes it is bit-identical before and after (the PEFT safetensors'
    tensors), and B's ``forward`` logprobs agree within the float32 bound (numerics.model_tol; the trainer runs
    one call at a time, so they are in fact expected equal)."""
    from safetensors.torch import load_file

    from forgelab.config.run_config import SHIPPED_MODEL

    api, _ = served
    before, after = (load_file(str(Path(api.local_path(sdk_run[k])) / "adapter_model.safetensors"))
                     for k in ("b_before", "b_after"))
    assert before.keys() == after.keys() and before
    assert all(torch.equal(before[k], after[k]) for k in before)
    for lp0, lp1 in zip(sdk_run["b_logprobs_before"], sdk_run["b_logprobs_after"]):
        check(max_abs_diff(lp0, lp1), model_tol(SHIPPED_MODEL, max_abs(lp0)), "B's logprobs around A's steps")
