"""Weight sync: trainer -> every generator replica, vs the raw vLLM reload of the same bytes in one process.

    python -m forgelab.bench weight_sync [--quick] [--replicas 2]

``push`` is what ``Run.push_weights`` does after every step, timed as the
controller's round trip of ``Trainer.push_weights(version, [replica actors],
transport=...)`` (a 1-process trainer; the replicas are one generator service's
actors), in two variants measured in the same processes:

- ``shm`` (the default transport, ``"auto"``): rank 0 gathers the HF state dict
  (``gather_ms``), copies it into its shared-memory safetensors file, overwritten
  in place after the first push (``write_ms``), then sends each replica a
  handle of a few KB; each replica maps the file and reloads from it, all
  replicas concurrently (``send_ms``: from the first send to the last answer).
- ``message``: the same gather, then the whole state dict is pickled into a
  Monarch message to each replica (once per replica), which unpickles it and
  reloads (``send_ms``).

Both end in the replicas' ``update_weights`` path: name/shape checks, drain
(nothing is in flight here), ``collective_rpc`` reload and prefix-cache reset;
``engine_ms`` is the slowest replica's ``last_update_ms`` (reload + reset).

``raw``: the floor for one replica: in a separate process holding only a vLLM
engine built like the generator's (``VLLMEngine``), the same checkpoint's
tensors, already in memory, are reloaded with ``llm.collective_rpc(
"reload_weights", kwargs={"weights_iterator": ...})``: no gather, no copy, no
message, one replica. ``raw xN together``: N such processes (N = replicas)
started at the same instant, timed as the slowest: what N reloads cost on this
machine at its current load (on an idle 2-core host about one raw; on a loaded
one up to N raws, since the replicas then compete for the same share of CPU).

``--quick`` measures nothing; it runs the tiny model only, 1 replica (one engine per side), the warm-up push of
each transport, then 1 repetition: raw, shm push, raw, message push, raw xN together, and every key of the JSON.

Sizes: the shipped tiny model (3.2 M params) and a random-init ~100 M-param
Llama (hidden 768, 16 layers, same tokenizer) written to a temp dir. Each
repetition runs raw, shm push, raw, message push, raw xN together, so load
from other jobs hits every side; ``sync_over_raw`` is the median over
repetitions of shm push / the raw run just before it (``sync_over_raw_message``
likewise for the message push; ``sync_over_raw_together``: shm push / that
repetition's raw xN together). Every process has 1 torch thread. On an
otherwise idle 2-core host the 2 replicas reload in parallel, one per core, so
``sync_over_raw`` near 1 means the push costs about one reload; the trainer's
gather and write run before the reloads and add to it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time

from forgelab.bench.common import Worker, emit_json, print_machine, print_table
from forgelab.bench.generator_bench import SHIPPED, random_state_dict, make_large_model


class RawReload(Worker):
    """A vLLM engine in its own process; `reload()` times one in-process `reload_weights` of the checkpoint."""

    def __init__(self, model_dir: str, threads: int = 1):
        super().__init__("raw reload", ["-m", "forgelab.bench.weight_sync", "--_raw", model_dir, str(threads)], threads)
        self.bytes = self.ready["bytes"]

    def reload(self) -> float:
        return self.run()["ms"]


def reload_together(raws: list[RawReload]) -> float:
    """Start every raw reload at once; the slowest one's ms (what N replicas reloading concurrently cost)."""
    for r in raws:
        r.start()
    return max(r.read()["ms"] for r in raws)


def _raw_main(model_dir: str, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    from forgelab.engines.generator import GeneratorConfig, VLLMEngine

    engine = VLLMEngine(GeneratorConfig(model_dir=model_dir))
    sd = random_state_dict(model_dir)
    nbytes = sum(v.numel() * v.element_size() for v in sd.values())
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(sd.items())})  # warm-up
    print(json.dumps({"ready": True, "bytes": nbytes}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t0 = time.perf_counter()
        engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(sd.items())})
        print(json.dumps({"ms": (time.perf_counter() - t0) * 1e3}), flush=True)


TRANSPORTS = {"shm": "auto", "message": "message"}  # bench label -> push_weights transport


async def measure(model_dir: str, replicas: int, reps: int, threads: int = 1) -> dict:
    """Per repetition: raw, shm push, raw, message push; medians per side and the paired ratios."""
    from forgelab.engines.generator import Generator, GeneratorConfig
    from forgelab.engines.trainer import Trainer, TrainerConfig

    raws = [RawReload(model_dir, threads) for _ in range(replicas)]
    raw = raws[0]
    gens = trainer = None
    try:
        gens, trainer = await asyncio.gather(
            Generator.options(num_replicas=replicas, threads=threads).as_service(GeneratorConfig(model_dir=model_dir)),
            Trainer.options(procs=1, threads=threads).as_actor(TrainerConfig(model_dir=model_dir)),
        )
        actors = [h.actor for h in gens.handles() if h is not None]
        assert len(actors) == replicas, f"only {len(actors)} of {replicas} generator replicas are healthy"
        version = 0
        for transport in TRANSPORTS.values():  # warm-up: first gather builds the adapter, first write the file
            version += 1
            await trainer.call("push_weights", version, actors, transport)
        sides = {label: {k: [] for k in ("raw_ms", "push_ms", "gather_ms", "write_ms", "send_ms", "engine_ms")}
                 for label in TRANSPORTS}
        together_ms: list[float] = []
        for _ in range(reps):
            for label, transport in TRANSPORTS.items():
                side = sides[label]
                side["raw_ms"].append(raw.reload())
                version += 1
                t0 = time.perf_counter()
                timing = (await trainer.call("push_weights", version, actors, transport))[0]
                side["push_ms"].append((time.perf_counter() - t0) * 1e3)
                assert timing["sent"] == replicas, timing["failed"]
                assert timing["transport"] == label, (label, timing["transport"], timing["fallback"])
                for key in ("gather_ms", "write_ms", "send_ms"):
                    side[key].append(timing[key])
                stats = [await h.stats.call_one() for h in gens.handles() if h is not None]
                side["engine_ms"].append(max(s["last_update_ms"] for s in stats))
            together_ms.append(reload_together(raws))
        nbytes = timing["bytes"]
    finally:
        for r in raws:
            r.close()
        for h in (gens, trainer):
            if h is not None:
                await h.shutdown()
    out = {"bytes": nbytes, "reps": reps, "raw_together_ms": statistics.median(together_ms)}
    for label, side in sides.items():
        out[label] = {k: statistics.median(v) for k, v in side.items()}
        out[label]["sync_over_raw"] = statistics.median(p / r for p, r in zip(side["push_ms"], side["raw_ms"]))
        out[label]["over_raw_together"] = statistics.median(p / r for p, r in zip(side["push_ms"], together_ms))
    return out


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--_raw":
        _raw_main(argv[1], int(argv[2]))
        return {}
    ap = argparse.ArgumentParser(prog="python -m forgelab.bench weight_sync", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="proves the code path: tiny model only, 1 replica, 1 repetition (raw, shm push, raw, "
                         "message push, raw xN together)")
    ap.add_argument("--replicas", type=int, default=None,
                    help="generator replicas the trainer pushes to (default 2; --quick 1: one engine per side)")
    ap.add_argument("--layers", type=int, default=16, help="layers of the large random model (16: ~100 M params)")
    args = ap.parse_args(argv)
    if args.replicas is None:
        args.replicas = 1 if args.quick else 2

    import torch

    torch.set_num_threads(1)
    start = print_machine("start")
    sizes = [("tiny", SHIPPED, 1 if args.quick else 8)]
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
    rows = [{"model": k, "transport": t, "MiB": r["bytes"] / 2**20, f"push to {args.replicas} ms": r[t]["push_ms"],
             "gather ms": r[t]["gather_ms"], "write ms": r[t]["write_ms"], "send ms": r[t]["send_ms"],
             "engine ms (max)": r[t]["engine_ms"], "raw reload ms": r[t]["raw_ms"], "push / raw": r[t]["sync_over_raw"],
             f"raw x{args.replicas} together ms": r["raw_together_ms"], "push / together": r[t]["over_raw_together"]}
            for k, r in results.items() for t in TRANSPORTS]
    print_table(rows, list(rows[0]))
    result = {
        "suite": "weight_sync",
        "replicas": args.replicas,
        "transport": "shm",
        "weight_sync_ms": {k: round(r["shm"]["push_ms"], 1) for k, r in results.items()},
        "raw_reload_ms": {k: round(r["shm"]["raw_ms"], 1) for k, r in results.items()},
        "sync_over_raw": {k: round(r["shm"]["sync_over_raw"], 3) for k, r in results.items()},
        "weight_sync_message_ms": {k: round(r["message"]["push_ms"], 1) for k, r in results.items()},
        "sync_over_raw_message": {k: round(r["message"]["sync_over_raw"], 3) for k, r in results.items()},
        "breakdown_ms": {k: {t: {m: round(r[t][m], 1) for m in ("gather_ms", "write_ms", "send_ms", "engine_ms")}
                             for t in TRANSPORTS} for k, r in results.items()},
        "raw_together_ms": {k: round(r["raw_together_ms"], 1) for k, r in results.items()},
        "sync_over_raw_together": {k: round(r["shm"]["over_raw_together"], 3) for k, r in results.items()},
        "mib": {k: round(r["bytes"] / 2**20, 1) for k, r in results.items()},
        "goal": "sync_over_raw <= 2",
        "goal_met": all(r["shm"]["sync_over_raw"] <= 2 for r in results.values()),
        "machine": {**start, "loadavg_end": end["loadavg"]},
    }
    emit_json(result)
    return result


if __name__ == "__main__":
    main()
