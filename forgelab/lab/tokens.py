"""One episode's completion, token by token, as coloured HTML spans plus a side table of the exact values.

Per token `i` of the completion:

- `logprob`: the generator's sampling logprob (natural log) of the token;
- `ref_logprob`: the reference model's logprob of the same token;
- `kl_k3`: the k3 estimate of KL(generator || reference) at this token,
  `exp(d) - d - 1` with `d = ref_logprob - logprob` (>= 0, unbiased; the same
  estimator the losses report as `kl_ref`, here against the sampling policy);
- `advantage`: the token's advantage on trained tokens (its per-token advantage under on-policy distillation,
  else the episode's), 0 on environment tokens;
- with a teacher (on-policy distillation): `teacher_logprob` and `teacher_gap` (`teacher_logprob - logprob`,
  teacher minus student on the student's sample: the per-token signal, > 0 where the teacher would raise it);
- once the episode trained, the trainer's view of the token (`forgelab.algos.token_truth`): `trainer_logprob`
  (under the weights it trained, before the update), `mismatch` (`trainer_logprob - logprob`: sampler vs
  trainer), `entropy`, `is_weight` (the importance weight the loss used) and `clipped` (1 if the loss clipped it).

Environment tokens (`loss_mask == 0` in a multi-turn episode) are greyed and
every switch between model and environment text is marked as a turn boundary.
When the episode carries `turns` ([(start, end, role)] over the completion,
from `forgelab.envs`), each turn starts with a boundary naming its role
("assistant", "user", "tool").
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from forgelab.lab._base import esc

#: Quantities the spans can be coloured by.
COLOUR_BY = ("logprob", "advantage", "kl", "mismatch", "entropy", "is_weight", "clipped", "teacher_gap")
#: Colourings that need a teacher's logprobs (offered only when the episodes carry them: `colour_choices`).
TEACHER_ONLY = ("teacher_gap",)


def colour_choices(df: Any) -> tuple[str, ...]:
    """The `COLOUR_BY` entries that apply to a rollouts frame: ``teacher_gap`` only when an episode has teacher
    logprobs (a run with a teacher)."""
    teacher = df is not None and "teacher_logprobs" in getattr(df, "columns", ()) and bool(
        df["teacher_logprobs"].notna().any())  # None or NaN without a teacher
    return COLOUR_BY if teacher else tuple(c for c in COLOUR_BY if c not in TEACHER_ONLY)


def k3(logprob: float, ref_logprob: float) -> float:
    """k3 estimate of KL(p || ref) from one sample of p: exp(d) - d - 1, d = ref_logprob - logprob."""
    d = ref_logprob - logprob
    return math.exp(d) - d - 1.0


def token_rows(ep: dict, tokenizer: Any = None) -> list[dict]:
    """Per-token values of one episode (a row of `run.rollouts` as a dict)."""
    ids = _listed(ep.get("completion_ids")) or []  # lists, or arrays as read back from parquet
    lps = _listed(ep.get("generator_logprobs")) or []
    refs = ep.get("ref_logprobs")
    refs = list(refs) if refs is not None and not _isnan(refs) else None
    mask = ep.get("loss_mask")
    mask = list(mask) if mask is not None and not _isnan(mask) else None
    adv = float(ep.get("advantage") or 0.0)
    token_adv = _listed(ep.get("token_advantages"))
    teacher = _listed(ep.get("teacher_logprobs"))
    train = {k: _listed(ep.get(k)) for k in ("trainer_logprobs", "entropy", "is_weight", "clipped")}
    turn_of: dict[int, tuple[int, str]] = {}
    turns = ep.get("turns")
    if isinstance(turns, (list, tuple)):
        for k, (start, end, role) in enumerate(turns):
            for i in range(int(start), int(end)):
                turn_of[i] = (k, str(role))
    rows = []
    for i, tid in enumerate(ids):
        lp = float(lps[i]) if i < len(lps) else float("nan")
        ref = float(refs[i]) if refs is not None and i < len(refs) else float("nan")
        trained = mask is None or (i < len(mask) and bool(mask[i]))
        turn, role = turn_of.get(i, (None, None))
        rows.append({
            "i": i, "id": int(tid), "text": _token_text(tokenizer, int(tid)), "trained": trained,
            "turn": turn, "role": role,
            "logprob": lp, "ref_logprob": ref,
            "kl": k3(lp, ref) if not (math.isnan(lp) or math.isnan(ref)) else float("nan"),
            "advantage": (float(token_adv[i]) if token_adv is not None and i < len(token_adv) else adv)
            if trained else 0.0,
            "teacher_logprob": _at(teacher, i, trained),
            "trainer_logprob": _at(train["trainer_logprobs"], i, trained),
            "entropy": _at(train["entropy"], i, trained), "is_weight": _at(train["is_weight"], i, trained),
            "clipped": _at(train["clipped"], i, trained),
        })
        rows[-1]["mismatch"] = rows[-1]["trainer_logprob"] - lp if trained else float("nan")
        rows[-1]["teacher_gap"] = rows[-1]["teacher_logprob"] - lp  # NaN without a teacher or off the mask
    return rows


def _listed(x: Any) -> list | None:
    return None if x is None or _isnan(x) else list(x)


def _at(values: list | None, i: int, trained: bool) -> float:
    return float(values[i]) if trained and values is not None and i < len(values) else float("nan")


def _isnan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)  # pandas fills a missing list cell with NaN


def _token_text(tokenizer: Any, tid: int) -> str:
    if tokenizer is None:
        return f"<{tid}>"
    try:
        return tokenizer.decode([tid])
    except Exception:
        try:
            return str(tokenizer.convert_ids_to_tokens([tid])[0])
        except Exception:
            return f"<{tid}>"


def _shown(text: str) -> str:
    """Token text for display: whitespace made visible, HTML escaped."""
    if text == "":
        return "∅"
    return esc(text).replace("\n", "↵").replace("\t", "⇥").replace(" ", "&nbsp;")


def title(row: dict) -> str:
    """The hover text of one token span: its exact values."""
    head = f"#{row['i']} id {row['id']} {row['text']!r}"
    if not row["trained"]:
        return f"{head} | environment token (loss_mask 0, not trained)"
    text = (f"{head} | logprob {row['logprob']:.4f} | ref_logprob {row['ref_logprob']:.4f} | "
            f"kl_k3 {row['kl']:.4f} | advantage {row['advantage']:.4f}")
    if not math.isnan(row.get("trainer_logprob", float("nan"))):
        text += (f" | trainer {row['trainer_logprob']:.4f} | mismatch {row['mismatch']:+.4f} | "
                 f"entropy {row['entropy']:.4f} | is_weight {row['is_weight']:.4f} | clipped {row['clipped']:.0f}")
    if not math.isnan(row.get("teacher_logprob", float("nan"))):
        text += f" | teacher {row['teacher_logprob']:.4f} | teacher_gap {row['teacher_gap']:+.4f}"
    return text


def colour(value: float, by: str, scale: float) -> str:
    """Background colour of a span. logprob: red (unlikely) to green (certain); advantage: red < 0 < green;
    kl: white to orange by kl / scale."""
    if value is None or math.isnan(value):
        return "#eeeeee"
    if by == "logprob":
        p = math.exp(min(0.0, value))
        return f"hsl({int(120 * p)}, 70%, {int(82 - 8 * p)}%)"
    if by in ("advantage", "teacher_gap"):
        a = max(-1.0, min(1.0, value / scale)) if scale > 0 else 0.0
        return f"hsl({120 if a >= 0 else 0}, 65%, {int(97 - 30 * abs(a))}%)"
    if by == "is_weight":  # 1 is neutral: red below, green above
        a = max(-1.0, min(1.0, (value - 1.0) / max(scale - 1.0, 1e-9)))
        return f"hsl({120 if a >= 0 else 0}, 65%, {int(97 - 30 * abs(a))}%)"
    if by == "clipped":
        return "hsl(0, 75%, 72%)" if value else "#ffffff"
    k = max(0.0, min(1.0, abs(value) / scale)) if scale > 0 else 0.0
    hue = {"kl": 30, "mismatch": 285, "entropy": 210}[by]
    return f"hsl({hue}, 90%, {int(97 - 40 * k)}%)"


def _scale(rows: list[dict], by: str) -> float:
    vals = [abs(r[by]) for r in rows if r["trained"] and not math.isnan(r[by])]
    return max(vals) if vals else 0.0


def spans_html(rows: Sequence[dict], by: str = "logprob") -> str:
    """One `<span class="fl-tok">` per completion token (title = exact values); turn boundaries between them."""
    if by not in COLOUR_BY:
        raise ValueError(f"colour by {by!r}: choose one of {COLOUR_BY}")
    scale = _scale(list(rows), by)
    out, prev = [], None
    for r in rows:
        key = (r["trained"], r.get("turn"))
        if prev is not None and key != prev:
            who = r.get("role") or ("model" if r["trained"] else "environment")
            out.append(f'<span class="fl-turn" title="turn boundary">▸ {esc(who)}</span>')
        prev = key
        if r["trained"]:
            style = f"background:{colour(r[by], by, scale)}"
        else:
            style = "background:#f0f0f0;color:#999;font-style:italic"
        out.append(f'<span class="fl-tok" style="{style}" title="{esc(title(r))}">{_shown(r["text"])}</span>')
    legend = {"logprob": "red = unlikely, green = certain (exp(logprob))",
              "advantage": f"red < 0 < green, scale ±{scale:.3g}",
              "kl": f"k3 KL(generator‖reference), white 0 → orange {scale:.3g}",
              "mismatch": f"|trainer - generator logprob|, white 0 → purple {scale:.3g}",
              "entropy": f"the trainer's entropy, white 0 → blue {scale:.3g}",
              "is_weight": "importance weight: red < 1 < green",
              "clipped": "red: the loss clipped the token",
              "teacher_gap": f"teacher - student logprob: red < 0 (the teacher pulls it down) < green, scale ±{scale:.3g}"}[by]
    return (f"{TOKEN_CSS}<div class='fl-tokens'>{''.join(out) or '<i>(empty completion)</i>'}</div>"
            f"<div class='fl-legend'>colour: {esc(by)} · {esc(legend)} · hover a token for its values</div>")


def table_html(rows: Sequence[dict], max_rows: int = 512) -> str:
    """The side table: one row per token with its exact values."""
    def num(x: float) -> str:
        return "" if math.isnan(x) else f"{x:.4f}"

    body = "".join(
        f"<tr class='{'' if r['trained'] else 'fl-env'}'><td>{r['i']}</td><td class='fl-mono'>{_shown(r['text'])}</td>"
        f"<td>{num(r['logprob']) if r['trained'] else ''}</td><td>{num(r['ref_logprob'])}</td>"
        f"<td>{num(r['kl']) if r['trained'] else ''}</td><td>{num(r['advantage'])}</td>"
        f"<td>{num(r['trainer_logprob'])}</td><td>{num(r['mismatch'])}</td><td>{num(r['entropy'])}</td>"
        f"<td>{num(r['is_weight'])}</td><td>{'' if math.isnan(r['clipped']) else int(r['clipped'])}</td>"
        f"<td>{num(r.get('teacher_gap', math.nan))}</td><td>{'' if r['trained'] else 'env'}</td></tr>"
        for r in list(rows)[:max_rows]
    )
    return (f"{TOKEN_CSS}<div class='fl-side'><table class='fl-table fl-token-table'><thead><tr><th>#</th><th>token</th>"
            f"<th>logprob</th><th>ref</th><th>kl_k3</th><th>adv</th><th>trainer</th><th>mismatch</th><th>entropy</th>"
            f"<th>is_w</th><th>clip</th><th>t_gap</th><th></th></tr></thead><tbody>{body}</tbody></table></div>")


def mismatch_histogram(df: Any, bins: Sequence[float] = (0.0, 1e-6, 1e-4, 1e-3, 1e-2, 0.1, 1.0)) -> dict[str, Any]:
    """Per-token |trainer - generator logprob| of the latest trained policy version in `df` (a `run.rollouts`
    frame), counted in `bins` (the last bin open-ended): ``{"version", "edges", "counts", "tokens"}``."""
    need = {"trainer_logprobs", "generator_logprobs", "policy_version"}
    if df is None or not len(df) or not need <= set(df.columns):
        return {"version": None, "edges": list(bins), "counts": [0] * len(bins), "tokens": 0}
    done = df[df["trainer_logprobs"].map(lambda x: x is not None and not _isnan(x))]
    if not len(done):
        return {"version": None, "edges": list(bins), "counts": [0] * len(bins), "tokens": 0}
    version = int(done["policy_version"].max())
    counts = [0] * len(bins)
    for _, r in done[done["policy_version"] == version].iterrows():
        mask = _listed(r.get("loss_mask"))
        for i, (t, g) in enumerate(zip(r["trainer_logprobs"], r["generator_logprobs"])):
            if mask is None or (i < len(mask) and mask[i]):
                d = abs(float(t) - float(g))
                counts[max(k for k, edge in enumerate(bins) if d >= edge)] += 1
    return {"version": version, "edges": list(bins), "counts": counts, "tokens": sum(counts)}


def histogram_html(h: dict[str, Any]) -> str:
    """`mismatch_histogram` as a small bar table."""
    if not h["tokens"]:
        return "<div class='fl-legend'>sampler-trainer mismatch: no trained episode yet</div>"
    edges, top = h["edges"], max(h["counts"]) or 1
    rows = "".join(
        f"<tr><td>{'≥' if k == len(edges) - 1 else ''}{edges[k]:g}{'' if k == len(edges) - 1 else f'–{edges[k + 1]:g}'}</td>"
        f"<td><div style='background:#8e44ad;height:10px;width:{int(160 * c / top)}px'></div></td><td>{c}</td></tr>"
        for k, c in enumerate(h["counts"]))
    return (f"<div class='fl-legend'>|trainer - generator logprob| per token, policy version {h['version']} "
            f"({h['tokens']} tokens)</div><table class='fl-table'>{rows}</table>")


TOKEN_CSS = """<style>
.fl-tokens{font-family:ui-monospace,Menlo,monospace;font-size:13px;line-height:1.9;white-space:normal;word-break:break-all}
.fl-tok{padding:1px 0;margin:0 1px 0 0;border-radius:3px;cursor:help}
.fl-turn{display:inline-block;margin:0 6px;padding:0 5px;border-left:3px solid #555;color:#555;font-size:11px;font-family:sans-serif}
.fl-legend{color:#777;font-size:11px;margin-top:4px}
.fl-table{border-collapse:collapse;font-size:12px}
.fl-table th{background:#f3f4f6;text-align:left;padding:3px 6px;border-bottom:1px solid #ccc;position:sticky;top:0}
.fl-table td{padding:2px 6px;border-bottom:1px solid #eee;vertical-align:top}
.fl-side{max-height:320px;overflow-y:auto}
.fl-mono{font-family:ui-monospace,Menlo,monospace}
.fl-env td{color:#999}
</style>"""
