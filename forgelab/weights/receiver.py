"""Weight sync, generator side: check an incoming state dict, pause admission, reload in place, bump the version.

    await receive(engine, version, weights)     # VLLMEngine.update_weights
    await receive_shared(engine, handle)        # VLLMEngine.update_weights_shared (a same-host shm handle)

`receive` checks every HF name and shape against the checkpoint first (a bad
update is refused and the old weights keep serving), stops admitting requests,
lets the in-flight ones finish on the old weights, reloads in place through the
vLLM worker extension `WeightUpdateExtension` (`reload_weights`), resets the
prefix cache and bumps the version. With ``update_mode="inflight"`` it loads
without draining (`_load_inflight`): the engine is between two steps whenever
this coroutine runs, so the running requests' next tokens come from the new
weights and the engine records where (`VLLMEngine.mark_new_version`). A shared-memory handle
(`forgelab.weights.shm.SharedWeights`) is mapped and read in place; one whose
file cannot be reached from here makes `receive_shared` answer why (a str), and
the trainer then sends the tensors (`forgelab.weights.sender`).
"""
from __future__ import annotations

import glob
import os
import time
from typing import Any

from forgelab.runtime import liveness
from forgelab.weights.checks import check_named_tensors
from forgelab.weights.shm import SharedWeights, SharedWeightsReader, SharedWeightsUnavailable

__all__ = ["checkpoint_shapes", "check_named_tensors", "check_weights", "WeightUpdateExtension", "receive", "receive_shared", "serve_base"]


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape of a checkpoint, read from safetensors headers (no tensor data)."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    if shapes:
        return shapes
    # No safetensors (e.g. pytorch_model.bin): build the model on the meta device.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_weights(weights: Any, expected: dict[str, tuple[int, ...]]) -> list[str]:
    """Problems with an HF-named state dict against `expected` shapes (empty list: fine)."""
    return check_named_tensors(weights, expected, naming="HF", what="weights",
                               missing_hint="; send the full state dict")


class WeightUpdateExtension:
    """vLLM worker extension (mixed into the worker class) that reloads weights in place."""

    def forgelab_reload_weights(self, items: Any) -> int:
        """Load `items` (HF (name, tensor) pairs, or safetensors bytes) in checkpoint format."""
        if isinstance(items, (bytes, bytearray)):  # multi-process engines cannot receive tensors
            from safetensors.torch import load

            items = list(load(bytes(items)).items())
        self.reload_weights(weights_iterator=items)
        _repack_tied_lm_head(self.model_runner.model)
        return len(items)


def _repack_tied_lm_head(model: Any) -> None:
    """Re-pack a tied output projection after a reload (vLLM's CPU backend; a no-op elsewhere).

    On CPU, vLLM packs the lm_head weight for oneDNN/sgl GEMMs at load time (a copy). A tied
    lm_head (Qwen3, Llama-3.2) is not in the reloaded checkpoint names, so reload_weights
    never re-processes it: the embedding changes while the packed output projection keeps the
    old weights (logprobs off by 1e-2..1). tests/test_real_shapes.py catches it.
    """
    lm_head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if lm_head is None or embed is None or not hasattr(lm_head, "cpu_linear"):
        return
    if lm_head.weight.data_ptr() != embed.weight.data_ptr():
        return  # untied: reloaded (and re-packed) with the other weights
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)


async def receive(engine: Any, version: int, weights: Any) -> int:
    """Swap `weights` into a `VLLMEngine` as `version`; returns the new version.

    `weights`: a dict of HF name -> tensor, or a `forgelab.weights.shm.SharedWeights`
    handle, whose file (same host) is mapped and read in place; that raises
    `SharedWeightsUnavailable` when the file cannot be reached from here.
    """
    async with engine.update_lock:
        await liveness.checkpoint("weights_receive")  # a test hook (a push that never completes); nothing unarmed
        if not isinstance(version, int) or version <= engine.version:
            raise ValueError(
                f"update_weights: version must be an int greater than the serving version "
                f"{engine.version}, got {version!r}; the generator keeps serving version {engine.version}"
            )
        if isinstance(weights, SharedWeights):
            engine.shared_reader = engine.shared_reader or SharedWeightsReader()
            try:
                weights = engine.shared_reader.open(weights)  # views of the trainer's file, no copy
            except ValueError as e:
                raise ValueError(f"update_weights(version={version}) refused: {e}. Nothing was loaded: "
                                 f"the generator keeps serving version {engine.version} with its old weights.") from None
        # progress the watchdog sees for a push (forgelab.runtime.watchdog): the bytes are here
        liveness.bump("weight_bytes_received", sum(int(t.numel()) * int(t.element_size()) for t in weights.values()))
        if getattr(engine, "lora", None) is not None:
            return await _receive_adapter(engine, version, weights)
        problems = check_weights(weights, engine.expected_shapes)
        if problems:
            raise ValueError(
                f"update_weights(version={version}) refused: " + "; ".join(problems[:8])
                + f". Nothing was loaded: the generator keeps serving version {engine.version} "
                "with its old weights."
            )
        if engine.config.update_mode == "inflight":
            return _load_inflight(engine, version, weights)
        engine.admitting.clear()
        try:
            t_drain = time.perf_counter()
            await engine.idle_event.wait()  # in-flight requests finish on the old weights
            t0 = time.perf_counter()
            engine.counters["drain_wait_s"] = engine.counters.get("drain_wait_s", 0.0) + t0 - t_drain
            engine.llm.collective_rpc("forgelab_reload_weights", args=(list(weights.items()),))
            engine.llm.reset_prefix_cache()  # cached KV was computed by the old weights
            engine.version = version
            engine.counters["weight_updates"] += 1
            engine.counters["last_update_ms"] = (time.perf_counter() - t0) * 1e3
        finally:
            engine.admitting.set()
        return engine.version


def _load_inflight(engine: Any, version: int, weights: Any) -> int:
    """Load `weights` between two engine steps, requests running on (no await: no step runs meanwhile).

    vLLM refuses to reset its prefix cache while any request holds blocks; then the reset waits for the
    engine's next idle moment (`VLLMEngine.prefix_reset_pending`) and, until it, a new request may reuse
    blocks computed by older weights, as the running requests use their own older KV. Each token's recorded
    logprob is still the one it was sampled with, so the losses' importance weights stay exact."""
    t0 = time.perf_counter()
    engine.llm.collective_rpc("forgelab_reload_weights", args=(list(weights.items()),))
    engine.version = version
    engine.mark_new_version(version)
    if engine.engine.has_unfinished_requests():
        engine.prefix_reset_pending = True
        engine.counters["prefix_cache_resets_deferred"] += 1
    elif engine.llm.reset_prefix_cache():
        engine.prefix_reset_pending = False
        engine.counters["prefix_cache_resets"] += 1
    engine.counters["weight_updates"] += 1
    engine.counters["inflight_updates"] += 1
    engine.counters["last_update_ms"] = (time.perf_counter() - t0) * 1e3
    return engine.version


async def _receive_adapter(engine: Any, version: int, tensors: Any) -> int:
    """LoRA: `tensors` is an adapter (PEFT names). Written to its own directory and loaded under its own name
    (``forgelab-{serial}-v{version}``, serial counting every adapter this engine ever loaded, so a warm pool's
    next run never reuses a name): vLLM keys its prefix cache on the adapter's name and path, so blocks cached
    under an older adapter are never reused (the base's cache, which other adapters share, is kept).
    Admission pauses and in-flight requests finish on the old adapter, as for full weights."""
    import shutil
    import tempfile

    from vllm.lora.request import LoRARequest

    from forgelab.weights.adapter import check_adapter, peft_config, write_adapter

    problems = check_adapter(tensors, engine.adapter_shapes)
    if problems:
        raise ValueError(f"update_weights(version={version}) refused: this generator serves LoRA adapters "
                         f"(rank {engine.lora.rank} on {list(engine.lora.targets)}): " + "; ".join(problems[:6])
                         + f". Nothing was loaded: the generator keeps serving version {engine.version}.")
    if getattr(engine, "adapter_root", None) is None:
        engine.adapter_root = tempfile.mkdtemp(prefix="forgelab-lora-")
    lo = engine.lora
    engine.adapter_serial = serial = getattr(engine, "adapter_serial", 0) + 1
    path = write_adapter(os.path.join(engine.adapter_root, f"{serial}-v{version}"), dict(tensors),
                         peft_config(rank=lo.rank, alpha=lo.alpha, targets=lo.targets, dropout=lo.dropout,
                                     base_model=engine.config.model_dir))
    engine.admitting.clear()
    try:
        await engine.idle_event.wait()  # in-flight requests finish on the old adapter
        t0 = time.perf_counter()
        new = LoRARequest(f"forgelab-{serial}-v{version}", serial, path)
        engine.engine.add_lora(new)  # loaded now, not by the first request
        old, engine.lora_request = engine.lora_request, new
        if old is not None:
            engine.engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        engine.version = version
        engine.counters["weight_updates"] += 1
        engine.counters["last_update_ms"] = (time.perf_counter() - t0) * 1e3
    finally:
        engine.admitting.set()
    return engine.version


def serve_base(engine: Any) -> None:
    """LoRA: unload the served adapter (and delete its directory); requests are served by the base again."""
    import shutil

    old, engine.lora_request = getattr(engine, "lora_request", None), None
    if old is not None:
        engine.engine.remove_lora(old.lora_int_id)
        shutil.rmtree(old.lora_path, ignore_errors=True)


async def receive_shared(engine: Any, handle: Any) -> int | str:
    """`receive(engine, handle.version, handle)`, or the reason (a str) when its file is not reachable here."""
    try:
        return await receive(engine, handle.version, handle)
    except SharedWeightsUnavailable as e:
        return f"shared-memory weights not reachable from this generator: {e}"

