"""Same-host weight push through shared memory (forgelab.weights_transport, Trainer.push_weights).

The first tests are pure (a writer and a reader in this process). The rest
share one real Generator (vLLM, the shipped tiny model) and one 1-process
Trainer whose shared-memory folder is a fresh directory under /dev/shm, and
run in file order: each states what it leaves behind. Golden values come
from HF transformers greedy decoding with the trainer's own weights, fetched
with ``get_hf_state_dict`` (the message path, independent of the file).
"""
from __future__ import annotations

import asyncio
import dataclasses
import mmap
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
from monarch.actor import endpoint

from forgelab.runtime import Component
from forgelab.weights.shm import (
    SharedWeightsReader,
    SharedWeightsUnavailable,
    SharedWeightsWriter,
    sweep_stale,
)

SHM = "/dev/shm"
pytestmark = pytest.mark.skipif(not os.path.isdir(SHM), reason="needs /dev/shm")


@pytest.fixture
def shm_root():
    root = tempfile.mkdtemp(prefix="forgelab-test-", dir=SHM)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _sd(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(11, 6, generator=g),
        "model.norm.weight": torch.randn(6, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(11, 6, generator=g).to(torch.float16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(6, 9, generator=g),
    }


# --- pure: writer and reader in one process ------------------------------------


def test_file_is_safetensors_and_reader_views_match(shm_root):
    from safetensors import safe_open

    sd = _sd()
    w = SharedWeightsWriter(shm_root)
    h = w.write(3, sd)
    assert h.version == 3 and h.nbytes == sum(v.numel() * v.element_size() for v in sd.values())
    assert dict(zip(h.names, h.shapes)) == {k: tuple(v.shape) for k, v in sd.items()}
    assert dict(zip(h.names, h.dtypes))["model.norm.weight"] == "BF16"
    with safe_open(h.path, framework="pt") as f:  # an ordinary safetensors file
        assert set(f.keys()) == set(sd)
        for k in sd:
            assert torch.equal(f.get_tensor(k), sd[k]) and f.get_tensor(k).dtype == sd[k].dtype
    got = SharedWeightsReader().open(h)
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
    w.close()


def test_reuse_overwrites_in_place_else_new_file(shm_root):
    w, r = SharedWeightsWriter(shm_root), SharedWeightsReader()
    h1 = w.write(1, _sd(0))
    ino = os.stat(h1.path).st_ino
    r.open(h1)
    h2 = w.write(2, _sd(1), reuse=True)
    assert os.stat(h2.path).st_ino == ino and h2.file_id == h1.file_id
    got = r.open(h2)  # same mapping, new bytes
    assert all(torch.equal(got[k], v) for k, v in _sd(1).items())
    h3 = w.write(3, _sd(2), reuse=False)  # someone may still read: a new file replaces the old one
    assert os.stat(h3.path).st_ino != ino and h3.file_id != h1.file_id
    assert sorted(os.listdir(w.dir)) == ["weights.safetensors"]  # no temp files left
    with pytest.raises(SharedWeightsUnavailable, match="replaced meanwhile"):
        r.open(h2)  # a straggler with the old handle does not read the new weights
    got = r.open(h3)
    assert all(torch.equal(got[k], v) for k, v in _sd(2).items())
    w.close()


def test_reader_refuses_other_host_missing_file_and_wrong_manifest(shm_root):
    w, r = SharedWeightsWriter(shm_root), SharedWeightsReader()
    h = w.write(1, _sd())
    with pytest.raises(SharedWeightsUnavailable, match="on host"):
        r.open(h, hostname=h.host + "-elsewhere")
    with pytest.raises(SharedWeightsUnavailable, match="no file"):
        r.open(dataclasses.replace(h, path=os.path.join(shm_root, "nope", "weights.safetensors")))
    lying = dataclasses.replace(h, shapes=tuple((1,) + s for s in h.shapes))
    with pytest.raises(ValueError, match="does not hold what its handle announces"):
        r.open(lying)
    w.close()


def test_close_sweep_and_process_exit_leave_nothing(shm_root):
    w = SharedWeightsWriter(shm_root)
    w.write(1, _sd())
    assert os.listdir(shm_root) == [os.path.basename(w.dir)]
    w.close()
    w.close()
    assert os.listdir(shm_root) == []
    # A process that exits without close(): its finalizer removes the directory.
    code = ("import sys, torch; from forgelab.weights.shm import SharedWeightsWriter as W;"
            "w = W(sys.argv[1]); w.write(1, {'a': torch.ones(4)}); print(w.dir)")
    out = subprocess.run([sys.executable, "-c", code, shm_root], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith(shm_root) and os.listdir(shm_root) == []
    # A process killed before it could clean up: the next writer on the host removes its directory.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = os.path.join(shm_root, f"forgelab-weights-{dead.pid}-abc123")
    os.mkdir(stale)
    mine = os.path.join(shm_root, f"forgelab-weights-{os.getpid()}-abc123")  # a live owner: kept
    os.mkdir(mine)
    assert sweep_stale(shm_root) == [stale]
    assert os.listdir(shm_root) == [os.path.basename(mine)]


# --- actors: a real generator and a 1-process trainer ------------------------------


class RemoteSink(Component):
    """Answers `update_weights_shared` as a generator on another host would, records `update_weights`."""

    def __init__(self) -> None:
        self.version = 0
        self.weights: dict = {}

    @endpoint
    async def update_weights_shared(self, handle) -> int | str:
        try:
            SharedWeightsReader().open(handle, hostname="another-host")
        except SharedWeightsUnavailable as e:
            return f"not reachable: {e}"
        raise AssertionError("a handle from another host was accepted")

    @endpoint
    async def update_weights(self, version: int, weights: dict) -> int:
        self.version, self.weights = version, {k: v.clone() for k, v in weights.items()}
        return version

    @endpoint
    async def received(self) -> tuple[int, dict]:
        return self.version, self.weights


SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "forgelab", "assets", "tiny-llama")
PROBLEMS = ["Compute 12+345", "Compute 7+5", "Compute 99+1", "Compute 3+4", "Compute 250+250", "Compute 8+80"]


async def _gather(*coros):
    return await asyncio.gather(*coros)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def shm_dir():
    root = tempfile.mkdtemp(prefix="forgelab-test-", dir=SHM)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def actors(loop, shm_dir):
    """(generator, trainer): the trainer starts from the generator's checkpoint, with a large LR."""
    from forgelab.engines.generator import Generator, GeneratorConfig
    from forgelab.engines.trainer import Trainer, TrainerConfig

    if not os.path.exists(os.path.join(SHIPPED, "model.safetensors")):
        pytest.fail(f"no model at {SHIPPED}: build it with `python -m forgelab.recipes.tiny_model`")

    async def spawn():
        return await asyncio.gather(
            Generator.options(procs=1).as_actor(GeneratorConfig(model_dir=SHIPPED, max_model_len=64)),
            Trainer.options(procs=1).as_actor(TrainerConfig(model_dir=SHIPPED, lr=1e-2, shm_dir=shm_dir)),
        )

    handles = loop.run_until_complete(spawn())
    yield handles
    for h in handles:
        loop.run_until_complete(h.shutdown())


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(SHIPPED)


def _greedy(loop, gen, tok) -> list[list[int]]:
    from forgelab.data import format_prompt
    from forgelab.engines.generator import SamplingConfig

    prompts = [format_prompt(tok, p) for p in PROBLEMS]
    groups = loop.run_until_complete(gen.generate.call_one(prompts, n=1, sampling=SamplingConfig(temperature=0.0, max_tokens=10)))
    return [g[0].completion_ids for g in groups]


@torch.no_grad()
def _hf_greedy(model, tok, weights: dict) -> list[list[int]]:
    from forgelab.data import format_prompt

    model.load_state_dict(weights)
    out = []
    for p in PROBLEMS:
        ids = torch.tensor([tok.encode(format_prompt(tok, p), add_special_tokens=False)])
        new = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        out.append(new[: new.index(tok.eos_token_id) + 1] if tok.eos_token_id in new else new)
    return out


def _train(loop, trainer, steps: int = 2) -> None:
    from trainer_actors import random_batches

    for batch in random_batches(105, steps, B=4, seed=steps):
        assert loop.run_until_complete(trainer.call_one("train_step", batch))["skipped"] == 0


def _weights_file(shm_dir: str) -> str:
    (d,) = os.listdir(shm_dir)
    return os.path.join(shm_dir, d, "weights.safetensors")


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_push_via_shm_serves_the_trainers_weights(loop, actors, hf, shm_dir):
    gen, trainer = actors
    model, tok = hf
    before = _greedy(loop, gen, tok)
    _train(loop, trainer)
    timing = loop.run_until_complete(trainer.call_one("push_weights", 1, [gen.actor]))
    assert timing["transport"] == "shm" and timing["transports"] == ["shm"] and timing["sent"] == 1, timing
    assert not timing["failed"] and not timing["fallback"]
    assert loop.run_until_complete(gen.call_one("version")) == 1
    expected = _hf_greedy(model, tok, loop.run_until_complete(trainer.call_one("get_hf_state_dict")))
    after = _greedy(loop, gen, tok)
    assert after == expected
    assert after != before, "the training steps did not change greedy outputs: the test would prove nothing"
    # vLLM copied the weights: scribbling over the file does not change what the generator serves.
    path = _weights_file(shm_dir)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        data_start = 8 + int.from_bytes(m[:8], "little")
        m[data_start:] = b"\x00" * (len(m) - data_start)
    assert _greedy(loop, gen, tok) == expected


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_next_push_overwrites_in_place_and_versions_increase(loop, actors, hf, shm_dir):
    gen, trainer = actors
    model, tok = hf
    ino = os.stat(_weights_file(shm_dir)).st_ino
    _train(loop, trainer, steps=1)
    timing = loop.run_until_complete(trainer.call_one("push_weights", 2, [gen.actor]))
    assert timing["transport"] == "shm" and timing["write_ms"] > 0, timing
    assert os.stat(_weights_file(shm_dir)).st_ino == ino  # the same file, rewritten
    assert loop.run_until_complete(gen.call_one("version")) == 2
    expected = _hf_greedy(model, tok, loop.run_until_complete(trainer.call_one("get_hf_state_dict")))
    assert _greedy(loop, gen, tok) == expected


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_bad_state_dict_via_shm_is_refused_and_old_weights_keep_serving(loop, actors, hf, shm_root):
    from monarch.actor import ActorError

    gen, trainer = actors
    _, tok = hf
    serving = _greedy(loop, gen, tok)
    good = loop.run_until_complete(trainer.call_one("get_hf_state_dict"))
    wrong_shape = dict(good)
    wrong_shape["lm_head.weight"] = good["lm_head.weight"][:-1]
    wrong_name = dict(good)
    wrong_name["model.layers.0.mlp.gate.weight"] = wrong_name.pop("model.layers.0.mlp.gate_proj.weight")
    w = SharedWeightsWriter(shm_root)
    try:
        for bad, needle in ((wrong_shape, "lm_head.weight: shape"), (wrong_name, "model.layers.0.mlp.gate.weight")):
            with pytest.raises(ActorError) as info:
                loop.run_until_complete(gen.update_weights_shared.call_one(w.write(3, bad, reuse=False)))
            assert needle in str(info.value) and "keeps serving version 2" in str(info.value), str(info.value)
        with pytest.raises(ActorError, match="greater than the serving version"):
            loop.run_until_complete(gen.update_weights_shared.call_one(w.write(2, good, reuse=False)))
        # A file this generator cannot see is an answer, not an error.
        lost = dataclasses.replace(w.write(3, good), path=os.path.join(shm_root, "gone", "weights.safetensors"))
        answer = loop.run_until_complete(gen.update_weights_shared.call_one(lost))
        assert isinstance(answer, str) and "no file" in answer
    finally:
        w.close()
    assert loop.run_until_complete(gen.call_one("version")) == 2
    assert _greedy(loop, gen, tok) == serving


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_fallback_to_messages_for_generators_that_cannot_map_the_file(loop, actors, hf, shm_dir):
    from trainer_actors import WeightSink

    gen, trainer = actors
    model, tok = hf
    remote, old = loop.run_until_complete(_gather(RemoteSink.options(procs=1).as_actor(),
                                                  WeightSink.options(procs=1).as_actor()))
    try:
        _train(loop, trainer, steps=1)
        timing = loop.run_until_complete(trainer.call_one("push_weights", 3, [gen.actor, remote.actor, old.actor]))
        expected = loop.run_until_complete(trainer.call_one("get_hf_state_dict"))
        got_remote = loop.run_until_complete(remote.call_one("received"))
        got_old = loop.run_until_complete(old.call_one("received"))
    finally:
        loop.run_until_complete(_gather(remote.shutdown(), old.shutdown()))
    assert timing["transports"] == ["shm", "message", "message"] and timing["transport"] == "mixed", timing
    assert timing["sent"] == 3 and not timing["failed"]
    assert "another-host" in timing["fallback"][1] and "no update_weights_shared" in timing["fallback"][2]
    assert 0 not in timing["fallback"]
    for version, weights in (got_remote, got_old):
        assert version == 3 and weights.keys() == expected.keys()
        assert all(torch.equal(weights[k], expected[k]) for k in expected)
    assert _greedy(loop, gen, tok) == _hf_greedy(model, tok, expected)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_forced_message_transport_and_failed_push_makes_a_new_file(loop, actors, hf, shm_dir):
    gen, trainer = actors
    model, tok = hf
    timing = loop.run_until_complete(trainer.call_one("push_weights", 4, [gen.actor], "message"))
    assert timing["transport"] == "message" and timing["write_ms"] == 0.0 and not timing["fallback"], timing
    assert loop.run_until_complete(gen.call_one("version")) == 4
    # A push the generator refuses (stale version) counts as failed: the file is not reused afterwards.
    ino = os.stat(_weights_file(shm_dir)).st_ino
    stale = loop.run_until_complete(trainer.call_one("push_weights", 4, [gen.actor]))
    assert stale["sent"] == 0 and "greater than the serving version" in stale["failed"][0]
    _train(loop, trainer, steps=1)
    timing = loop.run_until_complete(trainer.call_one("push_weights", 5, [gen.actor]))
    assert timing["transport"] == "shm" and os.stat(_weights_file(shm_dir)).st_ino != ino
    expected = _hf_greedy(model, tok, loop.run_until_complete(trainer.call_one("get_hf_state_dict")))
    assert _greedy(loop, gen, tok) == expected


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_trainer_shutdown_leaves_shm_empty(loop, actors, shm_dir):
    gen, trainer = actors
    assert len(os.listdir(shm_dir)) == 1
    loop.run_until_complete(trainer.shutdown())
    assert os.listdir(shm_dir) == []
