"""Every loss's value and gradient against a loop-based reference with hand-derived gradients.

The references below use Python floats only: the loss is written out token by
token and d loss / d logp is derived by hand (e.g. the PPO surrogate's
gradient is ``r A`` where the unclipped branch is active and 0 where the clip
is), so autograd in the code under test is checked, not reused.
"""

import inspect
import math
import random

import pytest
import torch

from forgelab.algos.loss_checks import accepted_loss_kwargs, check_loss_kwargs, with_completion_budget
from forgelab.algos.losses import BUILTIN_LOSSES, LOSSES, LossError, validate_loss_output
from numerics import check, fp32_tol

B, T = 5, 6


def _batch(seed=0, *, noise=0.4, ref=True, is_weights=True):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 3
    gen = logp + torch.randn(B, T, generator=g) * noise
    mask = torch.tensor(
        [
            [1, 1, 1, 1, 1, 1],
            [0, 0, 1, 1, 1, 0],  # prompt then completion then padding
            [0, 0, 0, 0, 0, 0],  # all masked
            [0, 1, 0, 1, 1, 0],  # multi-turn: environment token in between
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.float32,
    )
    # Garbage on untrained positions must not leak into value or gradient.
    gen = torch.where(mask > 0, gen, torch.tensor(-1e4))
    batch = {
        "logp": logp,
        "generator_logprobs_B_T": gen,
        "advantages_B": torch.tensor([1.3, -0.7, 2.0, 0.4, -1.1]),
        "mask_B_T": mask,
        "ref_logprobs_B_T": (logp + torch.randn(B, T, generator=g) * 0.3) if ref else None,
        "is_weights_B_T": (torch.rand(B, T, generator=g) * 2) if is_weights else None,
    }
    return batch


def _loss_tol(batch, *, n: int = B * T) -> float:
    """Float32 bound (numerics.py) for a loss (n = B*T) or one gradient entry (n = T) against the float64 loops.

    Every per-token term is a product of at most four factors, each bounded over the trained tokens: |A|, the
    IS weight, the ratio (or its clip, at most 1 + 2 here; gspo's sequence ratio is a geometric mean of the
    token ratios) and, for cispo and reinforce, |logp|; plus kl_coef (at most 0.5) times k3. S, the largest
    such magnitude, bounds every term; every loss weighs its terms by coefficients adding up to at most 1 and
    sums at most B*T of them (a gradient entry: gspo's row sum of T): fp32_tol(S, n, ulps=2), two for the
    terms' own roundings and the sum's.
    """
    on = batch["mask_B_T"] > 0
    lp, gen = batch["logp"].double(), batch["generator_logprobs_B_T"].double()
    w = batch["is_weights_B_T"] if batch["is_weights_B_T"] is not None else torch.ones(B, T)
    m = batch["advantages_B"].double().abs()[:, None] * w.double() * (lp - gen).exp().clamp_min(3.0)
    m = m * lp.abs().clamp_min(1.0)
    if batch["ref_logprobs_B_T"] is not None:
        d = batch["ref_logprobs_B_T"].double() - lp
        m = m + 0.5 * (d.exp() - d - 1)
    return fp32_tol(float(m[on].max()), n=n, ulps=2)


def _lists(batch):
    L = {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    w = L["is_weights_B_T"] or [[1.0] * T for _ in range(B)]
    return L["logp"], L["generator_logprobs_B_T"], L["advantages_B"], L["mask_B_T"], L["ref_logprobs_B_T"], w


def _surrogate(r, a, eps_low, eps_high):
    """(value of min(rA, clip(r)A), its derivative w.r.t. logp)."""
    clipped = min(max(r, 1 - eps_low), 1 + eps_high)
    unclipped_value, clipped_value = r * a, clipped * a
    if clipped_value < unclipped_value:
        return clipped_value, 0.0  # clip active: no gradient through the ratio
    return unclipped_value, r * a  # d(r a)/d logp = r a


def ref_grpo(batch, eps_low=0.2, eps_high=0.2, kl_coef=0.04):
    lp, g, A, m, ref, w = _lists(batch)
    rows = [b for b in range(B) if sum(m[b]) > 0]
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    for b in rows:
        n = sum(m[b])
        for t in range(T):
            if not m[b][t]:
                continue
            r = math.exp(lp[b][t] - g[b][t])
            o, do = _surrogate(r, A[b], eps_low, eps_high)
            term, dterm = -w[b][t] * o, -w[b][t] * do
            if ref is not None:
                d = ref[b][t] - lp[b][t]
                term += kl_coef * (math.exp(d) - d - 1)
                dterm += kl_coef * (1 - math.exp(d))
            loss += term / n / len(rows)
            grad[b][t] = dterm / n / len(rows)
    return loss, grad


def _token_level(batch, eps_low, eps_high, denom):
    lp, g, A, m, _, w = _lists(batch)
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            if m[b][t]:
                o, do = _surrogate(math.exp(lp[b][t] - g[b][t]), A[b], eps_low, eps_high)
                loss += -w[b][t] * o / denom
                grad[b][t] = -w[b][t] * do / denom
    return loss, grad


def ref_dapo(batch, eps_low=0.2, eps_high=0.28):
    n_tokens = sum(sum(row) for row in batch["mask_B_T"].tolist())
    return _token_level(batch, eps_low, eps_high, n_tokens)


def _widest_trained_span(mask):
    spans = [max(t for t in range(T) if row[t]) - min(t for t in range(T) if row[t]) + 1 for row in mask if any(row)]
    return max(spans, default=1)


def ref_dr_grpo(batch, eps_low=0.2, eps_high=0.2, max_tokens=None):
    budget = max_tokens or _widest_trained_span(batch["mask_B_T"].tolist())
    return _token_level(batch, eps_low, eps_high, B * budget)


def ref_gspo(batch, seq_eps_low=3e-4, seq_eps_high=4e-4):
    lp, g, A, m, _, w = _lists(batch)
    rows = [b for b in range(B) if sum(m[b]) > 0]
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    for b in rows:
        on = [t for t in range(T) if m[b][t]]
        s = math.exp(sum(lp[b][t] - g[b][t] for t in on) / len(on))
        w_seq = sum(w[b][t] for t in on) / len(on)
        o, do = _surrogate(s, A[b], seq_eps_low, seq_eps_high)  # do = s A (or 0) = d o / d log s
        loss += -w_seq * o / len(rows)
        for t in on:
            grad[b][t] = -w_seq * do / len(on) / len(rows)
    return loss, grad


def ref_cispo(batch, is_eps_low=1.0, is_eps_high=2.0):
    lp, g, A, m, _, w = _lists(batch)
    n_tokens = sum(sum(row) for row in m)
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            if m[b][t]:
                c = min(max(math.exp(lp[b][t] - g[b][t]), 1 - is_eps_low), 1 + is_eps_high)
                loss += -c * w[b][t] * A[b] * lp[b][t] / n_tokens
                grad[b][t] = -c * w[b][t] * A[b] / n_tokens
    return loss, grad


def ref_reinforce(batch):
    lp, _, A, m, _, w = _lists(batch)
    n_tokens = sum(sum(row) for row in m)
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            if m[b][t]:
                loss += -w[b][t] * A[b] * lp[b][t] / n_tokens
                grad[b][t] = -w[b][t] * A[b] / n_tokens
    return loss, grad


REFERENCES = {
    "grpo": ref_grpo,
    "dapo": ref_dapo,
    "dr_grpo": ref_dr_grpo,
    "gspo": ref_gspo,
    "cispo": ref_cispo,
    "reinforce": ref_reinforce,
}


def _call(name, batch, **hparams):
    logp = batch["logp"].clone().requires_grad_(True)
    kwargs = {k: v for k, v in batch.items() if k != "logp"}
    loss, metrics = LOSSES[name](logp, **kwargs, **hparams)
    loss.backward()
    return loss, metrics, logp.grad


def test_every_loss_has_a_reference():
    assert set(LOSSES) == set(REFERENCES)


@pytest.mark.numerics
@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("ref,is_weights", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("noise", [0.4, 1e-4])  # large noise: many clipped tokens; tiny: almost none (gspo)
def test_loss_value_and_gradient_match_loop_reference(name, ref, is_weights, noise):
    batch = _batch(seed=3, noise=noise, ref=ref, is_weights=is_weights)
    loss, metrics, grad = _call(name, batch)
    want_loss, want_grad = REFERENCES[name](batch)
    assert loss.dim() == 0
    check(abs(loss.item() - want_loss), _loss_tol(batch), f"{name} loss")
    for b in range(B):
        for t in range(T):
            check(abs(grad[b, t].item() - want_grad[b][t]), _loss_tol(batch, n=T), f"{name} gradient [{b}, {t}]")
    validate_loss_output((loss, metrics), name)


@pytest.mark.numerics
@pytest.mark.parametrize(
    "name,hparams",
    [
        ("grpo", {"eps_low": 0.1, "eps_high": 0.3, "kl_coef": 0.5}),
        ("dapo", {"eps_low": 0.05, "eps_high": 0.5}),
        ("dr_grpo", {"max_tokens": 32, "eps_low": 0.3}),
        ("gspo", {"seq_eps_low": 0.05, "seq_eps_high": 0.1}),
        ("cispo", {"is_eps_low": 0.2, "is_eps_high": 0.5}),
    ],
)
def test_hyperparameters_are_honoured(name, hparams):
    batch = _batch(seed=4)
    loss, _, grad = _call(name, batch, **hparams)
    want_loss, want_grad = REFERENCES[name](batch, **hparams)
    check(abs(loss.item() - want_loss), _loss_tol(batch), f"{name} loss")
    check(float((grad.double() - torch.tensor(want_grad, dtype=torch.float64)).abs().max()), _loss_tol(batch, n=T),
          f"{name} gradient")


def _clip_frac_loop(batch, eps_low, eps_high):
    lp, g, A, m, _, _ = _lists(batch)
    active = n = 0
    for b in range(B):
        for t in range(T):
            if m[b][t]:
                r = math.exp(lp[b][t] - g[b][t])
                n += 1
                active += (r > 1 + eps_high and A[b] > 0) or (r < 1 - eps_low and A[b] < 0)
    return active / n


@pytest.mark.numerics
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_metrics_match_loops(name):
    batch = _batch(seed=5)
    _, metrics, _ = _call(name, batch)
    lp, g, A, m, ref, _ = _lists(batch)
    on = [(b, t) for b in range(B) for t in range(T) if m[b][t]]
    assert metrics["kl_behaviour"] == pytest.approx(sum(g[b][t] - lp[b][t] for b, t in on) / len(on), rel=1e-4)
    assert metrics["ratio_mean"] == pytest.approx(sum(math.exp(lp[b][t] - g[b][t]) for b, t in on) / len(on), rel=1e-4)
    k3 = [math.exp(ref[b][t] - lp[b][t]) - (ref[b][t] - lp[b][t]) - 1 for b, t in on]
    assert metrics["kl_ref"] == pytest.approx(sum(k3) / len(k3), rel=1e-4)
    assert all(type(v) is float for v in metrics.values())
    if name in ("grpo", "dr_grpo"):
        assert metrics["clip_frac"] == pytest.approx(_clip_frac_loop(batch, 0.2, 0.2))
    if name == "dapo":
        assert metrics["clip_frac"] == pytest.approx(_clip_frac_loop(batch, 0.2, 0.28))
    if name in ("grpo", "dapo", "dr_grpo"):
        assert 0 < metrics["clip_frac"] < 1  # the fixture really exercises clipping


def test_no_ref_means_no_kl_ref_metric():
    _, metrics, _ = _call("grpo", _batch(seed=6, ref=False))
    assert "kl_ref" not in metrics and "kl_behaviour" in metrics


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_all_masked_batch_gives_zero_finite_loss_and_grad(name):
    batch = _batch(seed=7)
    batch["mask_B_T"] = torch.zeros(B, T)
    loss, metrics, grad = _call(name, batch)
    assert loss.item() == 0.0
    assert torch.equal(grad, torch.zeros(B, T))
    validate_loss_output((loss, metrics), name)




@pytest.mark.parametrize("name", sorted(LOSSES))
def test_on_policy_gradient_equals_reinforce_direction(name):
    """With generator == current policy and no weights, every token's gradient is -A_i times a positive scale."""
    batch = _batch(seed=9, ref=False, is_weights=False)
    batch["generator_logprobs_B_T"] = batch["logp"].clone()
    _, _, grad = _call(name, batch)
    A = batch["advantages_B"]
    m = batch["mask_B_T"]
    for b in range(B):
        for t in range(T):
            if m[b, t]:
                assert grad[b, t].item() * -A[b].item() > 0


def test_shape_errors_name_the_loss_and_the_argument():
    batch = _batch(seed=10)
    logp = batch.pop("logp")
    batch["mask_B_T"] = batch["mask_B_T"][:, :-1]
    with pytest.raises(LossError, match=r"'dapo'.*mask_B_T"):
        LOSSES["dapo"](logp, **batch)
    batch = _batch(seed=10)
    logp = batch.pop("logp")
    batch["advantages_B"] = batch["advantages_B"][:, None]
    with pytest.raises(LossError, match=r"advantages_B"):
        LOSSES["grpo"](logp, **batch)


@pytest.mark.parametrize(
    "out,pattern",
    [
        (torch.tensor(1.0), "expected a tuple"),
        ((torch.tensor([1.0, 2.0]), {}), "expected a scalar"),
        ((1.0, {}), "torch.Tensor"),
        ((torch.tensor(float("nan")), {}), "non-finite"),
        ((torch.tensor(float("inf")), {}), "non-finite"),
        ((torch.tensor(1), {}), "floating-point"),
        ((torch.tensor(1.0), [("kl", 0.0)]), "dict"),
        ((torch.tensor(1.0), {"kl": torch.tensor(0.0)}), r"\.item\(\)"),
        ((torch.tensor(1.0), {3: 0.0}), "must be str"),
    ],
)
def test_validate_loss_output_rejects_with_a_useful_message(out, pattern):
    with pytest.raises(LossError, match=pattern) as info:
        validate_loss_output(out, "my_loss")
    assert "my_loss" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_validate_loss_output_require_grad():
    with pytest.raises(LossError, match="no gradient"):
        validate_loss_output((torch.tensor(1.0), {}), "my_loss", require_grad=True)
    loss, metrics = validate_loss_output((torch.tensor([2.0], requires_grad=True) * 1, {"n": 3}), "my_loss", require_grad=True)
    assert loss.dim() == 0 and metrics == {"n": 3.0} and type(metrics["n"]) is float


@pytest.mark.numerics
def test_user_loss_is_a_first_class_registry_entry():
    def mine(logprobs_B_T, *, advantages_B, mask_B_T, **_):
        return -(advantages_B[:, None] * logprobs_B_T * mask_B_T).sum() / mask_B_T.sum(), {"custom": 1.0}

    registry = dict(LOSSES, mine=mine)
    batch = _batch(seed=11)
    logp = batch.pop("logp").requires_grad_(True)
    loss, _ = validate_loss_output(registry["mine"](logp, **batch), "mine", require_grad=True)
    want = ref_reinforce({**batch, "logp": logp.detach(), "is_weights_B_T": None})[0]
    check(abs(loss.item() - want), _loss_tol({**batch, "logp": logp.detach(), "is_weights_B_T": None}), "user loss")


@pytest.mark.numerics
def test_random_seeds_smoke():
    rng = random.Random(0)
    for _ in range(3):
        seed = rng.randrange(10_000)
        for name in LOSSES:
            batch = _batch(seed=seed)
            loss, _, _ = _call(name, batch)
            check(abs(loss.item() - REFERENCES[name](batch)[0]), _loss_tol(batch), f"{name} loss, seed {seed}")


# --- the shared KL-to-reference term ------------------------------------------------

RATIO_LOSSES = ["grpo", "dapo", "dr_grpo", "gspo", "cispo"]


def _kl_reduction_loop(name, batch, max_tokens=None):
    """(value, d/dlogp) of each loss's own reduction of the per-token k3, written out with floats."""
    lp, _, _, m, ref, _ = _lists(batch)
    rows = [b for b in range(B) if sum(m[b]) > 0]
    n_tokens = sum(sum(row) for row in m)
    value, grad = 0.0, [[0.0] * T for _ in range(B)]
    for b in rows:
        for t in range(T):
            if not m[b][t]:
                continue
            d = ref[b][t] - lp[b][t]
            k3, dk3 = math.exp(d) - d - 1, 1 - math.exp(d)
            if name in ("grpo", "gspo"):  # mean per sequence, then over sequences with tokens
                scale = 1 / sum(m[b]) / len(rows)
            elif name == "dr_grpo":  # constant budget: every row counts in B
                scale = 1 / (B * (max_tokens or _widest_trained_span(m)))
            else:  # dapo, cispo, reinforce: mean over trained tokens
                scale = 1 / n_tokens
            value += k3 * scale
            grad[b][t] = dk3 * scale
    return value, grad


@pytest.mark.numerics
@pytest.mark.parametrize("name", RATIO_LOSSES + ["reinforce"])
@pytest.mark.parametrize("kl_coef", [0.5, 0.04])
def test_kl_coef_adds_exactly_the_kl_term(name, kl_coef):
    batch = _batch(seed=12)
    hp = {"max_tokens": 9} if name == "dr_grpo" else {}
    loss0, metrics0, grad0 = _call(name, batch, kl_coef=0.0, **hp)
    loss1, metrics1, grad1 = _call(name, batch, kl_coef=kl_coef, **hp)
    kl, dkl = _kl_reduction_loop(name, batch, hp.get("max_tokens"))
    assert kl > 1e-3  # the fixture's reference really differs from the policy
    # each of the two losses (and gradients) carries its own rounding: twice the bound
    check(abs((loss1 - loss0).item() - kl_coef * kl), 2 * _loss_tol(batch), f"{name}: loss difference")
    check(float((grad1 - grad0).double().sub(kl_coef * torch.tensor(dkl, dtype=torch.float64)).abs().max()),
          2 * _loss_tol(batch, n=T), f"{name}: gradient difference")
    assert metrics1["kl_ref"] == pytest.approx(metrics0["kl_ref"])  # the metric does not depend on the coefficient


@pytest.mark.numerics
@pytest.mark.parametrize("name", RATIO_LOSSES + ["reinforce"])
def test_kl_defaults_grpo_only(name):
    batch = _batch(seed=13)
    loss_default, _, _ = _call(name, batch)
    loss_zero, _, _ = _call(name, batch, kl_coef=0.0)
    if name == "grpo":
        kl, _ = _kl_reduction_loop("grpo", batch)
        check(abs((loss_default - loss_zero).item() - 0.04 * kl), 2 * _loss_tol(batch), "grpo: default kl term")
    else:
        assert loss_default.item() == loss_zero.item()


@pytest.mark.parametrize("name", RATIO_LOSSES)
def test_kl_is_skipped_without_reference_and_bad_coefficients_raise(name):
    batch = _batch(seed=14, ref=False)
    assert _call(name, batch, kl_coef=0.3)[0].item() == _call(name, batch, kl_coef=0.0)[0].item()
    for bad in (-0.1, float("nan"), float("inf"), "0.1"):
        with pytest.raises(LossError, match="kl_coef"):
            _call(name, _batch(seed=14), kl_coef=bad)


# --- keyword validation ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_unknown_keyword_raises_naming_it_and_listing_the_accepted(name):
    batch = _batch(seed=8)
    logp = batch.pop("logp").requires_grad_(True)
    accepted = accepted_loss_kwargs(name)
    assert "kl_coef" in accepted
    with pytest.raises(LossError) as info:
        LOSSES[name](logp, **batch, eps_hgih=0.28, some_future_knob="x")
    text = str(info.value)
    assert name in text and "eps_hgih" in text and "some_future_knob" in text
    for ok in accepted:
        assert ok in text
    with pytest.raises(LossError, match="eps_hgih"):
        check_loss_kwargs(name, {"eps_hgih": 0.28})
    check_loss_kwargs(name, {k: 0.1 for k in accepted if k != "max_tokens"})  # every accepted name passes


def test_accepted_keywords_of_each_builtin():
    assert accepted_loss_kwargs("grpo") == ("eps_high", "eps_low", "kl_coef")
    assert accepted_loss_kwargs("dr_grpo") == ("eps_high", "eps_low", "kl_coef", "max_tokens")
    assert accepted_loss_kwargs("gspo") == ("kl_coef", "seq_eps_high", "seq_eps_low")
    assert accepted_loss_kwargs("cispo") == ("is_eps_high", "is_eps_low", "kl_coef")
    assert accepted_loss_kwargs("reinforce") == ("kl_coef",)


def test_check_loss_kwargs_user_losses_and_batch_names():
    def takes_anything(logprobs_B_T, *, advantages_B, mask_B_T, **_):
        return (logprobs_B_T * 0).sum(), {}

    def takes_beta(logprobs_B_T, *, advantages_B, mask_B_T, beta=0.1, generator_logprobs_B_T=None,
                   ref_logprobs_B_T=None, is_weights_B_T=None):
        return (logprobs_B_T * 0).sum(), {}

    check_loss_kwargs(takes_anything, {"whatever": 1})
    check_loss_kwargs(takes_beta, {"beta": 0.2})
    with pytest.raises(LossError, match=r"takes_beta.*\['bta'\].*accepts: beta"):
        check_loss_kwargs(takes_beta, {"bta": 0.2})
    with pytest.raises(LossError, match="mask_B_T.*from the batch"):
        check_loss_kwargs("grpo", {"mask_B_T": 1})
    with pytest.raises(LossError, match="unknown loss 'grpoo'"):
        check_loss_kwargs("grpoo", {})
    check_loss_kwargs("grpo", None)


# --- dr_grpo's completion budget --------------------------------------------------------


@pytest.mark.numerics
def test_dr_grpo_divides_by_the_completion_budget_not_the_padded_width():
    batch = _batch(seed=15)
    # A long prompt: 20 more positions, never trained. The budget-normalised loss must not move.
    pad = lambda x, v: torch.cat([torch.full((B, 20), v), x], dim=1)  # noqa: E731
    wide = {k: (pad(v, 0.0 if k in ("mask_B_T",) else -1.0) if isinstance(v, torch.Tensor) and v.dim() == 2 else v)
            for k, v in batch.items()}
    narrow_loss, _, _ = _call("dr_grpo", batch, max_tokens=16)
    wide_loss, _, _ = _call("dr_grpo", wide, max_tokens=16)
    tol = _loss_tol(batch)
    check(abs(wide_loss.item() - narrow_loss.item()), 2 * tol, "dr_grpo: padded vs narrow")
    check(abs(narrow_loss.item() - ref_dr_grpo(batch, max_tokens=16)[0]), tol, "dr_grpo, budget 16")
    # Without a budget: the widest trained span (6 here), not the padded width 26.
    check(abs(_call("dr_grpo", wide)[0].item() - ref_dr_grpo(batch, max_tokens=6)[0]), tol, "dr_grpo, no budget")


def test_with_completion_budget_fills_max_tokens_only_for_losses_that_take_it():
    assert with_completion_budget("dr_grpo", {}, 16) == {"max_tokens": 16}
    assert with_completion_budget("dr_grpo", {"max_tokens": 4, "eps_low": 0.1}, 16) == {"max_tokens": 4, "eps_low": 0.1}
    assert with_completion_budget("grpo", {"kl_coef": 0.0}, 16) == {"kl_coef": 0.0}
    assert with_completion_budget(lambda logprobs_B_T, **_: None, {}, 16) == {}
    assert with_completion_budget("dr_grpo", {}, None) == {}


def test_bad_max_tokens_raises():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(LossError, match="max_tokens"):
            _call("dr_grpo", _batch(seed=16), max_tokens=bad)


def test_loss_panel_refuses_an_unknown_keyword_before_calling_the_run():
    pytest.importorskip("ipywidgets")
    from types import SimpleNamespace

    from forgelab.lab.loss_panel import LossPanel

    calls = []

    async def set_loss(loss, **kwargs):  # must never be reached
        calls.append((loss, kwargs))
        return {"loss": loss, "applies_at_step": 1}

    run = SimpleNamespace(loss_name="grpo", set_loss=set_loss, status=lambda: {}, config=SimpleNamespace(name="t"))
    panel = LossPanel(run)
    _ = panel.widget
    panel.kwargs.value = "eps_hgih=0.28"
    assert panel.apply("dapo") is None
    assert calls == []
    assert panel.outcome["ok"] is False
    assert "eps_hgih" in panel.outcome["reason"] and "eps_high" in panel.outcome["reason"]
    assert "eps_hgih" in panel.message.value


def test_config_validation_reports_an_unknown_loss_keyword():
    from forgelab.config.run_config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match=r"train.loss_kwargs: .*'dapo'.*eps_hgih.*eps_high"):
        RunConfig.from_dict({"train": {"loss": "dapo", "loss_kwargs": {"eps_hgih": 0.28}}})
    RunConfig.from_dict({"train": {"loss": "dapo", "loss_kwargs": {"eps_high": 0.28, "kl_coef": 0.01}}})


def test_run_trainer_config_carries_the_completion_budget_to_dr_grpo():
    from forgelab.config.run_config import RunConfig
    from forgelab.engines.spawn import component_configs

    cfg = RunConfig.from_dict({"rollout": {"max_tokens": 12}, "train": {"loss": "dr_grpo"}})
    assert component_configs(cfg)["trainer"].loss_kwargs == {"max_tokens": 12}
    cfg = RunConfig.from_dict({"rollout": {"max_tokens": 12}, "train": {"loss": "dr_grpo", "loss_kwargs": {"max_tokens": 5}}})
    assert component_configs(cfg)["trainer"].loss_kwargs == {"max_tokens": 5}
    cfg = RunConfig.from_dict({"rollout": {"max_tokens": 12, "env": "calculator", "max_turns": 3,
                                           "task": "multistep"}, "train": {"loss": "dr_grpo"}})
    assert component_configs(cfg)["trainer"].loss_kwargs == {"max_tokens": 36}
    cfg = RunConfig.from_dict({"train": {"loss": "grpo", "loss_kwargs": {"kl_coef": 0.0}}})
    assert component_configs(cfg)["trainer"].loss_kwargs == {"kl_coef": 0.0}


def test_config_refuses_a_kl_coef_without_the_reference_model():
    from forgelab.config.run_config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match=r"kl_coef.*placement.reference"):
        RunConfig.from_dict({"train": {"loss": "dapo", "loss_kwargs": {"kl_coef": 0.05}},
                             "placement": {"reference": False}})
    RunConfig.from_dict({"train": {"loss": "grpo"}, "placement": {"reference": False}})  # grpo's default: skipped


# --- per-token advantages ([B, T]; on-policy distillation's signal) ---------------------------------------------


def _per_token_batch(seed=0, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 3
    gen = logp + 0.3 * torch.randn(B, T, generator=g)  # ratios far enough from 1 that clipping is active
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[2] = 0.0  # a fully masked row
    mask[0, 0] = 1.0
    adv_B = torch.randn(B, generator=g)
    ref = logp + 0.1 * torch.randn(B, T, generator=g)
    return logp, gen, mask, adv_B, ref


@pytest.mark.numerics
@pytest.mark.parametrize("name", sorted(BUILTIN_LOSSES))
def test_a_row_constant_per_token_advantage_gives_exactly_the_per_sequence_result(name):
    logp, gen, mask, adv_B, ref = _per_token_batch()
    kwargs = {"kl_coef": 0.05} if "kl_coef" in inspect.signature(LOSSES[name]).parameters else {}
    results = []
    for adv in (adv_B, adv_B[:, None].expand(-1, logp.shape[1]).clone()):
        leaf = logp.clone().requires_grad_(True)
        loss, metrics = LOSSES[name](leaf, generator_logprobs_B_T=gen, advantages_B=adv, mask_B_T=mask,
                                     ref_logprobs_B_T=ref, **kwargs)
        loss.backward()
        results.append((loss.detach(), leaf.grad.clone(), metrics))
    (l1, g1, m1), (l2, g2, m2) = results
    # exact: the same arithmetic on the same values (a constant row broadcasts to what [B, 1] broadcasts to)
    assert torch.equal(l1, l2) and torch.equal(g1, g2) and m1 == m2


@pytest.mark.numerics
def test_per_token_advantages_weight_each_token_reinforce_against_float64():
    logp, gen, mask, _, _ = _per_token_batch(seed=1)
    adv_B_T = torch.randn(logp.shape, generator=torch.Generator().manual_seed(3))
    leaf = logp.clone().requires_grad_(True)
    loss, _ = LOSSES["reinforce"](leaf, generator_logprobs_B_T=gen, advantages_B=adv_B_T, mask_B_T=mask)
    loss.backward()
    # independent computation: -sum(A_t * logp_t) / N over trained tokens, in float64
    want = -(adv_B_T.double() * logp.double() * mask.double()).sum() / mask.double().sum()
    want_grad = -(adv_B_T.double() * mask.double()) / mask.double().sum()
    # float32 bounds (tests/numerics.py): the loss is a mean of N products, a reduction of length N over terms of
    # mean magnitude S; each gradient entry is -A * m / N, elementwise with two roundings
    n = int(mask.sum())
    scale = float((adv_B_T.abs() * logp.abs() * mask).sum() / mask.sum())
    check(abs(loss.item() - want.item()), fp32_tol(scale, n=n), "reinforce loss with per-token advantages")
    check(float(((leaf.grad.double() - want_grad).abs() / want_grad.abs().clamp_min(1e-30))[mask != 0].max()),
          fp32_tol(1.0, ulps=2), "its gradient (relative, per trained token)")
    # the bug this guards against (a per-token advantage broadcast as one per row) is off by O(1):
    assert fp32_tol(scale, n=n) < 1e-3 * scale


def test_a_per_token_advantage_of_the_wrong_shape_is_refused_by_name():
    logp, gen, mask, _, _ = _per_token_batch()
    with pytest.raises(LossError, match=r"advantages_B has shape \(5, 6\), expected \(5,\).*or \(5, 7\)"):
        LOSSES["grpo"](logp, generator_logprobs_B_T=gen, advantages_B=torch.zeros(5, 6), mask_B_T=mask)
