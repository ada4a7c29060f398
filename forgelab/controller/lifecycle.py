"""A run's lifecycle: its state, the message saying why, and the `Gate` its loops wait on.

    life = Lifecycle(bus)
    life.state                      # created, starting, running, paused, stopped, finished, failed
    life.pause("too many skipped steps")   # finish the current step, then hold rollouts and training
    life.resume()

`Lifecycle` is the one writer of ``state`` and ``message``; the training loop and the rollouts receive it to
pause the run (a loss that keeps failing, a reward that hangs) and to read the gate.
"""
from __future__ import annotations

import logging
from forgelab.controller.events import Emitter
from forgelab.controller.rollout import Gate

log = logging.getLogger("forgelab.run")

__all__ = ["Lifecycle", "STATES"]

STATES = ("created", "starting", "running", "paused", "stopped", "finished", "failed")


class Lifecycle:
    """The run's state machine (see `STATES`) and its gate.

    Args:
        bus: the run's `forgelab.controller.events.EventBus` (``paused`` / ``resumed`` events).
    """

    def __init__(self, bus: Emitter) -> None:
        self.bus = bus
        self.state = "created"
        self.message = ""
        self.gate = Gate()

    def renew_gate(self) -> Gate:
        """A fresh gate: asyncio primitives belong to the event loop that starts the run."""
        self.gate = Gate()
        return self.gate

    def set(self, state: str, message: str | None = None) -> None:
        """Move to `state` (one of `STATES`), with `message` when given."""
        if state not in STATES:
            raise ValueError(f"run state {state!r}: expected one of {', '.join(STATES)}")
        self.state = state
        if message is not None:
            self.message = message

    def note(self, message: str) -> None:
        """Say something about the run in its message without changing its state (a lost worker, a checkpoint
        before the time limit); logged as a warning."""
        self.message = message
        log.warning("forgelab: %s", message)

    def pause(self, message: str | None = None) -> None:
        """Finish the current step, then hold rollouts and training (`message` says why, for people)."""
        if self.state == "running":
            if message is not None:
                self.message = message
                log.warning("forgelab: %s", message)
            self.gate.unpaused.clear()
            self.state = "paused"
            self.bus.emit("paused", message=self.message)

    def resume(self) -> bool:
        """Resume a paused run; False if it was not paused."""
        if self.state != "paused":
            return False
        self.message, self.state = "", "running"
        self.gate.unpaused.set()
        self.bus.emit("resumed")
        return True
