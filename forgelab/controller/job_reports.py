"""What a run's hosts job reports while it runs, made the run's own: a lost worker, the time limit near.

    reports = JobReports.attach(parts.job, lifecycle, bus, parts_on=parts_on_meshes(cfg.hosts),
                                stop=run.stop, save=run.save_checkpoint)   # None: the job reports nothing

A job that reports (`forgelab.runtime.slurm.ForgelabSlurmJob.add_listener`) calls back from a thread of its own
with one of two notices, which `JobReports` handles on the run's event loop:

- `LostWorker` (srun's report: mesh, host, task, reason). The event ``worker_lost`` and the run's message name
  the host, the run's parts on that worker's mesh and the reason; if the run then fails, its error message (and
  the exception's notes) carry it too (`failure_note`). What happens to the run is the usual: a service
  replica's calls fail over, or the run fails with Monarch's error.
- `TimeLimitNear` (Slurm's ``--signal`` before the job's time limit). The event ``time_limit``; the run stops
  after the current step, writes a checkpoint, and its message says where and how to resume (event
  ``time_limit_checkpoint``). A time limit is then a clean stop, not a crash: ``forgelab run CONFIG --resume
  latest`` (or ``python -m forgelab.runtime.slurm submit CONFIG --resume``) continues from that step.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

from forgelab.controller.events import Emitter
from forgelab.controller.lifecycle import Lifecycle
from forgelab.runtime.slurm_spec import LostWorker, TimeLimitNear

log = logging.getLogger("forgelab.run")

__all__ = ["JobReports", "ReportingJob", "parts_on_meshes"]

RESUME_HINT = ("resume with `forgelab run CONFIG --resume latest` (a batch job: `python -m forgelab.runtime.slurm "
               "submit CONFIG --resume`)")


@runtime_checkable
class ReportingJob(Protocol):
    """A hosts job that reports lost workers and its time limit (`ForgelabSlurmJob`)."""

    def add_listener(self, fn: Callable[[object], None]) -> None: ...


def parts_on_meshes(hosts: object) -> dict[str, list[str]]:
    """Host mesh name -> the run's parts placed on it, from the config's `hosts` (a `HostsConfig`)."""
    out: dict[str, list[str]] = {}
    for part in ("generator", "trainer", "reference", "envs"):
        mesh = getattr(hosts, part, None)
        if mesh is not None:
            out.setdefault(str(mesh), []).append(part)
    return out


class JobReports:
    """The run's side of its job's notices (see the module docstring).

    Args:
        lifecycle: the run's `Lifecycle` (its message; its state says whether the run still trains).
        bus: the run's event bus (``worker_lost``, ``time_limit``, ``time_limit_checkpoint``).
        parts_on: mesh name -> the run's parts on it (`parts_on_meshes`).
        stop: stops the run after the current step (`Run.stop`).
        save: writes a checkpoint and returns its directory (`Run.save_checkpoint`).
        loop: the run's event loop (notices arrive from the job's thread).
    """

    def __init__(self, lifecycle: Lifecycle, bus: Emitter, *, parts_on: Mapping[str, list[str]],
                 stop: Callable[[], Awaitable[None]], save: Callable[[], Awaitable[Path]],
                 loop: asyncio.AbstractEventLoop) -> None:
        self.lifecycle, self.bus, self.parts_on = lifecycle, bus, dict(parts_on)
        self._stop, self._save, self._loop = stop, save, loop
        self.lost: list[LostWorker] = []
        self.time_limit: TimeLimitNear | None = None
        self.checkpoint: Path | None = None
        """The checkpoint written before the time limit."""
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def attach(cls, job: object, lifecycle: Lifecycle, bus: Emitter, *, parts_on: Mapping[str, list[str]],
               stop: Callable[[], Awaitable[None]], save: Callable[[], Awaitable[Path]]) -> "JobReports | None":
        """Listen to `job` if it reports (has `add_listener`); None otherwise (a local or ssh job)."""
        if not isinstance(job, ReportingJob):
            return None
        reports = cls(lifecycle, bus, parts_on=parts_on, stop=stop, save=save, loop=asyncio.get_running_loop())
        job.add_listener(reports.hear)
        return reports

    def hear(self, notice: object) -> None:
        """A notice from the job's thread: handled on the run's loop (dropped once that loop has closed: the run
        is over)."""
        try:
            self._loop.call_soon_threadsafe(self.handle, notice)
        except RuntimeError:  # "Event loop is closed"
            log.info("forgelab: the run's loop has closed; job notice dropped: %s", notice)

    def handle(self, notice: object) -> None:
        if isinstance(notice, LostWorker):
            self._lost(notice)
        elif isinstance(notice, TimeLimitNear):
            self._time_limit(notice)

    def describe(self, worker: LostWorker) -> str:
        """The lost worker in words: the parts on it, then srun's report (host, mesh, task, reason)."""
        parts = self.parts_on.get(worker.mesh)
        who = f"the {' and '.join(parts)}'s" if parts else "a"
        return f"{who} worker was lost: {worker}"

    def failure_note(self) -> str:
        """What to add to the run's error when it fails after losing workers ("" when none was lost)."""
        return "".join(f"; {self.describe(w)}" for w in self.lost)

    async def settled(self) -> None:
        """Until the checkpoint before the time limit (if one is being written) is done: shutting the parts down
        waits for it."""
        if self._task is not None:
            await asyncio.shield(self._task)

    def _lost(self, worker: LostWorker) -> None:
        if worker in self.lost:
            return
        self.lost.append(worker)
        text = self.describe(worker)
        self.bus.emit("worker_lost", host=worker.host, parts=self.parts_on.get(worker.mesh, []), mesh=worker.mesh,
                      index=worker.index, task=worker.task, reason=worker.reason, job_id=worker.job_id, message=text)
        self.lifecycle.note(text)

    def _time_limit(self, notice: TimeLimitNear) -> None:
        if self.time_limit is not None:
            return
        self.time_limit = notice
        self.bus.emit("time_limit", job_id=notice.job_id, lead_s=notice.lead_s, message=str(notice))
        if self.lifecycle.state not in ("running", "paused"):
            self.lifecycle.note(f"{notice}; the run is {self.lifecycle.state}: no checkpoint taken")
            return
        self._task = self._loop.create_task(self._checkpoint_and_stop(notice))

    async def _checkpoint_and_stop(self, notice: TimeLimitNear) -> None:
        self.lifecycle.note(f"{notice}: stopping after the current step to write a checkpoint")
        await self._stop()
        if self.lifecycle.state != "stopped":  # it finished or failed meanwhile: nothing to resume
            return
        try:
            path = await self._save()
        except Exception as err:  # noqa: BLE001 -- said in the message; the run has stopped either way
            text = f"stopped before the time limit ({notice}), but its checkpoint failed: {type(err).__name__}: {err}"
            log.exception("forgelab: %s", text)
            self.lifecycle.note(text)
            self.bus.emit("time_limit_checkpoint", path=None, message=text)
            return
        self.checkpoint = path
        text = f"stopped before the time limit ({notice}); checkpoint {path}; {RESUME_HINT}"
        self.lifecycle.note(text)
        self.bus.emit("time_limit_checkpoint", path=str(path), message=text)
