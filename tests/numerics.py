"""Float32 tolerances for the tests: bounds derived from arithmetic, not from what one machine printed.

MKL, oneDNN and ATen choose other kernels on another CPU, at another batch size or thread count; the blocking
and the order of every reduction change with them, and float32 results move in their last bits. A bound below
what float32 can promise for a computation holds only on the machine where it was measured.
``make test-numerics`` runs the tests marked ``numerics`` under several such kernel choices on one machine.

How a bound is derived (``fp32_tol``):

* Ulps. ``EPS = torch.finfo(torch.float32).eps = 2**-23 ~ 1.19e-7``; ``EPS * |x|`` is at least one ulp of ``x``
  (the spacing of float32 numbers there); one rounding moves a value by at most half of that, ``u * |x|`` with
  the unit roundoff ``u = EPS / 2``.
* Reductions. A float32 sum of ``n`` terms (a dot product, a matmul entry, a logsumexp, a loss over tokens)
  rounds once per addition. Rounding errors behave as independent zero-mean variables, so whatever the order
  or blocking a kernel picks, the error grows like ``sqrt(n)``: within ``LAMBDA * sqrt(n) * u * S`` of the
  exact sum, ``S`` the magnitude of its terms (Higham & Mary 2019, "A new approach to probabilistic rounding
  error analysis"; the worst case, ``n * u * S``, is never approached by real kernels). ``LAMBDA = 4`` is the
  margin over the typical size. Two evaluations in different orders differ by at most the sum of their two
  errors: ``LAMBDA * sqrt(n) * EPS * S``.
* Chains. A model's forward is ``depth`` stages of such reductions (``n`` the longest, e.g. the MLP's hidden
  size); in a residual, normalised network a stage's relative error is carried on, not amplified, so the
  errors add: ``depth * LAMBDA * sqrt(n) * EPS * scale``, ``scale`` the largest magnitude of the values compared.
* Against float64. Compute the truth in float64 (its own rounding, ``2**-53`` relative, is negligible) and bound
  each float32 result's distance to it; give values that may be near zero an absolute ``floor`` (relative
  accuracy means nothing at 0).

Every test says which computation its bound is for, and that the bound still catches the bug the test exists for.
Set ``FORGELAB_NUMERICS_LOG=<file>`` to append every checked ``(test, what, err, tol)`` as a JSON line.
"""
from __future__ import annotations

import json
import math
import os

import torch

EPS = torch.finfo(torch.float32).eps
"""2**-23: one ulp of float32 at 1.0 (twice the unit roundoff)."""

LAMBDA = 4.0
"""How many times its typical size ``sqrt(n) * u * S`` a float32 reduction's rounding error may reach."""


def fp32_tol(scale: float, *, n: int = 1, depth: int = 1, ulps: float = 1.0, floor: float = 0.0) -> float:
    """``max(ulps * depth * LAMBDA * sqrt(n) * EPS * scale, floor)``: how far apart two float32 evaluations of one
    quantity may be (or one from the float64 truth).

    Args:
        scale: the largest magnitude of the values compared (or of the reduction's terms).
        n: the length of the longest reduction that produced them (1: elementwise).
        depth: reductions chained one after another (a model's layers), whose errors add.
        ulps: a multiple, for computations with several roundings per element (e.g. ``exp`` then ``log``).
        floor: an absolute lower bound, for values that may be near zero.
    """
    return max(ulps * depth * LAMBDA * math.sqrt(n) * EPS * float(scale), floor)


def model_tol(config, scale: float) -> float:
    """Bound on ``|a - b|`` for two float32 forwards of one decoder, logits or logprobs of magnitude <= ``scale``.

    ``config`` is a HF ``config.json`` (a dict, the model directory, or a ``PretrainedConfig``). The chain bound
    with ``depth`` = its layers + the output projection and ``n`` = its widest reduction (hidden or MLP size);
    a logprob ``z_y - logsumexp(z)`` adds the logsumexp's rounding (the log of a sum of V terms carries the
    sum's relative error, ``fp32_tol(1, n=V)``).
    """
    if isinstance(config, str):
        with open(os.path.join(config, "config.json")) as f:
            config = json.load(f)
    elif not isinstance(config, dict):
        config = config.to_dict()
    n = max(config["hidden_size"], config["intermediate_size"])
    return fp32_tol(scale, n=n, depth=config["num_hidden_layers"] + 1) + fp32_tol(1.0, n=config["vocab_size"])


def max_abs_diff(a, b) -> float:
    """``max |a - b|`` computed in float64 (tensors, or sequences of floats)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max()) if a.numel() else 0.0


def max_abs(a) -> float:
    """``max |a|`` as a Python float (0 for an empty tensor)."""
    a = torch.as_tensor(a, dtype=torch.float64)
    return float(a.abs().max()) if a.numel() else 0.0


def check(err: float, tol: float, what: str) -> None:
    """Assert ``err <= tol``, naming ``what`` and the ratio when it fails; log it when FORGELAB_NUMERICS_LOG is set."""
    err, tol = float(err), float(tol)
    path = os.environ.get("FORGELAB_NUMERICS_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "what": what,
                                "err": err, "tol": tol}) + "\n")
    assert err <= tol, f"{what}: {err:.3e} > tolerance {tol:.3e} ({err / tol:.2f}x)"


def summarize(path: str, top: int = 3) -> str:
    """The ``top`` comparisons closest to their bound in a FORGELAB_NUMERICS_LOG file, one per line."""
    if not os.path.exists(path):
        return "  no comparison logged"
    worst: dict[tuple[str, str], tuple[float, float, float]] = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            key = (r["test"], r["what"])
            ratio = r["err"] / r["tol"] if r["tol"] > 0 else math.inf
            if key not in worst or ratio > worst[key][0]:
                worst[key] = (ratio, r["err"], r["tol"])
    rows = sorted(worst.items(), key=lambda kv: -kv[1][0])[:top]
    head = f"  {len(worst)} comparisons; closest to their bound:"
    return "\n".join([head] + [f"    err/tol {ratio:.3f} ({err:.2e} / {tol:.2e})  {test.split('::')[-1]}: {what}"
                               for (test, what), (ratio, err, tol) in rows])


if __name__ == "__main__":  # python tests/numerics.py LOG: the comparisons closest to their bound
    import sys

    print(summarize(sys.argv[1]))
