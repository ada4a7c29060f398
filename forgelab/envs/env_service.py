"""The env actor replicas behind one handle, called through typed methods.

    envs = await EnvActor.options(num_replicas=2).as_service(EnvActorConfig(model_dir=...))   # an EnvService
    gens = [h.actor for h in generators.handles() if h is not None]
    episodes_P_G = await envs.run_groups(EnvGroupsRequest(env="calculator", tasks_P=problems, n=8,
                                                          generators=gens, sampling=sampling))
    stats = await envs.env_stats()                        # list[EnvStats], one per healthy replica

`EnvService` is a `forgelab.runtime.service.Service` (replica choice, health, respawn) whose methods name the
env actor's endpoints with typed requests and answers (`forgelab.generation`). `Envs` (`forgelab.generation`, re-exported here) is the
protocol the controller depends on (`forgelab.controller.rollout.EnvEpisodes`); `forgelab.testing.fakes.FakeEnvs`
satisfies it too.
"""
from __future__ import annotations

from forgelab.generation import EnvGroupsRequest, Envs, EnvStats, EpisodeGroups
from forgelab.runtime.service import Endpoint, Service

__all__ = ["ENV_STATS", "EnvService", "Envs", "RUN_GROUPS"]

RUN_GROUPS: Endpoint[EnvGroupsRequest, EpisodeGroups] = Endpoint("run_groups")
ENV_STATS: Endpoint[None, EnvStats] = Endpoint("stats")


class EnvService(Service):
    """`Service` over `EnvActor` replicas with the env actor's endpoints as typed methods."""

    async def run_groups(self, request: EnvGroupsRequest) -> EpisodeGroups:
        return await self.call(RUN_GROUPS, request)

    async def env_stats(self) -> list[EnvStats]:
        """Every healthy replica's episode counters and resources, in replica order."""
        return await self.call_each(ENV_STATS, None)
