"""The multi-turn episode runner: generator turns and environment steps, token-in/token-out.

    fmt = ChatFormat(tokenizer)
    ep = await run_episode(env, task, generate, fmt, sampling, EpisodeLimits(max_turns=4))

What it really is: a loop that keeps ONE growing list of token ids.

1. `obs = env.reset(task)`; `prompt_ids = template([user: obs], generation prompt)`.
2. `generate(ids so far)` -> one `Completion`; its ids and sampling logprobs are
   appended verbatim (loss mask 1). Nothing is re-tokenized: the trainer sees
   exactly the tokens the generator sampled.
3. `env.step(completion text)` -> observation; unless done, the observation is
   appended as the token ids of the chat template's rendering of that message
   followed by the assistant header (`ChatFormat.turn_ids`; loss mask 0,
   logprob 0.0). A turn that ran out of tokens gets the end-of-turn token
   appended first, as an environment token.
4. repeat from 2 until `done`, `max_turns` assistant turns, or
   `max_total_tokens` (prompt + completion) would be exceeded.

The final observation (after `done`) is kept in `info` but not appended: no
token after the last generated one can be trained.

The `Episode` has `prompt_ids` = the first prompt, `completion_ids` =
everything after it, `generator_logprobs` (0.0 on environment tokens),
`loss_mask` (1 exactly on generated tokens), `reward` = the sum of step rewards
and `info` with `turns` = [(start, end, role)] over `completion_ids`
(end exclusive; role "assistant" for generated turns, else the speaker of the
environment message), `outcome`, `turn_versions` (and `token_versions`,
run-length [version, first token] pairs over `completion_ids`, once a weight
update landed inside a turn: generator.update_mode inflight), `cached_tokens` (prompt
tokens each turn served from the prefix cache), `observations` and
`env_metrics` (the steps' `info["metrics"]` counters summed per name, e.g. tool
calls; `env_metric_means` averages them over episodes, as a `Run`'s `env/*` metrics).

Outcomes: "done" (the environment ended it), "max_turns", "max_tokens" (kept
and trained); "env_timeout", "env_error", "generator_error" (in `DROP_OUTCOMES`:
the episode is dropped with that reason and counted in the buffer accounting).
`policy_version` is the oldest version among its turns (weights may change
between turns), so staleness control stays conservative.
"""
from __future__ import annotations

import asyncio
import copy
import math
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from forgelab.types import Completion, Episode

__all__ = ["DROP_OUTCOMES", "ChatFormat", "EnvActorConfig", "EpisodeLimits", "env_metric_means", "final_answer",
           "latency_percentiles", "run_episode"]

DROP_OUTCOMES = frozenset({"env_timeout", "env_error", "generator_error"})
"""Episode outcomes that are not trained: the controller drops them with the outcome as reason."""

GenerateFn = Callable[[list[int], Any], Awaitable[Completion]]
"""`await generate(prompt_ids, sampling) -> Completion` (one sample)."""


@dataclass(kw_only=True)
class EpisodeLimits:
    """Bounds of one episode."""

    max_turns: int = 4
    """Most assistant (generated) turns."""
    max_total_tokens: int = 256
    """Most tokens in prompt + completion (keep it <= the generator's max_model_len)."""
    step_timeout_s: float = 10.0
    """A `reset` or `step` that takes longer is abandoned: the episode ends with outcome env_timeout."""

    def validate(self, where: str = "EpisodeLimits") -> None:
        for name in ("max_turns", "max_total_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{where}.{name} must be a positive integer, got {v!r}")
        if not (isinstance(self.step_timeout_s, (int, float)) and self.step_timeout_s > 0):
            raise ValueError(f"{where}.step_timeout_s must be > 0 seconds, got {self.step_timeout_s!r}")


class ChatFormat:
    """Token ids of chat messages, computed from the tokenizer's chat template.

    `prompt_ids(messages)` renders the first prompt (with the assistant header);
    `turn_ids(role, content)` is the ids that continue a conversation whose last
    assistant turn just ended: the template's rendering of that one message plus
    the assistant header. It is computed as a text difference against a fixed
    context, so the template must be prefix-stable (appending a message only
    appends text), which chat templates normally are; if not, it raises.

        >>> from forgelab.data.tokenizer import build_tokenizer
        >>> fmt = ChatFormat(build_tokenizer())
        >>> fmt.tokenizer.decode(fmt.turn_ids("tool", "<result>84</result>"))
        '<|tool|><result>84</result><|end|><|assistant|>'
    """

    _CONTEXT = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.eos_id: int = tokenizer.eos_token_id
        if self.eos_id is None:
            raise ValueError("ChatFormat: the tokenizer has no eos_token_id (the token that ends a turn)")
        self._base = self._render(self._CONTEXT, False)

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first prompt: `messages` rendered with the assistant header."""
        return self.encode(self._render(messages, True))

    def turn_ids(self, role: str, content: str) -> list[int]:
        """Ids of one `role` message (after an ended assistant turn) and the next assistant header."""
        full = self._render(self._CONTEXT + [{"role": role, "content": content}], True)
        if not full.startswith(self._base):
            raise ValueError(
                "ChatFormat: the chat template is not prefix-stable (rendering one more message changed the "
                "text before it), so turns cannot be appended as tokens; use a template that only appends"
            )
        return self.encode(full[len(self._base):])


def env_metric_means(episodes: list[Any]) -> dict[str, float]:
    """Per-episode mean of every `info["env_metrics"]` counter; an episode without a counter counts 0.

        >>> from types import SimpleNamespace as E
        >>> env_metric_means([E(info={"env_metrics": {"tool_calls": 2.0}}), E(info={"env_metrics": {}})])
        {'tool_calls': 1.0}
    """
    per_ep = [(ep.info or {}).get("env_metrics") or {} for ep in episodes]
    names = sorted({k for m in per_ep for k in m})
    return {k: sum(m.get(k, 0.0) for m in per_ep) / len(per_ep) for k in names} if per_ep else {}


def _nearest_rank(sorted_xs: list[float], q: float) -> float:
    return sorted_xs[min(len(sorted_xs) - 1, max(0, math.ceil(q / 100 * len(sorted_xs)) - 1))]


def latency_percentiles(episodes: list[Any]) -> dict[str, float]:
    """p50/p95/p99 (ms, nearest rank) of every turn's latency (generation + environment step) and of every
    episode's wall time, over all the episodes given (none sampled); {} when none was timed.

        >>> from types import SimpleNamespace as E
        >>> eps = [E(info={"turn_latency_s": [0.01, 0.03], "episode_latency_s": 0.05}),
        ...        E(info={"turn_latency_s": [0.02], "episode_latency_s": 0.02})]
        >>> latency_percentiles(eps)["turn_p50_ms"], latency_percentiles(eps)["episode_p99_ms"]
        (20.0, 50.0)
    """
    turns = sorted(x for ep in episodes for x in (ep.info or {}).get("turn_latency_s", ()))
    whole = sorted(ep.info["episode_latency_s"] for ep in episodes if "episode_latency_s" in (ep.info or {}))
    out: dict[str, float] = {}
    for name, xs in (("turn", turns), ("episode", whole)):
        if xs:
            for q in (50, 95, 99):
                out[f"{name}_p{q}_ms"] = round(_nearest_rank(xs, q) * 1e3, 6)
    return out


async def _bounded(coro: Awaitable[Any], timeout_s: float) -> Any:
    """Await `coro` for at most `timeout_s`; on timeout cancel it and do not wait for it to finish
    (an environment that swallows cancellation must not hang the episode)."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # no "never retrieved" warning
        raise asyncio.TimeoutError
    return task.result()


def _check_step(result: Any, env: Any) -> tuple[str | None, float, bool, dict]:
    if not (isinstance(result, tuple) and len(result) == 4):
        raise TypeError(f"{type(env).__name__}.step must return (observation, reward, done, info), got {result!r}")
    obs, reward, done, info = result
    if obs is not None and not isinstance(obs, str):
        raise TypeError(f"{type(env).__name__}.step: observation must be a str or None, got {type(obs).__name__}")
    return obs, float(reward), bool(done), dict(info or {})


async def run_episode(
    env: Any,
    task: Any,
    generate: GenerateFn,
    fmt: ChatFormat,
    sampling: Any,
    limits: EpisodeLimits | None = None,
) -> Episode:
    """Play one episode of `env` on `task`; never raises for environment or generator failures
    (they become the outcome, see the module docstring). `sampling.max_tokens` bounds each turn."""
    limits = limits or EpisodeLimits()
    info: dict[str, Any] = {"turns": [], "turn_versions": [], "cached_tokens": [], "observations": [],
                            "env_metrics": {}, "turn_latency_s": []}
    t_start = time.perf_counter()
    parts: dict[str, float] = {}
    prompt_ids: list[int] = []
    completion_ids: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    reward, text = 0.0, ""

    def finish(outcome: str, error: str = "") -> Episode:
        info["outcome"] = outcome
        info["episode_latency_s"] = time.perf_counter() - t_start
        info["assistant_turns"] = sum(1 for t in info["turns"] if t[2] == "assistant")
        if error:
            info["error"] = error
        versions = info["turn_versions"]
        return Episode(
            id=0, group_id=0, prompt_ids=prompt_ids, completion_ids=completion_ids, generator_logprobs=logprobs,
            policy_version=min(versions) if versions else -1, reward=reward, reward_parts=dict(parts),
            prompt=first_obs, completion=text, info=info, finish_reason=outcome, loss_mask=mask,
        )

    first_obs = ""
    try:
        first_obs = await _bounded(env.reset(task), limits.step_timeout_s)
    except asyncio.TimeoutError:
        return finish("env_timeout", f"reset took longer than step_timeout_s={limits.step_timeout_s}s")
    except Exception as e:
        return finish("env_error", f"reset: {type(e).__name__}: {e}")
    if not isinstance(first_obs, str):
        return finish("env_error", f"reset must return the first message as a str, got {type(first_obs).__name__}")
    info["observations"].append(first_obs)
    prompt_ids = fmt.prompt_ids([{"role": "user", "content": first_obs}])
    ids = list(prompt_ids)

    for turn in range(limits.max_turns):
        budget = limits.max_total_tokens - len(ids)
        if budget < 1:
            return finish("max_tokens")
        turn_sampling = copy.copy(sampling)
        turn_sampling.max_tokens = min(sampling.max_tokens, budget)
        t_turn = time.perf_counter()  # a turn's latency: its generation and its environment step
        try:
            c = await generate(ids, turn_sampling)
        except Exception as e:
            return finish("generator_error", f"{type(e).__name__}: {e}")
        start = len(completion_ids)
        completion_ids += c.completion_ids
        logprobs += [float(x) for x in c.logprobs]
        mask += [1] * len(c.completion_ids)
        ids += c.completion_ids
        info["turns"].append((start, len(completion_ids), "assistant"))
        info["turn_versions"].append(c.policy_version)
        runs = getattr(c, "token_versions", None) or [(c.policy_version, 0)]
        if len(runs) > 1 or "token_versions" in info:  # a weight update landed inside a turn (inflight mode)
            info.setdefault("token_versions", [[v, s] for v, s in _turn_runs(info)])
            info["token_versions"] += [[v, start + s] for v, s in runs]
        info["cached_tokens"].append(c.num_cached_tokens)
        text += c.text
        try:
            obs, r, done, step_info = _check_step(await _bounded(env.step(c.text), limits.step_timeout_s), env)
        except asyncio.TimeoutError:
            return finish("env_timeout", f"step {turn} took longer than step_timeout_s={limits.step_timeout_s}s")
        except Exception as e:
            return finish("env_error", f"step {turn}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
        info["turn_latency_s"].append(time.perf_counter() - t_turn)
        reward += r
        for k, v in (step_info.get("reward_parts") or {}).items():
            parts[k] = parts.get(k, 0.0) + float(v)
        for k, v in (step_info.get("metrics") or {}).items():
            info["env_metrics"][k] = info["env_metrics"].get(k, 0.0) + float(v)
        if obs is not None:
            info["observations"].append(obs)
        if done:
            return finish("done")
        if turn == limits.max_turns - 1:
            break
        if obs is None:
            return finish("env_error", f"step {turn} returned observation None without done=True")
        role = str(step_info.get("role", "user"))
        # A turn cut by max_tokens has no end-of-turn token yet: close it as the template would.
        env_ids = ([] if c.completion_ids[-1:] == [fmt.eos_id] else [fmt.eos_id]) + fmt.turn_ids(role, obs)
        if len(ids) + len(env_ids) >= limits.max_total_tokens:
            return finish("max_tokens")
        start = len(completion_ids)
        completion_ids += env_ids
        logprobs += [0.0] * len(env_ids)
        mask += [0] * len(env_ids)
        ids += env_ids
        info["turns"].append((start, len(completion_ids), role))
        text += f"\n[{role}] {obs}\n"
    return finish("max_turns")


def _turn_runs(info: dict) -> list[tuple[int, int]]:
    """(version, first completion token) of each earlier assistant turn (each of one version)."""
    turns = [t for t in info["turns"] if t[2] == "assistant"][:-1]  # the current turn is already in `turns`
    return [(v, t[0]) for v, t in zip(info["turn_versions"], turns)]


def final_answer(ep: Episode, tokenizer: Any) -> str:
    """The text an episode answers with: the whole completion for one step, else the last assistant turn
    ("" for an episode that failed: it counts as wrong)."""
    if "turns" not in ep.info:
        return ep.completion
    turns = [t for t in ep.info.get("turns", []) if t[2] == "assistant"]
    if not turns or ep.info.get("outcome") in DROP_OUTCOMES:
        return ""
    start, end, _ = turns[-1]
    return tokenizer.decode(ep.completion_ids[start:end], skip_special_tokens=True)


@dataclass(kw_only=True)
class EnvActorConfig:
    """How to build an `EnvActor`."""

    model_dir: str
    """Checkpoint directory whose tokenizer and chat template format the conversations."""
    max_concurrent: int = 1024
    """Most episodes running at once in this actor (the rest wait for a slot)."""
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    """Default max_turns / max_total_tokens / step_timeout_s (a call may override them)."""
    coalesce_ms: float | None = 1.0
    """Turns requested within this many ms go to the generator in one call (None: one call per turn)."""
    max_batch: int = 256
    """Most prompts in one coalesced `generate` call."""

    def validate(self) -> None:
        if not os.path.isdir(self.model_dir):
            raise ValueError(f"EnvActorConfig.model_dir={self.model_dir!r} is not a directory (need its tokenizer)")
        if isinstance(self.max_concurrent, bool) or not isinstance(self.max_concurrent, int) or self.max_concurrent < 1:
            raise ValueError(f"EnvActorConfig.max_concurrent must be a positive integer, got {self.max_concurrent!r}")
        if self.coalesce_ms is not None and not self.coalesce_ms >= 0:
            raise ValueError(f"EnvActorConfig.coalesce_ms must be >= 0 or None, got {self.coalesce_ms!r}")
        self.limits.validate("EnvActorConfig.limits")
