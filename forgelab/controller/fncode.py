"""A function's code as data: source, SHA-256 and a serialised copy, for checkpoints and the event log.

    rec = fn_record(my_loss)          # {"name", "qualname", "module", "builtin", "source", "sha256", "pickle"}
    fn = restore_fn(rec, what="loss 'my_loss'")   # the same function, in any process, later

A built-in (a value of ``LOSSES`` / ``REWARDS``) is recorded by its registry name
and restored from the registry; anything else (a notebook cell's function, a
lambda, a closure) by value with cloudpickle, base64 in JSON. ``sha256`` hashes
the source when it can be read (the same code gives the same hash in any
process), else the serialised bytes. A record that cannot be turned back into a
function raises `FunctionRestoreError` naming the function and why.
"""
from __future__ import annotations

import base64
import hashlib
import inspect
import textwrap
from typing import Any, Callable, Mapping


class FunctionRestoreError(RuntimeError):
    """A recorded function (loss or reward) cannot be rebuilt in this process."""


def source_of(fn: Callable) -> str:
    """The function's source text ('' when Python cannot find it, e.g. defined in a bare REPL)."""
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        try:
            return textwrap.dedent(inspect.getsource(type(fn)))  # a callable object
        except (OSError, TypeError):
            return ""


def _registry_name(fn: Callable, registry: Mapping[str, Any] | None) -> str | None:
    for name, value in (registry or {}).items():
        if value is fn:
            return name
    return None


def fn_record(fn: Callable, registry: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Describe `fn` so it can be shown, compared and restored; `registry` names the built-ins."""
    import cloudpickle

    if not callable(fn):
        raise TypeError(f"fn_record: expected a function, got {type(fn).__name__}")
    src = source_of(fn)
    builtin = _registry_name(fn, registry)
    rec: dict[str, Any] = {
        "name": getattr(fn, "__name__", type(fn).__name__),
        "qualname": getattr(fn, "__qualname__", ""),
        "module": getattr(fn, "__module__", ""),
        "builtin": builtin,
        "source": src,
        "pickle": None,
    }
    payload = b""
    if builtin is None:
        try:
            payload = cloudpickle.dumps(fn)
            rec["pickle"] = base64.b64encode(payload).decode("ascii")
        except Exception as e:  # recorded anyway (source, hash); restoring it will say why it cannot
            rec["pickle_error"] = f"{type(e).__name__}: {e}"
    rec["sha256"] = hashlib.sha256(src.encode() if src else payload).hexdigest()
    return rec


def restore_fn(rec: Mapping[str, Any], registry: Mapping[str, Any] | None = None, *, what: str = "function") -> Callable:
    """The function a `fn_record` describes: from `registry` for a built-in, else unpickled."""
    import cloudpickle

    if rec.get("builtin"):
        if registry is not None and rec["builtin"] in registry:
            return registry[rec["builtin"]]
        raise FunctionRestoreError(f"{what}: built-in {rec['builtin']!r} is not registered in this forgelab "
                                   f"(known: {sorted(registry or {})})")
    if not rec.get("pickle"):
        why = rec.get("pickle_error", "no serialised copy was recorded")
        raise FunctionRestoreError(f"{what} ({rec.get('qualname') or rec.get('name')}) cannot be restored: {why}. "
                                   "Define it again and pass it in (run.add_reward / run.set_loss).")
    try:
        return cloudpickle.loads(base64.b64decode(rec["pickle"]))
    except Exception as e:
        raise FunctionRestoreError(
            f"{what} ({rec.get('qualname') or rec.get('name')}, sha256 {str(rec.get('sha256'))[:12]}) cannot be "
            f"unpickled here: {type(e).__name__}: {e}. Its source was:\n{rec.get('source') or '(unknown)'}"
        ) from e


def loss_record(loss: str | Callable) -> dict[str, Any]:
    """`fn_record` for a loss given by name (registry) or as a function."""
    from forgelab.algos import LOSSES

    if isinstance(loss, str):
        return fn_record(LOSSES[loss], LOSSES)
    unpack = getattr(loss, "unpack", None)  # a trainer PackedLoss
    return fn_record(unpack() if unpack is not None else loss, LOSSES)


def reward_record(fn: Callable) -> dict[str, Any]:
    from forgelab.rewards.library import REWARDS

    return fn_record(fn, REWARDS)
