"""Where a run's rows come from: a `datasets.Dataset` / `DatasetDict` (from Python), a directory written by
``save_to_disk``, or a .parquet/.csv/.json/.jsonl file (from YAML), as plain row dicts.

    rows = read_rows(ds)                                  # a datasets.Dataset
    rows = read_rows("data/gsm8k_dir", split="train")     # save_to_disk of a DatasetDict: the split is named
    rows = read_rows("data/train.parquet")                # read through datasets (nested columns stay lists)

A DatasetDict has no implied training split: `split` must name one (``rollout.split``), and the held-out rows
are named as explicitly (``rollout.heldout``: another split's name, a second dataset, a fraction or a count;
`forgelab.data.datasets.load_split`). .parquet, .csv and .json go through `datasets` (``Dataset.from_*``);
.jsonl is read line by line with `json` (the same values, and an error names the bad line).

A row's ``prompt`` is text or chat messages (TRL's conversational format: a list of ``{"role", "content"}``);
`chat_messages` turns it into the messages the chat template renders, with an optional system prompt.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["DATA_SUFFIXES", "is_dataset", "is_data_source", "read_rows", "split_names", "chat_messages",
           "describe_source", "check_source"]

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
"""File kinds a run reads rows from."""


def is_dataset(x: Any) -> bool:
    """True for a `datasets.Dataset` or `DatasetDict` object (checked without importing datasets)."""
    return type(x).__module__.split(".")[0] == "datasets" and hasattr(x, "column_names")


def _is_dict(x: Any) -> bool:
    return is_dataset(x) and isinstance(x, dict)


def is_data_source(x: Any) -> bool:
    """True for a dataset object, a directory, or an existing file with a `DATA_SUFFIXES` suffix."""
    if is_dataset(x):
        return True
    if not isinstance(x, (str, os.PathLike)):
        return False
    p = Path(x)
    return p.is_dir() or (p.suffix in DATA_SUFFIXES and p.is_file())


def describe_source(x: Any) -> str:
    """A short name for messages and the manifest: the path, or the dataset's kind, size and fingerprint."""
    if not is_dataset(x):
        return str(x)
    if _is_dict(x):
        return f"DatasetDict({', '.join(f'{k}: {len(v)} rows' for k, v in x.items())})"
    return f"Dataset({len(x)} rows, fingerprint {getattr(x, '_fingerprint', '?')})"


def _open(source: Any, field: str) -> Any:
    """A dataset object for `source` (or a list of rows for .jsonl)."""
    if is_dataset(source):
        return source
    p = Path(source)
    if p.is_dir():
        import datasets

        try:
            return datasets.load_from_disk(str(p))
        except FileNotFoundError as e:
            raise ValueError(f"{field}: {str(p)!r} is a directory but not one written by save_to_disk ({e})") from None
    if not p.is_file():
        raise FileNotFoundError(f"{field}: dataset file {str(p)!r} does not exist")
    if p.suffix == ".jsonl":
        return _read_jsonl(p)
    if p.suffix not in DATA_SUFFIXES:
        raise ValueError(f"{field}: {str(p)!r}: unsupported suffix {p.suffix!r}; use one of {', '.join(DATA_SUFFIXES)} "
                         "or a save_to_disk directory")
    import datasets

    reader = {".parquet": datasets.Dataset.from_parquet, ".csv": datasets.Dataset.from_csv,
              ".json": datasets.Dataset.from_json}[p.suffix]
    was_off = datasets.is_progress_bar_enabled() is False
    datasets.disable_progress_bars()  # "Generating train split" bars for a local file: noise
    try:
        return reader(str(p))
    finally:
        if not was_off:
            datasets.enable_progress_bars()


def _read_jsonl(p: Path) -> list[dict]:
    rows = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: line {i} is not valid JSON ({e}); fix or remove that line") from None
    return rows


def split_names(source: Any) -> list[str] | None:
    """The split names of a DatasetDict source (object or save_to_disk directory), None for a single dataset."""
    if _is_dict(source):
        return list(source)
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        if (Path(source) / "dataset_dict.json").is_file():
            return list(json.loads((Path(source) / "dataset_dict.json").read_text()).get("splits", []))
    return None


def read_rows(source: Any, split: str | None = None, *, field: str = "rollout.task") -> list[dict]:
    """Every row of `source` as a dict (column -> value), in order.

    Args:
        source: a `datasets.Dataset` / `DatasetDict`, a save_to_disk directory, or a data file.
        split: the split to read of a DatasetDict; required for one, refused for a single dataset.
        field: the config field named in errors.
    """
    data = _open(source, field)
    if isinstance(data, list):
        rows = data
    else:
        if isinstance(data, dict):  # a DatasetDict: the split is never implied
            if split is None:
                raise ValueError(f"{field}: {describe_source(source)} has splits {sorted(data)}; name the training "
                                 "split with rollout.split (and the held-out one with rollout.heldout)")
            if split not in data:
                raise ValueError(f"rollout.split: {split!r} is not a split of {describe_source(source)} "
                                 f"(splits: {sorted(data)})")
            data = data[split]
        elif split is not None:
            raise ValueError(f"rollout.split: {split!r} given, but {describe_source(source)} is a single dataset "
                             "without splits; remove rollout.split")
        rows = data.to_list()
    if not rows:
        raise ValueError(f"{field}: {describe_source(source)} holds no rows")
    return rows


def chat_messages(prompt: Any, system_prompt: str | None = None) -> list[dict] | None:
    """The chat messages of a row's prompt: its own messages (a list of role/content dicts, TRL's
    conversational format), or a text prompt as one user turn when a system prompt is given; None for text
    without a system prompt (rendered as one user turn by `forgelab.data.prompts.format_prompt`).

    >>> chat_messages([{"role": "user", "content": "hi"}], "Be brief.")
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'hi'}]
    >>> chat_messages("2+2=") is None, chat_messages("2+2=", "Answer only.")[1]
    (True, {'role': 'user', 'content': '2+2='})
    """
    if isinstance(prompt, str):
        if system_prompt is None:
            return None
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        raise ValueError(f"prompt: expected text or a list of chat messages ({{'role', 'content'}} dicts), got "
                         f"{str(prompt)[:120]!r}")
    if system_prompt is not None:
        if messages[0].get("role") == "system":
            raise ValueError("rollout.system_prompt: the row's messages already start with a system message; "
                             "remove one of the two")
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages


def check_source(task: Any, heldout: Any, split: str | None) -> None:
    """Raise ``ValueError`` naming the field unless `task`, `split` and a held-out split name or dataset
    fit together (a toy task name is checked by the caller). Reads no rows (a split list at most)."""
    if not is_data_source(task):
        raise ValueError(f"rollout.task: {describe_source(task)!r} is neither a toy task nor a dataset (a "
                         f"datasets.Dataset/DatasetDict, a save_to_disk directory or an existing "
                         f"{'/'.join(DATA_SUFFIXES)} file)")
    splits = split_names(task)
    if splits is not None and split is None:
        raise ValueError(f"rollout.split: {describe_source(task)} has splits {splits}; name the one that trains "
                         "(e.g. rollout.split: train); it is never implied")
    if splits is not None and split not in splits:
        raise ValueError(f"rollout.split: {split!r} is not a split of {describe_source(task)} (splits: {splits})")
    if splits is None and split is not None:
        raise ValueError(f"rollout.split: {split!r} given, but {describe_source(task)} has no splits")
    if isinstance(heldout, str) and not is_data_source(heldout):
        if splits is None or heldout not in splits:
            raise ValueError(f"rollout.heldout: {heldout!r} is neither a split of {describe_source(task)} "
                             f"({splits or 'it has none'}) nor an existing dataset directory or file")
        if heldout == split:
            raise ValueError(f"rollout.heldout: {heldout!r} is also rollout.split; hold out another split")
