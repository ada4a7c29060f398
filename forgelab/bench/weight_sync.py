"""Weight sync: trainer -> every generator replica, vs the raw vLLM reload of the same bytes in one process.

    python -m forgelab.bench weight_sync [--quick] [--replicas 2]

``push``: what ``Run.push_weights`` does after every step: the controller calls
``Trainer.push_weights(version, [replica actors])``; the trainer gathers its
torchtitan weights as an HF state dict, sends it to every generator replica
concurrently (Monarch messages), and each replica reloads it into vLLM
(``collective_rpc`` + prefix-cache reset). Timed as the controller's round
trip, with the trainer's own split (``gather_ms``, ``send_ms``) and the
replicas' engine time (``last_update_ms``).

``raw``: the floor for one replica: in a separate process holding only a vLLM
engine built like the generator's (``VLLMEngine``), the same checkpoint's
tensors are reloaded with ``llm.collective_rpc("reload_weights",
kwargs={"weights_iterator": ...})``: no gather, no message, no copy.

Sizes: the shipped tiny model (3.2 M params) and a random-init ~100 M-param
Llama (hidden 768, 16 layers, same tokenizer) written to a temp dir. Push and
raw alternate (raw, push, raw, push, ...) so load from other jobs hits both;
``sync_over_raw`` is the median over those pairs of push / raw. Every process
has 1 torch thread. Replicas reload concurrently, but on this 2-core host they
share the cores with each other and the trainer: a ratio near the replica
count means the sync is bound by the reloads themselves.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from forgelab.bench.common import emit_json, print_machine, print_table
from forgelab.bench.generator import SHIPPED, _process_env, _state_dict, make_large_model


class RawReload:
    """A vLLM engine in its own process; `reload()` times one in-process `reload_weights` of the checkpoint."""

    def __init__(self, model_dir: str, threads: int = 1):
        env = {**os.environ, **_process_env(threads)}
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "forgelab.bench.weight_sync", "--_raw", model_dir,
                                      str(threads)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        self.bytes = self._read()["bytes"]

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.log.seek(0)
                raise RuntimeError(f"raw reload subprocess exited (rc {self.proc.wait()}):\n{self.log.read()[-3000:]}")
            if line.startswith("{"):
                return json.loads(line)

    def reload(self) -> float:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._read()["ms"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except Exception:
                self.proc.kill()


def _raw_main(model_dir: str, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    from forgelab.generator import GeneratorConfig, VLLMEngine

    engine = VLLMEngine(GeneratorConfig(model_dir=model_dir))
    sd = _state_dict(model_dir)
    nbytes = sum(v.numel() * v.element_size() for v in sd.values())
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(sd.items())})  # warm-up
    print(json.dumps({"ready": True, "bytes": nbytes}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t0 = time.perf_counter()
        engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(sd.items())})
        print(json.dumps({"ms": (time.perf_counter() - t0) * 1e3}), flush=True)


async def measure(model_dir: str, replicas: int, reps: int, threads: int = 1) -> dict:
    """Alternate raw reloads and trainer -> `replicas` generators pushes; medians and the paired ratio."""
    from forgelab.generator import Generator, GeneratorConfig
    from forgelab.trainer import Trainer, TrainerConfig

    raw = RawReload(model_dir, threads)
    gens = trainer = None
    try:
        gens, trainer = await asyncio.gather(
            Generator.options(num_replicas=replicas, threads=threads).as_service(GeneratorConfig(model_dir=model_dir)),
            Trainer.options(procs=1, threads=threads).as_actor(TrainerConfig(model_dir=model_dir)),
        )
        actors = [h.actor for h in gens.handles() if h is not None]
        assert len(actors) == replicas, f"only {len(actors)} of {replicas} generator replicas are healthy"
        version = 1
        await trainer.call("push_weights", version, actors)  # warm-up (first gather builds the adapter)
        raw_ms, push_ms, gather_ms, send_ms, engine_ms = [], [], [], [], []
        for _ in range(reps):
            raw_ms.append(raw.reload())
            version += 1
            t0 = time.perf_counter()
            timing = (await trainer.call("push_weights", version, actors))[0]
            push_ms.append((time.perf_counter() - t0) * 1e3)
            assert timing["sent"] == replicas, timing["failed"]
            gather_ms.append(timing["gather_ms"])
            send_ms.append(timing["send_ms"])
            stats = [await h.stats.call_one() for h in gens.handles() if h is not None]
            engine_ms.append(max(s["last_update_ms"] for s in stats))
        nbytes = timing["bytes"]
    finally:
        raw.close()
        for h in (gens, trainer):
            if h is not None:
                await h.shutdown()
    return {"bytes": nbytes, "raw_ms": statistics.median(raw_ms), "push_ms": statistics.median(push_ms),
            "gather_ms": statistics.median(gather_ms), "send_ms": statistics.median(send_ms),
            "engine_ms": statistics.median(engine_ms),
            "sync_over_raw": statistics.median(p / r for p, r in zip(push_ms, raw_ms)), "reps": reps}


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--_raw":
        _raw_main(argv[1], int(argv[2]))
        return {}
    ap = argparse.ArgumentParser(prog="python -m forgelab.bench weight_sync", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model only, 3 pairs")
    ap.add_argument("--replicas", type=int, default=2, help="generator replicas the trainer pushes to")
    ap.add_argument("--layers", type=int, default=16, help="layers of the large random model (16: ~100 M params)")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    start = print_machine("start")
    sizes = [("tiny", SHIPPED, 3 if args.quick else 8)]
    tmp = None
    if not args.quick:
        tmp = tempfile.TemporaryDirectory(prefix="forgelab-wsync-")
        params = make_large_model(tmp.name, hidden=768, layers=args.layers)
        sizes.append((f"large-{params / 1e6:.0f}M", tmp.name, 5))
    results = {}
    try:
        for label, model_dir, reps in sizes:
            results[label] = asyncio.run(measure(model_dir, args.replicas, reps))
            print(f"  {label}: {json.dumps(results[label])}", flush=True)
    finally:
        if tmp is not None:
            tmp.cleanup()
    end = print_machine("end")
    rows = [{"model": k, "MiB": r["bytes"] / 2**20, f"push to {args.replicas} ms": r["push_ms"],
             "gather ms": r["gather_ms"], "send ms": r["send_ms"], "engine ms (max)": r["engine_ms"],
             "raw reload ms": r["raw_ms"], "push / raw": r["sync_over_raw"]} for k, r in results.items()]
    print_table(rows, list(rows[0]))
    result = {
        "suite": "weight_sync",
        "replicas": args.replicas,
        "weight_sync_ms": {k: round(r["push_ms"], 1) for k, r in results.items()},
        "raw_reload_ms": {k: round(r["raw_ms"], 1) for k, r in results.items()},
        "sync_over_raw": {k: round(r["sync_over_raw"], 3) for k, r in results.items()},
        "mib": {k: round(r["bytes"] / 2**20, 1) for k, r in results.items()},
        "goal": "sync_over_raw <= 2",
        "goal_met": all(r["sync_over_raw"] <= 2 for r in results.values()),
        "machine": {**start, "loadavg_end": end["loadavg"]},
    }
    emit_json(result)
    return result


if __name__ == "__main__":
    main()
