"""Run the fault scenarios and write docs/reliability.md's figures from what they measured.

    heavy .venv/bin/python tools/reliability_report.py            # run tests/test_faults.py, then rewrite the doc
    .venv/bin/python tools/reliability_report.py --no-run         # rewrite from the last artifacts/faults_summary.json

``tests/test_faults.py`` injects the faults into real process meshes and
writes ``artifacts/faults_summary.json`` (each test records its numbers only
once its checks passed). This script runs that file with pytest, then
replaces the block between ``<!-- figures:begin -->`` and
``<!-- figures:end -->`` in ``docs/reliability.md`` with the numbers of that
run: the machine and its load, how many tests passed, each fault's measured
outcome and the totals. A fault whose test failed is written as "not
measured (its test failed)", never with an older number.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = ROOT / "artifacts" / "faults_summary.json"
DOC = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"
MISSING = "not measured (its test failed)"


def run_tests() -> dict:
    """pytest tests/test_faults.py; returns its counts, wall time and the load average at start."""
    load = [round(x, 2) for x in os.getloadavg()]
    if SUMMARY.exists():
        SUMMARY.unlink()  # never report a previous run's numbers as this run's
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_faults.py"],
                          cwd=ROOT, capture_output=True, text=True)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    log = SUMMARY.with_name("faults_pytest.log")  # the whole session, for whoever reads a failure
    log.parent.mkdir(exist_ok=True)
    log.write_text(proc.stdout + "\n" + proc.stderr)
    print(proc.stdout[-3000:], proc.stderr[-2000:], f"(full log: {log})", sep="\n", flush=True)
    failed = [ln.split(" - ")[0].removeprefix("FAILED ") for ln in proc.stdout.splitlines() if ln.startswith("FAILED ")]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", tail)}
    return {"loadavg_start": load, "seconds": round(time.perf_counter() - t0, 1), "counts": counts, "rc": proc.returncode,
            "summary_line": tail, "failed": failed}


def _reasons(dropped: dict) -> str:
    return ", ".join(f"{n} `{k}`" for k, n in sorted(dropped.items(), key=lambda kv: -kv[1]))


def render(summary: dict, session: dict) -> str:
    """The figures block (markdown) from a faults summary and the test session's facts."""
    g, ref, bl = summary.get("generator_kill"), summary.get("reference_kill"), summary.get("bad_loss")
    rf, ck, rs, ra = (summary.get(k) for k in ("reward_faults", "controller_kill", "resume", "run_a"))
    tot = summary.get("totals", {})
    counts = session.get("counts", {})
    lines = [
        f"Figures from `python tools/reliability_report.py` on {session.get('date', '?')}: "
        f"`tests/test_faults.py` {', '.join(f'{n} {k}' for k, n in counts.items()) or session.get('summary_line', '')}"
        f" in {session.get('seconds', '?')} s; 2-core machine, 1-minute load average {session.get('loadavg_start')} "
        "at the start (other jobs shared it).",
        "",
        *([f"Failed tests in this run: {', '.join('`' + f.split('::')[-1] + '`' for f in session['failed'])}.", ""]
          if session.get("failed") else []),
        "| fault | measured in this run |",
        "|---|---|",
        "| generator replica SIGKILLed mid-`generate` (2 replicas) | "
        + (f"killed at step {g['step']}; respawned ({g['restarts']} restart) and served version "
           f"{g['respawned_with_version']['served']} = the run's {g['respawned_with_version']['run_version']} "
           "before its first request" if g else MISSING) + " |",
        "| reference model SIGKILLed | "
        + (f"killed at step {ref['step']}; {ref['restarts']} restart, rollouts waited and retried" if ref else MISSING)
        + " |",
        "| reward raises / returns NaN / hangs | "
        + (f"{rf['raised']} raised, {rf['nan']} NaN, {rf['hung']} hung past the timeout "
           f"({rf['abandoned_threads_alive_at_end']} abandoned threads still blocked at the end; the run finished)"
           if rf else MISSING) + " |",
        "| `run.add_reward` with a reward that fails on recent rollouts | "
        + (f"{summary['rewards_refused']} refused" if "rewards_refused" in summary else MISSING) + " |",
        "| loss returns a wrong shape, then NaN | "
        + (f"{bl['skipped_steps']} steps skipped, parameters and optimizer bit-identical; paused twice, resumed at "
           f"step {bl['paused_at_step']}" if bl else MISSING) + " |",
        "| controller SIGKILLed after a checkpoint | "
        + (f"its {ck['children']} child processes gone {ck['seconds_until_children_gone']} s later "
           f"({ck['orphans']} orphans)" if ck else MISSING)
        + ("; " + (f"resumed at step {rs['resumed_at_step']}, finished at step {rs['final_step']}" if rs else MISSING))
        + " |",
        "| bad configuration | "
        + (f"{summary['bad_configs']} kinds, each a `ConfigError` before any process spawned"
           if "bad_configs" in summary else MISSING) + " |",
        "",
    ]
    if tot:
        lines.append(f"**Totals: {tot['faults_total']} faults injected, {tot['runs_finished']} of {tot['runs']} runs "
                     f"finished, {tot['episodes_lost']} episodes lost, {tot['orphan_processes']} orphan processes.**")
    if ra:
        e = ra["episodes"]
        lines.append(f"Run A: {e['generated']} episodes generated = {e['trained']} trained + {e['evicted']} evicted + "
                     f"{e['dropped']} dropped ({_reasons(e['dropped_reasons'])}) + {e['buffered']} buffered + "
                     f"{e['in_flight']} in flight.")
    if rs:
        e = rs["episodes"]
        lines.append(f"The resumed run: {e['generated']} generated = {e['trained']} trained + {e['evicted']} evicted "
                     f"+ {e['dropped']} dropped + {e['buffered']} buffered + {e['in_flight']} in flight.")
    return "\n".join(lines)


def write_doc(block: str, doc: Path = DOC) -> None:
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc}: add the markers {BEGIN} and {END} around the figures first")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{block}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-run", action="store_true", help="do not run the tests; use the last summary file")
    args = ap.parse_args(argv)
    session = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    session_file = SUMMARY.with_name("faults_session.json")
    if args.no_run:
        if session_file.exists():
            session = json.loads(session_file.read_text())
    else:
        session.update(run_tests())
        session_file.parent.mkdir(exist_ok=True)
        session_file.write_text(json.dumps(session, indent=2) + "\n")
    if not SUMMARY.exists():
        raise SystemExit(f"no {SUMMARY.relative_to(ROOT)}: the fault tests did not get far enough to write it")
    block = render(json.loads(SUMMARY.read_text()), session)
    write_doc(block)
    print(block)
    return 0 if session.get("rc", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
