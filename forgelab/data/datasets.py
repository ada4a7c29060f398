"""Problem sources for rollouts: the toy tasks, or datasets (a `datasets.Dataset` / `DatasetDict` from
Python; a save_to_disk directory or a .jsonl/.parquet/.csv/.json file from YAML: `forgelab.data.sources`).

A dataset holds one problem per row with columns `prompt` (text, or chat
messages as in TRL's conversational format) and optionally `target`, `task`
and any other columns, which travel to the rewards as `info` (TRL-style rewards
get each as a keyword). Nothing is downloaded.

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

import random
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

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


def load_file(path, columns: dict[str, str] | None = None, *, split: str | None = None,
              system_prompt: str | None = None) -> list[Problem]:
    """Problems from a dataset: a .jsonl/.parquet/.csv/.json file, a save_to_disk directory, or (from Python) a
    `datasets.Dataset` / `DatasetDict` (`forgelab.data.sources.read_rows`).

    Columns: ``prompt`` (text, or chat messages: TRL's conversational format) and ``target`` (optional: a
    TRL-style dataset's rewards read their own columns), or GSM8K's; every other column travels to the rewards
    as `info`.

    Args:
        path: the file, directory or dataset object.
        columns: forgelab field (``prompt``, ``target``) -> the file's column;
            default: ``prompt``/``target`` if present, else `GSM8K_COLUMNS`
            when the file has ``question``/``answer`` (see the module docstring).
        split: the split of a DatasetDict to read (required for one).
        system_prompt: a system message put before every prompt (the prompts become chat messages).
    """
    from forgelab.data.sources import read_rows

    return problems_from_rows(read_rows(path, split), path, columns, system_prompt)


def problems_from_rows(rows: list[dict], source, columns: dict[str, str] | None = None,
                       system_prompt: str | None = None) -> list[Problem]:
    """`Problem`s from row dicts (see `load_file`). A chat prompt's messages (with the system prompt) go to
    ``info["prompt_messages"]`` and its last user message's text is ``Problem.prompt``."""
    from forgelab.data.sources import chat_messages, describe_source
    from forgelab.rewards.trl_compat import PROMPT_MESSAGES

    name = Path(source).stem if isinstance(source, (str, Path)) else "dataset"
    where = describe_source(source)
    if columns is None and rows and not ({"prompt", "target"} <= set(rows[0])) and {"question", "answer"} <= set(rows[0]):
        columns = GSM8K_COLUMNS
    gsm8k = columns == GSM8K_COLUMNS
    prompt_col, target_col = (columns or {}).get("prompt", "prompt"), (columns or {}).get("target", "target")
    out = []
    for i, row in enumerate(rows):
        if prompt_col not in row or (target_col not in row and "target" in (columns or {})):
            raise ValueError(
                f"{where}: row {i} lacks a {prompt_col!r} or {target_col!r} column (has {sorted(row)}); "
                "map yours with load_file(path, columns={'prompt': ..., 'target': ...})"
            )
        info = {k: v for k, v in row.items() if k not in (prompt_col, target_col, "task")}
        target = str(row[target_col]) if target_col in row else ""
        if gsm8k:
            info["solution"], target = target, gsm8k_target(target)
        try:
            messages = chat_messages(row[prompt_col], system_prompt)
        except ValueError as e:
            raise ValueError(f"{where}: row {i}: {e}") from None
        text = str(row[prompt_col])
        if messages is not None:
            info[PROMPT_MESSAGES] = messages
            text = next((str(m.get("content", "")) for m in reversed(messages) if m.get("role") == "user"), text)
        out.append(Problem(prompt=text, target=target, task=str(row.get("task", name)), info=info))
    if not out:
        raise ValueError(f"dataset {where!r} holds no problems")
    return out


def load_problems(source: str, split: str, n: int, seed: int = 0) -> list[Problem]:
    """`n` problems of a toy task's split, or of a file.

    For a file, "train" is every row but the last `n_test = max(1, len/10)`
    and "test" is those last rows (files are expected to be pre-shuffled).
    """
    if isinstance(source, str) and source in TASKS:
        return get_task(source).make(split, n, seed)
    rows = load_file(source)
    n_test = max(1, len(rows) // 10) if len(rows) > 1 else 0
    part = rows[len(rows) - n_test:] if split == "test" else rows[: len(rows) - n_test]
    return part[:n] if n else part


TOY_TRAIN_PROBLEMS = 4000
"""Training problems a toy task generates when `max_train` is None (a toy task has no rows to count)."""


@dataclass
class DataSplit:
    """A run's data: the training problems, the held-out problems it evaluates on, and how they were chosen."""

    train: list[Problem]
    heldout: list[Problem]
    description: str
    """One line for people: where each part comes from and which config fields chose it."""
    info: dict = field(default_factory=dict)
    """The same as data (for the manifest): source, rows, train and held-out counts, the limits applied."""


def load_split(task, *, heldout: float | int | str = 0.1, max_train: int | None = None, eval_n: int = 200,
               seed: int = 0, split: str | None = None, system_prompt: str | None = None,
               reasoning_gym: Any = None) -> DataSplit:
    """The training and held-out problems of a run, chosen only by the arguments (nothing silent).

    Args:
        task: a toy task name (`TASKS`), a .jsonl/.parquet/.csv/.json file, a save_to_disk directory, or a
            `datasets.Dataset` / `DatasetDict` (`forgelab.data.sources`).
        heldout: for a dataset task, the held-out split: a fraction in (0, 1) of its rows (its last rows; files
            are expected to be pre-shuffled), a count of its last rows, another split's name (a DatasetDict), or a
            second dataset (then every row of `task` trains). A toy task evaluates on its own test split, or on a
            dataset given here.
        max_train: at most this many training problems (a file's first training rows); None: every training
            row of a file, `TOY_TRAIN_PROBLEMS` generated problems of a toy task.
        eval_n: held-out problems kept for evaluation (the first ones).
        seed: the toy tasks' generation seed.
        split: the split of a DatasetDict `task` that trains (required for one; never implied).
        system_prompt: a system message before every prompt of a dataset task (its prompts become chat messages).
        reasoning_gym: with `task` "reasoning_gym", ``rollout.reasoning_gym`` (which task, its parameters, seed,
            size: `forgelab.data.reasoning_gym_source.reasoning_gym_split`); `heldout` and `split` do not apply.

    >>> s = load_split("addition", max_train=10, eval_n=5)
    >>> len(s.train), len(s.heldout), s.description
    (10, 5, "data: 10 generated 'addition' training problems (rollout.max_train_problems: 10); held out: 5 of its test split (eval.n)")
    """
    from forgelab.data.reasoning_gym_source import TASK_NAME as RG_TASK, reasoning_gym_split

    if task == RG_TASK:
        if reasoning_gym is None:
            raise ValueError(f"rollout.reasoning_gym: required with rollout.task: {RG_TASK}")
        check_split_fields(max_train, 0.1)
        train, held, what, info = reasoning_gym_split(reasoning_gym, eval_n=eval_n, max_train=max_train)
        return DataSplit(train=train, heldout=held, description=what, info=info)
    check_split_fields(max_train, heldout, task, split)
    from forgelab.data.sources import describe_source, is_dataset, split_names

    limit = "all" if max_train is None else str(max_train)
    held_file = isinstance(heldout, str) or is_dataset(heldout)
    if held_file:
        if isinstance(heldout, str) and heldout in (split_names(task) or []):  # another split of the DatasetDict
            held = load_file(task, split=heldout, system_prompt=system_prompt)
            held_what = f"{len(held)} rows of its split {heldout!r} (rollout.heldout)"
        else:
            held = load_file(heldout, system_prompt=system_prompt)
            held_what = f"{len(held)} rows of {describe_source(heldout)} (rollout.heldout)"
    if isinstance(task, str) and task in TASKS:
        n = TOY_TRAIN_PROBLEMS if max_train is None else max_train
        train = get_task(task).make("train", n, seed)
        if not held_file:
            held = get_task(task).make("test", eval_n, seed)
            held_what = f"{len(held)} of its test split (eval.n)"
        if max_train is None:
            limit = f"null -> {TOY_TRAIN_PROBLEMS}, a toy task has no rows"
        what = f"{len(train)} generated {task!r} training problems (rollout.max_train_problems: {limit})"
        info = {"source": task, "rows": None, "train": len(train)}
    else:
        rows = load_file(task, split=split, system_prompt=system_prompt)
        name = describe_source(task) + (f" split {split!r}" if split is not None else "")
        if held_file:
            train_rows, where = rows, f"every row of {name}"
        else:
            n_test = _heldout_rows(len(rows), heldout, name)
            train_rows, held = rows[: len(rows) - n_test], rows[len(rows) - n_test:]
            where = f"rows 0-{len(rows) - n_test - 1} of {name}"
            held_what = f"its last {n_test} rows (rollout.heldout: {heldout!r})"
        train = train_rows if max_train is None else train_rows[:max_train]
        what = (f"{len(train)} of {len(train_rows)} training rows ({where}; rollout.max_train_problems: {limit})")
        info = {"source": describe_source(task), "split": split, "rows": len(rows), "train": len(train),
                "train_rows": len(train_rows)}
    if not train:
        raise ValueError(f"data: {describe_source(task)!r} leaves no training problems; lower rollout.heldout or "
                         "add rows")
    if not held:
        raise ValueError(f"data: {describe_source(task)!r} leaves no held-out problems; set rollout.heldout to a fraction, a count "
                         "or a second file")
    evaluated = held[:eval_n]
    if len(evaluated) < len(held):
        held_what += f", the first {len(evaluated)} evaluated (eval.n)"
    info.update(heldout=describe_source(heldout), heldout_rows=len(held), evaluated=len(evaluated), max_train_problems=max_train)
    return DataSplit(train=train, heldout=evaluated, description=f"data: {what}; held out: {held_what}", info=info)


def check_split_fields(max_train: int | None, heldout: float | int | str, task=None, split: str | None = None) -> None:
    """Raise ``ValueError`` naming the field unless ``rollout.max_train_problems`` / ``rollout.heldout`` are valid
    (a positive count or None; a fraction in (0, 1), a count >= 1, an existing dataset file or directory, a
    dataset object, or a split of a DatasetDict `task` other than `split`); a dataset `task` is checked with
    its `split` (`forgelab.data.sources.check_source`)."""
    from forgelab.data.sources import check_source, is_data_source, is_dataset

    if max_train is not None and (isinstance(max_train, bool) or not isinstance(max_train, int) or max_train < 1):
        raise ValueError(f"rollout.max_train_problems: must be a positive integer or null (all rows), got {max_train!r}")
    if task is not None and not (isinstance(task, str) and task in TASKS):
        check_source(task, heldout, split)
        if isinstance(heldout, str) and not is_data_source(heldout):
            return  # a split name, checked against the task's splits
    elif split is not None:
        raise ValueError(f"rollout.split: {split!r} given, but rollout.task {task!r} is a toy task (no splits)")
    if is_dataset(heldout):
        return
    if isinstance(heldout, str):
        if not is_data_source(heldout):
            raise ValueError(f"rollout.heldout: {heldout!r} is not an existing dataset file or directory; give a "
                             "file, a fraction in (0, 1) of the task's rows, a count of its last rows, or a split "
                             "of a DatasetDict task")
    elif isinstance(heldout, bool) or not isinstance(heldout, (int, float)) or not (
            0 < heldout < 1 or (heldout >= 1 and float(heldout).is_integer())):
        raise ValueError(f"rollout.heldout: {heldout!r} is neither a fraction in (0, 1) nor a count >= 1 of held-out "
                         "rows nor a file")


def _heldout_rows(n_rows: int, heldout: float | int, task: str) -> int:
    """How many of a file's last rows a fraction or a count of held-out rows means."""
    if isinstance(heldout, bool) or not isinstance(heldout, (int, float)):
        raise ValueError(f"rollout.heldout: expected a fraction, a count or a file, got {heldout!r}")
    if isinstance(heldout, float) and not heldout.is_integer() or 0 < heldout < 1:
        if not 0 < heldout < 1:
            raise ValueError(f"rollout.heldout: a fraction must be in (0, 1), got {heldout!r}")
        # exact decimal arithmetic: 0.1 of 70 rows is 7, not int(7.000000000000001) or int(6.9999...)
        n_test = max(1, int(Fraction(str(heldout)) * n_rows))
    else:
        n_test = int(heldout)
        if n_test < 1:
            raise ValueError(f"rollout.heldout: a count must be >= 1, got {heldout!r}")
    if n_test >= n_rows:
        raise ValueError(f"rollout.heldout: {heldout!r} holds out {n_test} of the {n_rows} rows of {task}, leaving "
                         "none to train on; lower it or give a second file")
    return n_test


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
