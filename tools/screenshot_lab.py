"""Screenshot the live lab in headless Chromium: `make screenshot` writes docs/img/lab.png.

    python tools/screenshot_lab.py [--out docs/img/lab.png] [--steps 50]

Starts JupyterLab on 127.0.0.1 (free port, token, a temporary root), writes a
notebook that starts a short asynchronous GRPO run on the addition task with
the shipped tiny model and displays `run.dashboard()`, runs all its cells from
the Run menu in Debian's Chromium (driven by Playwright, as
tests/test_lab_browser.py does), waits until the learning curves have drawn
`--shot-at` steps and the rollout table has rows, screenshots the dashboard
while the run trains, lets the notebook finish and shut the run down, then
stops JupyterLab. About a minute and a half on two CPU cores.

Needs Debian's chromium (`make browser`) and the playwright package (in requirements.lock).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ROOT = Path(__file__).resolve().parent.parent


def _cells(steps: int, shot_at: int) -> list[str]:
    return [
        f"""from forgelab import Run
from forgelab.config import EvalConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig
cfg = RunConfig(name="addition",
                rollout=RolloutConfig(task="addition", group_size=8, prompts_per_rollout=8, concurrency=2, max_tokens=8),
                train=TrainConfig(steps={steps}, batch_size=64, max_policy_age=1),
                eval=EvalConfig(every=10, n=100),
                tracking=TrackingConfig(out_dir="runs", wandb=False))
run = Run(cfg)
await run.start()""",
        "lab = run.dashboard()\nlab",
        # The panels refresh at most every few seconds (the lab's share of the controller's time is capped, so on
        # a busy machine the curves may wait a minute): refresh every panel now, at step `shot_at`, while the run
        # keeps training, so the picture is of one moment of a live run.
        f"""await run.until(step={shot_at})
for panel in lab.panels:
    panel.throttle.run_now()
print("LAB-READY", run.step)
await run.wait()
await run.shutdown()
print("LAB-RUN-DONE", run.state, run.step)""",
    ]


def _notebook(steps: int, shot_at: int) -> dict:
    cell = lambda src: {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],  # noqa: E731
                        "source": src.splitlines(keepends=True)}
    return {"nbformat": 4, "nbformat_minor": 5, "cells": [cell(c) for c in _cells(steps, shot_at)],
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_jupyterlab(tmp: Path, steps: int, shot_at: int) -> tuple[subprocess.Popen, str, str]:
    root = tmp / "root"
    root.mkdir()
    (root / "lab.ipynb").write_text(json.dumps(_notebook(steps, shot_at)))
    settings = tmp / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    port, token = _free_port(), secrets.token_hex(16)
    # the kernel imports this checkout's forgelab
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=pythonpath, JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
               JUPYTER_CONFIG_DIR=str(tmp / "config"))
    log = (tmp / "jupyter.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.port_retries=0",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         *(["--allow-root"] if os.geteuid() == 0 else [])],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:  # the server has nothing to await on: poll its status endpoint until it answers
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            return proc, base, token
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                _stop(proc)
                raise RuntimeError(f"JupyterLab did not start:\n{(tmp / 'jupyter.log').read_text()[-3000:]}")
            time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)  # jupyter_server's clean stop: shuts the kernels down, then the loop
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    try:  # anything left in the server's own session (kernel children) goes too
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _shoot(base: str, token: str, out: Path, shot_at: int) -> None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    failed = "document.body.innerText.includes('Traceback (most recent call last)')"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000}, device_scale_factor=1)
            page.goto(f"{base}/lab/tree/lab.ipynb?token={token}", wait_until="domcontentloaded")
            page.locator(".jp-Notebook").first.wait_for(timeout=60_000)
            select = page.locator(".jp-Dialog").get_by_role("button", name="Select Kernel")
            try:  # JupyterLab may ask which kernel to use; take the notebook's own (python3)
                select.wait_for(timeout=15_000)
                select.click()
            except PlaywrightTimeout:
                pass
            page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first.wait_for(timeout=60_000)
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()

            # rendered: the curves' caption says at least `shot_at` steps and the rollout table has a row
            try:
                page.wait_for_function(
                    f"""() => {failed} || ([...document.querySelectorAll('.widget-html-content')].some(e => {{
                           const m = /(\\d+) steps · redraw/.exec(e.textContent); return m && +m[1] >= {shot_at}; }})
                         && document.querySelector('table.fl-rollouts tbody tr') !== null
                         && document.querySelector('img.widget-image')?.complete
                         && document.body.innerText.includes('LAB-READY'))""",
                    timeout=300_000)
            except PlaywrightTimeout:
                page.screenshot(path=str(out.with_suffix(".timeout.png")), full_page=True)
                raise RuntimeError(f"the lab did not render {shot_at} steps; the page is in "
                                   f"{out.with_suffix('.timeout.png')}:\n{page.locator('body').inner_text()[-3000:]}")
            if page.evaluate(f"() => {failed}"):
                raise RuntimeError("a notebook cell raised:\n" + page.locator(".jp-OutputArea").last.inner_text()[-3000:])
            page.set_viewport_size({"width": 1400, "height": 2600})  # room for the whole dashboard
            dash = page.locator(".jp-OutputArea-output").filter(has=page.locator("img.widget-image")).first
            dash.scroll_into_view_if_needed()
            # from the lab's title to the end of the rollout table's scroll box (the token view below is left out)
            box = dash.bounding_box()
            table = page.locator(".jupyter-widgets", has=page.locator("table.fl-rollouts")).last.bounding_box()
            clip = dict(x=box["x"], y=box["y"], width=box["width"], height=table["y"] + table["height"] + 8 - box["y"])
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out), clip=clip)
            print(f"screenshot_lab: wrote {out} ({out.stat().st_size} bytes)")

            # let the notebook finish: the run trains its last steps and shuts its processes down
            page.wait_for_function(f"() => {failed} || document.body.innerText.includes('LAB-RUN-DONE')",
                                   timeout=300_000)
            if page.evaluate(f"() => {failed}"):
                raise RuntimeError("a notebook cell raised:\n" + page.locator(".jp-OutputArea").last.inner_text()[-3000:])
        finally:
            browser.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "lab.png")
    ap.add_argument("--steps", type=int, default=50, help="the run's training steps")
    ap.add_argument("--shot-at", type=int, default=None,
                    help="screenshot once the curves show this many steps (default: --steps minus 10)")
    args = ap.parse_args(argv)
    if not os.path.exists(CHROMIUM):
        print("screenshot_lab: Debian's chromium is not installed (`make browser` as root)", file=sys.stderr)
        return 2
    shot_at = args.shot_at or max(1, args.steps - 10)
    with tempfile.TemporaryDirectory(prefix="forgelab-screenshot-") as tmp:
        proc, base, token = _start_jupyterlab(Path(tmp), args.steps, shot_at)
        try:
            _shoot(base, token, args.out.resolve(), shot_at)
        finally:
            _stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
