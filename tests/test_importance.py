"""Truncated importance weights against plain-Python loops."""

import math

import pytest
import torch

from forgelab.algos.importance import truncated_is_weights


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(3, 5, generator=g) * 2
    gen = trainer + torch.randn(3, 5, generator=g) * 1.0
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 1, 1, 0, 1]], dtype=torch.float32)
    gen = torch.where(mask > 0, gen, torch.tensor(-1e4))  # garbage on padding
    return trainer, gen, mask


def _metrics_loop(ws, raw, cap):
    n = len(ws)
    return {
        "is_weight_mean": sum(ws) / n,
        "is_weight_max": max(ws),
        "is_truncated_frac": sum(r > cap for r in raw) / n,
        "is_ess": sum(ws) ** 2 / (n * sum(w * w for w in ws)),
    }


def test_token_level_matches_loop():
    trainer, gen, mask = _inputs()
    weights, metrics = truncated_is_weights(trainer, gen, mask, cap=1.1)
    tr, ge, m = trainer.tolist(), gen.tolist(), mask.tolist()
    ws, raw = [], []
    for b in range(3):
        for t in range(5):
            if m[b][t]:
                rho = math.exp(tr[b][t] - ge[b][t])
                raw.append(rho)
                ws.append(min(rho, 1.1))
                assert weights[b, t].item() == pytest.approx(min(rho, 1.1), rel=1e-5)
            else:
                assert weights[b, t].item() == 1.0
    want = _metrics_loop(ws, raw, 1.1)
    for k, v in want.items():
        assert metrics[k] == pytest.approx(v, rel=1e-5), k
    assert 0 < metrics["is_truncated_frac"] < 1


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_sequence_levels_match_loop(level):
    trainer, gen, mask = _inputs(seed=1)
    weights, metrics = truncated_is_weights(trainer, gen, mask, cap=2.0, level=level)
    tr, ge, m = trainer.tolist(), gen.tolist(), mask.tolist()
    ws, raw = [], []
    for b in range(3):
        on = [t for t in range(5) if m[b][t]]
        if not on:
            assert weights[b].tolist() == [1.0] * 5
            continue
        s = sum(tr[b][t] - ge[b][t] for t in on)
        rho = math.exp(s if level == "sequence" else s / len(on))
        raw.append(rho)
        ws.append(min(rho, 2.0))
        for t in range(5):
            assert weights[b, t].item() == pytest.approx(min(rho, 2.0) if t in on else 1.0, rel=1e-5)
    want = _metrics_loop(ws, raw, 2.0)
    for k, v in want.items():
        assert metrics[k] == pytest.approx(v, rel=1e-5), k


def test_huge_log_ratio_truncates_without_overflow_and_weights_are_detached():
    trainer = torch.tensor([[0.0, -1.0]], requires_grad=True)
    gen = torch.tensor([[-1000.0, -1.0]])
    weights, metrics = truncated_is_weights(trainer, gen, torch.ones(1, 2), cap=3.0)
    assert weights.tolist() == [[3.0, 1.0]]
    assert not weights.requires_grad
    assert metrics["is_truncated_frac"] == 0.5 and metrics["is_weight_max"] == 3.0
    assert all(math.isfinite(v) for v in metrics.values())


def test_no_trained_tokens_gives_neutral_metrics():
    weights, metrics = truncated_is_weights(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
    assert torch.equal(weights, torch.ones(2, 3))
    assert metrics == {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_truncated_frac": 0.0, "is_ess": 1.0}


def test_uniform_weights_have_ess_one_and_infinite_cap_disables_truncation():
    x = torch.full((2, 3), -0.5)
    _, metrics = truncated_is_weights(x, x - 0.25, torch.ones(2, 3), cap=math.inf)
    assert metrics["is_ess"] == pytest.approx(1.0)
    assert metrics["is_weight_mean"] == pytest.approx(math.exp(0.25))
    assert metrics["is_truncated_frac"] == 0.0


def test_bad_arguments_are_explained():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="unknown level"):
        truncated_is_weights(x, x, x, level="tokens")
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(x, x, x, cap=0.0)
    with pytest.raises(ValueError, match="shapes differ"):
        truncated_is_weights(x, torch.zeros(1, 3), x)
