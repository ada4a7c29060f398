"""Problem sources for rollouts: the toy tasks, or local jsonl/parquet files.

A file holds one problem per row with columns `prompt` and `target` (and
optionally `task` and any other columns, which travel to the rewards as
`info`). Nothing is downloaded.

`ProblemStream` hands out training problems in a seeded, epoch-shuffled
order and remembers its position, so a resumed run continues with exactly
the problems the interrupted one would have seen next.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from forgelab.tasks import TASKS, Problem, get_task


def load_file(path: str | Path) -> list[Problem]:
    """Problems from a local .jsonl or .parquet file (columns: prompt, target[, task, ...])."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"dataset file {str(p)!r} does not exist")
    if p.suffix == ".jsonl":
        rows = []
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}: line {i} is not valid JSON ({e}); fix or remove that line") from None
    elif p.suffix == ".parquet":
        import pandas as pd

        rows = pd.read_parquet(p).to_dict("records")
    else:
        raise ValueError(f"dataset file {str(p)!r}: unsupported suffix {p.suffix!r}; use .jsonl or .parquet")
    out = []
    for i, row in enumerate(rows):
        if "prompt" not in row or "target" not in row:
            raise ValueError(f"{p}: row {i} lacks a 'prompt' or 'target' column (has {sorted(row)})")
        info = {k: v for k, v in row.items() if k not in ("prompt", "target", "task")}
        out.append(Problem(prompt=str(row["prompt"]), target=str(row["target"]), task=str(row.get("task", p.stem)), info=info))
    if not out:
        raise ValueError(f"dataset file {str(p)!r} holds no problems")
    return out


def load_problems(source: str, split: str, n: int, seed: int = 0) -> list[Problem]:
    """`n` problems of a toy task's split, or of a file.

    For a file, "train" is every row but the last `n_test = max(1, len/10)`
    and "test" is those last rows (files are expected to be pre-shuffled).
    """
    if source in TASKS:
        return get_task(source).make(split, n, seed)
    rows = load_file(source)
    n_test = max(1, len(rows) // 10) if len(rows) > 1 else 0
    part = rows[len(rows) - n_test:] if split == "test" else rows[: len(rows) - n_test]
    return part[:n] if n else part


class ProblemStream:
    """An endless, seeded, epoch-shuffled stream of training problems with a position."""

    def __init__(self, problems: list[Problem], seed: int = 0):
        if not problems:
            raise ValueError("ProblemStream needs at least one problem")
        self.problems = problems
        self.seed = seed
        self.position = 0  # problems handed out so far

    def _order(self, epoch: int) -> list[int]:
        idx = list(range(len(self.problems)))
        random.Random(f"{self.seed}:{epoch}").shuffle(idx)
        return idx

    def next(self, k: int) -> list[Problem]:
        out = []
        n = len(self.problems)
        for _ in range(k):
            epoch, i = divmod(self.position, n)
            if i == 0 or not hasattr(self, "_epoch") or self._epoch != epoch:
                self._epoch, self._perm = epoch, self._order(epoch)
            out.append(self.problems[self._perm[i]])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        self.seed = int(state["seed"])
        if hasattr(self, "_epoch"):
            del self._epoch
