"""Shared test setup: environment defaults every forgelab process inherits, and fixtures several modules use."""
import asyncio
import os

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


@pytest.fixture(scope="module")
def loop():
    """One event loop per test module: its module-scoped actors, services and runs live and die on it."""
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
