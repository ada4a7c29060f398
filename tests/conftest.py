"""Shared test setup: environment defaults every forgelab process inherits, and fixtures several modules use."""
import asyncio
import os
from pathlib import Path

import pytest

# vLLM on CPU otherwise reserves most of the machine's memory for its KV cache.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_THREADS = os.environ.get("FORGELAB_TEST_THREADS")
if _THREADS:
    # `make test-numerics` varies the thread count (it changes how a reduction is split): this process runs with
    # it, and so does every process it starts. forgelab starts an actor's process with OMP_NUM_THREADS,
    # MKL_NUM_THREADS and FORGELAB_THREADS set from its placement's `threads` (default 1), so those are
    # overridden after the placement sets them; plain subprocesses inherit os.environ. (The generator calls
    # torch.set_num_threads(FORGELAB_THREADS); other processes take torch's default from OMP_NUM_THREADS, which
    # torch caps at the machine's cores.)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = os.environ["FORGELAB_THREADS"] = _THREADS
    import torch

    torch.set_num_threads(int(_THREADS))
    from forgelab.runtime import component as _component

    _placement_env = _component.Placement.process_env

    def _process_env_with_test_threads(self) -> dict[str, str]:
        env = _placement_env(self)
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = env["FORGELAB_THREADS"] = _THREADS
        return env

    _component.Placement.process_env = _process_env_with_test_threads
elif os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test`: two workers on two cores, each beside its own actor processes (one thread each, their
    # placement's default). A worker's own torch work at torch's default of one thread per core spun against the
    # other worker: test_lora's activation-checkpointing check took 8.2 s at 2 threads on a busy machine, 0.9 s
    # at 1, test_distill's per-row HF forwards ~15x slower (2026-11-28). Bounds hold at any thread count
    # (make test-numerics runs 1, 2 and 4).
    import torch

    torch.set_num_threads(1)


ENGINE_POOL_MAX_IDLE = 1
"""Idle engine sets one test worker keeps (each holds a generator, a trainer and a reference: see the report of
tests/test_pool_reuse.py for its memory); the modules that share them need one engine key."""


def _module_uses_pool(request: pytest.FixtureRequest) -> bool:
    return any("engine_pool" in getattr(item, "fixturenames", ()) for item in request.session.items
               if getattr(item, "module", None) is request.module)


@pytest.fixture(scope="session")
def worker_loop():
    """The test worker's long-lived event loop: the pooled engine sets' services (and the modules that use them)
    live on it, since a service keeps the loop it started on. Closed at the session's end."""
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="session")
def engine_pool(worker_loop):
    """This test worker's `ProcessPool` (one idle set at most): a module opts in with ``Run(cfg, spawn=engine_pool)``
    and gets warm processes re-initialised for its run when an earlier module left a set with the same engine key
    (`forgelab.engines.pool.engine_key`); its `loop` is then `worker_loop`. Stopped at the session's end."""
    from forgelab.engines.pool import ProcessPool

    pool = ProcessPool(max_idle=ENGINE_POOL_MAX_IDLE)
    _POOL[:] = [(pool, worker_loop)]
    yield pool
    _POOL.clear()
    worker_loop.run_until_complete(pool.shutdown())


_POOL: list = []
"""This worker's `engine_pool` and its loop, while the session has one (for the hook below)."""


_POOLED_FILES: dict[str, bool] = {}
"""File -> whether one of its tests takes `engine_pool` (computed once per file)."""


def _pooled_file(item: pytest.Item) -> bool:
    file = item.nodeid.split("::", 1)[0]
    if file not in _POOLED_FILES:
        _POOLED_FILES[file] = any("engine_pool" in getattr(i, "fixturenames", ())
                                  for i in item.session.items if i.nodeid.split("::", 1)[0] == file)
    return _POOLED_FILES[file]


_LAST_GROUP: list[str | None] = [None]
"""The engine group (root conftest's ENGINE_GROUPS) of the last pooled file this worker ran."""


def pytest_runtest_setup(item: pytest.Item) -> None:
    """This worker's idle pooled engines are stopped when it starts a file that will not take them: a file that
    needs the machine's memory to itself (the root conftest's EXCLUSIVE), a file that does not use `engine_pool`,
    or one of another engine group (the files sharing a set run one after the other, as one unit: after the last
    of them the idle set would only hold memory beside the next file's own processes)."""
    root = item.config.pluginmanager.get_plugin(str(Path(__file__).resolve().parent.parent / "conftest.py"))
    file = item.nodeid.split("::", 1)[0]
    pooled = _pooled_file(item)
    group = getattr(root, "ENGINE_GROUPS", {}).get(file, file)
    if _POOL and _POOL[0][0].idle and (file in getattr(root, "EXCLUSIVE", ()) or not pooled
                                       or group != _LAST_GROUP[0]):
        pool, lp = _POOL[0]
        lp.run_until_complete(pool.close_idle())
    if pooled:
        _LAST_GROUP[0] = group


@pytest.fixture(scope="module")
def loop(request):
    """One event loop per test module: its module-scoped actors, services and runs live and die on it. A module
    that takes `engine_pool` runs on the worker's `worker_loop` instead (the pooled services live on it)."""
    if _module_uses_pool(request):
        yield request.getfixturevalue("worker_loop")
        return
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def _grpo_config(out_dir, *, name: str = "t", steps: int = 60, eval_n: int = 200, reference: bool = True, **rollout):
    from forgelab.config.run_config import EvalConfig, PlacementConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig

    return RunConfig(
        name=name,
        rollout=RolloutConfig(task="addition", group_size=8, prompts_per_rollout=8, concurrency=2, max_tokens=8,
                              **rollout),
        # lr 3e-4 and up makes the shipped tiny model worse at addition; 1e-4 lifts mean reward in ~60 steps
        train=TrainConfig(steps=steps, batch_size=64, lr=1e-4, warmup_steps=2, max_policy_age=1, seed=0),
        eval=EvalConfig(every=0, n=eval_n),
        tracking=TrackingConfig(out_dir=str(out_dir), wandb=False),
        placement=PlacementConfig(reference=reference),
    )


@pytest.fixture(scope="session")
def grpo_config():
    """The small seeded asynchronous-GRPO addition run the end-to-end tests train, as a builder.

    ``grpo_config(out_dir, name="t", steps=60, eval_n=200, reference=True, **rollout)``: batch 64 (8 problems
    x 8 samples), lr 1e-4, staleness bound 1, no periodic eval, no wandb; ``rollout`` adds RolloutConfig fields
    (e.g. ``env="calculator", max_turns=3``).
    """
    return _grpo_config
