"""The benchmark figure: held-out accuracy vs training wall time, from the suites' `--json-out` files.

    python -m forgelab.bench.plot --e2e docs/img/e2e.json --async docs/img/async.json \
        --out docs/img/accuracy_vs_time.png

Left: forgelab vs TRL (`e2e`), one line per run (later runs dashed). Right:
forgelab at each max_policy_age (`async`). Each curve is (training seconds,
held-out greedy accuracy) at every evaluation; the dotted line is the target.
Either file may be left out (its panel is then empty).
"""
from __future__ import annotations

import argparse
import json

COLORS = {"forgelab": "tab:blue", "trl": "tab:red", "trl_vllm": "tab:orange", "0": "tab:gray", "1": "tab:blue", "2": "tab:green"}


def _curves(ax, runs: dict, label_of, target: float | None, title: str) -> None:
    for key, rs in runs.items():
        for i, r in enumerate(rs):
            curve = r.get("curve") or []
            if not curve:
                continue
            ax.plot([c[1] for c in curve], [c[2] for c in curve], color=COLORS.get(str(key), None),
                    linestyle="-" if i == 0 else "--", marker=".", label=label_of(key) if i == 0 else None)
    if target is not None:
        ax.axhline(target, color="black", linestyle=":", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel("wall time since training started (s, evaluations included)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot(e2e: dict | None, async_: dict | None, out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    if e2e:
        names = {"forgelab": "forgelab", "trl": "TRL GRPOTrainer", "trl_vllm": "TRL + vLLM colocate"}
        _curves(left, e2e["runs"], lambda k: names.get(k, k),
                e2e.get("target_accuracy"), "e2e: forgelab vs TRL")
    if async_:
        _curves(right, async_["runs"], lambda k: f"max_policy_age {k}", async_.get("target_accuracy"),
                "async: staleness bound")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m forgelab.bench.plot", description=__doc__.split("\n")[0])
    ap.add_argument("--e2e", default="", help="the e2e suite's --json-out file")
    ap.add_argument("--async", dest="async_", default="", help="the async suite's --json-out file")
    ap.add_argument("--out", default="accuracy_vs_time.png")
    args = ap.parse_args(argv)
    load = lambda p: json.load(open(p)) if p else None  # noqa: E731
    print(plot(load(args.e2e), load(args.async_), args.out))


if __name__ == "__main__":
    main()
