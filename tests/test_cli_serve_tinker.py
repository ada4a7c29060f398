"""`forgelab serve-tinker` as a user starts it: a process serving Tinker's REST API over its own shared engines.
The unmodified tinker SDK (``.venv-tinker``) creates a client and scores one sequence; Ctrl-C (SIGINT) ends the
server and every process it started."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from numerics import check, max_abs, model_tol

ROOT = Path(__file__).resolve().parent.parent
SDK_PYTHON = ROOT / ".venv-tinker" / "bin" / "python"
TOKENS = [1, 4, 27, 28, 21, 29, 30, 39, 8, 5, 30, 32, 8]  # the chat-templated "12+34=" and its answer "46"

SDK_SCRIPT = """
import json, sys, tinker
from tinker import types
tokens = json.loads(sys.argv[1])
with tinker.ServiceClient() as service:
    tc = service.create_lora_training_client(base_model=sys.argv[2], rank=8, train_unembed=False).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[len(tokens) - 1])})
    out = tc.forward([datum], "cross_entropy").result()
    print(json.dumps({"loss": out.metrics["loss:sum"], "logprobs": out.loss_fn_outputs[0]["logprobs"].tolist()}))
"""


@pytest.mark.integration
def test_serve_tinker_cli_answers_the_sdk_and_stops_clean(tmp_path: Path) -> None:
    """The CLI's first line gives the base URL and key; the SDK's ``forward`` on a fresh client gives the base
    model's logprobs (HF transformers in float64, within the float32 forward bound) and ``loss:sum`` = their
    negated sum; SIGINT ends the CLI with status 0 and no process it started is left."""
    if not SDK_PYTHON.exists():
        pytest.skip(f"{SDK_PYTHON} is missing: `make tinker-venv` builds the SDK's virtualenv (make test does)")
    import torch
    from transformers import AutoModelForCausalLM

    from forgelab.config.run_config import SHIPPED_MODEL

    proc = subprocess.Popen([sys.executable, "-m", "forgelab.cli", "serve-tinker", "--slots", "1", "--root",
                             str(tmp_path / "ckpt")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line, f"serve-tinker printed nothing (rc {proc.poll()}):\n{proc.stderr.read()[-3000:] if proc.stderr else ''}"
        info = json.loads(line)
        assert info["base_url"].startswith("http://127.0.0.1:") and info["api_key"].startswith("tml-")
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "the engines run in processes of their own"
        env = {**os.environ, "TINKER_BASE_URL": info["base_url"], "TINKER_API_KEY": info["api_key"],
               "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}
        sdk = subprocess.run([str(SDK_PYTHON), "-c", SDK_SCRIPT, json.dumps(TOKENS), info["base_model"]], env=env,
                             capture_output=True, text=True, timeout=300)
        assert sdk.returncode == 0, sdk.stderr[-3000:]
        got = json.loads(sdk.stdout.strip().splitlines()[-1])
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0, proc.stderr.read()[-3000:] if proc.stderr else rc
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]

    model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, dtype=torch.float64).eval()
    ids = torch.tensor([TOKENS])
    with torch.no_grad():
        truth = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    check(float((torch.tensor(got["logprobs"], dtype=torch.float64) - truth).abs().max()),
          model_tol(SHIPPED_MODEL, max_abs(truth)), "serve-tinker forward logprobs vs HF float64")
    assert abs(got["loss"] + sum(got["logprobs"])) <= 1e-4 * max(1.0, abs(got["loss"]))
