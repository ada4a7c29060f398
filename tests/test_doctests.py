"""The examples in the pure modules' docstrings are executed (they are documentation)."""
import doctest
import importlib

import pytest

MODULES = [
    "forgelab.rewards.library", "forgelab.rewards.math_answers", "forgelab.data.datasets", "forgelab.controller.buffer", "forgelab.data.tasks", "forgelab.algos.logprobs",
    "forgelab.algos.advantages", "forgelab.algos.losses", "forgelab.algos.loss_checks", "forgelab.algos.kl", "forgelab.algos.importance", "forgelab.algos.batching",
    "forgelab.engines.trainer_state", "forgelab.engines.trainer_optim", "forgelab.engines.contracts", "forgelab.envs.episode", "forgelab.algos.token_truth", "forgelab.algos.primitive_losses",
    "forgelab.bench.inflight_bench", "forgelab.bench.variants_bench", "forgelab.bench.distill_bench",
    "forgelab.serve.tools", "forgelab.envs.mcp_tools", "forgelab.runtime.startup_cpus", "forgelab.runtime.cpu_use",
    "forgelab.controller.agent_runner",
]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    mod = importlib.import_module(name)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} doctest(s) failed in {name}"
