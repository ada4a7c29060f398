"""forgelab.engines.trainer_dist.sum_of_squares: the trainer's gradient norm, checked against float64."""
import pytest
import torch

from forgelab.engines.trainer_dist import sum_of_squares
from numerics import check, fp32_tol


@pytest.mark.numerics
def test_sum_of_squares_is_float64_accurate_on_embedding_sized_tensors():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(40_000_000, generator=g) * 1e-3, torch.randn(3, 5, generator=g), torch.zeros(0)]
    truth = sum(float((t.double() ** 2).sum()) for t in tensors)
    got = sum_of_squares(tensors)
    assert got.dtype == torch.float64
    # Each piece's float32 norm sums 65,536 squares (numerics.fp32_tol(1, n=2**16) relative, 1.2e-4); the pieces are
    # combined in float64, so the total is off by at most the worst piece's relative error. One float32 norm over
    # the 40M elements, the regression this guards against, is 4e-3 off.
    check(abs(float(got) / truth - 1), fp32_tol(1.0, n=1 << 16), "sum_of_squares relative error")
    assert float(sum_of_squares([])) == 0.0
    assert float(sum_of_squares([torch.tensor([3.0, 4.0])], piece=1)) == 25.0
