"""gather_logprobs, token_entropy, shift_for_targets and masked reductions against plain-Python loops."""

import math

import pytest
import torch

from forgelab.algos.logprobs import gather_logprobs, masked_mean, masked_sum, shift_for_targets, token_entropy
from numerics import check, fp32_tol

# Float32 bounds against the float64 loops (numerics.py): a logprob z_y - logsumexp(z) of a row of V logits, cast
# to float32, is within fp32_tol(max |z|, n=V) (each logit rounded, the V-term sum); the row with a +1000 offset
# has ulps of 6e-5, the others of 1e-6. An entropy moves by at most 2H <= 2 log V times the logits' error, plus
# its own V-term sum.


def _loop_logprob(row: list[float], target: int) -> float:
    m = max(row)
    return row[target] - (m + math.log(sum(math.exp(z - m) for z in row)))


def _loop_entropy(row: list[float]) -> float:
    m = max(row)
    exps = [math.exp(z - m) for z in row]
    s = sum(exps)
    return -sum((e / s) * math.log(e / s) for e in exps if e > 0)


@pytest.fixture
def logits_targets():
    g = torch.Generator().manual_seed(0)
    logits_B_T_V = torch.randn(2, 5, 7, generator=g, dtype=torch.float64) * 3
    logits_B_T_V[1, 2] += 1000.0  # a huge but finite offset must not overflow
    targets_B_T = torch.randint(0, 7, (2, 5), generator=g)
    return logits_B_T_V, targets_B_T


@pytest.mark.numerics
def test_gather_logprobs_matches_loop(logits_targets):
    logits, targets = logits_targets
    got = gather_logprobs(logits, targets)
    assert got.dtype == torch.float32 and got.shape == (2, 5)
    for b in range(2):
        for t in range(5):
            want = _loop_logprob(logits[b, t].tolist(), int(targets[b, t]))
            check(abs(got[b, t].item() - want), fp32_tol(logits[b, t].abs().max(), n=7), f"logprob [{b}, {t}]")


@pytest.mark.numerics
def test_gather_logprobs_chunked_equals_unchunked(logits_targets):
    logits, targets = logits_targets
    full = gather_logprobs(logits, targets)
    for chunk in (1, 2, 3, 5, 99):
        assert torch.equal(gather_logprobs(logits, targets, chunk_size=chunk), full)


@pytest.mark.numerics
def test_gather_logprobs_gradient_is_onehot_minus_softmax(logits_targets):
    logits, targets = logits_targets
    logits = logits.float().requires_grad_(True)
    gather_logprobs(logits, targets, chunk_size=2).sum().backward()
    for b in range(2):
        for t in range(5):
            row = logits[b, t].tolist()
            m = max(row)
            s = sum(math.exp(z - m) for z in row)
            for v in range(7):
                want = (1.0 if v == int(targets[b, t]) else 0.0) - math.exp(row[v] - m) / s
                assert logits.grad[b, t, v].item() == pytest.approx(want, abs=1e-5)


@pytest.mark.numerics
def test_gather_logprobs_bf16_input_computes_in_fp32():
    logits = torch.randn(1, 3, 11).to(torch.bfloat16)
    targets = torch.tensor([[0, 5, 10]])
    got = gather_logprobs(logits, targets)
    assert got.dtype == torch.float32
    for t in range(3):
        want = _loop_logprob(logits[0, t].float().tolist(), int(targets[0, t]))
        assert got[0, t].item() == pytest.approx(want, abs=1e-5)


def test_gather_logprobs_shape_mismatch_says_what_to_do():
    with pytest.raises(ValueError, match="shift_for_targets"):
        gather_logprobs(torch.zeros(1, 4, 3), torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.numerics
def test_token_entropy_matches_loop(logits_targets):
    logits, _ = logits_targets
    got = token_entropy(logits)
    for b in range(2):
        for t in range(5):
            check(abs(got[b, t].item() - _loop_entropy(logits[b, t].tolist())),
                  fp32_tol(logits[b, t].abs().max() * math.log(7), n=7), f"entropy [{b}, {t}]")
    uniform = token_entropy(torch.zeros(1, 1, 9))
    check(abs(uniform.item() - math.log(9)), fp32_tol(math.log(9), n=9), "entropy of 9 equal logits")


@pytest.mark.numerics
def test_token_entropy_with_banned_token_is_finite_with_finite_grad():
    logits = torch.tensor([[[0.0, 1.0, float("-inf")]]], requires_grad=True)
    h = token_entropy(logits)
    assert h.item() == pytest.approx(_loop_entropy([0.0, 1.0]), abs=1e-6)
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_shift_for_targets():
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0]])
    inputs, targets = shift_for_targets(tokens)
    assert inputs.tolist() == [[1, 2, 3], [5, 6, 0]]
    assert targets.tolist() == [[2, 3, 4], [6, 0, 0]]
    with pytest.raises(ValueError, match="L >= 2"):
        shift_for_targets(torch.tensor([[1]]))


@pytest.mark.numerics
def test_masked_reductions_match_loops_and_ignore_masked_nans():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, generator=g)
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 1]], dtype=torch.float32)
    x[0, 3] = float("nan")
    x[1, 0] = float("inf")
    rows = x.tolist()
    m = mask.tolist()
    on = [[(b, t) for t in range(4) if m[b][t]] for b in range(3)]
    all_on = [bt for row in on for bt in row]
    # float32 sums of at most 12 terms (masked ones are exact zeros): fp32_tol(sum |x|, n=12) (numerics.py)
    tol = fp32_tol(sum(abs(rows[b][t]) for b, t in all_on), n=12)
    check(abs(masked_sum(x, mask).item() - sum(rows[b][t] for b, t in all_on)), tol, "masked_sum")
    check(abs(masked_mean(x, mask).item() - sum(rows[b][t] for b, t in all_on) / len(all_on)), tol, "masked_mean")
    per_row = masked_mean(x, mask, dim=1)
    for b in range(3):
        want = sum(rows[b][t] for _, t in on[b]) / len(on[b]) if on[b] else 0.0
        check(abs(per_row[b].item() - want), tol, f"masked_mean row {b}")
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_masked_mean_all_masked_has_zero_finite_grad():
    x = torch.randn(2, 3, requires_grad=True)
    masked_mean(x, torch.zeros(2, 3), dim=1).sum().backward()
    assert torch.equal(x.grad, torch.zeros(2, 3))
