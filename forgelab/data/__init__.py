"""Data: the toy tasks (generated deterministically), dataset files, the problem stream, the tiny tokenizer.

    from forgelab.data import get_task, load_file, ProblemStream
    problems = get_task("addition").make("test", 200, seed=0)

`tasks` defines the toy tasks and `Problem`; `datasets` reads datasets (Dataset objects, save_to_disk directories, jsonl/parquet/csv/json
files through `sources`; GSM8K columns map as they are) and streams problems to the rollouts; `tokenizer` builds the shipped character-level one.
"""
from forgelab.data.prompts import format_prompt, problem_chat
from forgelab.data.datasets import (DataSplit, ProblemStream, gsm8k_target, load_file, load_problems, load_split,
                                    problems_from_rows)
from forgelab.data.sources import read_rows
from forgelab.data.tasks import TASKS, Problem, Task, extract_integer_answer, get_task

__all__ = ["TASKS", "DataSplit", "Problem", "ProblemStream", "load_split", "Task", "extract_integer_answer", "format_prompt", "get_task", "gsm8k_target",
           "load_file", "load_problems", "problem_chat", "problems_from_rows", "read_rows"]
