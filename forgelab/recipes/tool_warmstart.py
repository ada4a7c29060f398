"""Warm start for the calculator tool: a short SFT of the shipped tiny model on tool transcripts.

    python -m forgelab.recipes.tool_warmstart --out forgelab/assets/tiny-llama-tool [--call-rate R] [--steps N]

The shipped model (``forgelab/assets/tiny-llama``) has never seen ``<calc>``:
on ``CalculatorToolEnv`` it answers directly, so RL has no tool call to
reinforce. This recipe (CPU, one thread; 250 steps, 3-4 minutes on the shared
2-core machine) makes ``forgelab/assets/tiny-llama-tool``:

1. takes TRAIN-split problems of every task (``forgelab.data.tasks``) and plays each
   twice through the real episode runner (``forgelab.envs.run_episode``)
   against the real ``CalculatorToolEnv``, with a scripted teacher as the
   generator: once calling the tool (``<calc>12+45</calc>``; the environment
   answers ``<result>57</result>`` as a tool turn; the teacher answers
   ``57``) and once answering directly (``57``). The transcripts are token for
   token what the runner builds during RL (chat template, tool turn, end tokens);
2. fine-tunes with AdamW, each step on ``batch_tool`` tool and ``batch_direct``
   direct transcripts, the loss only where the episode's ``loss_mask`` is 1
   (assistant tokens and their end token; never the prompt or the tool turn);
3. labels the FIRST assistant token (``<`` of a call, or the answer's first
   digit) only on a seeded share of transcripts (``decision_fractions``), so
   every tool transcript teaches how to call and how to use the result, while
   the policy decides to call on about ``call_rate`` of its samples;
4. writes a normal HF checkpoint (safetensors, tokenizer, generation config),
   ``model_card.json`` and ``README.md``, with held-out tool-use statistics
   before and after (``tool_use_stats``, TEST split, greedy and sampled),
   played through the same runner with HF ``generate`` (``play_hf``).

Why ``call_rate`` 0.3 and not 1.0 (measured, 40 GRPO steps on multistep from
each, ``tests/test_tool_warmstart.py``'s configuration): from 0.3 the rollouts'
tool-call rate rises from 0.19-0.26 to 0.72-0.91 because calling is rewarded
-- RL learns WHEN to call -- and held-out greedy accuracy from 0.095 to
0.75-0.82; from 1.0 the policy calls on every sample from the start, RL only
polishes the copying, and held-out accuracy went from 0.255 to 0.655.
Fewer than ~250 steps leave the copying (of the expression into the call, of
the result into the answer) unlearnt: at 150 steps the answer equals the
tool's result in only ~30 % of sampled calls. The direct transcripts keep
(and, being more SFT, raise) direct-answer accuracy; when they were ~5 % of
the labelled tokens (one mixed stream), it collapsed to ~0.

Deterministic: the problems, the decision labels, the batch order and the
weights are seeded, and one thread is used (two runs wrote identical weights).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from forgelab.envs import CalculatorToolEnv, ChatFormat, EpisodeLimits, run_episode, tool_use_stats
from forgelab.data.tasks import TASKS, Problem
from forgelab.recipes.sft import IGNORE, Stream, masked_ce_sum, pad_right, train_sft
from forgelab.types import Completion, Episode

ASSETS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets")
SHIPPED = os.path.join(ASSETS, "tiny-llama")
TOOL_WARMSTART = os.path.join(ASSETS, "tiny-llama-tool")
"""Where the warm start made with the default recipe ships."""

__all__ = ["TOOL_WARMSTART", "ToolWarmstart", "decision_fractions", "encode_episodes", "masked_ce_sum", "play_hf",
           "teacher_episodes", "tool_use_stats", "train"]


@dataclass(kw_only=True)
class ToolWarmstart:
    """Hyper-parameters of the warm start (the defaults are the measured recipe)."""

    out: str
    """Output checkpoint directory."""
    base: str = SHIPPED
    """Checkpoint to fine-tune (default: the shipped tiny model)."""
    call_rate: float = 0.3
    """Target probability that the policy opens its first turn with a tool call (see `decision_fractions`)."""
    steps: int = 250
    """Optimizer steps."""
    batch_tool: int = 32
    """Tool transcripts per step."""
    batch_direct: int = 64
    """Direct-answer transcripts per step (they are short: a quarter of a tool transcript's tokens)."""
    lr: float = 1e-3
    """AdamW learning rate (linear warmup, then constant; as the shipped model's recipe)."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    n_train: dict[str, int] = field(default_factory=lambda: {"addition": 4_000, "multistep": 2_000})
    """TRAIN-split problems per task; each gives one tool and one direct transcript."""
    seed: int = 0
    """Seeds the problems, the decision labels, the batch order and the sampled evaluation."""
    n_eval: int = 200
    """TEST-split problems per task in the model card's statistics (0: skip the evaluation)."""
    threads: int = 1
    """``torch.set_num_threads``."""


def decision_fractions(call_rate: float, batch_tool: int, batch_direct: int) -> tuple[float, float]:
    """``(tool, direct)``: the fractions of tool and direct transcripts whose FIRST assistant token
    (``<`` of ``<calc>``, or the answer's first character) carries a label.

    Every other assistant token is always labelled, so every tool transcript teaches how to call
    and how to use the result, while the first token alone sets how often the policy decides to
    call: per step, labelled ``<`` / (labelled ``<`` + labelled direct starts) = ``call_rate``.

    >>> [round(f, 4) for f in decision_fractions(0.3, 32, 64)]   # 0.3 = 32 * 6/7 / (32 * 6/7 + 64)
    [0.8571, 1.0]
    >>> decision_fractions(1.0, 32, 64)
    (1.0, 0.0)
    """
    if not 0.0 <= call_rate <= 1.0:
        raise ValueError(f"ToolWarmstart.call_rate must be in [0, 1], got {call_rate!r}")
    if call_rate * (batch_tool + batch_direct) <= batch_tool:
        return call_rate * batch_direct / ((1.0 - call_rate) * batch_tool), 1.0
    return 1.0, (1.0 - call_rate) * batch_tool / (call_rate * batch_direct)


# ----------------------------------------------------------------------------------- transcripts


def _run_async(make_coro: Any) -> Any:
    """``asyncio.run(make_coro())``, in a worker thread when this thread already runs a loop (Jupyter)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coro())
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make_coro())).result()


def _scripted(turns: Sequence[str], tokenizer) -> Any:
    """A generate function that says `turns[i]` (+ the end token) on its i-th call."""
    calls = iter(turns)

    async def generate(ids: list[int], sampling: Any) -> Completion:
        text = next(calls)
        out = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        return Completion(prompt_ids=list(ids), completion_ids=out, logprobs=[0.0] * len(out), text=text,
                          finish_reason="stop", policy_version=0)

    return generate


def teacher_turns(problem: Problem, use_tool: bool) -> list[str]:
    """The teacher's assistant turns: ``["<calc>12+45</calc>", "57"]`` or ``["57"]``.

    >>> teacher_turns(Problem(prompt="(7+5)*3=", target="36", task="multistep"), True)
    ['<calc>(7+5)*3</calc>', '36']
    """
    if not use_tool:
        return [problem.target]
    return [f"<calc>{problem.prompt.rstrip().removesuffix('=')}</calc>", problem.target]


def teacher_episodes(problems: Sequence[Problem], use_tool: Sequence[bool], fmt: ChatFormat,
                     env_kwargs: dict | None = None) -> list[Episode]:
    """Each problem played by the episode runner against `CalculatorToolEnv` with the scripted teacher."""
    from forgelab.engines.generator import SamplingConfig

    limits = EpisodeLimits(max_turns=3, max_total_tokens=512)
    sampling = SamplingConfig(temperature=0.0, max_tokens=64)

    async def main() -> list[Episode]:
        return list(await asyncio.gather(*(
            run_episode(CalculatorToolEnv(**(env_kwargs or {})), p, _scripted(teacher_turns(p, t), fmt.tokenizer),
                        fmt, sampling, limits)
            for p, t in zip(problems, use_tool)
        )))

    episodes = _run_async(main)
    for p, ep in zip(problems, episodes):
        if ep.info.get("outcome") != "done" or ep.reward_parts.get("correct") != 1.0:
            raise RuntimeError(f"teacher transcript for {p.prompt!r} did not end correct: {ep.info}")
    return episodes


def encode_episodes(episodes: Sequence[Episode], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids_N_T, labels_N_T)``, right-padded: ids = prompt + completion, labels = ids where the
    episode's loss mask is 1 (generated tokens), IGNORE elsewhere (prompt, tool turns, padding)."""
    rows = [ep.prompt_ids + ep.completion_ids for ep in episodes]
    labels = [[IGNORE] * len(ep.prompt_ids)
              + [t if m else IGNORE for t, m in zip(ep.completion_ids, ep.loss_mask or [1] * len(ep.completion_ids))]
              for ep in episodes]
    return pad_right(rows, labels, pad_id)


@dataclass
class Transcripts:
    """The recipe's training data: tool and direct transcripts, encoded, with the decision labels applied."""

    tool: list[Episode]
    direct: list[Episode]
    tool_ids_N_T: torch.Tensor
    tool_labels_N_T: torch.Tensor
    direct_ids_N_T: torch.Tensor
    direct_labels_N_T: torch.Tensor


def training_data(r: ToolWarmstart, fmt: ChatFormat) -> Transcripts:
    """Every TRAIN problem as a tool transcript and as a direct one; the first assistant token labelled on
    the seeded share of each given by `decision_fractions`."""
    problems = [p for name, n in r.n_train.items() for p in TASKS[name].make("train", n, r.seed)]
    tool = teacher_episodes(problems, [True] * len(problems), fmt)
    direct = teacher_episodes(problems, [False] * len(problems), fmt)
    pad = fmt.tokenizer.pad_token_id
    (tids, tlab), (dids, dlab) = encode_episodes(tool, pad), encode_episodes(direct, pad)
    rng = random.Random(f"tool_warmstart:{r.seed}")
    for eps, labels, frac in zip((tool, direct), (tlab, dlab), decision_fractions(r.call_rate, r.batch_tool,
                                                                                  r.batch_direct)):
        for i, ep in enumerate(eps):
            if rng.random() >= frac:
                labels[i, len(ep.prompt_ids)] = IGNORE
    return Transcripts(tool, direct, tids, tlab, dids, dlab)


# ----------------------------------------------------------------------------------- evaluation


class _HFBatcher:
    """Batches the `generate` calls of episodes running together into one HF `generate` per wave.

    A call waits until every episode still running has asked for its next turn, then all of them
    are generated together (left padding); deterministic for a given seed and set of episodes.
    """

    def __init__(self, model, tokenizer, active: int, temperature: float):
        self.model, self.tok, self.active, self.temperature = model, tokenizer, active, temperature
        self.queue: list[tuple[list[int], Any, asyncio.Future]] = []

    async def generate(self, ids: list[int], sampling: Any) -> Completion:
        fut = asyncio.get_running_loop().create_future()
        self.queue.append((list(ids), sampling, fut))
        self._maybe_flush()
        return await fut

    def finished(self) -> None:
        self.active -= 1
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if not self.queue or len(self.queue) < self.active:
            return
        items, self.queue = self.queue, []
        pad = self.tok.pad_token_id
        T = max(len(ids) for ids, _, _ in items)
        ids_B_T = torch.tensor([[pad] * (T - len(ids)) + ids for ids, _, _ in items])
        mask_B_T = torch.tensor([[0] * (T - len(ids)) + [1] * len(ids) for ids, _, _ in items])
        max_new = max(s.max_tokens for _, s, _ in items)
        kw = (dict(do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0) if self.temperature > 0
              else dict(do_sample=False))
        with torch.no_grad():
            out_B_T = self.model.generate(input_ids=ids_B_T, attention_mask=mask_B_T, max_new_tokens=max_new,
                                          eos_token_id=self.tok.eos_token_id, pad_token_id=pad, **kw)
        for (ids, s, fut), row in zip(items, out_B_T[:, T:].tolist()):
            row = row[: s.max_tokens]
            if self.tok.eos_token_id in row:
                row = row[: row.index(self.tok.eos_token_id) + 1]
            stop = row[-1:] == [self.tok.eos_token_id]
            fut.set_result(Completion(prompt_ids=ids, completion_ids=row, logprobs=[0.0] * len(row),
                                      text=self.tok.decode(row, skip_special_tokens=True),
                                      finish_reason="stop" if stop else "length", policy_version=0))


def play_hf(model, tokenizer, problems: Sequence[Problem], *, temperature: float = 0.0, samples: int = 1,
            max_tokens: int = 24, max_turns: int = 3, env_kwargs: dict | None = None,
            seed: int = 0) -> list[Episode]:
    """Episodes of `CalculatorToolEnv` on `problems` (`samples` each), played by the episode runner with HF
    `generate` as the generator (greedy when `temperature` is 0). The same runner and format as RL rollouts."""
    from forgelab.engines.generator import SamplingConfig

    fmt = ChatFormat(tokenizer)
    sampling = SamplingConfig(temperature=temperature, max_tokens=max_tokens)
    limits = EpisodeLimits(max_turns=max_turns, max_total_tokens=256)
    tasks = [p for p in problems for _ in range(samples)]
    was_training = model.training
    model.eval()
    torch.manual_seed(seed)

    async def main() -> list[Episode]:
        batcher = _HFBatcher(model, tokenizer, len(tasks), temperature)

        async def one(p: Problem) -> Episode:
            try:
                return await run_episode(CalculatorToolEnv(**(env_kwargs or {})), p, batcher.generate, fmt,
                                         sampling, limits)
            finally:
                batcher.finished()

        return list(await asyncio.gather(*(one(p) for p in tasks)))

    try:
        return _run_async(main)
    finally:
        model.train(was_training)


def evaluate(model, tokenizer, n: int, seed: int, max_tokens: int = 24) -> dict[str, dict]:
    """Tool-use statistics on the first `n` TEST problems of every task: greedy, and 4 samples at temperature 1."""
    out: dict[str, dict] = {}
    for name, task in TASKS.items():
        probs = task.make("test", n, seed)
        out[name] = {
            "greedy": _rounded(tool_use_stats(play_hf(model, tokenizer, probs, max_tokens=max_tokens, seed=seed))),
            "sampled_t1_x4": _rounded(tool_use_stats(play_hf(model, tokenizer, probs, temperature=1.0, samples=4,
                                                             max_tokens=max_tokens, seed=seed))),
        }
    return out


def _rounded(d: dict) -> dict:
    """4 decimals; NaN (a rate with nothing to count) becomes None, which JSON can hold."""
    return {k: (None if v != v else round(v, 4)) if isinstance(v, float) else v for k, v in d.items()}


# ----------------------------------------------------------------------------------- training


def train(r: ToolWarmstart) -> dict:
    """Run the recipe; returns the model card dict (also written to ``r.out``).

    Each step (`forgelab.recipes.sft.train_sft`, ``average="tokens"``): `batch_tool` tool and
    `batch_direct` direct transcripts (two forward passes, each trimmed to its last label), loss = mean
    cross-entropy over all their labelled tokens.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from forgelab.data.tokenizer import save_tokenizer

    decision = decision_fractions(r.call_rate, r.batch_tool, r.batch_direct)  # validates call_rate
    load = os.getloadavg()  # the machine is shared: timings mean little without it
    torch.set_num_threads(r.threads)
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(r.base)
    model = AutoModelForCausalLM.from_pretrained(r.base, dtype=torch.float32)
    data = training_data(r, ChatFormat(tokenizer))
    print(f"transcripts: {len(data.tool):,} tool x {data.tool_ids_N_T.shape[1]} tokens, {len(data.direct):,} "
          f"direct x {data.direct_ids_N_T.shape[1]}; built in {time.perf_counter() - t0:.1f}s", flush=True)
    before = evaluate(model, tokenizer, r.n_eval, r.seed) if r.n_eval else None

    torch.manual_seed(r.seed)
    streams = [Stream(data.tool_ids_N_T, data.tool_labels_N_T, r.batch_tool),
               Stream(data.direct_ids_N_T, data.direct_labels_N_T, r.batch_direct)]
    result = train_sft(model, streams, steps=r.steps, lr=r.lr, warmup_steps=r.warmup_steps, seed=r.seed,
                       average="tokens", log_every=25)
    losses, train_s = result.losses, result.train_seconds

    model.eval()
    os.makedirs(r.out, exist_ok=True)
    model.save_pretrained(r.out, safe_serialization=True)
    os.chmod(os.path.join(r.out, "model.safetensors"), 0o644)  # written 0600; the default one ships in git
    save_tokenizer(tokenizer, r.out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(r.out)
    after = evaluate(model, tokenizer, r.n_eval, r.seed) if r.n_eval else None
    defaults = ToolWarmstart(out="")
    flags = [f"--{k.replace('_', '-')} {getattr(r, k)}" for k in CLI_FIELDS if getattr(r, k) != getattr(defaults, k)]
    card = {
        "base": "forgelab/assets/tiny-llama" if r.base == SHIPPED else r.base,
        "what": "the base model after a short SFT on calculator-tool transcripts (assistant <calc>expr</calc>, "
                "tool <result>N</result>, assistant N) and direct answers, played by forgelab's episode runner "
                "against CalculatorToolEnv; loss on assistant tokens only",
        "command": " ".join(["python -m forgelab.recipes.tool_warmstart --out",
                             "forgelab/assets/tiny-llama-tool" if os.path.abspath(r.out) == TOOL_WARMSTART else "DIR",
                             *flags]),
        "recipe": {k: v for k, v in asdict(r).items() if k not in ("out", "base")},
        "decision_label_fractions": {"tool": round(decision[0], 4), "direct": round(decision[1], 4)},
        "transcripts": {"tool": len(data.tool), "direct": len(data.direct)},
        "train_seconds": round(train_s, 1),
        "load_average_at_start": [round(x, 2) for x in load],
        "total_seconds": round(time.perf_counter() - t0, 1),
        "final_loss": round(sum(losses[-25:]) / len(losses[-25:]), 4),
        "eval": {
            "function": "forgelab.recipes.tool_warmstart.evaluate: CalculatorToolEnv episodes on the TEST split "
                        "(greedy, and 4 samples at temperature 1), max_tokens 24 per turn, max_turns 3",
            "n_per_task": r.n_eval, "seed": r.seed, "before": before, "after": after,
        },
        "torch_version": torch.__version__,
    }
    with open(os.path.join(r.out, "model_card.json"), "w") as f:
        json.dump(card, f, indent=2)
        f.write("\n")
    with open(os.path.join(r.out, "README.md"), "w") as f:
        f.write(render_readme(card))
    print(json.dumps({k: card[k] for k in ("train_seconds", "total_seconds", "final_loss")}), flush=True)
    return card


def render_readme(card: dict) -> str:
    """The model card in Markdown, from the machine-readable card dict."""
    ev, rec = card["eval"], card["recipe"]

    def fmt(v):
        return "-" if v is None else f"{100 * v:.1f} %"

    rows = []
    for when, name in (("before", "base"), ("after", "warm start")):
        for task, modes in (ev.get(when) or {}).items():
            for mode, st in modes.items():
                rows.append(f"| {name} | {task} | {mode} | {fmt(st['tool_rate'])} | {fmt(st['wellformed_rate'])} | "
                            f"{fmt(st['result_use_rate'])} | {fmt(st['accuracy'])} | {fmt(st['accuracy_with_tool'])} | "
                            f"{fmt(st['accuracy_direct'])} |")
    table = "\n".join(rows) or "| (not evaluated) |"
    return f"""# tiny-llama-tool (forgelab)

`{card['base']}` after a short supervised warm start on the calculator tool
(`CalculatorToolEnv`): the starting point for RL that learns to use the tool.
Built by `forgelab/recipes/tool_warmstart.py` (its docstring says why each choice).

- **Data**: {card['transcripts']['tool']:,} tool transcripts (assistant `<calc>12+45</calc>`, tool
  `<result>57</result>`, assistant `57`) and {card['transcripts']['direct']:,} direct answers, of the same
  TRAIN problems ({', '.join(f'{k}: {v:,}' for k, v in rec['n_train'].items())}), played by forgelab's
  episode runner against the environment with a scripted teacher, so the tokens are
  exactly those of RL episodes; loss on assistant tokens only.
- **Decision labels**: the first assistant token is labelled on {100 * card['decision_label_fractions']['tool']:.1f} % of
  tool and {100 * card['decision_label_fractions']['direct']:.1f} % of direct transcripts, so the policy opens
  with a call on about {100 * rec['call_rate']:.0f} % of its samples (`call_rate`), leaving RL the choice.
- **Training**: AdamW, lr {rec['lr']}, {rec['steps']} steps of {rec['batch_tool']} tool + {rec['batch_direct']} direct
  transcripts, {card['train_seconds']} s on {rec['threads']} CPU thread(s) (load average at start
  {card['load_average_at_start'][0]} on a shared machine), final loss {card['final_loss']}.
- **Seed**: {rec['seed']}. **Reproduce**: `{card['command']}`

## Tool use on held-out problems (TEST split, {ev['n_per_task']} per task)

Played through the episode runner with HF `generate`; max 24 tokens per turn, 3 turns.
"sampled" is 4 samples per problem at temperature 1 (what RL rollouts see).
Rates: tool = episodes that call; well-formed = calls the calculator accepts; result use =
answers equal to the tool's result, among episodes that call; accuracy overall, with and
without a call.

| model | task | mode | tool | well-formed | result use | accuracy | acc. with tool | acc. direct |
|---|---|---|---|---|---|---|---|---|
{table}

Machine-readable: `model_card.json`.
"""


CLI_FIELDS = ("call_rate", "steps", "batch_tool", "batch_direct", "lr", "seed")


def main(argv: list[str] | None = None) -> dict:
    d = ToolWarmstart(out="")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--base", default=d.base)
    for name in (*CLI_FIELDS, "n_eval"):
        default = getattr(d, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    a = p.parse_args(argv)
    return train(ToolWarmstart(out=a.out, base=a.base, n_eval=a.n_eval, **{k: getattr(a, k) for k in CLI_FIELDS}))


if __name__ == "__main__":
    main(sys.argv[1:])
