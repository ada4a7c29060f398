"""forgelab.engines.trainer_support.sum_of_squares: the trainer's gradient norm, checked against float64."""
import torch

from forgelab.engines.trainer_support import sum_of_squares


def test_sum_of_squares_is_float64_accurate_on_embedding_sized_tensors():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(40_000_000, generator=g) * 1e-3, torch.randn(3, 5, generator=g), torch.zeros(0)]
    truth = sum(float((t.double() ** 2).sum()) for t in tensors)
    got = sum_of_squares(tensors)
    assert got.dtype == torch.float64
    assert abs(float(got) / truth - 1) <= 1e-6, float(got) / truth - 1
    assert float(sum_of_squares([])) == 0.0
    assert float(sum_of_squares([torch.tensor([3.0, 4.0])], piece=1)) == 25.0
