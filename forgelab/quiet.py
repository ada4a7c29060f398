"""Quiet by default: the known third-party lines forgelab's users cannot act on are filtered at their source.

Each entry below names one line, where it comes from and why it is noise on a
forgelab run; nothing else is silenced (no blanket ``warnings.simplefilter``,
no raised log levels). `install()` runs when any ``forgelab`` module is
imported, in the controller and in every actor process, so notebooks, the demo
and the CLI show forgelab's own output. ``FORGELAB_VERBOSE=1`` turns it off.

- vLLM (logger ``vllm.triton_utils.importing``): "Triton is installed, but
  doesn't include CPU backend. Disabling Triton." -- on CPU vLLM never uses
  Triton; torchtitan needs it installed.
- vLLM ``vllm/triton_utils/dispatcher.py``: ``FutureWarning: `torch.distributed.reduce_op`
  is deprecated`` -- raised by vLLM walking torch's module attributes, not by any use.
- vLLM's CPU worker: torch's C++ warning "NUMA binding: Using MEMBIND policy
  for memory allocation on the NUMA nodes (...)" printed once when the
  generator binds its memory node: the binding is what we want.

- Monarch: "Monarch internal logs are being written to <file>; execution id
  ..." printed by its Rust side to file descriptor 2 when a process first
  makes its client context (red in a notebook's first cell). The file is
  always ``<temp dir>/<user>/monarch_log.log`` (docs/reliability.md says
  where to look when something fails).

Left alone on purpose: every warning forgelab itself raises.

`RepeatLimiter` collapses a burst of identical log lines (a generator respawn
makes every rollout fail the same way) into the first line plus one
"(repeated N times)" line.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
import threading
import warnings

__all__ = ["install", "installed", "LOG_FILTERS", "WARNING_FILTERS", "CPP_LINES", "MONARCH_LINES", "RepeatLimiter"]

LOG_FILTERS: list[tuple[str, str]] = [
    ("vllm.triton_utils.importing", r"Triton is installed, but doesn't include CPU backend"),
]
"""(logger name, regex on the message): log records dropped by a filter on that logger only."""

WARNING_FILTERS: list[tuple[type[Warning], str, str]] = [
    (FutureWarning, r"`torch\.distributed\.reduce_op` is deprecated", r"vllm\.triton_utils\.dispatcher"),
]
"""(category, regex on the message, regex on the module the warning is attributed to): ignored."""

CPP_LINES: list[str] = [r"NUMA binding: Using MEMBIND policy"]
"""Lines torch's C++ side prints straight to file descriptor 2 while vLLM's CPU worker binds its memory node."""

MONARCH_LINES: list[str] = [r"^Monarch internal logs are being written to "]
"""Lines Monarch's Rust side prints straight to file descriptor 2 while it makes the process's client context."""

_installed = False
_lock = threading.Lock()


class _DropMatching(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not self.pattern.search(record.getMessage())
        except Exception:  # a record that cannot format is not ours to drop
            return True


def installed() -> bool:
    """Whether `install()` has run in this process."""
    return _installed


def install() -> None:
    """Add the targeted filters (idempotent; a no-op with ``FORGELAB_VERBOSE=1``)."""
    global _installed
    with _lock:
        if _installed or os.environ.get("FORGELAB_VERBOSE", "") not in ("", "0"):
            return
        for name, pattern in LOG_FILTERS:
            logging.getLogger(name).addFilter(_DropMatching(pattern))
        for category, message, module in WARNING_FILTERS:
            warnings.filterwarnings("ignore", message=message, category=category, module=module)
        _patch_cpu_memory_binding()
        _after_import("monarch._src.actor.actor_mesh", _wrap_monarch_client_context)
        _installed = True


def _patch_cpu_memory_binding() -> None:
    """Wrap vLLM's CPU worker's one call of ``torch.ops._C.init_cpu_memory_env`` so its NUMA line is dropped.

    The line comes from C++ (``TORCH_WARN``) straight to fd 2, where no Python
    filter sees it: the wrapper captures fd 2 for the duration of that call
    only, drops lines matching `CPP_LINES` and writes every other line back.
    Installed lazily, when ``vllm.v1.worker.cpu_worker`` is imported.
    """
    _after_import("vllm.v1.worker.cpu_worker", _wrap_worker_module)


def _after_import(target: str, hook) -> None:
    """Call ``hook(module)`` on module ``target`` now if it is imported, else right after it is."""
    import importlib.abc
    import importlib.machinery

    if target in sys.modules:
        hook(sys.modules[target])
        return

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target_=None):
            if fullname != target:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_hook(module):
                exec_module(module)
                hook(module)

            spec.loader.exec_module = exec_and_hook
            return spec

    sys.meta_path.insert(0, _Finder())


def _wrap_monarch_client_context(module) -> None:
    """Make Monarch's lazy client context run its first initialisation with `MONARCH_LINES` dropped from fd 2.

    The initialisation starts no process (checked: the bootstrap spawns no child), so nothing inherits the
    captured descriptor; any other line written meanwhile is written back."""
    lazy = getattr(module, "_client_context", None)
    init = getattr(lazy, "_init", None)
    if init is None or getattr(init, "_forgelab_quiet", False):
        return

    def quiet_init(*args, **kwargs):
        with _drop_fd2_lines(MONARCH_LINES):
            return init(*args, **kwargs)

    quiet_init._forgelab_quiet = True
    lazy._init = quiet_init


class _FilteredOps:
    """Stands in for ``torch.ops._C`` inside vLLM's cpu_worker module: one op wrapped, the rest passed through."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        op = getattr(self._ops, name)
        if name != "init_cpu_memory_env":
            return op

        def quiet_call(*args, **kwargs):
            with _drop_fd2_lines(CPP_LINES):
                return op(*args, **kwargs)

        return quiet_call


class _FilteredTorch:
    def __init__(self, torch_module):
        self._torch = torch_module

    def __getattr__(self, name):
        if name == "ops":
            return _FilteredOpsRoot(self._torch.ops)
        return getattr(self._torch, name)


class _FilteredOpsRoot:
    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        space = getattr(self._ops, name)
        return _FilteredOps(space) if name == "_C" else space


def _wrap_worker_module(module) -> None:
    torch_module = getattr(module, "torch", None)
    if torch_module is not None and not isinstance(torch_module, _FilteredTorch):
        module.torch = _FilteredTorch(torch_module)


class _drop_fd2_lines:
    """Capture file descriptor 2 inside the block; afterwards write back every line not matching ``patterns``."""

    def __init__(self, patterns: list[str]):
        self.patterns = [re.compile(p) for p in patterns]

    def __enter__(self):
        try:
            sys.stderr.flush()
        except Exception:
            pass
        self.saved = os.dup(2)
        self.tmp = tempfile.TemporaryFile()
        os.dup2(self.tmp.fileno(), 2)
        return self

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.tmp.seek(0)
        kept = [line for line in self.tmp.read().decode(errors="replace").splitlines(keepends=True)
                if not any(p.search(line) for p in self.patterns)]
        self.tmp.close()
        if kept:
            os.write(2, "".join(kept).encode())
        return False


class RepeatLimiter:
    """Logs a message once, counts identical ones that follow, and logs one "(repeated N times)" line for them.

    The summary is logged when a different message arrives or on `flush()`
    (call it when the burst is over, e.g. after the next success).

        >>> import logging
        >>> seen = []
        >>> class Keep(logging.Handler):
        ...     def emit(self, record): seen.append(record.getMessage())
        >>> lg = logging.getLogger("forgelab.doctest.repeat"); lg.addHandler(Keep()); lg.propagate = False
        >>> limiter = RepeatLimiter(lg)
        >>> for _ in range(5): limiter.warning("rollout failed: %s", "replica 0 is dead")
        >>> limiter.flush(); seen
        ['rollout failed: replica 0 is dead', 'rollout failed: replica 0 is dead (repeated 4 more times)']
    """

    def __init__(self, logger: logging.Logger):
        self.logger = logger
        self._last: tuple[int, str] | None = None
        self._repeats = 0

    def log(self, level: int, msg: str, *args) -> bool:
        """Log ``msg % args`` at ``level`` unless it repeats the previous message; True if a line was written."""
        text = msg % args if args else msg
        if self._last == (level, text):
            self._repeats += 1
            return False
        self.flush()
        self._last = (level, text)
        self.logger.log(level, "%s", text)
        return True

    def warning(self, msg: str, *args) -> bool:
        return self.log(logging.WARNING, msg, *args)

    def flush(self) -> None:
        """Write the pending "(repeated N more times)" line, if any, and forget the last message."""
        if self._last is not None and self._repeats:
            level, text = self._last
            self.logger.log(level, "%s (repeated %d more times)", text, self._repeats)
        self._last, self._repeats = None, 0
