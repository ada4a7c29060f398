"""Group advantages against plain-Python loops."""

import math
import random
import statistics

import pytest
import torch

from forgelab.algos.advantages import (
    ADVANTAGES,
    group_mean_centered,
    group_zscore,
    group_zscore_unbiased,
    leave_one_out,
    no_reward_advantage,
)
from numerics import check, fp32_tol


def _tol(row: list[float], std: float = 1.0, z: float = 0.0) -> float:
    """Float32 bound (numerics.py) for (r - mean) / std of a group: r - mean sums G rewards (fp32_tol(max |r|, n=G)),
    divided by std; z's own relative error comes from std's G-term sum (fp32_tol(|z|, n=G))."""
    return fp32_tol(max(map(abs, row)), n=len(row)) / std + fp32_tol(abs(z), n=len(row))


def _random_rewards(P=4, G=5, seed=0):
    rng = random.Random(seed)
    rows = [[rng.choice([0.0, 1.0, 0.5, -1.0]) + rng.random() * 0.1 for _ in range(G)] for _ in range(P)]
    rows.append([1.0] * G)  # zero-variance group
    return rows


@pytest.mark.numerics
def test_group_zscore_matches_loop_population_std():
    rows = _random_rewards()
    got = group_zscore(torch.tensor(rows), eps=1e-6)
    for p, row in enumerate(rows):
        mean = sum(row) / len(row)
        std = math.sqrt(sum((r - mean) ** 2 for r in row) / len(row))  # divide by G, not G-1
        for g, r in enumerate(row):
            want = (r - mean) / (std + 1e-6)
            check(abs(got[p, g].item() - want), _tol(row, std + 1e-6, want), f"zscore [{p}, {g}]")
    assert torch.equal(got[-1], torch.zeros(5))


def test_group_zscore_single_sample_group_is_zero_not_nan():
    assert group_zscore(torch.tensor([[3.0], [1.0]])).tolist() == [[0.0], [0.0]]


@pytest.mark.numerics
def test_group_zscore_unbiased_matches_statistics_stdev():
    rows = _random_rewards(seed=3)
    got = group_zscore_unbiased(torch.tensor(rows))
    for p, row in enumerate(rows):
        mean, std = statistics.fmean(row), statistics.stdev(row)  # divides by G-1
        for g, r in enumerate(row):
            want = (r - mean) / (std + 1e-4)
            check(abs(got[p, g].item() - want), _tol(row, std + 1e-4, want), f"unbiased zscore [{p}, {g}]")
    assert torch.equal(got[-1], torch.zeros(5))


@pytest.mark.numerics
def test_group_zscore_unbiased_equals_trl_group_normalisation():
    """TRL's own code path (GRPOTrainer, scale_rewards="group"): nanstd per group, then / (std + 1e-4)."""
    utils = pytest.importorskip("trl.trainer.utils")
    rows = _random_rewards(P=6, G=8, seed=4)
    rewards = torch.tensor(rows).view(-1)
    G = 8
    mean = rewards.view(-1, G).mean(dim=1).repeat_interleave(G)
    std = utils.nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G)
    trl_adv = (rewards - mean) / (std + 1e-4)
    got = group_zscore_unbiased(torch.tensor(rows)).view(-1)
    for i, (a, b) in enumerate(zip(got.tolist(), trl_adv.tolist())):
        row = rows[i // G]
        check(abs(a - b), _tol(row, statistics.stdev(row) + 1e-4, b), f"vs TRL [{i}]")


def test_group_zscore_unbiased_needs_two_samples():
    with pytest.raises(ValueError, match="G=1"):
        group_zscore_unbiased(torch.tensor([[1.0]]))


@pytest.mark.numerics
def test_group_mean_centered_matches_loop():
    rows = _random_rewards(seed=1)
    got = group_mean_centered(torch.tensor(rows))
    for p, row in enumerate(rows):
        mean = sum(row) / len(row)
        for g, r in enumerate(row):
            check(abs(got[p, g].item() - (r - mean)), _tol(row), f"mean centered [{p}, {g}]")


@pytest.mark.numerics
def test_leave_one_out_matches_loop():
    rows = _random_rewards(seed=2)
    got = leave_one_out(torch.tensor(rows))
    for p, row in enumerate(rows):
        for g, r in enumerate(row):
            others = [x for j, x in enumerate(row) if j != g]
            check(abs(got[p, g].item() - (r - sum(others) / len(others))), _tol(row), f"leave one out [{p}, {g}]")


def test_leave_one_out_needs_two_samples():
    with pytest.raises(ValueError, match="G=1"):
        leave_one_out(torch.tensor([[1.0]]))


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_bad_inputs_are_explained(name):
    with pytest.raises(ValueError, match=r"\[P, G\]"):
        ADVANTAGES[name](torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="NaN"):
        ADVANTAGES[name](torch.tensor([[1.0, float("nan")]]))


def test_registry_names():
    assert ADVANTAGES == {"grpo": group_zscore, "grpo_unbiased": group_zscore_unbiased, "dr_grpo": group_mean_centered,
                          "rloo": leave_one_out, "none": no_reward_advantage}


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
@pytest.mark.parametrize("value", [0.1, 0.3, 1.1, -0.7, 1e-3])
def test_equal_rewards_that_float32_cannot_represent_give_exact_zero(name, value):
    # 1.0 is exact in float32; 0.1 is not, and a float32 mean of eight 0.1s carried rounding noise
    # that the std (of the same size) turned into advantages of ~0.01 (tutorial 07 saw a sum of -0.059).
    got = ADVANTAGES[name](torch.full((3, 8), value))
    assert torch.equal(got, torch.zeros(3, 8)), got
