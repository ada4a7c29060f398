"""The rollout inspector: filter and sort recent episodes, pick one, read its completion token by token.

Reads `run.rollouts` (a DataFrame of recent episodes) on refresh; the table
shows at most `max_rows` episodes after filtering and sorting. The selected
episode's tokens are rendered by `forgelab.lab.tokens`.
"""
from __future__ import annotations

import math
from typing import Any

from forgelab.lab._base import ENDED, Panel, esc
from forgelab.lab.summary import state_line
from forgelab.lab.tokens import (COLOUR_BY, colour_choices, histogram_html, mismatch_histogram, spans_html, table_html,
                                 token_rows)
from forgelab.controller.facade import RunFacade

SORT_COLUMNS = ("id", "reward", "advantage", "policy_version", "group_id", "length", "mismatch_max")
CORRECTNESS = ("all", "only right", "only wrong")
STATUSES = ("all statuses", "trained", "buffered", "in_flight", "evicted", "dropped")


def _short(x: Any, n: int) -> str:
    s = "" if x is None or (isinstance(x, float) and math.isnan(x)) else str(x)
    return s if len(s) <= n else s[: n - 1] + "…"


def _num(x: Any) -> str:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return esc(x)
    return "" if math.isnan(v) else f"{v:.3g}"


class RolloutInspector(Panel):
    """A filterable, sortable table of recent episodes and a token-level view of the selected one.

    Filters: `text` (substring of prompt or completion, case-insensitive), `correctness`
    ("only right": the `reward/exact_answer` part (else the reward) is > 0.5), `reward_range`, `task`, `status`
    (buffer status; "dropped" matches every reason). When the run has ended, the table shows the trained
    episodes (the newest ones are then the last rollout, cancelled unscored) unless `status` was set by hand.
    Colour the tokens by `colour_by`: "logprob" (generator), "advantage", "kl" (k3 vs the reference), or the
    trainer's view once trained: "mismatch" (trainer vs generator logprob), "entropy", "is_weight", "clipped";
    with a teacher (its logprobs on the episodes), "teacher_gap" (teacher - student logprob per token).
    Sort by "mismatch_max" to find the episodes where the sampler and the trainer disagree most;
    `histogram` shows the per-token mismatch of the latest trained policy version.
    """

    min_interval_s = 2.0

    def __init__(self, run: RunFacade, *, max_rows: int = 25, min_interval_s: float | None = None):
        super().__init__(run, min_interval_s=min_interval_s)
        self.max_rows = max_rows
        self.df = None
        """The filtered, sorted episodes currently listed (pandas DataFrame)."""
        self._syncing = False
        self._seen = (-1, -1)
        self._status_set = False  # the user chose a status: the end of the run does not change it

    # ------------------------------------------------------------------ widget
    def _build(self):
        import ipywidgets as W

        lay = W.Layout
        self.text = W.Text(placeholder="filter prompt / completion", layout=lay(width="220px"))
        self.correctness = W.Dropdown(options=CORRECTNESS, value="all", layout=lay(width="115px"))
        self.task = W.Dropdown(options=["all tasks"], value="all tasks", layout=lay(width="140px"))
        self.status = W.Dropdown(options=STATUSES, value="all statuses", layout=lay(width="125px"))
        self.reward_range = W.FloatRangeSlider(value=(-1e9, 1e9), min=-1e9, max=1e9, step=0.01, description="reward",
                                               readout_format=".2f", continuous_update=False,
                                               layout=lay(width="300px"), style={"description_width": "50px"})
        self.sort_by = W.Dropdown(options=SORT_COLUMNS, value="id", description="sort", layout=lay(width="170px"),
                                  style={"description_width": "32px"})
        self.ascending = W.ToggleButton(value=False, description="ascending", icon="sort-amount-asc",
                                        layout=lay(width="105px"))
        self.table = W.HTML(layout=lay(width="100%", max_height="330px", overflow="auto"))
        self.select = W.Dropdown(options=[], description="episode", layout=lay(width="460px"),
                                 style={"description_width": "55px"})
        self.colour_by = W.ToggleButtons(options=colour_choices(None), value="logprob", style={"button_width": "78px"})
        self.histogram = W.HTML()
        self.header = W.HTML()
        self.tokens = W.HTML(layout=lay(width="62%"))
        self.side = W.HTML(layout=lay(width="38%"))
        for w in (self.text, self.correctness, self.task, self.status, self.reward_range, self.sort_by, self.ascending):
            w.observe(self._on_filter, names="value")
        self.select.observe(lambda _: self._show_selected(), names="value")
        self.colour_by.observe(lambda _: self._show_selected(), names="value")
        filters = W.HBox([self.text, self.correctness, self.task, self.status, self.reward_range, self.sort_by,
                          self.ascending],
                         layout=lay(flex_flow="row wrap", align_items="center"))
        picker = W.HBox([self.select, W.Label("colour by"), self.colour_by], layout=lay(align_items="center"))
        return W.VBox([filters, self.table, self.histogram, picker, self.header, W.HBox([self.tokens, self.side])])

    def _wants(self, msg: dict) -> bool:
        # new episodes arrive with steps; the end of the run turns the table to the trained episodes
        return "event" not in msg or msg["event"].get("kind") in ENDED

    def _on_filter(self, change) -> None:
        if not self._syncing:
            if isinstance(change, dict) and change.get("owner") is self.status:  # a traitlets change (a dict)
                self._status_set = True
            self._apply(self._all())

    # ------------------------------------------------------------------ data
    def _all(self):
        return self.run.rollouts

    def refresh(self) -> None:
        if self._widget is None:
            return
        df = self._all()
        ended = getattr(self.run, "state", None) in ENDED
        key = (len(df), int(df["id"].iloc[-1]) if len(df) and "id" in df.columns else -1, ended)
        if key == self._seen and self.df is not None:
            return
        self._seen = key
        self._syncing = True
        try:
            if len(self.colour_by.options) < len(COLOUR_BY):  # until the episodes show a teacher
                choices = colour_choices(df)
                if tuple(self.colour_by.options) != choices:
                    self.colour_by.options = choices
            if (ended and not self._status_set and self.status.value == "all statuses" and "status" in df.columns
                    and (df["status"] == "trained").any()):
                self.status.value = "trained"
            if len(df) and "task" in df.columns:
                tasks = ["all tasks"] + sorted(str(t) for t in df["task"].dropna().unique())
                if list(self.task.options) != tasks:
                    keep = self.task.value if self.task.value in tasks else "all tasks"
                    self.task.options, self.task.value = tasks, keep
            if len(df) and "reward" in df.columns:
                lo, hi = float(df["reward"].min()), float(df["reward"].max())
                hi = hi if hi > lo else lo + 1.0
                if (lo, hi) != (self.reward_range.min, self.reward_range.max):  # 5 validated trait writes: on change
                    untouched = self.reward_range.value == (self.reward_range.min, self.reward_range.max)
                    self.reward_range.min, self.reward_range.max = -1e9, 1e9  # widen first: min must stay <= max
                    self.reward_range.min, self.reward_range.max = lo, hi
                    if untouched:
                        self.reward_range.value = (lo, hi)
        finally:
            self._syncing = False
        self._apply(df)

    def filtered(self, df=None):
        """Apply the current filters and sort to `df` (default: `run.rollouts`)."""
        df = self._all() if df is None else df
        if len(df) == 0:
            return df
        keep = None  # no filter set (the usual case while watching a run): no mask, no row copy

        def both(mask):
            return mask if keep is None else keep & mask

        q = self.text.value.strip().lower()
        if q:
            keep = both(df["prompt"].astype(str).str.lower().str.contains(q, regex=False)
                        | df["completion"].astype(str).str.lower().str.contains(q, regex=False))
        if self.correctness.value != "all":
            col = "reward/exact_answer" if "reward/exact_answer" in df.columns else "reward"
            right = df[col].fillna(0.0).astype(float) > 0.5
            keep = both(right if self.correctness.value == "only right" else ~right)
        if self.task.value != "all tasks" and "task" in df.columns:
            keep = both(df["task"].astype(str) == self.task.value)
        if self.status.value != "all statuses" and "status" in df.columns:
            keep = both(df["status"].astype(str).str.split(":").str[0] == self.status.value)
        lo, hi = self.reward_range.value
        reward = df["reward"].astype(float)
        if reward.min() < lo - 1e-9 or reward.max() > hi + 1e-9:
            keep = both((reward >= lo - 1e-9) & (reward <= hi + 1e-9))
        out = df if keep is None else df[keep]
        out = out.assign(length=[len(x) if isinstance(x, (list, tuple)) else 0 for x in out["completion_ids"]])
        if self.sort_by.value not in out.columns:  # e.g. mismatch_max before any episode trained
            out = out.assign(**{self.sort_by.value: float("nan")})
        return out.sort_values(self.sort_by.value, ascending=self.ascending.value, kind="stable", na_position="last")

    def _apply(self, df) -> None:
        self.df = self.filtered(df)
        self.table.value = self._table_html(self.df)
        key = (len(df), int(df["policy_version"].max()) if len(df) and "policy_version" in df.columns else -1)
        if key != getattr(self, "_hist_key", None):  # per trained version, not per refresh
            self._hist_key = key
            self.histogram.value = histogram_html(mismatch_histogram(df))
        shown = self.df.head(self.max_rows)
        cols = ("id", "reward", "completion")  # none before the first rollout: an empty frame has no columns
        options = [(f"#{int(i)}  r={_num(rw)}  {_short(c, 40)}", int(i))
                   for i, rw, c in zip(*(shown[k].tolist() for k in cols))] if set(cols) <= set(shown.columns) else []
        prev = self.select.value
        self._syncing = True
        try:
            self.select.options = options
            ids = [v for _, v in options]
            self.select.value = prev if prev in ids else (ids[0] if ids else None)
        finally:
            self._syncing = False
        self._show_selected()

    def _table_html(self, df) -> str:
        from forgelab.lab.tokens import TOKEN_CSS

        n = len(df)
        if n == 0:
            return "<i>no episodes match (or none generated yet)</i>"
        parts = [c for c in df.columns if c.startswith("reward/")]
        cols = ["id", "task", "prompt", "completion", "target", "reward", *parts, "advantage", "policy_version", "status"]
        cols = [c for c in cols if c in df.columns]
        heads = {"policy_version": "version", "advantage": "adv"}
        head = "".join(f"<th>{esc(heads.get(c, c.split('/', 1)[-1]))}</th>" for c in cols)
        sel = self.select.value if self._widget is not None else None
        rows = []
        head_df = df.head(self.max_rows)
        for r in (dict(zip(cols, vals)) for vals in zip(*(head_df[c].tolist() for c in cols))):
            cells = []
            for c in cols:
                v = r.get(c)
                if c in ("prompt", "completion"):
                    cells.append(f"<td class='fl-mono' title='{esc(v)}'>{esc(_short(v, 60 if c == 'completion' else 48))}</td>")
                elif isinstance(v, float):
                    cells.append(f"<td>{_num(v)}</td>")
                else:
                    cells.append(f"<td>{esc(_short(v, 24))}</td>")
            style = " style='background:#eef5ff'" if r.get("id") == sel else ""
            rows.append(f"<tr class='fl-ep'{style}>{''.join(cells)}</tr>")
        more = f"<div style='color:#777;font-size:11px'>showing {min(n, self.max_rows)} of {n} matching episodes</div>"
        return f"{TOKEN_CSS}<table class='fl-table fl-rollouts'><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>{more}"

    # ------------------------------------------------------------------ selection
    def episode(self, episode_id: int | None = None) -> dict | None:
        """The episode (a dict) with this id, default the selected one."""
        eid = self.select.value if episode_id is None else episode_id
        if eid is None or self.df is None:
            return None
        src = self.df if eid in set(self.df["id"]) else self._all()
        hit = src[src["id"] == eid]
        return None if len(hit) == 0 else hit.iloc[0].to_dict()

    def show(self, episode_id: int) -> None:
        """Select an episode by id (clearing filters if it is filtered out)."""
        _ = self.widget
        if episode_id not in [v for _, v in self.select.options]:
            self._syncing = True
            self.text.value, self.correctness.value, self.task.value = "", "all", "all tasks"
            self.status.value = "all statuses"
            self.reward_range.value = (self.reward_range.min, self.reward_range.max)
            self._syncing = False
            df = self._all()
            self.df = self.filtered(df)
            ep = df[df["id"] == episode_id]
            if len(ep) == 0:
                raise KeyError(f"episode {episode_id} is not among the {len(df)} recent rollouts")
            row = ep.iloc[0]
            self._syncing = True
            self.select.options = list(self.select.options) + [(f"#{episode_id}  r={_num(row.reward)}", int(episode_id))]
            self._syncing = False
        self.select.value = int(episode_id)
        self._show_selected()

    def _show_selected(self) -> None:
        if self._syncing:
            return
        ep = self.episode()
        if ep is None:
            self.header.value, self.tokens.value, self.side.value = "", "", ""
            return
        rows = token_rows(ep, getattr(self.run, "tokenizer", None))
        parts = " · ".join(f"{k.split('/', 1)[1]} {_num(v)}" for k, v in ep.items() if k.startswith("reward/"))
        env = sum(not r["trained"] for r in rows)
        self.header.value = (
            f"<div style='margin-top:6px'><b>episode #{ep['id']}</b> (group {ep.get('group_id')}, task {esc(ep.get('task'))}, "
            f"policy version {ep.get('policy_version')}, {esc(ep.get('finish_reason'))}, {esc(ep.get('status'))}) · "
            f"reward <b>{_num(ep.get('reward'))}</b> ({esc(parts)}) · advantage <b>{_num(ep.get('advantage'))}</b> · "
            f"{len(rows)} tokens{f' ({env} from the environment)' if env else ''}<br>"
            f"<span class='fl-mono' style='color:#555'>prompt: {esc(_short(ep.get('prompt'), 200))} · target: "
            f"{esc(ep.get('target'))}</span></div>"
        )
        self.tokens.value = spans_html(rows, self.colour_by.value)
        self.side.value = table_html(rows)

    def summary(self) -> str:
        try:
            df = self._all()
        except Exception:
            df = None
        n = 0 if df is None else len(df)
        lines = ["RolloutInspector: " + state_line(self.run), f"{n} recent episodes"]
        if n:
            for r in df.tail(5).to_dict("records"):
                lines.append(f"  #{r.get('id')} reward {_num(r.get('reward'))} adv {_num(r.get('advantage'))} "
                             f"v{r.get('policy_version')}: {_short(r.get('prompt'), 40)!r} -> {_short(r.get('completion'), 40)!r}")
        return "\n".join(lines)
