"""Helpers shared by benchmark suites: timing, a text table, the JSON line."""
from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any, Iterable, Sequence


def median_ms(samples_ns: Sequence[int | float]) -> float:
    """Median of nanosecond samples, in milliseconds."""
    if not samples_ns:
        raise ValueError("median_ms: no samples")
    return statistics.median(samples_ns) / 1e6


def now_ns() -> int:
    return time.perf_counter_ns()


class Timer:
    """`with Timer() as t: ...` then `t.ns` / `t.ms`."""

    def __enter__(self) -> "Timer":
        self.start = time.perf_counter_ns()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.ns = time.perf_counter_ns() - self.start

    @property
    def ms(self) -> float:
        return self.ns / 1e6


def print_table(rows: Iterable[dict[str, Any]], columns: Sequence[str]) -> None:
    """Print dict rows as an aligned text table with the given columns."""
    def fmt(value: Any) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    cells = [[fmt(row.get(c, "")) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


class Worker:
    """A benchmark side in its own process, driven over stdin: "run" starts one timed run, "quit" ends it.

    The child prints JSON lines on stdout (anything else is ignored) and its
    stderr goes to a temp file, shown when it dies. One process per side
    because vLLM patches torch globals and one process holds one in-process
    engine; driven step by step so its runs can alternate with the other side's.
    """

    def __init__(self, what: str, argv: list[str], threads: int):
        import os
        import subprocess
        import tempfile

        from forgelab.runtime.component import Placement

        self.what = what
        env = {**os.environ, **Placement(threads=threads).process_env()}
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, *argv], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.ready = self.read()  # the child's first JSON line, after its build + warm-up

    def read(self) -> dict:
        """The child's next JSON line."""
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.log.seek(0)
                raise RuntimeError(f"{self.what} subprocess exited (rc {self.proc.wait()}):\n{self.log.read()[-3000:]}")
            if line.startswith("{"):
                return json.loads(line)

    def start(self) -> None:
        """Start one run (read its result with `read()`)."""
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()

    def run(self) -> dict:
        self.start()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()


def emit_json(result: dict[str, Any]) -> None:
    """Print `result` as one JSON line; suites call this last.

    It starts on a fresh line: a child process's exit message (forwarded to this
    process's stderr by Monarch) can end without a newline just before it.
    """
    sys.stderr.flush()
    print("\n" + json.dumps(result, sort_keys=False), flush=True)


def machine_info() -> dict[str, Any]:
    """Cores, CPU model and the 1/5/15-minute load average now: printed by every suite at start and end."""
    import os
    import platform

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    return {"cores": os.cpu_count(), "cpu": model, "loadavg": load}


def print_machine(when: str) -> dict[str, Any]:
    """Print one line describing the machine and its load; returns the same facts."""
    m = machine_info()
    print(f"machine ({when}): {m['cores']} cores, {m['cpu']}, load average {m['loadavg']}", flush=True)
    return m


def run_children(module: str, *argss: tuple[str, ...]) -> list[dict[str, Any]]:
    """Run ``python -m module *args`` once per argument tuple, all at once; each child's last stdout line, as JSON.

    A benchmark measures in a child process what must not share this one's memory or warm state (each child's
    VmHWM is its own peak). Concurrent children share the cores, so their timings are only meaningful run one
    at a time (one tuple per call). A child that fails raises with the tail of its stderr.
    """
    import subprocess

    procs = [subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args in argss]
    outs = [(args, p, *p.communicate()) for args, p in zip(argss, procs)]
    for args, p, _, err in outs:
        if p.returncode != 0:
            raise RuntimeError(f"{module} child {args} failed:\n{err[-3000:]}")
    return [json.loads(out.strip().splitlines()[-1]) for _, _, out, _ in outs]
