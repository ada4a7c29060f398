"""`EnvActor`: many multi-turn episodes as asyncio tasks inside one process.

    envs = await EnvActor.options(num_replicas=2).as_service(EnvActorConfig(model_dir=...))   # an EnvService
    gens = [h.actor for h in generators.handles() if h is not None]
    groups_P_G = await envs.run_groups(EnvGroupsRequest(env="calculator", tasks_P=problems, n=8, generators=gens,
                                                        sampling=sampling))

`run_groups` takes an `EnvGroupsRequest` and `stats` answers `EnvStats` (`forgelab.generation`); the positional
form ``run_groups(env, tasks, n, generators, sampling, ...)`` is still accepted for one release.

Where generation goes: the caller passes the generator replicas' actor
meshes, and each episode calls `generate` on one of them directly (picked
least-loaded when the episode starts, then sticky, so every turn of a
conversation lands on the replica that holds its earlier KV in the prefix
cache). Turns that episodes request within `coalesce_ms` of each other travel
in one `generate` call (a Monarch message per turn costs more CPU than a tiny
model's decode step); calls are not serialised, and the generator's
continuous batching merges every call in flight, so while some environments
think, other episodes' turns keep the batch full. No request passes through
the controller, which stays free to train. (Routing through the controller
would add a hop per turn and put thousands of small messages on the training
process's event loop.)

An episode holds one slot of `max_concurrent` (a semaphore shared by every
call to this actor) from its reset to its end. Environment steps run on this
process's event loop and time out after `step_timeout_s` (outcome
`env_timeout`). A generator replica that dies mid-episode fails that episode
(`generator_error`); the next call is given the service's current replicas.

`run_groups` answers through an explicit response port: Monarch hands an actor
one call at a time, and an endpoint that awaited its episodes would block the
next caller until they all finished.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import time
from typing import Any, Awaitable, Callable, Sequence

from monarch.actor import Port, endpoint

from forgelab.envs.episode import EnvActorConfig  # noqa: F401 -- re-exported
from forgelab.envs.registry import make_env
from forgelab.envs.episode import ChatFormat, EpisodeLimits, run_episode
from forgelab.envs.env_service import EnvService
from forgelab.generation import EnvGroupsRequest, EnvStats, GenerateRequest, GeneratorMesh, SamplingSettings, generate_on
from forgelab.runtime import liveness
from forgelab.runtime.component import Component, answer_in_task
from forgelab.runtime.gc_timer import freeze_startup_objects, gc_stats
from forgelab.types import Episode

__all__ = ["EnvActor", "EnvActorConfig", "run_groups_local"]


def _sampling_key(sampling: Any) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in vars(sampling).items()))


class _Coalescer:
    """Merges the turns that episodes request at about the same time into one `generate` call.

    One Monarch message per turn per episode costs more CPU than a tiny model's
    decode step, so turns arriving within `window_s` of each other (or in the
    same event-loop pass, with window 0) travel together, up to `max_batch`
    prompts per call. Calls are not serialised: while one batch is generating,
    the next is sent, and the generator's continuous batching merges them.
    """

    def __init__(self, mesh: GeneratorMesh, window_s: float, max_batch: int):
        self.mesh, self.window_s, self.max_batch = mesh, window_s, max_batch
        self.queue: list[tuple[list[int], Any, asyncio.Future]] = []
        self.flusher: asyncio.Task | None = None
        self.calls: set[asyncio.Task] = set()

    async def generate(self, ids: list[int], sampling: Any) -> Any:
        fut = asyncio.get_running_loop().create_future()
        self.queue.append((ids, sampling, fut))
        if self.flusher is None or self.flusher.done():
            self.flusher = asyncio.ensure_future(self._flush())
        return await fut

    async def _flush(self) -> None:
        await asyncio.sleep(self.window_s)  # let the other episodes of this wave queue their turns
        by_key: dict[tuple, list] = {}
        for item in self.queue:
            by_key.setdefault(_sampling_key(item[1]), []).append(item)
        self.queue = []
        for items in by_key.values():
            for i in range(0, len(items), self.max_batch):
                task = asyncio.ensure_future(self._call(items[i:i + self.max_batch]))
                self.calls.add(task)
                task.add_done_callback(self.calls.discard)

    async def _call(self, items: list) -> None:
        try:
            groups = await generate_on(self.mesh, GenerateRequest(prompts_P=[ids for ids, _, _ in items], n=1,
                                                                  sampling=items[0][1]))
        except Exception as e:
            for _, _, fut in items:
                if not fut.done():
                    fut.set_exception(e)
            return
        for (_, _, fut), g in zip(items, groups):
            if not fut.done():
                fut.set_result(g[0])


class _Generators:
    """Least-loaded choice among generator actor meshes, counting this process's episodes on each.

    `coalesce_ms=None` sends one `generate` call per turn; otherwise turns are
    merged per replica by a `_Coalescer`.
    """

    def __init__(self, meshes: Sequence[GeneratorMesh], coalesce_ms: float | None = None, max_batch: int = 256):
        if not meshes:
            raise ValueError("run_groups: no generator given; pass the healthy generator replicas' actor meshes")
        self.meshes = list(meshes)
        self.in_flight = [0] * len(self.meshes)
        self._rr = itertools.count()
        self.coalescers = (None if coalesce_ms is None
                           else [_Coalescer(m, coalesce_ms / 1e3, max_batch) for m in self.meshes])

    def pick(self) -> int:
        start = next(self._rr)
        n = len(self.meshes)
        return min(((start + k) % n for k in range(n)), key=lambda i: self.in_flight[i])

    def bind(self, index: int) -> Callable[[list[int], Any], Awaitable[Any]]:
        mesh = self.meshes[index]
        co = None if self.coalescers is None else self.coalescers[index]

        async def generate(ids: list[int], sampling: Any):
            self.in_flight[index] += 1
            try:
                if co is not None:
                    out = await co.generate(ids, sampling)
                else:
                    out = (await generate_on(mesh, GenerateRequest(prompts_P=[ids], n=1, sampling=sampling)))[0][0]
                liveness.bump("env_turns")  # progress the watchdog sees (forgelab.runtime.watchdog)
                return out
            finally:
                self.in_flight[index] -= 1

        return generate


async def run_groups_local(
    env: str | Callable[..., Any],
    tasks: Sequence[Any],
    n: int,
    generate_for: Callable[[], Callable[[list[int], Any], Awaitable[Any]]],
    fmt: ChatFormat,
    sampling: Any,
    limits: EpisodeLimits,
    semaphore: asyncio.Semaphore,
    env_kwargs: dict | None = None,
) -> list[list[Episode]]:
    """`n` episodes per task (groups in task order), each in its own asyncio task, at most
    `semaphore` at once. `generate_for()` gives each episode its (sticky) generate function."""

    async def one(task: Any) -> Episode:
        async with semaphore:
            t0 = time.perf_counter()
            try:
                e = make_env(env, env_kwargs)
            except Exception as err:
                ep = Episode(id=0, group_id=0, prompt_ids=[], completion_ids=[], generator_logprobs=[],
                             policy_version=-1, finish_reason="env_error", loss_mask=[],
                             info={"outcome": "env_error", "error": f"{type(err).__name__}: {err}", "turns": []})
            else:
                ep = await run_episode(e, task, generate_for(), fmt, sampling, limits)
            ep.info["latency_s"] = time.perf_counter() - t0
            liveness.bump("env_episodes")
            return ep

    flat = await asyncio.gather(*(one(t) for t in tasks for _ in range(n)))
    return [list(flat[i * n:(i + 1) * n]) for i in range(len(tasks))]


class EnvActor(Component):
    """Runs episodes of any environment against the generator. Endpoints: run_groups, stats (typed methods of
    its service: `EnvService`)."""

    SERVICE = EnvService

    def __init__(self, config: EnvActorConfig):
        config.validate()
        self.config = config
        self.fmt: ChatFormat | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._stats = {"episodes": 0, "running": 0, "max_running": 0}
        self._outcomes: dict[str, int] = {}

    @endpoint
    async def setup(self) -> None:
        from transformers import AutoTokenizer

        self.fmt = ChatFormat(AutoTokenizer.from_pretrained(self.config.model_dir))
        self._semaphore = asyncio.Semaphore(self.config.max_concurrent)
        freeze_startup_objects()  # the tokenizer's and libraries' objects: never scanned by later collections
        gc_stats()  # start timing garbage-collection pauses

    async def _run(self, req: EnvGroupsRequest) -> list[list[Episode]]:
        if self.fmt is None or self._semaphore is None:
            raise RuntimeError("EnvActor.setup() has not run; spawn it with EnvActor.options(...).as_service(config)")
        n = req.n
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"run_groups: n (episodes per task) must be a positive integer, got {n!r}")
        d = self.config.limits
        limits = EpisodeLimits(
            max_turns=d.max_turns if req.max_turns is None else req.max_turns,
            max_total_tokens=d.max_total_tokens if req.max_total_tokens is None else req.max_total_tokens,
            step_timeout_s=d.step_timeout_s if req.step_timeout_s is None else req.step_timeout_s,
        )
        limits.validate("run_groups limits")
        gens = _Generators(req.generators, self.config.coalesce_ms, self.config.max_batch)
        total = len(req.tasks_P) * n
        s = self._stats
        s["running"] += total
        s["max_running"] = max(s["max_running"], s["running"])
        try:
            groups = await run_groups_local(req.env, req.tasks_P, n, lambda: gens.bind(gens.pick()), self.fmt,
                                            req.sampling, limits, self._semaphore,
                                            None if req.env_kwargs is None else dict(req.env_kwargs))
        finally:
            s["running"] -= total
        s["episodes"] += total
        for g in groups:
            for ep in g:
                o = ep.info.get("outcome", "")
                self._outcomes[o] = self._outcomes.get(o, 0) + 1
        return groups

    @endpoint(explicit_response_port=True)
    async def run_groups(
        self, port: Port, request: EnvGroupsRequest | str | Callable[..., Any], tasks: Sequence[Any] | None = None,
        n: int | None = None, generators: Sequence[Any] | None = None, sampling: SamplingSettings | None = None,
        env_kwargs: dict | None = None, max_turns: int | None = None, max_total_tokens: int | None = None,
        step_timeout_s: float | None = None,
    ) -> None:
        """`EpisodeGroups` (list[list[Episode]]): ``request.n`` episodes of ``request.env`` per task (ids 0: the
        caller numbers them). The other arguments: the positional form (``request`` then is the env), deprecated."""
        req = EnvGroupsRequest.coerce(request, tasks, n, generators, sampling, env_kwargs, max_turns,
                                      max_total_tokens, step_timeout_s)
        answer_in_task(port, lambda: self._run(req), "EnvActor.run_groups")

    @endpoint
    async def stats(self) -> EnvStats:
        """Episodes finished, running now, most running at once, outcome counts, CPU time and this process's
        resident memory now and at its peak (MiB)."""
        import resource

        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        try:
            with open("/proc/self/statm") as f:  # resident pages are the second field
                rss_mib = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        except OSError:  # not Linux
            rss_mib = peak_mib
        gc = gc_stats()
        return EnvStats(episodes=self._stats["episodes"], running=self._stats["running"],
                        max_running=self._stats["max_running"], outcomes=dict(self._outcomes),
                        max_concurrent=self.config.max_concurrent, cpu_time_s=time.process_time(), rss_mib=rss_mib,
                        peak_rss_mib=peak_mib, gc_pause_s=gc["gc_pause_s"], gc_collections=int(gc["gc_collections"]),
                        gc_max_pause_s=gc["gc_max_pause_s"])
