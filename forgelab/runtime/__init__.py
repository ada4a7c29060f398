"""Monarch runtime: components (actors with external placement) and services.

The names load lazily: `forgelab.runtime.liveness` and `forgelab.runtime.watchdog` (which the controller imports
early) do not pull Monarch in; `Component`, `Service` and the rest import it on first use."""
from typing import TYPE_CHECKING

from forgelab.lazy import lazy_exports

if TYPE_CHECKING:
    from forgelab.runtime import supervision
    from forgelab.runtime.component import ActorHandle, Component, ComponentStartError, Configured, Placement
    from forgelab.runtime.placement import job_from_config
    from forgelab.runtime.service import (
        NoHealthyReplicaError,
        ReplicaFailedError,
        ReplicaStatus,
        Service,
        ServiceEvent,
        Session,
    )

__all__ = [
    "ActorHandle",
    "Component",
    "ComponentStartError",
    "Configured",
    "NoHealthyReplicaError",
    "Placement",
    "ReplicaFailedError",
    "ReplicaStatus",
    "Service",
    "ServiceEvent",
    "Session",
    "job_from_config",
    "supervision",
]

_where = {name: "forgelab.runtime.component" for name in
          ("ActorHandle", "Component", "ComponentStartError", "Configured", "Placement")}
_where.update({name: "forgelab.runtime.service" for name in
               ("NoHealthyReplicaError", "ReplicaFailedError", "ReplicaStatus", "Service", "ServiceEvent", "Session")})
_where["job_from_config"] = "forgelab.runtime.placement"
__getattr__, __dir__ = lazy_exports(__name__, _where)

