"""Monarch runtime: components (actors with external placement) and services."""
from forgelab.runtime.component import ActorHandle, Component, Configured, Placement
from forgelab.runtime import supervision

__all__ = ["ActorHandle", "Component", "Configured", "Placement", "supervision"]
