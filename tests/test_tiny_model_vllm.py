"""vLLM (in-process, CPU, eager) greedy outputs equal HF greedy outputs on the shipped model.

vLLM runs in a fresh interpreter (this file as a script): inside a long pytest
session, vLLM's kernel registration walks every imported module, and a module
some other test imported (werkzeug's context-local proxies) raises on it.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _vllm_greedy(prompts: list[str]) -> list[dict]:
    # Before vLLM is imported: in-process engine, a small KV cache, one thread (vLLM's CPU
    # worker ignores later set_num_threads calls).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch

    torch.set_num_threads(1)
    from vllm import LLM, SamplingParams

    from forgelab.recipes.tiny_model import DEFAULT_OUT

    llm = LLM(model=DEFAULT_OUT, dtype="float32", enforce_eager=True, max_model_len=128, max_num_seqs=32, seed=0)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    return [{"text": o.outputs[0].text, "finish_reason": o.outputs[0].finish_reason,
             "last_token": o.outputs[0].token_ids[-1]} for o in outs]


def test_vllm_greedy_equals_hf_greedy():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from forgelab.data import format_prompt
    from forgelab.controller.evaluate import greedy_generate_hf
    from forgelab.recipes.tiny_model import DEFAULT_OUT
    from forgelab.data.tasks import TASKS

    tok = AutoTokenizer.from_pretrained(DEFAULT_OUT)
    problems = [p for t in TASKS.values() for p in t.make("test", 12, 0)]
    prompts = [format_prompt(tok, p.prompt) for p in problems]
    assert len(prompts) >= 16

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_OUT, dtype=torch.float32).eval()
    hf_texts = greedy_generate_hf(model, tok, prompts, max_new_tokens=8)

    p = subprocess.run([sys.executable, __file__], input=json.dumps(prompts), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    completions = json.loads(p.stdout.strip().splitlines()[-1])
    # vLLM stops at the end-of-turn token (the eos) and leaves it out of the text
    stopped = [c["finish_reason"] == "stop" and c["last_token"] == tok.eos_token_id for c in completions]
    assert sum(stopped) >= 0.9 * len(completions)
    assert [c["text"] for c in completions] == hf_texts


if __name__ == "__main__":
    print(json.dumps(_vllm_greedy(json.loads(sys.stdin.read()))))
