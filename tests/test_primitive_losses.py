"""Tinker's losses (`forgelab.algos.primitive_losses`) against their definitions, token by token in float64.

The references loop over Python floats (float64) and give d loss / d logp derived by hand: cross_entropy
``-w``; importance_sampling ``-r A``; ppo ``-r A`` where the unclipped term is the minimum and 0 where the
clipped one is (a constant); cispo ``-clip(r) A`` (the clipped ratio is a stop-gradient). So autograd in the
code under test is checked, not reused. The inputs are float32 and carry garbage off the mask, which must not
reach value or gradient.
"""
from __future__ import annotations

import math

import pytest
import torch

from forgelab.algos.primitive_losses import PRIMITIVE_LOSSES
from numerics import check, fp32_tol

B, T = 4, 7
LOW, HIGH = 0.8, 1.2


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1],
                         [1, 1, 1, 1, 0, 0, 0],  # a shorter sequence, right-padded
                         [0, 0, 0, 0, 0, 0, 0],  # nothing
                         [1, 1, 1, 1, 1, 0, 0]], dtype=torch.float32)
    logp = -torch.rand(B, T, generator=g) * 4
    q = logp + torch.randn(B, T, generator=g) * 0.5  # ratios spread on both sides of the clip range
    adv = torch.randn(B, T, generator=g)
    adv[:, :2] = 0.0  # the prompt's tokens carry no advantage (as a Datum's do)
    weights = torch.rand(B, T, generator=g) * 2
    weights[:, :2] = 0.0  # cross_entropy: the prompt is not learned
    weights[3, 3] = 0.0
    off = mask == 0
    return {"logp": logp, "mask_B_T": mask, "generator_logprobs_B_T": torch.where(off, 1e4, q),
            "advantages_B": torch.where(off, 1e4, adv), "weights_B_T": torch.where(off, 1e4, weights)}


def _reference(name: str, b: dict[str, torch.Tensor], **cfg: float) -> tuple[float, list[list[float]]]:
    """``(loss, dloss/dlogp)`` from the definition, float64, one token at a time."""
    low, high = cfg.get("clip_low_threshold", LOW), cfg.get("clip_high_threshold", HIGH)
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            if b["mask_B_T"][i, t] == 0:
                continue
            lp, q = float(b["logp"][i, t]), float(b["generator_logprobs_B_T"][i, t])
            a, w = float(b["advantages_B"][i, t]), float(b["weights_B_T"][i, t])
            r = math.exp(lp - q)
            c = min(max(r, low), high)
            if name == "cross_entropy":
                loss, grad[i][t] = loss - w * lp, -w
            elif name == "importance_sampling":
                loss, grad[i][t] = loss - r * a, -r * a
            elif name == "ppo":
                clipped_is_min = c * a < r * a
                loss -= min(r * a, c * a)
                grad[i][t] = 0.0 if clipped_is_min else -r * a
            elif name == "cispo":
                loss, grad[i][t] = loss - c * lp * a, -c * a
    return loss, grad


def _scale(name: str, b: dict[str, torch.Tensor]) -> float:
    """The largest magnitude of one token's term (and of its gradient) over the mask: |w logp| for
    cross_entropy; |r A| for importance_sampling and ppo (clip(r) <= r or <= 1.2 there); |clip(r) A logp| and
    |clip(r) A| for cispo."""
    on = b["mask_B_T"] > 0
    lp, q, a, w = (b[k].double()[on] for k in ("logp", "generator_logprobs_B_T", "advantages_B", "weights_B_T"))
    r = torch.exp(lp - q)
    terms = {"cross_entropy": [w * lp, w], "importance_sampling": [r * a], "ppo": [r * a, HIGH * a],
             "cispo": [r.clamp(LOW, HIGH) * a * lp, r.clamp(LOW, HIGH) * a]}[name]
    return max(float(x.abs().max()) for x in terms)


def _run(name: str, b: dict[str, torch.Tensor], **cfg: float) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    logp = b["logp"].clone().requires_grad_(True)
    kwargs = {k: v for k, v in b.items() if k != "logp" and (name == "cross_entropy" or k != "weights_B_T")}
    loss, metrics = PRIMITIVE_LOSSES[name](logp, **kwargs, **cfg)
    loss.backward()
    assert logp.grad is not None
    return loss.detach(), logp.grad, metrics


@pytest.mark.numerics
@pytest.mark.parametrize("name", sorted(PRIMITIVE_LOSSES))
def test_value_and_gradient_equal_the_definition_in_float64(name: str) -> None:
    """Bound: each loss is a float32 sum of at most B*T terms, each a product of up to three rounded factors
    (and an exp of a rounded difference |logp - q| <= 2 for the ratio losses): fp32_tol(S, n=B*T, ulps=4), S the
    largest term. A gradient entry is one such product: fp32_tol(S, ulps=4). Catches a mean instead of a sum
    (off by 22x), a missed weight or a clip branch taken the wrong way (a whole term)."""
    for seed in range(3):
        b = _batch(seed)
        loss, grad, _ = _run(name, b)
        ref_loss, ref_grad = _reference(name, b)
        s = _scale(name, b)
        check(abs(float(loss) - ref_loss), fp32_tol(s, n=B * T, ulps=4), f"{name} loss, seed {seed}")
        check(float((grad.double() - torch.tensor(ref_grad, dtype=torch.float64)).abs().max()),
              fp32_tol(s, ulps=4), f"{name} gradient, seed {seed}")


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["ppo", "cispo"])
def test_clip_thresholds_come_from_the_config(name: str) -> None:
    """Other thresholds (0.95, 1.05: most tokens clipped) give the definition with those thresholds, and another
    value than the defaults (so the config is read); some tokens are reported clipped."""
    b = _batch(1)
    cfg = {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}
    loss, grad, metrics = _run(name, b, **cfg)
    ref_loss, ref_grad = _reference(name, b, **cfg)
    s = _scale(name, b)
    check(abs(float(loss) - ref_loss), fp32_tol(s, n=B * T, ulps=4), f"{name} loss with thresholds")
    check(float((grad.double() - torch.tensor(ref_grad, dtype=torch.float64)).abs().max()), fp32_tol(s, ulps=4),
          f"{name} gradient with thresholds")
    assert abs(ref_loss - _reference(name, b)[0]) > 10 * fp32_tol(s, n=B * T, ulps=4)
    assert metrics["clip_frac"] > 0.0


@pytest.mark.parametrize("name", sorted(PRIMITIVE_LOSSES))
def test_losses_are_sums_over_rows(name: str) -> None:
    """Sum semantics: the loss of a batch is the sum of its rows' losses, and a row's gradient does not depend on
    the other rows (a mean would divide both by the batch's token count). Float32 bound as above."""
    b = _batch(2)
    loss, grad, _ = _run(name, b)
    parts = [_run(name, {k: v[i:i + 1] for k, v in b.items()}) for i in range(B)]
    s = _scale(name, b)
    check(abs(float(loss) - sum(float(p[0]) for p in parts)), fp32_tol(s, n=B * T, ulps=8), f"{name}: sum of rows")
    check(float((grad - torch.cat([p[1] for p in parts])).abs().max()), fp32_tol(s, ulps=4),
          f"{name}: row gradients alone and in the batch")


def test_cross_entropy_weights() -> None:
    """Weights scale each token's term and gradient exactly (0 drops a token; 2 doubles it); no weights means
    weight 1 on every masked token; weights off the mask are ignored."""
    logp = torch.tensor([[-1.0, -2.0, -0.5, -4.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, m = PRIMITIVE_LOSSES["cross_entropy"](logp, mask_B_T=mask, weights_B_T=torch.tensor([[0.0, 2.0, 1.0, 9.0]]))
    loss.backward()
    assert float(loss.detach()) == 4.5 and m["weight_sum"] == 3.0
    assert logp.grad is not None and logp.grad.tolist() == [[0.0, -2.0, -1.0, 0.0]]
    plain, _ = PRIMITIVE_LOSSES["cross_entropy"](logp.detach(), mask_B_T=mask)
    assert float(plain) == 3.5


def test_bad_inputs_are_named() -> None:
    from forgelab.algos.loss_checks import LossError

    logp = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(LossError, match="needs generator_logprobs_B_T"):
        PRIMITIVE_LOSSES["importance_sampling"](logp, mask_B_T=torch.ones(2, 3), advantages_B=torch.ones(2, 3))
    with pytest.raises(LossError, match="clip_low_threshold"):
        PRIMITIVE_LOSSES["ppo"](logp, mask_B_T=torch.ones(2, 3), generator_logprobs_B_T=torch.zeros(2, 3),
                                advantages_B=torch.ones(2), clip_low_threshold=0.2, clip_high_threshold=0.9)
    with pytest.raises(LossError, match=r"advantages_B has shape \(3,\)"):
        PRIMITIVE_LOSSES["cispo"](logp, mask_B_T=torch.ones(2, 3), generator_logprobs_B_T=torch.zeros(2, 3),
                                  advantages_B=torch.ones(3))
