"""What crosses the process boundary to and from a generator and an environment actor, typed.

    req = GenerateRequest(prompts_P=[ids_a, ids_b], n=8, sampling=SamplingConfig(max_tokens=64))
    completions_P_G = await generators.generate(req)        # list[list[Completion]], prompt order
    stats = await generators.engine_stats()                  # list[EngineStats], one per healthy replica
    episodes_P_G = await envs.run_groups(EnvGroupsRequest(env="calculator", tasks_P=problems, n=8, ...))

The generator's endpoints (`forgelab.engines.generator.Generator`) take and answer these objects; the typed
methods of its service (`forgelab.engines.generator_service.GeneratorService`) and of the env actors' service
(`forgelab.envs.env_service.EnvService`) send them through forgelab's own routing (replica choice, retry, health).
Token ids and logprobs travel as Python lists (cheap to pickle); the result of a generate call is
`forgelab.types.Completion` (``completion_ids`` [T], ``logprobs`` [T], ``finish_reason``, ``policy_version``).

Shape letters in names: P prompts (or tasks) in a call, G samples per prompt, T tokens of one completion.

This module imports nothing above `forgelab.types` (the env actors, below the engines, build requests too),
so the sampling settings are typed by the `SamplingSettings` protocol, which
`forgelab.config.components.SamplingConfig` satisfies.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable, Iterator, Mapping, Protocol, Sequence, cast

from forgelab.types import Completion, Episode

if TYPE_CHECKING:
    import torch
    from vllm import SamplingParams

__all__ = ["AdapterUpdate", "CompletionGroups", "EngineStats", "EngineStatus", "EnvGroupsRequest", "EnvStats",
           "EpisodeGroups", "Envs", "GenerateRequest", "GeneratorMesh", "Generators", "ReplicaActor", "Prompt", "SamplingSettings", "WeightUpdate",
           "generate_on"]

Prompt = str | Sequence[int]
"""A prompt: chat-templated text (encoded without extra special tokens) or its token ids."""

CompletionGroups = list[list[Completion]]
"""``completions_P_G``: for each prompt of a request, in order, its ``n`` completions."""

EpisodeGroups = list[list[Episode]]
"""``episodes_P_G``: for each task of a request, in order, its ``n`` episodes."""


class SamplingSettings(Protocol):
    """What a generator reads from a request's sampling settings (`forgelab.config.components.SamplingConfig`)."""

    @property
    def max_tokens(self) -> int: ...

    def validate(self, where: str = "SamplingConfig") -> None: ...

    def to_vllm(self, seed: int | None = None) -> SamplingParams:
        """One sample's `vllm.SamplingParams` (a generator engine calls it; env actors only pass the settings on)."""
        ...


class _ItemAccess:
    """``obj["field"]`` and ``obj.get("field")`` for readers written when these answers were dicts.

    Deprecated (one release): read the attributes. Only fields are reachable, so a typo still raises KeyError."""

    def __getitem__(self, name: str) -> object:
        if name not in self._names():
            raise KeyError(name)
        return cast(object, getattr(self, name))

    def get(self, name: str, default: object = None) -> object:
        return self[name] if name in self._names() else default

    def keys(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def _names(self) -> tuple[str, ...]:
        return tuple(cast("dict[str, object]", getattr(self, "__dataclass_fields__")))


# -- generator --------------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class GenerateRequest:
    """One `generate` call: ``n`` completions of each prompt, sampled with ``sampling``."""

    prompts_P: Sequence[Prompt]
    """The prompts, each chat-templated text or a non-empty list of token ids (ints)."""
    n: int = 1
    """Completions per prompt (G)."""
    sampling: SamplingSettings | None = None
    """Sampling settings; None: the generator config's own (`GeneratorConfig.sampling`)."""
    seeds_P_G: Sequence[Sequence[int]] | None = None
    """One vLLM seed per sample (deterministic runs derive them from the run seed and the episode id); None:
    unseeded sampling."""
    lora_slot: str | None = None
    """Serve the request with this LoRA slot's adapter and version (a `SlotGenerator` engine shared by runs);
    None: the generator's own weights."""
    abort_key: str | None = None
    """A key `Generators.abort` cancels this request's samples by, in the engine (the agent door's calls: a client
    that disconnects mid-generation); None: it cannot be aborted."""

    @classmethod
    def coerce(cls, request: GenerateRequest | Sequence[Prompt], n: int = 1, sampling: SamplingSettings | None = None,
               seeds: Sequence[Sequence[int]] | None = None) -> GenerateRequest:
        """``request`` itself, or a request built from the positional form ``(prompts, n, sampling, seeds)`` that
        endpoints accepted before they were typed (deprecated; kept one release)."""
        if isinstance(request, GenerateRequest):
            return request
        return cls(prompts_P=request, n=n, sampling=sampling, seeds_P_G=seeds)


@dataclass(kw_only=True)
class WeightUpdate:
    """New full weights for a generator: HF-named tensors, served as ``version`` (strictly increasing)."""

    version: int
    weights: Mapping[str, torch.Tensor]
    """HF parameter name -> tensor (the checkpoint's names, shapes and dtypes: `forgelab.weights.receiver`)."""


@dataclass(kw_only=True)
class AdapterUpdate:
    """A LoRA adapter for one slot of a shared generator, served as that slot's ``version``."""

    slot: str
    version: int
    tensors: Mapping[str, torch.Tensor]
    """PEFT-named LoRA tensors (``...lora_A.weight`` [r, in], ``...lora_B.weight`` [out, r])."""


@dataclass(kw_only=True)
class EngineStats(_ItemAccess):
    """A generator engine's cumulative counters (since the process started) and the values derived from them.

    Times are seconds of the engine process (``clock_s`` is its `time.perf_counter` when read: take differences
    of two reads); fractions are in [0, 1]."""

    busy_time_s: float
    """Time inside vLLM's ``engine.step()``."""
    intake_time_s: float
    """Time adding requests (vLLM's input processing)."""
    idle_time_s: float
    """Time with no request unfinished (the current idle period included)."""
    idle_periods: int
    admission_wait_s: float
    """Time waiting for calls still arriving to join a step (`GeneratorConfig.admission_window_ms`)."""
    steps: int
    """Engine steps run."""
    requests: int
    """Requests (samples) finished."""
    aborted_requests: int
    """Requests (samples) aborted before they finished (`Generators.abort`)."""
    tokens_generated: int
    prompt_tokens: int
    cached_prompt_tokens: int
    """Prompt tokens served from the prefix cache."""
    max_concurrent_requests: int
    sum_concurrent_requests: int
    weight_updates: int
    last_update_ms: float
    inflight_updates: int
    """Weight updates loaded while requests ran (``update_mode: inflight``)."""
    requests_spanning_versions: int
    prefix_cache_resets: int
    prefix_cache_resets_deferred: int
    cached_tokens_possibly_stale: int
    drain_wait_s: float
    kv_cache_usage_sum: float
    """Sum over engine steps of the KV-cache usage after the step."""
    kv_cache_usage_max: float
    kv_cache_usage: float
    """The usage after the last step."""
    preemptions: int
    """Requests whose KV blocks vLLM freed because the cache was full (recomputed later)."""
    mean_concurrent_requests: float
    cpu_time_s: float
    """The process's CPU time, all threads."""
    clock_s: float
    gc_pause_s: float
    gc_collections: int
    gc_max_pause_s: float
    prefix_cache_hit_rate: float
    kv_cache_usage_mean: float

    @classmethod
    def from_counters(cls, counters: Mapping[str, float]) -> EngineStats:
        """From the engine's counter dict (`VLLMEngine.stats`); a missing or unknown name raises TypeError."""
        return cls(**counters)  # type: ignore[arg-type]  # mixed int/float values: the names are checked here

    def counters(self) -> dict[str, float]:
        """The fields as a dict (name -> number)."""
        return {k: float(v) for k, v in dataclasses.asdict(self).items()}


@dataclass(kw_only=True)
class EngineStatus(_ItemAccess):
    """What a generator serves right now."""

    version: int
    """The weights version it serves (-1 after `reset_version`, before the next push)."""
    in_flight_requests: int
    update_mode: str
    """"drain" or "inflight" (`GeneratorConfig.update_mode`)."""
    admitting: bool
    """False while a weight update holds new requests back."""
    device: str
    stats: EngineStats


class _EndpointCall(Protocol):
    def call_one(self, *args: object, **kwargs: object) -> Awaitable[object]: ...


class GeneratorMesh(Protocol):
    """A generator replica's actor mesh (Monarch), as an env actor calls it directly."""

    @property
    def generate(self) -> _EndpointCall: ...


async def generate_on(mesh: GeneratorMesh, request: GenerateRequest) -> CompletionGroups:
    """`request` on one generator actor mesh (rank 0), bypassing the service (env actors hold the meshes)."""
    return cast(CompletionGroups, await mesh.generate.call_one(request))


class ReplicaActor(Protocol):
    """A replica's handle as far as the controller reads it: the actor (mesh) inside, passed on to env actors
    and to the trainer's weight push."""

    @property
    def actor(self) -> object: ...


class Generators(Protocol):
    """What the controller calls on the generator replicas (rollouts, the generator meter)."""

    async def generate(self, request: GenerateRequest) -> CompletionGroups:
        """``n`` completions of each prompt, in prompt order, from one replica."""
        ...

    async def engine_stats(self) -> list[EngineStats]:
        """Every healthy replica's engine counters, in replica order."""
        ...

    async def abort(self, abort_key: str) -> list[int]:
        """Abort, in the engines, the unfinished samples of the requests sent with ``abort_key`` (their calls fail);
        how many each healthy replica aborted."""
        ...

    def handles(self) -> Sequence[ReplicaActor | None]:
        """Each replica's handle (None while it is not healthy), in replica order."""
        ...


# -- environment actors -----------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class EnvGroupsRequest:
    """One `run_groups` call: ``n`` episodes of ``env`` per task, played against ``generators``."""

    env: str | Callable[..., object]
    """A name in `forgelab.envs.ENVS` or a factory importable in the env actor's process."""
    tasks_P: Sequence[object]
    """The tasks (problems) handed to each episode's ``env.reset(task)``."""
    n: int
    """Episodes per task (G)."""
    generators: Sequence[GeneratorMesh]
    """The healthy generator replicas' actor meshes (each episode calls one directly, sticky)."""
    sampling: SamplingSettings
    env_kwargs: Mapping[str, object] | None = None
    """Keyword arguments of the env factory (`RolloutConfig.env_kwargs`)."""
    max_turns: int | None = None
    """None: the env actor config's limit (`EnvActorConfig.limits`); likewise the next two."""
    max_total_tokens: int | None = None
    step_timeout_s: float | None = None

    @classmethod
    def coerce(cls, request: EnvGroupsRequest | str | Callable[..., object], tasks: Sequence[object] | None = None,
               n: int | None = None, generators: Sequence[GeneratorMesh] | None = None,
               sampling: SamplingSettings | None = None, env_kwargs: Mapping[str, object] | None = None,
               max_turns: int | None = None, max_total_tokens: int | None = None,
               step_timeout_s: float | None = None) -> EnvGroupsRequest:
        """``request`` itself, or one built from the positional form ``(env, tasks, n, generators, sampling, ...)``
        that `run_groups` accepted before it was typed (deprecated; kept one release)."""
        if isinstance(request, EnvGroupsRequest):
            return request
        if tasks is None or n is None or generators is None or sampling is None:
            raise TypeError("run_groups: pass an EnvGroupsRequest (or env, tasks, n, generators, sampling)")
        return cls(env=request, tasks_P=tasks, n=n, generators=generators, sampling=sampling, env_kwargs=env_kwargs,
                   max_turns=max_turns, max_total_tokens=max_total_tokens, step_timeout_s=step_timeout_s)


@dataclass(kw_only=True)
class EnvStats(_ItemAccess):
    """An env actor's episode counters and its process's resources."""

    episodes: int
    """Episodes finished since the process started."""
    running: int
    """Episodes in flight now (waiting for a slot included)."""
    max_running: int
    outcomes: dict[str, int] = field(default_factory=dict)
    """Outcome -> episodes (`forgelab.envs.episode`: "done", "max_turns", "env_timeout", ...)."""
    max_concurrent: int
    """The actor's episode slots (`EnvActorConfig.max_concurrent`)."""
    cpu_time_s: float
    rss_mib: float
    """Resident memory now (MiB)."""
    peak_rss_mib: float
    gc_pause_s: float
    gc_collections: int
    gc_max_pause_s: float


class Envs(Protocol):
    """What the controller calls on the env actors (`forgelab.envs.env_service.EnvService`, the fakes' `FakeEnvs`)."""

    async def run_groups(self, request: EnvGroupsRequest) -> EpisodeGroups:
        """``request.n`` episodes per task, groups in task order, played by one replica (episode ids 0: the
        caller numbers them)."""
        ...
