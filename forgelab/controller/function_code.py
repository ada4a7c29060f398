"""A function's code as data: source, SHA-256 and a serialised copy, for checkpoints and the event log.

    rec = fn_record(my_loss)   # {"name", "qualname", "module", "builtin", "source", "sha256", "pickle", "pickle_sha256"}
    fn = restore_fn(rec, what="loss 'my_loss'", trusted=True)   # the same function, in any process, later

A built-in (a value of ``LOSSES`` / ``REWARDS``) is recorded by its registry name
and restored from the registry; anything else (a notebook cell's function, a
lambda, a closure) by value with cloudpickle, base64 in JSON. ``sha256`` hashes
the source when it can be read (the same code gives the same hash in any
process), else the serialised bytes; ``pickle_sha256`` hashes the pickle bytes
as written.

Unpickling is running code, so `restore_fn` unpickles only when the caller says
the record comes from a trusted place (``trusted=True``; the CLI's ``--trust``)
and raises `UntrustedCodeError` otherwise; even then a payload whose bytes do not
hash to the recorded ``pickle_sha256`` (edited, corrupted, or the hash removed) is
refused with `TamperedCodeError` before anything is unpickled. Built-ins are
rebuilt from this process's registry and need no trust. A record that cannot be
turned back into a function raises `FunctionRestoreError` naming the function and why.
"""
from __future__ import annotations

import base64
import hashlib
import inspect
import textwrap
import types
import weakref
from typing import Mapping, TypeVar, cast

F = TypeVar("F")
"""A registry's kind of function (a loss, a reward): what `restore_fn` gives back for a record of that kind."""


class FunctionRestoreError(RuntimeError):
    """A recorded function (loss or reward) cannot be rebuilt in this process."""


class UntrustedCodeError(FunctionRestoreError):
    """A recorded function would have to be unpickled (run) and the caller did not say its source is trusted."""


class TamperedCodeError(FunctionRestoreError):
    """A recorded function's pickle does not hash to the SHA-256 recorded when it was written."""


_RESTORED_SOURCE: "weakref.WeakKeyDictionary[object, str]" = weakref.WeakKeyDictionary()
"""The recorded source of each function `restore_fn` unpickled: its code is the recorded code, and the file it
was defined in may be on another machine, gone, or edited since (the record's text is the truth)."""


def source_of(fn: object) -> str:
    """The function's source text ('' when Python cannot find it, e.g. defined in a bare REPL); an adapter
    (a TRL-style reward's `TRLReward`) shows the function it wraps (``__wrapped__``). A function restored from a
    record (`restore_fn`) has the record's source."""
    if callable(fn):
        fn = inspect.unwrap(fn)
    try:
        recorded = _RESTORED_SOURCE.get(fn)
    except TypeError:  # not weak-referenceable: never restored
        recorded = None
    if recorded:
        return recorded
    try:
        return textwrap.dedent(inspect.getsource(fn))  # type: ignore[arg-type]  # getsource raises TypeError on what it cannot read
    except (OSError, TypeError):
        try:
            return textwrap.dedent(inspect.getsource(type(fn)))  # a callable object
        except (OSError, TypeError):
            return ""


def code_sha256(fn: object) -> str | None:
    """SHA-256 of the code that runs when `fn` is called: its bytecode, constants (nested functions included)
    and names, through any ``__wrapped__`` chain; None for a callable without Python code.

    Unlike ``sha256`` (the source text as `inspect` reads it from the file *now*), it is what the process
    loaded: a file edited after the import does not change it, and a moved or re-commented function keeps it.
    The same Python version gives the same value in any process.
    """
    h = hashlib.sha256()

    def const(c: object) -> bytes:
        if isinstance(c, types.CodeType):
            visit(c)
            return b"<code>"
        if isinstance(c, frozenset):  # repr order follows string hashing, which differs per process
            return b"frozenset" + repr(sorted(repr(x) for x in c)).encode()
        if isinstance(c, tuple):
            return b"(" + b",".join(const(x) for x in c) + b")"
        return repr(c).encode()

    def visit(code: types.CodeType) -> None:
        h.update(code.co_code + b"\0" + repr(code.co_names).encode() + b"\0")
        for c in code.co_consts:
            h.update(const(c) + b"\0")

    f: object = fn
    found = False
    for _ in range(16):  # decorators (functools.wraps) keep the wrapped function in __wrapped__
        code = getattr(f, "__code__", None) or getattr(getattr(f, "__call__", None), "__code__", None)
        if isinstance(code, types.CodeType):
            visit(code)
            found = True
        f = getattr(f, "__wrapped__", None)
        if f is None:
            break
    return h.hexdigest() if found else None


def _registry_name(fn: object, registry: Mapping[str, object] | None) -> str | None:
    for name, value in (registry or {}).items():
        if value is fn:
            return name
    return None


def fn_record(fn: object, registry: Mapping[str, object] | None = None) -> dict[str, object]:
    """Describe `fn` so it can be shown, compared and restored; `registry` names the built-ins."""
    import cloudpickle  # type: ignore[import-untyped]  # cloudpickle ships no type information

    if not callable(fn):
        raise TypeError(f"fn_record: expected a function, got {type(fn).__name__}")
    src = source_of(fn)
    builtin = _registry_name(fn, registry)
    rec: dict[str, object] = {
        "name": getattr(fn, "__name__", type(fn).__name__),
        "qualname": getattr(fn, "__qualname__", ""),
        "module": getattr(fn, "__module__", ""),
        "builtin": builtin,
        "source": src,
        "code_sha256": code_sha256(fn),
        "pickle": None,
    }
    payload = b""
    if builtin is None:
        try:
            payload = cloudpickle.dumps(fn)
            rec["pickle"] = base64.b64encode(payload).decode("ascii")
            rec["pickle_sha256"] = hashlib.sha256(payload).hexdigest()
        except Exception as e:  # recorded anyway (source, hash); restoring it will say why it cannot
            rec["pickle_error"] = f"{type(e).__name__}: {e}"
    rec["sha256"] = hashlib.sha256(src.encode() if src else payload).hexdigest()
    return rec


def restore_fn(rec: Mapping[str, object], registry: Mapping[str, F] | None = None, *, what: str = "function",
               trusted: bool = False) -> F:
    """The function a `fn_record` describes: from `registry` for a built-in, else unpickled.

    Unpickling runs code: it happens only with ``trusted=True`` (else `UntrustedCodeError`), and only when the
    pickle's bytes hash to the recorded ``pickle_sha256`` (else `TamperedCodeError`).
    """
    import cloudpickle

    builtin = rec.get("builtin")
    if builtin:
        if registry is not None and isinstance(builtin, str) and builtin in registry:
            return registry[builtin]
        raise FunctionRestoreError(f"{what}: built-in {rec['builtin']!r} is not registered in this forgelab "
                                   f"(known: {sorted(registry or {})})")
    if not rec.get("pickle"):
        why = rec.get("pickle_error", "no serialised copy was recorded")
        raise FunctionRestoreError(f"{what} ({rec.get('qualname') or rec.get('name')}) cannot be restored: {why}. "
                                   "Define it again and pass it in (run.add_reward / run.set_loss).")
    label = f"{what} ({rec.get('qualname') or rec.get('name')})"
    if not trusted:
        raise UntrustedCodeError(
            f"{label}: refusing to unpickle its recorded code: unpickling runs code, and the caller did not say "
            "where it comes from is trusted. If you (or someone you trust) wrote this run directory or checkpoint, "
            f"pass trusted=True (CLI: --trust). Its source was:\n{rec.get('source') or '(unknown)'}")
    try:
        payload = base64.b64decode(rec["pickle"], validate=True)  # type: ignore[arg-type]  # not str/bytes: binascii raises TypeError, caught
    except Exception as e:
        raise TamperedCodeError(f"{label}: its pickle is not valid base64 ({e}); the record was edited or corrupted") from e
    digest = hashlib.sha256(payload).hexdigest()
    if digest != rec.get("pickle_sha256"):
        raise TamperedCodeError(
            f"{label}: its pickle's sha256 {digest[:12]}... does not match the sha256 recorded when it was written "
            f"({str(rec.get('pickle_sha256'))[:12]}...): the payload was edited or corrupted (or written without a "
            "hash); refusing to unpickle it, even though the caller trusts the directory")
    try:
        # the record was written by `fn_record` for this registry's kind of function (a loss, a reward)
        fn = cast(F, cloudpickle.loads(payload))
    except Exception as e:
        raise FunctionRestoreError(
            f"{what} ({rec.get('qualname') or rec.get('name')}, sha256 {str(rec.get('sha256'))[:12]}) cannot be "
            f"unpickled here: {type(e).__name__}: {e}. Its source was:\n{rec.get('source') or '(unknown)'}"
        ) from e
    source = rec.get("source")
    if isinstance(source, str) and source:
        try:
            _RESTORED_SOURCE[inspect.unwrap(fn) if callable(fn) else fn] = source
        except TypeError:  # an object that takes no weak reference: its source is looked up as usual
            pass
    return fn


def loss_record(loss: object) -> dict[str, object]:
    """`fn_record` for a loss given by name (registry) or as a function."""
    from forgelab.algos import LOSSES

    if isinstance(loss, str):
        return fn_record(LOSSES[loss], LOSSES)
    unpack: object = getattr(loss, "unpack", None)  # a trainer PackedLoss
    return fn_record(unpack() if callable(unpack) else loss, LOSSES)


def reward_record(fn: object) -> dict[str, object]:
    from forgelab.rewards.library import REWARDS

    return fn_record(fn, REWARDS)
