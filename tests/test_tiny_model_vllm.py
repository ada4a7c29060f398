"""vLLM (in-process, CPU, eager) greedy outputs equal HF greedy outputs on the shipped model."""

import os

# Before vLLM is imported: in-process engine, a small KV cache, one thread (vLLM's CPU
# worker ignores later set_num_threads calls).
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest
import torch

torch.set_num_threads(1)

from forgelab.evaluate import format_prompt, greedy_generate_hf  # noqa: E402
from forgelab.recipes.tiny_model import DEFAULT_OUT  # noqa: E402
from forgelab.tasks import TASKS  # noqa: E402

pytestmark = pytest.mark.integration


def test_vllm_greedy_equals_hf_greedy():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(DEFAULT_OUT)
    problems = [p for t in TASKS.values() for p in t.make("test", 12, 0)]
    prompts = [format_prompt(tok, p.prompt) for p in problems]

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_OUT, dtype=torch.float32).eval()
    hf_texts = greedy_generate_hf(model, tok, prompts, max_new_tokens=8)

    llm = LLM(model=DEFAULT_OUT, dtype="float32", enforce_eager=True, max_model_len=128,
              max_num_seqs=32, seed=0)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    completions = [o.outputs[0] for o in outs]
    # vLLM stops at the end-of-turn token (the eos) and leaves it out of the text
    stopped = [c.finish_reason == "stop" and c.token_ids[-1] == tok.eos_token_id for c in completions]
    assert sum(stopped) >= 0.9 * len(completions)
    assert len(prompts) >= 16
    assert [c.text for c in completions] == hf_texts
