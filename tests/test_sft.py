"""The supervised loop both recipes share (forgelab.recipes.sft): how a step's loss is averaged, the
snapshot hook, and that a short run is the start of a longer one. The recipes' own numbers are checked
in tests/test_tiny_model.py and tests/test_tool_warmstart.py; here a bigram model keeps it fast."""
from __future__ import annotations

import contextlib
import doctest
import io
from types import SimpleNamespace

import pytest
import torch

from forgelab.recipes import sft
from forgelab.recipes.sft import IGNORE, Stream, pad_right, train_sft

V = 11
EPS32 = torch.finfo(torch.float32).eps


class Bigram(torch.nn.Module):
    """Next-token logits from the current token alone: ``model(input_ids=ids_B_T).logits`` like HF's."""

    def __init__(self, seed: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(V, V, generator=torch.Generator().manual_seed(seed)))

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.table[input_ids])


def stream(n: int, length: int, labelled: int, batch_size: int, seed: int) -> Stream:
    """``n`` rows of ``length`` random tokens (ragged: row i is shorter by i % 3), the last ``labelled`` labelled."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(1, V, (length - i % 3,), generator=g).tolist() for i in range(n)]
    labels = [[IGNORE] * (len(r) - labelled) + r[-labelled:] for r in rows]
    return Stream(*pad_right(rows, labels, pad_id=0), batch_size=batch_size)


def quiet_train(*args, **kwargs) -> sft.SFTResult:
    with contextlib.redirect_stdout(io.StringIO()):
        return train_sft(*args, **kwargs)


def test_doctests():
    result = doctest.testmod(sft)
    assert result.failed == 0 and result.attempted > 0


def test_tokens_average_pools_the_labelled_tokens_of_every_stream():
    # whole streams as batches, so the first step's loss is over all of their rows whatever the order
    a, b = stream(6, 9, 5, 6, seed=1), stream(10, 4, 1, 10, seed=2)  # 30 vs 10 labelled tokens
    model = Bigram(0)
    with torch.no_grad():
        table64 = model.table.double()

    def ce64(s: Stream) -> torch.Tensor:  # float64 reference, summed over labelled tokens
        logits = table64[s.ids_N_T[:, :-1]].flatten(0, 1)
        return torch.nn.functional.cross_entropy(logits, s.labels_N_T[:, 1:].flatten(), ignore_index=IGNORE,
                                                 reduction="sum")

    n_a, n_b = int((a.labels_N_T != IGNORE).sum()), int((b.labels_N_T != IGNORE).sum())
    pooled = float((ce64(a) + ce64(b)) / (n_a + n_b))
    per_stream = float((ce64(a) / n_a + ce64(b) / n_b) / 2)
    got = quiet_train(model, [a, b], steps=1, lr=1e-3, warmup_steps=1, seed=0, average="tokens").losses[0]
    # float32: each of the 40 terms is a log-sum-exp over 11 logits of size < 5, good to a few ulps of ~10;
    # the sums of 40 terms add at most 40 roundings: relative error well under 100 eps
    tol = 100 * EPS32 * pooled
    assert abs(got - pooled) <= tol
    assert abs(per_stream - pooled) > 10 * tol  # the test tells the two averages apart


def test_mean_average_is_cross_entropys_mean_on_one_stream():
    s = stream(8, 7, 3, 8, seed=3)
    model = Bigram(1)
    with torch.no_grad():
        expected = float(sft.sft_loss(model, s.ids_N_T, s.labels_N_T))
    got = quiet_train(model, [s], steps=1, lr=1e-3, warmup_steps=1, seed=0, average="mean").losses[0]
    # the same rows in another order: the same mean up to the reduction's rounding (24 terms)
    assert abs(got - expected) <= 24 * EPS32 * expected


def test_choices_are_checked():
    s = stream(4, 5, 2, 2, seed=4)
    with pytest.raises(ValueError, match="one stream"):
        train_sft(Bigram(0), [s, s], steps=1, lr=1e-3, warmup_steps=1, seed=0, average="mean")
    with pytest.raises(ValueError, match="'mean' or 'tokens'"):
        train_sft(Bigram(0), [s], steps=1, lr=1e-3, warmup_steps=1, seed=0, average="batch")  # type: ignore[arg-type]


def test_a_short_run_is_the_start_of_a_longer_one_and_the_hook_sees_each_step():
    streams = [stream(10, 8, 4, 3, seed=5), stream(7, 5, 2, 4, seed=6)]  # both reshuffle within 7 steps
    seen: list[tuple[int, int]] = []
    long = Bigram(2)
    full = quiet_train(long, streams, steps=7, lr=1e-2, warmup_steps=3, seed=9, average="tokens",
                       after_step=lambda k, so_far: seen.append((k, len(so_far.losses))))
    short = Bigram(2)
    part = quiet_train(short, streams, steps=4, lr=1e-2, warmup_steps=3, seed=9, average="tokens")
    assert seen == [(k, k) for k in range(1, 8)]
    assert part.losses == full.losses[:4]  # bit for bit: the same ops in the same order
    assert not torch.equal(short.table, long.table)
