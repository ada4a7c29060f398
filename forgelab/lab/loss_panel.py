"""Hot-swap the loss from a dropdown: the registry's losses plus functions registered from a cell.

"apply" schedules `run.set_loss(...)` on the run's event loop (the kernel's
loop in Jupyter) and returns at once; the run dry-runs the loss on the last
batch and either refuses it (shown as "refused: <reason>", nothing changes)
or applies it at the next step boundary (shown as "applies at step N").
"""
from __future__ import annotations

import ast
import asyncio
from typing import Any, Callable

from forgelab.algos import LOSSES
from forgelab.algos.loss_checks import LossError, check_loss_kwargs
from forgelab.lab._base import Panel, esc
from forgelab.lab.summary import loss_name_of, state_line
from forgelab.controller.facade import RunFacade


def parse_kwargs(text: str) -> dict[str, Any]:
    """'eps_high=0.28, beta=0.0' -> {'eps_high': 0.28, 'beta': 0.0} (values are Python literals)."""
    text = (text or "").strip()
    if not text:
        return {}
    call = ast.parse(f"f({text})", mode="eval").body
    if not isinstance(call, ast.Call) or call.args:
        raise ValueError(f"loss kwargs must look like 'name=value, ...', got {text!r}")
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}


class LossPanel(Panel):
    """Dropdown of losses (registry + `register(fn)`), kwargs field, apply button, current loss and outcome."""

    min_interval_s = 0.5

    def __init__(self, run: RunFacade, *, min_interval_s: float | None = None):
        super().__init__(run, min_interval_s=min_interval_s)
        self.user_losses: dict[str, Callable] = {}
        self.pending: asyncio.Future | None = None
        """The last scheduled swap (await it, or check `.done()`)."""
        self.outcome: dict | None = None
        """The last swap's result: {"ok": True, "loss", "applies_at_step"} or {"ok": False, "reason"}."""

    def _options(self) -> list[tuple[str, Any]]:
        return [(name, name) for name in LOSSES] + [(f"{name} (yours)", fn) for name, fn in self.user_losses.items()]

    def _build(self):
        import ipywidgets as W

        self.choice = W.Dropdown(options=self._options(), description="loss", layout=W.Layout(width="230px"),
                                 style={"description_width": "36px"})
        self.kwargs = W.Text(placeholder="kwargs, e.g. eps_high=0.28", layout=W.Layout(width="220px"))
        self.apply_button = W.Button(description="apply", icon="exchange", button_style="warning",
                                     layout=W.Layout(width="90px"))
        self.apply_button.on_click(lambda _: self.apply())
        self.current = W.HTML()
        self.message = W.HTML()
        title = W.HTML("<b>Loss</b> <span style='color:#777'>(dry-run on the last batch, applies at the next step)</span>")
        return W.VBox([title, self.current, W.HBox([self.choice, self.kwargs, self.apply_button]), self.message])

    def _wants(self, msg: dict) -> bool:
        ev = msg.get("event")
        return ev is not None and ev.get("kind") in ("loss_swapped", "loss_refused", "resumed_from_checkpoint")

    def refresh(self) -> None:
        if self._widget is None:
            return
        self.current.value = f"current loss: <b>{esc(loss_name_of(self.run.snapshot().loss))}</b>"

    def register(self, fn: Callable, name: str | None = None) -> None:
        """Offer a loss function defined in a cell (signature of `forgelab.algos.LOSSES` entries) in the dropdown."""
        if not callable(fn):
            raise TypeError(f"register expects a loss function, got {fn!r}")
        name = name or getattr(fn, "__name__", "custom")
        self.user_losses[name] = fn
        if self._widget is not None:
            self.choice.options = self._options()
            self.choice.value = fn

    def apply(self, loss: str | Callable | None = None, **loss_kwargs: Any) -> asyncio.Future | None:
        """Schedule `run.set_loss(loss or the selected one, **kwargs)`; returns the future (also `self.pending`)."""
        _ = self.widget
        loss = self.choice.value if loss is None else loss
        if loss is None:
            self._refuse("choose a loss first")
            return None
        try:
            kwargs = {**parse_kwargs(self.kwargs.value), **loss_kwargs}
        except Exception as e:
            self._refuse(f"kwargs not understood: {e}")
            return None
        try:  # a misspelt hyperparameter is refused here, before the dry run
            check_loss_kwargs(loss, kwargs)
        except LossError as e:
            self._refuse(str(e))
            return None
        self.message.value = f"<span style='color:#777'>dry-running {esc(loss_name_of(loss))} on the last batch…</span>"
        try:
            self.pending = self.schedule(self._apply(loss, kwargs))
        except Exception as e:
            self._refuse(f"{type(e).__name__}: {e}")
            return None
        return self.pending

    async def apply_async(self, loss: str | Callable | None = None, **loss_kwargs: Any) -> dict:
        """Like `apply` but awaited: returns `self.outcome`."""
        _ = self.widget
        return await self._apply(self.choice.value if loss is None else loss, loss_kwargs)

    async def _apply(self, loss, kwargs) -> dict:
        try:
            res = await self.run.set_loss(loss, **kwargs)
        except Exception as e:
            self._refuse(str(e))
        else:
            res = res or {}
            self.outcome = {"ok": True, **res}
            self._show(True, f"{esc(res.get('loss', loss_name_of(loss)))} applies at step {res.get('applies_at_step', '?')}")
        self.refresh()
        return self.outcome

    def _refuse(self, reason: str) -> None:
        self.outcome = {"ok": False, "reason": reason}
        self._show(False, esc(reason))

    def _show(self, ok: bool, text: str) -> None:
        if ok:
            self.message.value = f"<span style='color:#1b7a1b'>✓ {text}</span>"
        else:
            self.message.value = (f"<pre style='color:#b00020;background:#fff4f4;padding:6px;white-space:pre-wrap'>"
                                  f"refused: {text}</pre>")

    def summary(self) -> str:
        known = ", ".join(list(LOSSES) + list(self.user_losses))
        return f"LossPanel: {state_line(self.run).splitlines()[0]}\nlosses: {known}"
