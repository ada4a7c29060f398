"""Checks around a loss function: its keyword arguments before it runs, its output after.

``check_loss_kwargs(loss, kwargs)`` is pure and cheap: config validation,
``Run.set_loss`` and the loss panel call it so a misspelt hyperparameter
(``eps_hgih``) is refused before anything runs. The built-in losses also
reject unknown keywords themselves (``strict_hparams``). A user's own loss
that takes ``**kwargs`` accepts whatever it likes.

``with_completion_budget`` fills in ``max_tokens`` (the completion budget a
constant-normalised loss such as ``dr_grpo`` divides by) when the loss takes it
by name and the user did not set it.

    >>> check_loss_kwargs("dapo", {"eps_high": 0.28})
    >>> check_loss_kwargs("dapo", {"eps_hgih": 0.28})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    forgelab.algos.loss_checks.LossError: loss 'dapo' does not take ['eps_hgih']; it accepts: eps_high, eps_low, kl_coef
    >>> with_completion_budget("dr_grpo", {}, 32)
    {'max_tokens': 32}
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

__all__ = [
    "LossError",
    "BATCH_ARGS",
    "accepted_loss_kwargs",
    "check_loss_kwargs",
    "strict_hparams",
    "with_completion_budget",
    "completion_budget",
    "without_reference",
    "reads_reference",
    "KL_ONLY_REFERENCE",
    "reference_notes",
    "loss_label",
    "validate_loss_output",
]

BATCH_ARGS = ("generator_logprobs_B_T", "advantages_B", "mask_B_T", "ref_logprobs_B_T", "is_weights_B_T")
"""Keyword arguments the trainer passes from the batch; never hyperparameters."""


class LossError(ValueError):
    """A loss function was called with bad inputs or returned something the trainer cannot use."""


LOSSES: dict[str, Callable[..., Any]] = {}
"""Losses by name (the built-in ones are registered by `forgelab.algos.losses`, which defines them). A user's
own function with the same signature is a first-class entry. It lives here, below the losses, so that the
checks can resolve a name without importing the module that defines the losses."""


KL_ONLY_REFERENCE: list[Callable[..., Any]] = []
"""Losses that read ``ref_logprobs_B_T`` only in their ``kl_coef`` term and the ``kl_ref`` metric (the built-ins,
registered by `forgelab.algos.losses`): `reads_reference` is False for them at ``kl_coef`` 0."""


def _resolve(loss: Any) -> tuple[str, Callable]:
    if isinstance(loss, str):
        if loss not in LOSSES:
            raise LossError(f"unknown loss {loss!r}; registered losses: {sorted(LOSSES)} (or pass a function)")
        return loss, LOSSES[loss]
    if hasattr(loss, "unpack") and hasattr(loss, "payload"):  # a PackedLoss (forgelab.engines.trainer_state)
        return getattr(loss, "name", "loss"), loss.unpack()
    if callable(loss):
        return getattr(loss, "__name__", type(loss).__name__), loss
    raise LossError(f"a loss must be a name in LOSSES or a function, got {type(loss).__name__}")


def accepted_loss_kwargs(loss: Any) -> tuple[str, ...] | None:
    """The hyperparameter names ``loss`` takes (sorted), or None if it takes any (``**kwargs``) or cannot be inspected."""
    _, fn = _resolve(loss)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in params if p.kind in kinds]
    return tuple(sorted(n for n in names[1:] if n not in BATCH_ARGS)) if names else ()


def check_loss_kwargs(loss: Any, kwargs: Mapping[str, Any] | None) -> None:
    """Raise ``LossError`` naming every keyword in ``kwargs`` that ``loss`` does not take, and listing those it does.

    ``loss`` is a name in ``LOSSES``, a function or a packed function. The
    batch tensors (``mask_B_T``, ...) are never valid hyperparameters. A loss
    with ``**kwargs`` accepts anything.
    """
    if kwargs is None:
        return
    if not isinstance(kwargs, Mapping):
        raise LossError(f"loss_kwargs must be a dict of hyperparameters, got {type(kwargs).__name__}")
    name, _ = _resolve(loss)
    batch = sorted(k for k in kwargs if k in BATCH_ARGS)
    if batch:
        raise LossError(f"loss {name!r}: {batch} come from the batch, not from loss_kwargs; remove them")
    accepted = accepted_loss_kwargs(loss)
    if accepted is None:
        return
    unknown = sorted(k for k in kwargs if k not in accepted)
    if unknown:
        raise LossError(f"loss {name!r} does not take {unknown}; it accepts: {', '.join(accepted) or 'no hyperparameters'}")


def strict_hparams(fn: Callable) -> Callable:
    """Make a loss raise ``LossError`` on an unknown keyword (naming it and listing the accepted ones).

    Python's own ``TypeError`` names only the first unknown keyword and not the
    accepted ones; the trainer shows this message as the skip reason.
    """
    accepted = set(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def wrapper(logprobs_B_T, **kwargs):
        if not accepted.issuperset(kwargs):
            check_loss_kwargs(fn, {k: v for k, v in kwargs.items() if k not in BATCH_ARGS})
        return fn(logprobs_B_T, **kwargs)

    return wrapper


def with_completion_budget(loss: Any, kwargs: Mapping[str, Any] | None, budget: int | None) -> dict[str, Any]:
    """``kwargs`` plus ``max_tokens=budget`` when ``loss`` takes ``max_tokens`` by name and it is not set.

    ``budget`` is the most completion tokens one episode can train on:
    ``rollout.max_tokens``, times ``rollout.max_turns`` for environment runs.
    A loss with only ``**kwargs`` gets nothing added (it did not ask).

    >>> with_completion_budget("dr_grpo", {"max_tokens": 8}, 32), with_completion_budget("dapo", {}, 32)
    ({'max_tokens': 8}, {})
    """
    out = dict(kwargs or {})
    if budget is None or "max_tokens" in out:
        return out
    _, fn = _resolve(loss)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return out
    if "max_tokens" in params and params["max_tokens"].kind is not inspect.Parameter.VAR_KEYWORD:
        out["max_tokens"] = int(budget)
    return out


def without_reference(loss: Any, kwargs: Mapping[str, Any] | None) -> tuple[dict[str, Any], str | None]:
    """The keywords ``loss`` runs with when there is no reference model, and a message when they differ.

    An explicit ``kl_coef > 0`` raises ``LossError`` (there are no reference logprobs to take a KL to). A
    loss whose own default ``kl_coef`` is positive (grpo's 0.04) gets ``kl_coef=0.0`` written in, with a
    message saying so: the KL term is off, and now visibly so.

    >>> without_reference("grpo", {})[0], without_reference("dapo", {})
    ({'kl_coef': 0.0}, ({}, None))
    """
    out = dict(kwargs or {})
    name, fn = _resolve(loss)
    kl = out.get("kl_coef")
    if isinstance(kl, (int, float)) and not isinstance(kl, bool) and kl > 0:
        raise LossError(f"kl_coef: {kl} needs the reference model, but placement.reference is false; set "
                        "placement.reference: true or kl_coef: 0")
    if kl is not None:
        return out, None
    try:
        p = inspect.signature(fn).parameters.get("kl_coef")
    except (TypeError, ValueError):
        p = None
    default = None if p is None or p.default is inspect.Parameter.empty else p.default
    if not isinstance(default, (int, float)) or isinstance(default, bool) or default <= 0:
        return out, None
    out["kl_coef"] = 0.0
    return out, (f"loss {name!r} takes kl_coef={default} by default, but placement.reference is false: with no "
                 "reference model there is no KL term, so it trains with kl_coef 0. Set "
                 "train.loss_kwargs.kl_coef: 0 to say so, or placement.reference: true for the KL term")


def reads_reference(fn: object, kwargs: Mapping[str, object] | None) -> bool:
    """Whether ``fn`` called with ``kwargs`` needs ``ref_logprobs_B_T`` for its loss or gradient.

    A loss in `KL_ONLY_REFERENCE` (the built-ins) reads the reference only through its KL term
    (``kl_coef * k3``), and through the ``kl_ref`` metric, which is reported whenever reference logprobs are
    given; with ``kl_coef`` 0 (given, or the loss's own default) neither loss nor gradient depends on them. Any
    other function may read them: True.

    >>> from forgelab.algos.losses import dapo, grpo
    >>> reads_reference(dapo, {}), reads_reference(dapo, {"kl_coef": 0.1}), reads_reference(grpo, {})
    (False, True, True)
    >>> reads_reference(grpo, {"kl_coef": 0.0}), reads_reference(lambda lp, **kw: (lp.sum(), {}), {"kl_coef": 0})
    (False, True)
    """
    if not any(fn is f for f in KL_ONLY_REFERENCE):
        return True
    kl = (kwargs or {}).get("kl_coef")
    if kl is None:
        default = inspect.signature(cast("Callable[..., object]", fn)).parameters["kl_coef"].default
        kl = default
    return not (isinstance(kl, (int, float)) and not isinstance(kl, bool) and kl == 0)


def reference_notes(loss: Any, kwargs: Mapping[str, Any] | None, reference: bool) -> list[str]:
    """What a run with this loss resolves implicitly about KL, in words (a run logs each at start)."""
    return [] if reference else [n for n in [without_reference(loss, kwargs)[1]] if n]


def loss_label(loss: Any) -> str:
    """The name a loss spec goes by: the registry name, a packed loss's name, or the function's ``__name__``."""
    return _resolve(loss)[0] if not isinstance(loss, str) else loss


def completion_budget(rollout: Any) -> int:
    """Most generated tokens one episode can hold: ``rollout.max_tokens``, times ``max_turns`` with an environment.

    >>> from types import SimpleNamespace as NS
    >>> completion_budget(NS(max_tokens=16, env=None, max_turns=4)), completion_budget(NS(max_tokens=16, env="calculator", max_turns=4))
    (16, 64)
    """
    turns = rollout.max_turns if getattr(rollout, "env", None) else 1
    return int(rollout.max_tokens) * int(turns)


# --- the loss's output ------------------------------------------------------------


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        shown = value.item() if value.numel() == 1 else f"{value.numel()} elements"
        return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype}, value={shown})"
    text = repr(value)
    return f"{type(value).__name__} {text[:120] + '...' if len(text) > 120 else text}"


def validate_loss_output(out, name: str, *, require_grad: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """Check a loss function's return value; return it as ``(loss, metrics)`` or raise ``LossError``.

    Used by the trainer after every call and by the hot-swap dry run before a
    new loss goes live. Requires ``(scalar finite floating tensor, dict[str, real number])``;
    with ``require_grad`` the loss must also be attached to the autograd graph.

    >>> import torch
    >>> validate_loss_output((torch.tensor(0.5), {"kl_behaviour": 0.0}), "mine")[0].item()
    0.5
    >>> validate_loss_output(torch.tensor([0.5, 1.0]), "mine")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    LossError: loss 'mine' returned Tensor(shape=(2,), ...), expected a tuple (loss, metrics); ...
    """
    if not (isinstance(out, tuple) and len(out) == 2):
        raise LossError(
            f"loss {name!r} returned {_describe(out)}, expected a tuple (loss, metrics); "
            'return `loss, {"name": float, ...}`'
        )
    loss, metrics = out
    if not isinstance(loss, torch.Tensor):
        raise LossError(f"loss {name!r} returned loss={_describe(loss)}, expected a torch.Tensor scalar")
    if loss.numel() != 1 or loss.dim() > 1:
        raise LossError(
            f"loss {name!r} returned loss={_describe(loss)}, expected a scalar; reduce it "
            "(e.g. forgelab.algos.masked_mean(per_token, mask_B_T))"
        )
    if not loss.is_floating_point():
        raise LossError(f"loss {name!r} returned loss={_describe(loss)}, expected a floating-point tensor")
    if not torch.isfinite(loss).all():
        raise LossError(
            f"loss {name!r} returned a non-finite loss {_describe(loss)}; check for exp() overflow on padding "
            "positions (mask before exponentiating), division by a zero token count, or log(0)"
        )
    if require_grad and not loss.requires_grad:
        raise LossError(
            f"loss {name!r} returned a loss with no gradient {_describe(loss)}; it must be computed from "
            "logprobs_B_T without .detach()/.item()/torch.no_grad()"
        )
    if not isinstance(metrics, dict):
        raise LossError(f"loss {name!r} returned metrics={_describe(metrics)}, expected a dict[str, float]")
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise LossError(f"loss {name!r} returned a metric key {key!r}; metric names must be str")
        if isinstance(value, torch.Tensor) or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise LossError(
                f"loss {name!r} returned metric {key!r}={_describe(value)}, expected a plain float; "
                "use .item() on tensors"
            )
    return loss.reshape(()), {k: float(v) for k, v in metrics.items()}
