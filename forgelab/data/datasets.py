"""Problem sources for rollouts: the toy tasks, or local jsonl/parquet files.

A file holds one problem per row with columns `prompt` and `target` (and
optionally `task` and any other columns, which travel to the rewards as
`info`). Nothing is downloaded.

Column mapping. Files in GSM8K's format (`question`, and `answer` holding the
worked solution ending in `#### <value>`) load as they are: with no `prompt`
/ `target` columns and both `question` and `answer` present,
`GSM8K_COLUMNS` applies: `prompt <- question`, `target <- the part of answer
after the last "####"` (spaces and thousands separators removed, so
`"#### 1,000"` gives `"1000"`), and the full solution travels as
`info["solution"]`. Other layouts pass `columns={"prompt": "problem",
"target": "solution"}` to `load_file` (forgelab field -> file column).
Score such data with `REWARDS["math_answer"]` (answer tags, `\\boxed{}`,
numeric comparison).

`ProblemStream` hands out training problems in a seeded, epoch-shuffled
order and remembers its position, so a resumed run continues with exactly
the problems the interrupted one would have seen next.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from forgelab.data.tasks import TASKS, Problem, get_task


GSM8K_COLUMNS = {"prompt": "question", "target": "answer"}
"""The column mapping applied to files with `question`/`answer` columns and no `prompt`/`target`."""


def gsm8k_target(answer: str) -> str:
    """The final value of a GSM8K `answer`: the text after the last ``####``, spaces and commas removed.

    >>> gsm8k_target("She pays 2 * 500 = 1000 dollars.\\n#### 1,000"), gsm8k_target("42")
    ('1000', '42')
    """
    text = str(answer)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return text.strip().replace(",", "").replace(" ", "")


def load_file(path: str | Path, columns: dict[str, str] | None = None) -> list[Problem]:
    """Problems from a local .jsonl or .parquet file (columns: prompt, target[, task, ...], or GSM8K's).

    Args:
        path: the file.
        columns: forgelab field (``prompt``, ``target``) -> the file's column;
            default: ``prompt``/``target`` if present, else `GSM8K_COLUMNS`
            when the file has ``question``/``answer`` (see the module docstring).
    """
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
    if columns is None and rows and not ({"prompt", "target"} <= set(rows[0])) and {"question", "answer"} <= set(rows[0]):
        columns = GSM8K_COLUMNS
    gsm8k = columns == GSM8K_COLUMNS
    prompt_col, target_col = (columns or {}).get("prompt", "prompt"), (columns or {}).get("target", "target")
    out = []
    for i, row in enumerate(rows):
        if prompt_col not in row or target_col not in row:
            raise ValueError(
                f"{p}: row {i} lacks a {prompt_col!r} or {target_col!r} column (has {sorted(row)}); "
                "map yours with load_file(path, columns={'prompt': ..., 'target': ...})"
            )
        info = {k: v for k, v in row.items() if k not in (prompt_col, target_col, "task")}
        target = str(row[target_col])
        if gsm8k:
            info["solution"], target = target, gsm8k_target(target)
        out.append(Problem(prompt=str(row[prompt_col]), target=target, task=str(row.get("task", p.stem)), info=info))
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
