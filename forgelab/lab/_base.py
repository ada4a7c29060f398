"""What every lab panel shares: a lazily built widget, display hooks, the run listener and a throttle.

A panel is a view over a `Run`: it reads `run.snapshot()`, `run.metrics`,
`run.rollouts`, `run.events` and `run.status()` and sends commands through the run's public
methods. The widget is built on first use of `.widget` (or on display in a
notebook); only then does the panel listen to the run, so a panel that is
only printed costs nothing while training.
"""
from __future__ import annotations

import asyncio
import html
import logging
import time
import weakref
from typing import Any, Callable

from forgelab.lab.summary import field, text_summary  # noqa: F401 -- field: re-exported for the panels
from forgelab.controller.facade import RunFacade

log = logging.getLogger("forgelab.lab")


def in_notebook() -> bool:
    """True inside a Jupyter kernel (a frontend can render widgets); False in scripts, plain IPython, tests."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def user_namespace() -> dict | None:
    """The notebook's namespace (`get_ipython().user_ns`), or None outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    ip = get_ipython()
    return None if ip is None else ip.user_ns


def esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class DutyBudget:
    """One duty-cycle budget shared by several throttles: together they take at most `max_duty` of the time.

    Each member refreshes at most once per ``sum(recent members' last cost) / max_duty``
    seconds, so with k panels of costs c_i the lab's share of the controller is
    at most ``sum(c_i) / interval = max_duty`` however many panels are on
    screen (a budget per panel would let k panels take k times as much). A member
    that has not refreshed for `active_s` (its output scrolled away, its run
    finished) stops counting.
    """

    def __init__(self, max_duty: float, active_s: float = 120.0):
        self.max_duty = float(max_duty)
        self.active_s = float(active_s)
        self._members: weakref.WeakSet = weakref.WeakSet()

    def add(self, throttle: "Throttle") -> None:
        self._members.add(throttle)

    def cost(self) -> float:
        """The sum of the active members' last refresh cost (seconds)."""
        now = time.monotonic()
        return sum(t.last_cost for t in list(self._members) if now - t.last_run <= self.active_s)


ENDED = ("finished", "stopped", "failed")
"""The run states (and their events) after which nothing changes: panels refresh at once on them."""

LAB_BUDGET = DutyBudget(max_duty=0.015)
"""Every lab view in this process shares it: the lab's refreshes together take at most 1.5 % of the
controller's time (the benchmark's goal is 2 % of a step for everything the lab does)."""


class Throttle:
    """Runs `fn` at most once per `min_interval_s` (and within a duty-cycle budget), later rather than never.

    `poke()` is what a run listener calls after every step or event; it is
    O(1): either `fn` is due and runs now, or one timer is armed on the running
    event loop for the time left (a timer already armed absorbs further pokes).
    No thread, no polling loop. The interval also stretches to
    `last_cost / max_duty`, so a slow redraw can never take more than
    `max_duty` of the controller's time (2% by default); `max_interval_s` optionally caps the stretch.
    With a shared `budget` (`DutyBudget`; the lab's panels use `LAB_BUDGET`) the stretch is
    the sum of every member's last cost over the budget's duty instead: the members together stay
    within it.
    """

    def __init__(self, fn: Callable[[], None], min_interval_s: float = 2.0, max_duty: float = 0.02,
                 max_interval_s: float | None = None, budget: DutyBudget | None = None):
        self.fn = fn
        self.budget = budget
        if budget is not None:
            budget.add(self)
        self.min_interval_s = float(min_interval_s)
        self.max_duty = float(max_duty)
        self.max_interval_s = max_interval_s
        self.last_run = float("-inf")
        self.last_cost = 0.0
        self.calls = 0
        self.total_cost = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._waiters: list[asyncio.Future] = []

    @property
    def interval_s(self) -> float:
        if self.budget is not None:
            stretched = max(self.last_cost, self.budget.cost()) / self.budget.max_duty
        else:
            stretched = self.last_cost / self.max_duty if self.max_duty > 0 else 0.0
        if self.max_interval_s is not None:  # a cap trades the duty-cycle guarantee for liveliness
            stretched = min(self.max_interval_s, stretched)
        return max(self.min_interval_s, stretched)

    def poke(self) -> None:
        if self._timer is not None:
            return
        wait = self.last_run + self.interval_s - time.monotonic()
        loop = running_loop()
        if wait <= 0 or loop is None:
            # Outside an event loop (a direct call from a cell or a test) there is nobody to fire a timer: run now.
            self.run_now()
        else:
            self._timer = loop.call_later(wait, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self.run_now()
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def flush(self) -> None:
        """Run now if a refresh is pending (its timer is cancelled and its waiters are told): the last word on
        something that will not change again (a run that ended) is shown at once, outside the budget, once."""
        if self._timer is not None:
            self._timer.cancel()
            self._fire()

    async def settled(self) -> None:
        """Until no refresh is pending: `await panel.throttle.settled()` lets a cell or a test see the view catch up."""
        while self._timer is not None:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut

    def run_now(self) -> None:
        t0 = time.perf_counter()
        try:
            self.fn()
        except Exception:
            log.exception("forgelab.lab: refresh failed")
        finally:
            cost = time.perf_counter() - t0
            if self.calls:  # the first call builds figures and loads fonts: not what later redraws cost
                self.last_cost = cost
            self.total_cost += cost
            self.calls += 1
            self.last_run = time.monotonic()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for fut in self._waiters:
            fut.cancel()
        self._waiters = []


class View:
    """Shows `.widget` in a notebook and `.summary()` as text elsewhere; `repr()` never raises.

    Subclasses provide `widget` (an ipywidgets object, built on first use) and `summary()`.
    """

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        text = self.__repr__()
        if not in_notebook():
            return {"text/plain": text}
        try:
            bundle = dict(self.widget._repr_mimebundle_(include=include, exclude=exclude, **kwargs) or {})
        except Exception as e:  # never let a view break a cell
            log.warning("forgelab.lab: cannot build widget (%s); showing text", e)
            return {"text/plain": text}
        bundle["text/plain"] = text
        return bundle

    def __repr__(self) -> str:
        try:
            return self.summary()
        except Exception as e:
            return f"<{type(self).__name__}: summary failed: {type(e).__name__}: {e}>"

    __str__ = __repr__


class Panel(View):
    """Base class: `.widget` builds the view once; `repr()` is a text summary that never raises."""

    #: How often the panel may refresh itself from run listener callbacks (seconds).
    min_interval_s: float = 1.0

    def __init__(self, run: RunFacade, *, min_interval_s: float | None = None):
        self.run = run
        self._widget = None
        self._listening = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.throttle = Throttle(self.refresh, self.min_interval_s if min_interval_s is None else min_interval_s,
                                 budget=LAB_BUDGET)

    # -- to implement
    def _build(self):  # -> ipywidgets.Widget
        raise NotImplementedError

    def refresh(self) -> None:
        """Re-read the run and update the widget (no-op before the widget exists)."""

    def summary(self) -> str:
        return text_summary(self.run)

    def _wants(self, msg: dict) -> bool:
        """Whether a listener message (a metrics row or {"event": ev}) should trigger a refresh."""
        return True

    # -- shared machinery
    @property
    def widget(self):
        if self._widget is None:
            self._widget = self._build()
            self.throttle.run_now()  # first fill; errors are logged, never raised into the notebook
            self.listen()
        return self._widget

    def listen(self) -> None:
        if not self._listening and hasattr(self.run, "add_listener"):
            self.run.add_listener(self._on_run)
            self._listening = True

    def _on_run(self, msg: dict) -> None:
        # Called by the run inside its training step: remember the loop, mark dirty, return fast.
        self._loop = running_loop() or self._loop
        if self._widget is not None and self._wants(msg):
            self.throttle.poke()
            ev = msg.get("event")
            if ev is not None and ev.get("kind") in ENDED:
                # the run's end is its last change: a refresh the budget has put off (up to a minute when a
                # redraw is slow) happens now, so no panel shows a finished run as running
                self.throttle.flush()

    def schedule(self, coro) -> asyncio.Future:
        """Run a run coroutine (set_loss, stop, save_checkpoint) on the run's loop without blocking the caller."""
        loop = running_loop()
        if loop is not None:
            return asyncio.ensure_future(coro)
        loop = self._loop
        if loop is not None and loop.is_running():  # called from another thread than the run's loop
            return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop), loop=loop)
        if loop is None:
            try:
                loop = asyncio.get_event_loop_policy().get_event_loop()
            except RuntimeError:
                loop = None
        if loop is None or loop.is_closed():
            coro.close()
            raise RuntimeError("no event loop to run this on; call the run's coroutine yourself with await")
        # The run's loop is not running right now (a script between awaits): the task runs when it next is.
        return loop.create_task(coro)

    def close(self) -> None:
        """Stop listening to the run and close the widget."""
        self.throttle.cancel()
        if self._listening:
            self.run.remove_listener(self._on_run)
            self._listening = False
        if self._widget is not None:
            self._widget.close()
            self._widget = None


class Composite(Panel):
    """A view made of panels (`panels`): each listens for itself, closing it closes them all, and its text
    summary is the run's."""

    @property
    def panels(self) -> list[Panel]:
        raise NotImplementedError

    def listen(self) -> None:  # the panels listen for themselves
        pass

    def close(self) -> None:
        for p in self.panels:
            p.close()
        super().close()

    def summary(self) -> str:
        return text_summary(self.run)
