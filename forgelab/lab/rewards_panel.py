"""Reward weights as sliders, and registering a reward function written in a notebook cell.

Every change goes through the run: `run.set_reward_weights` (checked, recorded
as a `reward_weights` event) and `run.add_reward` (validated on recent
rollouts first; refused with a report, and the old rewards stay). Errors are
shown in the panel, never raised into the notebook.
"""
from __future__ import annotations

from typing import Any, Callable

from forgelab.lab._base import Panel, esc, user_namespace
from forgelab.lab.summary import rewards_line, state_line
from forgelab.controller.facade import RunFacade


class RewardPanel(Panel):
    """One `FloatSlider` per reward weight, plus `register(name, fn, weight)` and a by-name form."""

    min_interval_s = 0.5

    def __init__(self, run: RunFacade, *, user_ns: dict | None = None, min_interval_s: float | None = None):
        super().__init__(run, min_interval_s=min_interval_s)
        self.user_ns = user_ns
        self.sliders: dict[str, Any] = {}
        self._syncing = False
        self.last_error: str | None = None
        """The text of the last refused change (None after a success)."""

    def _build(self):
        import ipywidgets as W

        self.box = W.VBox()
        self.message = W.HTML()
        self.fn_name = W.Text(placeholder="function name in the notebook", description="function",
                              layout=W.Layout(width="290px"), style={"description_width": "60px"})
        self.reward_name = W.Text(placeholder="(default: function name)", description="as",
                                  layout=W.Layout(width="230px"), style={"description_width": "24px"})
        self.new_weight = W.FloatText(value=1.0, description="weight", layout=W.Layout(width="140px"),
                                      style={"description_width": "46px"})
        self.add_button = W.Button(description="validate & add", icon="plus", button_style="info",
                                   layout=W.Layout(width="140px"))
        self.add_button.on_click(lambda _: self.register_by_name(self.fn_name.value, self.reward_name.value or None,
                                                                 self.new_weight.value))
        self.preview_button = W.Button(description="preview on recent rollouts", icon="eye",
                                       layout=W.Layout(width="200px"))
        self.preview_button.on_click(lambda _: self.preview_by_name(self.fn_name.value))
        form = W.HBox([self.fn_name, self.reward_name, self.new_weight, self.add_button, self.preview_button],
                      layout=W.Layout(flex_flow="row wrap", align_items="center"))
        title = W.HTML("<b>Rewards</b> <span style='color:#777'>(weights apply from the next scored rollout)</span>")
        return W.VBox([title, self.box, form, self.message])

    def _wants(self, msg: dict) -> bool:
        ev = msg.get("event")
        return ev is not None and ev.get("kind") in ("reward_weights", "reward_added", "reward_removed")

    def refresh(self) -> None:
        """Mirror the run's weights: rebuild sliders if the set of rewards changed, else move them."""
        if self._widget is None:
            return
        import ipywidgets as W

        weights = self.run.snapshot().reward_weights
        self._syncing = True
        try:
            if list(weights) != list(self.sliders):
                for s in self.sliders.values():
                    s.close()
                self.sliders = {}
                for name, w in weights.items():
                    s = W.FloatSlider(value=w, min=min(0.0, w), max=max(1.0, 2 * abs(w)), step=0.01,
                                      description=name, continuous_update=False, readout_format=".2f",
                                      layout=W.Layout(width="430px"), style={"description_width": "130px"})
                    s.observe(lambda ch, name=name: self._on_slider(name, ch["new"]), names="value")
                    self.sliders[name] = s
                self.box.children = tuple(self.sliders.values())
            for name, w in weights.items():
                s = self.sliders[name]
                s.min, s.max = min(s.min, w), max(s.max, w)
                s.value = w
        finally:
            self._syncing = False

    def _on_slider(self, name: str, value: float) -> None:
        if self._syncing:
            return
        self.set_weight(name, value)

    def set_weight(self, name: str, value: float) -> bool:
        """`run.set_reward_weights({name: value})`; on error the message is shown and the slider moves back."""
        try:
            self.run.set_reward_weights({name: float(value)})
        except Exception as e:
            self._error(f"weight of {name!r} not changed: {type(e).__name__}: {e}")
            self.refresh()
            return False
        self._ok(f"{esc(name)} weight → {float(value):g}")
        return True

    def register(self, name: str, fn: Callable[..., float], weight: float = 1.0) -> bool:
        """Validate `fn` on recent rollouts and add it as reward `name`; on refusal show the report, change nothing."""
        _ = self.widget
        try:
            self.run.add_reward(name, fn, weight)
        except Exception as e:
            self._error(f"reward {name!r} not added ({type(e).__name__}):\n{e}")
            return False
        self._ok(f"reward {esc(name)} added with weight {weight:g} (validated on recent rollouts)")
        self.refresh()
        return True

    def register_by_name(self, fn_name: str, name: str | None = None, weight: float = 1.0) -> bool:
        """Look `fn_name` up in the notebook's namespace and `register` it."""
        _ = self.widget
        ns = self.user_ns if self.user_ns is not None else user_namespace()
        fn_name = (fn_name or "").strip()
        if ns is None:
            self._error("not in IPython: there is no notebook namespace; call panel.register(name, fn, weight)")
            return False
        if fn_name not in ns:
            self._error(f"no {fn_name!r} in the notebook namespace; define it in a cell first")
            return False
        if not callable(ns[fn_name]):
            self._error(f"{fn_name!r} is a {type(ns[fn_name]).__name__}, not a function")
            return False
        return self.register(name or fn_name, ns[fn_name], weight)

    def preview(self, fn: Callable[..., float], recent: int = 256):
        """Rescore the last `recent` rollouts with `fn` alone (`run.rescore`; nothing changes); shows and returns the
        DataFrame: old/new reward and advantage per episode, correlation, groups whose advantage signs flip."""
        _ = self.widget
        try:
            ids = [int(i) for i in self.run.rollouts["id"].tail(recent)]
            df = self.run.rescore(fn, episodes=ids)
        except Exception as e:
            self._error(f"preview failed ({type(e).__name__}): {e}")
            return None
        a = df.attrs
        self._ok(f"preview on {a['n_episodes']} recent rollouts: mean reward {df['old_reward'].mean():.3g} -> "
                 f"{df['new_reward'].mean():.3g}, correlation {a['correlation']:.3g}, "
                 f"{len(a['flipped_groups'])} group(s) flip advantage signs; nothing applied")
        return df

    def preview_by_name(self, fn_name: str):
        """Look `fn_name` up in the notebook's namespace and `preview` it."""
        ns = self.user_ns if self.user_ns is not None else user_namespace()
        fn = (ns or {}).get((fn_name or "").strip())
        if not callable(fn):
            _ = self.widget
            self._error(f"no function {fn_name!r} in the notebook namespace; define it in a cell first")
            return None
        return self.preview(fn)

    def _error(self, text: str) -> None:
        self.last_error = text
        self.message.value = (f"<pre style='color:#b00020;background:#fff4f4;padding:6px;white-space:pre-wrap;"
                              f"max-height:220px;overflow:auto'>{esc(text)}</pre>")

    def _ok(self, text_html: str) -> None:
        self.last_error = None
        self.message.value = f"<span style='color:#1b7a1b'>✓ {text_html}</span>"

    def summary(self) -> str:
        return "RewardPanel: " + state_line(self.run).splitlines()[0] + "\n" + rewards_line(self.run)
