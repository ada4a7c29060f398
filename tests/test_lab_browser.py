"""The live lab in a real browser: JupyterLab + headless Debian Chromium, driven by Playwright.

Starts JupyterLab on 127.0.0.1 (free port, token, no browser, a temporary
root), writes a notebook that starts a 4-step run and displays
`run.dashboard()`, runs all cells from the Run menu, waits until the learning
curves image and the rollout table show data, checks the DOM, saves
`artifacts/lab_dashboard.png` and shuts everything down.

Needs Debian's chromium (`apt-get install -y chromium`); nothing is downloaded here.
"""
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.integration]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACT = Path(__file__).resolve().parent.parent / "artifacts" / "lab_dashboard.png"

CELLS = [
    """from forgelab.config.run_config import *
from forgelab.run import Run
cfg = RunConfig(name="labbrowser",
                rollout=RolloutConfig(task="addition", group_size=4, prompts_per_rollout=4, concurrency=1, max_tokens=6),
                train=TrainConfig(steps=4, batch_size=16, max_policy_age=1, warmup_steps=1), eval=EvalConfig(every=0, n=16),
                tracking=TrackingConfig(out_dir="runs", wandb=False), placement=PlacementConfig(reference=True))
run = Run(cfg)
await run.start()""",
    "lab = run.dashboard()\nlab",
    """await run.wait()
await lab.metrics.throttle.settled()
await run.shutdown()
print("LAB-RUN-DONE", run.state, run.step)""",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _notebook() -> dict:
    cell = lambda src: {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],  # noqa: E731
                        "source": src.splitlines(keepends=True)}
    return {"nbformat": 4, "nbformat_minor": 5, "cells": [cell(c) for c in CELLS],
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}}


def _require_browser() -> None:
    """Skip without Chromium or Playwright; with the env var CI set, fail with the same reason instead."""
    import importlib.util

    reason = None
    if shutil.which("chromium") is None or not os.path.exists(CHROMIUM):
        reason = "Debian's chromium is not installed (apt-get install -y chromium, or `make browser` as root)"
    elif importlib.util.find_spec("playwright") is None:
        reason = "the playwright package is not installed (it is in requirements.lock; run `make setup`)"
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI is set and the browser test cannot run: {reason}", pytrace=False)
    pytest.skip(f"{reason}; the browser test needs it (with CI set this fails instead)")


@pytest.fixture
def jupyterlab(tmp_path):
    _require_browser()
    root = tmp_path / "root"
    root.mkdir()
    (root / "lab.ipynb").write_text(json.dumps(_notebook()))
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"), JUPYTER_CONFIG_DIR=str(tmp_path / "config"))
    log = (tmp_path / "jupyter.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.port_retries=0",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         *(["--allow-root"] if os.geteuid() == 0 else [])],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:  # the server has nothing to await on: poll its status endpoint until it answers
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not start:\n{(tmp_path / 'jupyter.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield base, token, tmp_path
    finally:
        # SIGTERM is the server's clean stop (jupyter_server's _signal_stop: shuts the kernels down, then the
        # loop); SIGINT is not: without a tty it interrupts the loop and skips that cleanup, with one it asks
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        try:  # anything left in the server's own session (kernel children) goes too
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()


def test_dashboard_renders_in_jupyterlab(jupyterlab):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import expect, sync_playwright

    base, token, tmp_path = jupyterlab
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.goto(f"{base}/lab/tree/lab.ipynb?token={token}", wait_until="domcontentloaded")
            page.locator(".jp-Notebook").first.wait_for(timeout=60_000)
            # JupyterLab may ask which kernel to use; take the notebook's own (python3)
            select = page.locator(".jp-Dialog").get_by_role("button", name="Select Kernel")
            try:
                select.wait_for(timeout=15_000)
                select.click()
            except PlaywrightTimeout:
                pass  # no dialog: the kernel started by itself
            page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first.wait_for(timeout=60_000)
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()

            image = page.locator("img.widget-image").first
            rows = page.locator("table.fl-rollouts tbody tr")
            page.wait_for_function(
                "() => [...document.querySelectorAll('.widget-html-content')].some(e => /[1-9][0-9]* steps · redraw/.test(e.textContent))",
                timeout=200_000)
            expect(rows.first).to_be_visible(timeout=60_000)
            page.get_by_text("LAB-RUN-DONE").first.wait_for(timeout=200_000)

            assert rows.count() >= 1
            src = image.get_attribute("src")
            assert src and (src.startswith("blob:") or src.startswith("data:image/png"))
            assert page.evaluate("(img) => img.naturalWidth", image.element_handle()) > 300
            assert page.locator("span.fl-tok").count() >= 1
            expect(page.get_by_text("· version").first).to_contain_text("4/4", timeout=30_000)

            page.wait_for_function(  # the last redraw (after the final step) reached the page
                "() => [...document.querySelectorAll('.widget-html-content')].some(e => /\\b4 steps · redraw/.test(e.textContent))",
                timeout=60_000)
            page.set_viewport_size({"width": 1500, "height": 2600})  # room for the whole dashboard in the notebook panel
            out = page.locator(".jp-OutputArea-output").filter(has=page.locator("img.widget-image")).first
            out.scroll_into_view_if_needed()
            ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
            out.screenshot(path=str(ARTIFACT))
            assert ARTIFACT.stat().st_size > 20_000
        finally:
            browser.close()


@pytest.mark.parametrize("ci", ["", "1"])
def test_missing_browser_skips_locally_and_fails_under_ci(monkeypatch, ci):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("CI", ci)
    expected = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(expected, match="chromium is not installed"):
        _require_browser()
