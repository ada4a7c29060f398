"""Runtime overheads: raw Monarch `call_one` vs `Service.route`, and state-dict moves.

    python -m forgelab.bench runtime [--quick]

Raw and routed calls are interleaved (alternating which goes first) against
the same trivial endpoint, so machine load hits both alike; the ratio is the
routing overhead. The state dict (10 MiB of float32 in two tensors) goes from
one actor to another directly, not through the controller.

``--quick`` measures nothing: 500 interleaved calls of each kind (not 2000) and 5 state-dict moves (not 20),
every step of the full mode otherwise.
"""
from __future__ import annotations

import argparse
import asyncio
import os

from monarch.actor import endpoint

from forgelab.bench.common import Timer, emit_json, median_ms, now_ns, print_machine, print_table
from forgelab.runtime import Component


class Ping(Component):
    @endpoint
    async def ping(self) -> int:
        return 1


class StateSink(Component):
    @endpoint
    async def receive(self, state: dict) -> int:
        return sum(t.numel() * t.element_size() for t in state.values())


class StateSource(Component):
    def __init__(self, mib: int):
        import torch

        n = mib * 1024 * 1024 // 4
        self.state = {"w0": torch.randn(n // 2), "w1": torch.randn(n - n // 2)}

    @endpoint
    async def push(self, sink) -> int:
        return await sink.receive.call_one(self.state)


async def _run(calls: int, moves: int) -> dict:
    raw = await Ping.as_actor()
    svc = await Ping.options(num_replicas=2).as_service()
    src = await StateSource.as_actor(10)
    sink = await StateSink.as_actor()
    try:
        raw_ep = raw.actor.ping
        for _ in range(50):  # warm up both paths
            await raw_ep.call_one()
            await svc.route("ping")
        raw_ns, route_ns = [], []
        for i in range(calls):
            for which in ((0, 1) if i % 2 else (1, 0)):
                t0 = now_ns()
                if which == 0:
                    await raw_ep.call_one()
                    raw_ns.append(now_ns() - t0)
                else:
                    await svc.route("ping")
                    route_ns.append(now_ns() - t0)
        nbytes = await src.push.call_one(sink.actor)  # warm-up move
        assert nbytes == 10 * 1024 * 1024, nbytes
        move_ns = []
        for _ in range(moves):
            with Timer() as t:
                await src.push.call_one(sink.actor)
            move_ns.append(t.ns)
    finally:
        await asyncio.gather(svc.shutdown(), raw.shutdown(), src.shutdown(), sink.shutdown())
    raw_ms, route_ms = median_ms(raw_ns), median_ms(route_ns)
    return {
        "suite": "runtime",
        "raw_call_one_ms": round(raw_ms, 4),
        "route_ms": round(route_ms, 4),
        "route_over_raw": round(route_ms / raw_ms, 3),
        "state_dict_10mib_ms": round(median_ms(move_ns), 2),
        "calls": calls,
        "moves": moves,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m forgelab.bench runtime")
    parser.add_argument("--quick", action="store_true", help="proves the code path: 500 calls, 5 moves (default 2000, 20)")
    args = parser.parse_args(argv or [])
    calls, moves = (500, 5) if args.quick else (2000, 20)
    start = print_machine("start")
    result = asyncio.run(_run(calls, moves))
    end = print_machine("end")
    result.update({"quick": args.quick, "goal": "route_over_raw <= 1.2", "goal_met": result["route_over_raw"] <= 1.2,
                   "machine": {**start, "loadavg_end": end["loadavg"]}})
    print(f"runtime bench: {calls} interleaved calls each, {moves} state-dict moves, pid {os.getpid()}")
    print_table(
        [
            {"what": "raw call_one", "median_ms": result["raw_call_one_ms"]},
            {"what": "service.route", "median_ms": result["route_ms"]},
            {"what": "route / raw", "median_ms": result["route_over_raw"]},
            {"what": "10 MiB state dict actor->actor", "median_ms": result["state_dict_10mib_ms"]},
        ],
        ["what", "median_ms"],
    )
    emit_json(result)
    return result
