"""lm-eval (EleutherAI's harness, 0.4.13) against the live policy, through the agent door (docs/agents.md).

    tasks_dir = write_addition_tasks(run.out_dir / "lm_eval", run.tokenizer, run.heldout[:64])
    result = await run.lm_eval(tasks=["forgelab_addition_gen", "forgelab_addition_mc"])
    result.scores        # {"lm_eval/forgelab_addition_gen/exact_match": 0.42, ...}, also columns of run.metrics

lm-eval runs in a child process (``python -m forgelab.serve.lm_eval_door SPEC``, which calls
``lm_eval.simple_evaluate``), so the controller's event loop keeps serving the door while it evaluates. Its model is
lm-eval's own ``local-completions`` client pointed at the door's ``/v1/completions`` (token-id prompts, the run's
tokenizer from its local directory; the run's key in ``OPENAI_API_KEY``, never on a command line). Its calls name
no session, so they are served and not recorded (no episodes, no admission slots). Hubs stay off in the child
(``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE``): the tasks are local YAML files over a local JSON-lines file.

The two local tasks (`write_addition_tasks`), over problems of forgelab's ``addition`` task:

- ``forgelab_addition_gen`` (``generate_until``): the chat-templated prompt (`format_prompt`, as forgelab's own
  evaluation renders it), greedy, at most ``max_gen_toks`` tokens, scored by lm-eval's ``exact_match`` after a
  ``regex`` filter that states forgelab's answer rule in lm-eval's terms (surrounding whitespace and leading zeros
  ignored, ``-0`` is ``0``, anything else not an integer is wrong): its score is forgelab's held-out accuracy on
  the same problems and weights (`tests/test_lm_eval_door.py`).
- ``forgelab_addition_mc`` (``multiple_choice``, log-likelihood): four candidate answers per problem (the sum, +1,
  +10, +11); ``acc`` is the fraction whose sum is the most likely continuation of the prompt. Each candidate's
  log-likelihood is the sum of the door's prompt logprobs (``echo``) over its tokens.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from forgelab.data.prompts import format_prompt, problem_chat
from forgelab.data.tasks import Problem

if TYPE_CHECKING:
    from forgelab.config.run_config import RunConfig
    from forgelab.controller.lifecycle import Lifecycle
    from forgelab.controller.tracking import Tracker
    from forgelab.serve.door import AgentDoor

__all__ = ["ADDITION_TASKS", "LmEvalResult", "lm_eval_run", "run_lm_eval", "scores_of", "write_addition_tasks"]

#: The local tasks `write_addition_tasks` writes.
ADDITION_TASKS = ("forgelab_addition_gen", "forgelab_addition_mc")
DATA_FILE = "forgelab_addition.jsonl"

#: forgelab's integer-answer rule (`forgelab.data.tasks.extract_integer_answer` then ``==`` target) as an lm-eval
#: ``regex`` filter: the integer's digits without leading zeros, or no match ("[invalid]", never equal to a target).
#: A ``-`` is allowed only before zeros (forgelab reads "-0" as "0"); targets of ``addition`` are never negative.
ANSWER_REGEX = r"^\s*(?:-(?=0+\s*$))?0*(\d+)\s*$"

_GEN_YAML = """\
# forgelab's addition task as an lm-eval generate_until task (written by forgelab.serve.lm_eval_door)
task: forgelab_addition_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: prompt
doc_to_target: answer
target_delimiter: ""
generation_kwargs:
  until: []
  max_gen_toks: {max_gen_toks}
  do_sample: false
  temperature: 0.0
filter_list:
  - name: integer
    filter:
      - function: regex
        regex_pattern: '{regex}'
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

_MC_YAML = """\
# forgelab's addition task as an lm-eval multiple_choice (log-likelihood) task (written by forgelab.serve.lm_eval_door)
task: forgelab_addition_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: prompt
doc_to_choice: choices
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_addition_tasks(directory: str | os.PathLike[str], tokenizer: Any, problems: Sequence[Problem], *,
                         max_gen_toks: int = 8) -> Path:
    """Write the two local lm-eval tasks over ``problems`` into ``directory`` (its ``--include_path``).

    Args:
        directory: created if missing; gets ``forgelab_addition.jsonl`` and one YAML file per task.
        tokenizer: the run's tokenizer (its chat template renders each prompt, as `format_prompt` does for
            forgelab's own evaluation).
        problems: problems of the ``addition`` task (the run's held-out draw, say).
        max_gen_toks: the generation budget (the run's ``rollout.max_tokens`` for the same evaluation).
    """
    if not problems:
        raise ValueError("write_addition_tasks: no problems given; pass e.g. run.heldout[:64]")
    bad = sorted({p.task for p in problems if p.task != "addition"})
    if bad:
        raise ValueError(f"write_addition_tasks: problems of task(s) {bad} given; these files hold 'addition' "
                         "problems only (their multiple-choice candidates are sums)")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    with (d / DATA_FILE).open("w") as f:
        for p in problems:
            t = int(p.target)
            choices = [str(c) for c in (t, t + 1, t + 10, t + 11)]
            f.write(json.dumps({"question": p.prompt, "prompt": format_prompt(tokenizer, problem_chat(p)),
                                "answer": p.target, "choices": choices, "gold": 0}) + "\n")
    data = json.dumps(str((d / DATA_FILE).resolve()))
    (d / "forgelab_addition_gen.yaml").write_text(_GEN_YAML.format(data=data, max_gen_toks=max_gen_toks,
                                                                   regex=ANSWER_REGEX))
    (d / "forgelab_addition_mc.yaml").write_text(_MC_YAML.format(data=data))
    return d


@dataclass
class LmEvalResult:
    """What one lm-eval invocation through the door gave."""

    scores: dict[str, float]
    """``lm_eval/<task>/<metric>`` -> value (lm-eval's aggregate; a metric under a named filter keeps the filter:
    ``exact_match`` of ``forgelab_addition_gen`` is after its ``integer`` filter)."""
    results: dict[str, Any]
    """lm-eval's ``results`` (per task: ``"<metric>,<filter>"`` -> value, stderr when bootstrapped)."""
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Per task, lm-eval's logged samples: ``doc``, ``arguments``, ``resps`` (a generation's text, or
    ``[log-likelihood, is_greedy]`` per choice), ``filtered_resps`` and the per-item metrics."""
    seconds: float = 0.0


def scores_of(results: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """lm-eval's ``results`` as flat ``lm_eval/<task>/<metric>`` numbers: its ``"<metric>,<filter>"`` entries,
    stderrs left out (``name``, ``alias``, ``sample_len`` are not metrics)."""
    out: dict[str, float] = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            metric = key.split(",", 1)[0]
            if "," not in key or metric.endswith("_stderr") or isinstance(value, bool) \
                    or not isinstance(value, (int, float)):
                continue
            out[f"lm_eval/{task}/{metric}"] = float(value)
    return out


async def run_lm_eval(*, base_url: str, key: str, model_name: str, tokenizer_path: str | os.PathLike[str],
                      tasks: Sequence[str], include_path: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                      limit: int | None = None, batch_size: int = 16, timeout_s: float = 3600.0,
                      on_line: Callable[[str], None] | None = None) -> LmEvalResult:
    """Run lm-eval on ``tasks`` against the door in a child process; its results once it exits.

    Args:
        base_url: the door's OpenAI base URL (``run.openai_base_url``: ``http://127.0.0.1:<port>/v1``).
        key: the run's key (``run.door_key``); given to the child in its environment only.
        model_name: the door's model id (``door.model_name``).
        tokenizer_path: a local tokenizer directory (the run's model), for lm-eval's token-id prompts.
        tasks: task names found under ``include_path`` (or lm-eval's stock tasks, which download their data:
            refused while the hubs are offline).
        include_path: the directory of local task YAML files (`write_addition_tasks`).
        out_dir: where the child's spec and results go (``lm_eval_results.json``).
        limit: at most this many documents per task. batch_size: prompts per request to the door.
        timeout_s: the child is killed past this.
        on_line: called with each line the child prints (progress; default: dropped).
    """
    if not tasks:
        raise ValueError("run_lm_eval: no tasks given; e.g. tasks=['forgelab_addition_gen']")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = {"model_args": {"base_url": base_url.rstrip("/") + "/completions", "model": model_name,
                           "tokenizer": str(tokenizer_path), "tokenizer_backend": "huggingface",
                           "tokenized_requests": True, "batch_size": batch_size, "max_retries": 1,
                           "timeout": int(timeout_s)},
            "tasks": list(tasks), "include_path": str(include_path), "limit": limit,
            "results": str(out / "lm_eval_results.json")}
    spec_path = out / "lm_eval_spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    env = {**os.environ, "OPENAI_API_KEY": key, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "forgelab.serve.lm_eval_door", str(spec_path),
                                                env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    tail: list[str] = []

    async def pump() -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            tail.append(line)
            del tail[:-40]
            if on_line is not None:
                on_line(line)

    try:
        await asyncio.wait_for(asyncio.gather(pump(), proc.wait()), timeout_s)
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"lm-eval exited with {proc.returncode} on tasks {list(tasks)}; its last lines:\n"
                           + "\n".join(tail))
    got = json.loads(Path(spec["results"]).read_text())  # type: ignore[arg-type]  # a str, written above
    return LmEvalResult(scores=scores_of(got["results"]), results=got["results"], samples=got["samples"],
                        seconds=time.perf_counter() - t0)


class DoorRun(Protocol):
    """What `lm_eval_run` reads of a run (a `forgelab.run.Run`)."""

    door: AgentDoor | None
    out_dir: Path
    config: RunConfig
    lifecycle: Lifecycle
    tracker: Tracker | None

    @property
    def heldout(self) -> Sequence[Problem]: ...
    @property
    def tokenizer(self) -> Any: ...
    @property
    def step(self) -> int: ...
    @property
    def version(self) -> int: ...
    def emit(self, kind: str, **fields: Any) -> None: ...


async def lm_eval_run(run: DoorRun, tasks: Sequence[str] = ADDITION_TASKS, *, n: int | None = None,
                      include_path: str | os.PathLike[str] | None = None, limit: int | None = None,
                      batch_size: int = 16, timeout_s: float = 3600.0) -> LmEvalResult:
    """`run_lm_eval` on a `forgelab.run.Run` with its door open (``run.lm_eval`` calls this).

    Without ``include_path`` the two addition tasks are written over the run's first ``n`` held-out problems (all
    by default) into ``<out_dir>/lm_eval/tasks``. New rollouts wait while it runs (the run's evaluation gate, as
    for `Run.evaluate`), so the policy it scores is the one served when it started unless a train step already
    under way pushes new weights (``version_start`` / ``version_end`` in the event tell). Its scores become
    ``lm_eval/<task>/<metric>`` columns of ``run.metrics`` at the run's current step (the dashboard's held-out
    accuracy plot draws them) and an ``lm_eval`` event.
    """
    if run.door is None:
        raise RuntimeError("lm_eval: the run's agent door is not open; set door.enabled: true and spawn or start "
                           "the run first (docs/agents.md)")
    base = Path(run.out_dir) / "lm_eval"
    if include_path is None:
        problems = list(run.heldout)[: n or None]
        include_path = write_addition_tasks(base / "tasks", run.tokenizer, problems,
                                            max_gen_toks=run.config.rollout.max_tokens)
    step, version = run.step, run.version
    async with run.lifecycle.gate.hold():
        result = await run_lm_eval(base_url=run.door.base_url, key=run.door.key, model_name=run.door.model_name,
                                   tokenizer_path=run.config.model.path, tasks=tasks, include_path=include_path,
                                   out_dir=base / f"step{step}", limit=limit, batch_size=batch_size,
                                   timeout_s=timeout_s)
    if run.tracker is not None:
        run.tracker.annotate(step, result.scores)
    run.emit("lm_eval", tasks=list(tasks), scores=result.scores, seconds=round(result.seconds, 2),
             version_start=version, version_end=run.version, include_path=str(include_path))
    return result


def _child(spec_path: str) -> None:
    """The child process: lm-eval's Python API on the spec `run_lm_eval` wrote; results as JSON."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    spec = json.loads(Path(spec_path).read_text())
    res = lm_eval.simple_evaluate(model="local-completions", model_args=spec["model_args"], tasks=spec["tasks"],
                                  task_manager=TaskManager(include_path=spec["include_path"]), limit=spec["limit"],
                                  log_samples=True, bootstrap_iters=0)
    if res is None:
        raise SystemExit("lm-eval returned no results")
    Path(spec["results"]).write_text(json.dumps({"results": res["results"], "samples": res.get("samples", {})},
                                                default=str))


if __name__ == "__main__":
    _child(sys.argv[1])
