"""What a generator checks before it loads tensors it was sent: names and shapes against what it serves.

    problems = check_named_tensors(tensors, expected_shapes, naming="HF", what="weights")

One check for a full weight update (`forgelab.weights.receiver.check_weights`, HF names) and an adapter update
(`forgelab.weights.adapter.check_adapter`, PEFT names): a problem found in one is found in the other.
"""
from __future__ import annotations

__all__ = ["check_named_tensors"]


def check_named_tensors(tensors: object, expected: dict[str, tuple[int, ...]], *, naming: str,
                        what: str, missing_hint: str = "") -> list[str]:
    """Problems with a dict of `naming`-named tensors (``"HF"`` weights, ``"PEFT"`` adapter tensors) against
    `expected` shapes: not a dict, unknown or missing names (the first five of each), a value that is not a
    floating-point tensor, a wrong shape. An empty list: fine. `what` names the thing in the messages
    (``"weights"``, ``"an adapter"``); `missing_hint` ends the missing-names message (what to send instead)."""
    import torch

    if not isinstance(tensors, dict):
        return [f"{what} must be a dict of {naming} name -> torch.Tensor, got {type(tensors).__name__}"]
    problems = []
    unknown = [k for k in tensors if k not in expected]
    if unknown:
        problems.append(f"unknown names {unknown[:5]} (expected {naming} names such as {sorted(expected)[:3]})")
    missing = [k for k in expected if k not in tensors]
    if missing:
        problems.append(f"missing names {missing[:5]} ({len(missing)} of {len(expected)} missing{missing_hint})")
    for name, value in tensors.items():
        if name not in expected:
            continue
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            problems.append(f"{name}: expected a floating-point torch.Tensor, got {type(value).__name__}"
                            + (f" of dtype {value.dtype}" if isinstance(value, torch.Tensor) else ""))
        elif tuple(value.shape) != expected[name]:
            problems.append(f"{name}: shape {tuple(value.shape)}, expected {expected[name]}")
    return problems
