"""One check serves a full weight update and an adapter update (forgelab.weights.checks.check_named_tensors):
the same problems are found in both, named in each one's terms. Fast, no process."""
from __future__ import annotations

import torch

from forgelab.weights.adapter import check_adapter
from forgelab.weights.receiver import check_weights

EXPECTED = {"a": (2, 3), "b": (4,)}


def test_a_good_update_has_no_problems_in_either_form():
    good = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
    assert check_weights(good, EXPECTED) == [] and check_adapter(good, EXPECTED) == []


def test_each_kind_of_problem_is_found_by_both_and_named_in_their_terms():
    bad = {"a": torch.zeros(2, 2), "b": torch.zeros(4, dtype=torch.int64), "c": torch.zeros(1)}
    w, a = check_weights(bad, EXPECTED), check_adapter(bad, EXPECTED)
    for problems, naming in ((w, "HF"), (a, "PEFT")):
        assert any(p.startswith("unknown names ['c']") and f"expected {naming} names" in p for p in problems)
        assert "a: shape (2, 2), expected (2, 3)" in problems
        assert any(p.startswith("b: expected a floating-point torch.Tensor") and "torch.int64" in p for p in problems)
    missing = {"a": torch.zeros(2, 3)}
    assert check_weights(missing, EXPECTED) == ["missing names ['b'] (1 of 2 missing; send the full state dict)"]
    assert check_adapter(missing, EXPECTED) == ["missing names ['b'] (1 of 2 missing)"]
    assert check_weights([1], EXPECTED)[0].startswith("weights must be a dict of HF name")
    assert check_adapter([1], EXPECTED)[0].startswith("an adapter must be a dict of PEFT name")
