"""Monarch runtime: components (actors with external placement) and services."""
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
