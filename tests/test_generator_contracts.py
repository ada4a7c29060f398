"""The generator's and env actors' typed contracts (forgelab.generation), in process: requests, answers, typed
routing, the fakes satisfying the controller's protocols, the deprecated module aliases, and a type checker
refusing a wrongly typed generator call. The endpoints themselves run on real processes in test_generator.py
and test_envs.py."""
from __future__ import annotations

import asyncio
import importlib
import sys
import warnings
from pathlib import Path

import pytest

from forgelab.config.components import SamplingConfig
from forgelab.generation import (EngineStats, EngineStatus, EnvGroupsRequest, EnvStats, GenerateRequest)

ROOT = Path(__file__).resolve().parent.parent

COUNTERS = dict(
    busy_time_s=1.5, intake_time_s=0.1, idle_time_s=2.0, idle_periods=3, admission_wait_s=0.0, steps=40, requests=16,
    aborted_requests=0,
    tokens_generated=320, prompt_tokens=200, cached_prompt_tokens=50, max_concurrent_requests=16,
    sum_concurrent_requests=400, weight_updates=1, last_update_ms=12.0, inflight_updates=0,
    requests_spanning_versions=0, prefix_cache_resets=0, prefix_cache_resets_deferred=0,
    cached_tokens_possibly_stale=0, drain_wait_s=0.0, kv_cache_usage_sum=4.0, kv_cache_usage_max=0.2,
    kv_cache_usage=0.1, preemptions=2, mean_concurrent_requests=10.0, cpu_time_s=9.0, clock_s=100.0,
    gc_pause_s=0.01, gc_collections=5, gc_max_pause_s=0.005, prefix_cache_hit_rate=0.25, kv_cache_usage_mean=0.1,
)


def test_generate_request_from_the_positional_form():
    sampling = SamplingConfig(max_tokens=4)
    req = GenerateRequest.coerce([[1, 2], [3]], 2, sampling, [[7, 8], [9, 10]])
    assert req == GenerateRequest(prompts_P=[[1, 2], [3]], n=2, sampling=sampling, seeds_P_G=[[7, 8], [9, 10]])
    assert GenerateRequest.coerce(req) is req
    assert req.lora_slot is None


def test_env_request_from_the_positional_form_and_refuses_half_of_it():
    sampling = SamplingConfig()
    req = EnvGroupsRequest.coerce("echo", ["t"], 3, ["mesh"], sampling, max_turns=2)  # type: ignore[list-item]
    assert (req.env, list(req.tasks_P), req.n, req.max_turns, req.step_timeout_s) == ("echo", ["t"], 3, 2, None)
    with pytest.raises(TypeError, match="EnvGroupsRequest"):
        EnvGroupsRequest.coerce("echo", ["t"])


def test_engine_stats_names_are_checked_and_dict_reads_still_work():
    stats = EngineStats.from_counters(COUNTERS)
    assert stats.requests == 16 and stats["requests"] == 16 and stats.get("steps") == 40
    assert stats.get("no_such_counter", -1) == -1 and "preemptions" in stats
    with pytest.raises(KeyError):
        stats["no_such_counter"]
    assert stats.counters() == {k: float(v) for k, v in COUNTERS.items()}
    with pytest.raises(TypeError):  # a counter the engine added without the contract knowing
        EngineStats.from_counters({**COUNTERS, "new_counter": 1.0})
    with pytest.raises(TypeError):  # one the contract names but the engine stopped counting
        EngineStats.from_counters({k: v for k, v in COUNTERS.items() if k != "steps"})
    status = EngineStatus(version=1, in_flight_requests=0, update_mode="drain", admitting=True, device="cpu",
                          stats=stats)
    assert status["stats"]["weight_updates"] == 1  # the reads test_generator.py was written with
    env = EnvStats(episodes=4, running=0, max_running=4, max_concurrent=8, cpu_time_s=1.0, rss_mib=100.0,
                   peak_rss_mib=120.0, gc_pause_s=0.0, gc_collections=0, gc_max_pause_s=0.0)
    assert env["episodes"] - env.running == 4 and env.outcomes == {}


def test_generator_meter_reads_typed_stats():
    from forgelab.controller.generator_meter import GeneratorMeter

    class Gens:
        def __init__(self) -> None:
            self.answers = [EngineStats.from_counters(COUNTERS),
                            EngineStats.from_counters({**COUNTERS, "steps": 50, "kv_cache_usage_sum": 9.0,
                                                       "preemptions": 4, "requests": 20})]

        async def engine_stats(self) -> list[EngineStats]:
            return [self.answers.pop(0)]

    meter, gens = GeneratorMeter(), Gens()
    first = asyncio.run(meter.row(gens))  # type: ignore[arg-type]  # only engine_stats is read
    assert first["generator/kv_cache_usage"] == 4.0 / 40 and first["generator/preemptions"] == 2.0
    second = asyncio.run(meter.row(gens))  # type: ignore[arg-type]
    # deltas: (9 - 4) / (50 - 40) usage per step, 4 - 2 preemptions over 20 - 16 requests
    assert second == {"generator/kv_cache_usage": 0.5, "generator/kv_cache_usage_now": 0.1,
                      "generator/preemptions": 2.0, "generator/preemptions_per_request": 0.5}


def test_fake_generators_typed_generate_is_the_positional_one():
    from forgelab.testing.fakes import FakeGenerators

    seeds = [[11, 12, 13], [14, 15, 16]]
    typed = asyncio.run(FakeGenerators(2).generate(GenerateRequest(prompts_P=[[1], [2]], n=3, seeds_P_G=seeds)))
    legacy = asyncio.run(FakeGenerators(2).route("generate", [[1], [2]], 3, None, seeds))
    assert typed == legacy and [len(g) for g in typed] == [3, 3]
    with pytest.raises(ValueError, match="LoRA"):
        asyncio.run(FakeGenerators(1).generate(GenerateRequest(prompts_P=[[1]], lora_slot="a")))
    assert asyncio.run(FakeGenerators(1).engine_stats()) == []


def test_typed_endpoint_sends_its_request_or_nothing():
    from forgelab.runtime.service import Endpoint

    req = GenerateRequest(prompts_P=[[1]])
    assert Endpoint[GenerateRequest, int]("generate").args(req) == (req,)
    assert Endpoint[None, int]("stats").args(None) == ()


@pytest.mark.parametrize("old,new,names", [
    ("forgelab.engines.slot_generator", "forgelab.engines.generator_slots", ["SlotGenerator", "SlotVLLMEngine"]),
    ("forgelab.engines.slot_parts", "forgelab.engines.shared_parts", ["SlotGenerators", "SlotParts",
                                                                      "SlotTrainerHandle"]),
])
def test_old_slot_module_paths_warn_and_give_the_same_objects(old, new, names):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alias = importlib.import_module(old)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught)
    moved = importlib.import_module(new)
    assert all(getattr(alias, n) is getattr(moved, n) for n in names)


# The type checker's probe of the generator's contract runs in tests/test_typecheck.py (one mypy run there).
