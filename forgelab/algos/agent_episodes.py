"""Token-exact episodes from an agent's OpenAI-API calls: recording and stitching, as pure functions.

An agent talks to the run's policy through the agent door (`forgelab.serve.openai_api`) one call at a time; each
call of a session is recorded exactly as the generator served it (`Call`: prompt ids, and per choice the completion
ids, sampling logprobs and the policy version of every token). What it really is: one growing list of token ids
per *segment*, as in the native episode loop (`forgelab.envs.episode.run_episode`):

    seg = start_segment(call_1)                       # prompt_ids = call 1's prompt, the choices kept as the tail
    k = extends(seg, call_2.prompt_ids)               # which tail choice call 2's prompt continues (None: none)
    seg = extend_segment(seg, k, call_2, role="tool") # choice k's ids (mask 1), then the new template, tool and user
                                                      # tokens up to call 2's prompt end (mask 0, logprob 0.0)
    ep = segment_episode(seg, choice=0)               # the last call's choice appended: one multi-turn Episode

A call *extends* a segment when its prompt ids start with the segment's ids so far followed by one of the last
call's choices (prompt + completion of that choice): the stored ids are reused, never re-tokenized. A call that
extends nothing (the agent edited its history, or a template re-rendered the past differently) starts a new
segment; the door counts those (``agent/retokenized_segments``). With ``n`` > 1 the later call picks the choice it
continues (the one whose text the agent sent back); choices nobody continued are not part of the episode.

Every function returns new objects and leaves its arguments unchanged (no I/O, no clock, no actor).

    >>> c1 = Call(prompt_ids=[1, 2], choices=[Choice(completion_ids=[5, 9], logprobs=[-0.5, -0.1], version=3)])
    >>> seg = start_segment(c1)
    >>> c2 = Call(prompt_ids=[1, 2, 5, 9, 7, 2], choices=[Choice(completion_ids=[6], logprobs=[-0.2], version=4)])
    >>> extends(seg, c2.prompt_ids), extends(seg, [1, 2, 5, 8])
    (0, None)
    >>> ep = segment_episode(extend_segment(seg, 0, c2, role="user"))
    >>> ep.prompt_ids, ep.completion_ids, ep.loss_mask, ep.generator_logprobs, ep.policy_version
    ([1, 2], [5, 9, 7, 2, 6], [1, 1, 0, 0, 1], [-0.5, -0.1, 0.0, 0.0, -0.2], 3)
    >>> ep.info["token_versions"], ep.info["turns"]
    ([[3, 0], [4, 4]], [(0, 2, 'assistant'), (2, 4, 'user'), (4, 5, 'assistant')])
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from forgelab.types import Completion, Episode

__all__ = ["Call", "Choice", "Segment", "call_of", "extends", "extend_segment", "segment_episode", "start_segment",
           "run_lengths"]


@dataclass(frozen=True, kw_only=True)
class Choice:
    """One sampled completion of a call, as the generator served it."""

    completion_ids: list[int]
    logprobs: list[float]
    """The sampling logprob of each completion token (`forgelab.types.Completion.logprobs`)."""
    version: int
    """The policy version of the first token (the oldest)."""
    token_versions: list[tuple[int, int]] = field(default_factory=list)
    """Run-length ``(version, first token index)`` pairs when a weight update landed mid-completion; empty: all
    `version`."""
    text: str = ""
    finish_reason: str = ""

    def versions(self) -> list[int]:
        """The policy version of every completion token."""
        runs = self.token_versions or [(self.version, 0)]
        out: list[int] = []
        for i, (v, start) in enumerate(runs):
            end = runs[i + 1][1] if i + 1 < len(runs) else len(self.completion_ids)
            out += [v] * (end - start)
        return out


@dataclass(frozen=True, kw_only=True)
class Call:
    """One recorded call: the prompt ids the generator saw and its choices (``n`` of them)."""

    prompt_ids: list[int]
    choices: list[Choice]


def call_of(prompt_ids: Sequence[int], completions: Sequence[Completion]) -> Call:
    """A `Call` from the generator's answer to one prompt (its ``n`` `Completion`s)."""
    return Call(prompt_ids=list(prompt_ids), choices=[
        Choice(completion_ids=list(c.completion_ids), logprobs=[float(x) for x in c.logprobs], version=c.policy_version,
               token_versions=[(int(v), int(s)) for v, s in c.token_versions] if len(c.token_versions) > 1 else [],
               text=c.text, finish_reason=c.finish_reason) for c in completions])


@dataclass(frozen=True, kw_only=True)
class Segment:
    """A multi-turn episode being recorded: the committed tokens and the last call's choices (not yet committed).

    ``completion_ids`` run from the end of the first prompt to the end of the last call's prompt; ``mask`` is 1 on
    generated tokens and 0 on template, tool and user tokens; ``versions`` is each token's policy version (-1 on
    the tokens nobody generated)."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[tuple[int, int, str]] = field(default_factory=list)
    """``(start, end, role)`` over ``completion_ids``: "assistant" for generated turns, else the speaker."""
    tail: list[Choice] = field(default_factory=list)
    """The last call's choices."""
    calls: int = 0

    def ids(self) -> list[int]:
        """The last call's prompt ids (the first prompt and everything committed after it)."""
        return self.prompt_ids + self.completion_ids

    def tokens(self) -> int:
        """Token ids held (what bounds a session's memory)."""
        return len(self.prompt_ids) + len(self.completion_ids) + sum(len(c.completion_ids) for c in self.tail)


def start_segment(call: Call) -> Segment:
    """A new segment whose first prompt is ``call``'s."""
    return Segment(prompt_ids=list(call.prompt_ids), tail=list(call.choices), calls=1)


def extends(segment: Segment, prompt_ids: Sequence[int], prefer: int | None = None) -> int | None:
    """The index of the tail choice that ``prompt_ids`` continues (its ids start with the segment's ids and that
    choice's completion, and go on past them), or None.

    ``prefer``: the choice the caller matched by text (a chat call); it wins when it matches. Otherwise the longest
    matching choice wins (two choices with equal ids are interchangeable)."""
    base = segment.ids()
    if len(prompt_ids) <= len(base) or list(prompt_ids[: len(base)]) != base:
        return None
    rest = list(prompt_ids[len(base):])
    fits = [k for k, c in enumerate(segment.tail)
            if len(rest) > len(c.completion_ids) and rest[: len(c.completion_ids)] == c.completion_ids]
    if prefer is not None and prefer in fits:
        return prefer
    return max(fits, key=lambda k: len(segment.tail[k].completion_ids)) if fits else None


def _commit(segment: Segment, choice: int) -> Segment:
    """``segment`` with tail choice ``choice`` appended as generated tokens (mask 1) and no tail."""
    c = segment.tail[choice]
    start = len(segment.completion_ids)
    return dataclasses.replace(
        segment, completion_ids=segment.completion_ids + c.completion_ids, logprobs=segment.logprobs + c.logprobs,
        mask=segment.mask + [1] * len(c.completion_ids), versions=segment.versions + c.versions(),
        turns=segment.turns + [(start, start + len(c.completion_ids), "assistant")], tail=[])


def extend_segment(segment: Segment, choice: int, call: Call, role: str = "user") -> Segment:
    """``segment`` continued by ``call``, whose prompt extends tail choice ``choice`` (`extends`): that choice's
    tokens are committed as generated, the prompt's remaining tokens (end of turn, the new messages, the next
    assistant header) as ``role``'s (mask 0, logprob 0.0), and ``call``'s choices become the tail."""
    if extends(segment, call.prompt_ids, prefer=choice) != choice:
        raise ValueError(f"extend_segment: the call's prompt ({len(call.prompt_ids)} tokens) does not continue "
                         f"choice {choice} of this segment; start a new segment (start_segment) instead")
    seg = _commit(segment, choice)
    delta = list(call.prompt_ids[len(seg.ids()):])
    start = len(seg.completion_ids)
    return dataclasses.replace(
        seg, completion_ids=seg.completion_ids + delta, logprobs=seg.logprobs + [0.0] * len(delta),
        mask=seg.mask + [0] * len(delta), versions=seg.versions + [-1] * len(delta),
        turns=seg.turns + [(start, start + len(delta), role)], tail=list(call.choices), calls=seg.calls + 1)


def run_lengths(versions: Sequence[int]) -> list[list[int]]:
    """``[version, first index]`` pairs where the version changes, over the generated tokens (-1 entries, the
    tokens nobody generated, continue the run before them).

        >>> run_lengths([3, 3, -1, -1, 4, 4])
        [[3, 0], [4, 4]]
    """
    runs: list[list[int]] = []
    for i, v in enumerate(versions):
        if v >= 0 and (not runs or runs[-1][0] != v):
            runs.append([v, i])
    return runs


def segment_episode(segment: Segment, choice: int = 0) -> Episode:
    """The segment as one multi-turn `Episode` (id and group 0: the caller numbers it), the last call's choice
    ``choice`` appended as the final generated turn.

    ``policy_version`` is the oldest version among its tokens (the staleness bound stays conservative);
    ``info``: ``turns``, ``turn_versions``, ``assistant_turns``, ``calls``, ``outcome`` "done", and
    ``token_versions`` (run-length) when more than one version served it."""
    if not segment.tail:
        raise ValueError("segment_episode: the segment has no call recorded")
    if not 0 <= choice < len(segment.tail):
        raise ValueError(f"segment_episode: choice {choice} is not one of the last call's {len(segment.tail)} choices")
    seg = _commit(segment, choice)
    generated = [v for v in seg.versions if v >= 0]
    runs = run_lengths(seg.versions)
    assistant = [t for t in seg.turns if t[2] == "assistant"]
    info: dict[str, object] = {
        "turns": list(seg.turns), "turn_versions": [seg.versions[s] if e > s else -1 for s, e, _ in assistant],
        "assistant_turns": len(assistant), "calls": seg.calls, "outcome": "done"}
    if len(runs) > 1:
        info["token_versions"] = runs
    last = segment.tail[choice]
    return Episode(id=0, group_id=0, prompt_ids=list(seg.prompt_ids), completion_ids=seg.completion_ids,
                   generator_logprobs=seg.logprobs, policy_version=min(generated) if generated else -1,
                   completion=last.text, finish_reason=last.finish_reason, loss_mask=seg.mask, info=info)
