"""LoRA end to end: adapters in the torchtitan trainer, the adapter alone pushed to vLLM, the reference for free.

One 1-process LoRA trainer (1-row micro-batches), one 2-process LoRA trainer (FSDP2) and one LoRA generator are
spawned once for the module and shared by the tests in file order. Golden values come from independent
computations: the base model (adapters off / vLLM without an adapter), the other world size, HF transformers
with `peft` loading the exported adapter, and a float64 HF model with the adapter merged in.

Float32 bounds (see each test): equal-by-construction paths are compared bit for bit (B = 0 adds exact
zeros); every other float32 path (vLLM, HF + peft, the trainer on 1 or 2 ranks) is bounded by the model's
forward bound (tests/numerics.py), against a float64 computation of the same model where there is one.
"""
from __future__ import annotations

import asyncio
import json
import os
import pickle
import shutil

import pytest
import torch

from numerics import EPS, check, max_abs, max_abs_diff, model_tol
from trainer_actors import random_batches, tiny_model_dir

integration = pytest.mark.integration
numerics = pytest.mark.numerics

RANK, ALPHA = 8, 16.0
ADAM_EPS = 1e-4
PROMPTS = ["12+34=", "7+8=", "Q: 100+250=", "3+3+3=", "41+1=", "9+90="]


async def _gather(*coros):
    return await asyncio.gather(*coros)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def hf_config(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def lora():
    from forgelab.config.components import LoraConfig

    return LoraConfig(enabled=True, rank=RANK, alpha=ALPHA)


@pytest.fixture(scope="module")
def parts(loop, model_dir, lora):
    """(1-process trainer with 1-row micro-batches, 2-process FSDP2 trainer, generator), all LoRA."""
    from dataclasses import replace

    from forgelab.engines.generator import Generator, GeneratorConfig
    from forgelab.engines.trainer import Trainer, TrainerConfig

    # AdamW eps 1e-4: a step is then Lipschitz in the gradient (constant lr / eps), so 1 and 2 ranks can be
    # compared weight by weight (with the default 1e-8 a gradient within rounding of zero moves its weight by up
    # to lr either way); the adapters' gradients are ~1e-5 per element, so they still move by ~20x theirs
    cfg = TrainerConfig(model_dir=model_dir, lr=2e-3, eps=ADAM_EPS, warmup_steps=0, loss="grpo",
                        loss_kwargs={"kl_coef": 0.05}, lora=lora)
    handles = loop.run_until_complete(_gather(
        Trainer.options(procs=1).as_actor(replace(cfg, micro_batch_size=1)),
        Trainer.options(procs=2).as_actor(cfg),
        Generator.options(procs=1).as_actor(GeneratorConfig(model_dir=model_dir, max_model_len=96, lora=lora,
                                                            max_loras=2)),
    ))
    yield handles
    for h in handles:
        loop.run_until_complete(h.shutdown())


@pytest.fixture(scope="module")
def lora_pool(loop):
    """One LoRA generator + trainer set (the shipped model, no reference process) for every `Run` of the module:
    the swap test's first run spawns it; its resume, fork and replay, then the GRPO run, re-initialise it
    (`ProcessPool`: weights, optimizer, adapters and versions from each run's config): one cold start instead of
    two. The GRPO run comes last: the swap test's first run on a set that had served the 150-step GRPO run
    differed from its own resume in the last bit of step 5's metrics (2026-11-27), so its exact comparisons keep
    the fresh set they always had."""
    from forgelab.engines.pool import ProcessPool

    pool = ProcessPool()
    yield pool
    loop.run_until_complete(pool.shutdown())


@pytest.fixture(scope="module")
def batches(hf_config):
    # No reference logprobs in the batches: a LoRA trainer takes them from its base (lora.reference "base").
    return random_batches(hf_config["vocab_size"], 3, B=4, seed=0, with_ref=False)


def _greedy(loop, gen, n_tokens: int = 10):
    from forgelab.config.components import SamplingConfig

    groups = loop.run_until_complete(gen.call_one("generate", PROMPTS, 1, SamplingConfig(temperature=0.0,
                                                                                         max_tokens=n_tokens)))
    return [g[0] for g in groups]


def _hf_logprobs(model, completions) -> list[torch.Tensor]:
    """Per completion, log p(completion token | prefix) under a HF model (any dtype), as float64."""
    out = []
    with torch.no_grad():
        for c in completions:
            ids = torch.tensor([c.prompt_ids + c.completion_ids])
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)
            pos = torch.arange(len(c.prompt_ids) - 1, ids.shape[1] - 1)
            out.append(logp[pos, ids[0, pos + 1]])
    return out


def _max_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


# --------------------------------------------------------------------------------------------- pure
def test_config_off_by_default_and_bad_targets_named():
    from forgelab.config import ConfigError, RunConfig
    from forgelab.config.components import LORA_TARGETS

    cfg = RunConfig()
    assert not cfg.lora.enabled and not cfg.component("trainer").lora.enabled
    assert not cfg.component("generator").lora.enabled
    on = RunConfig.from_dict({"lora": {"enabled": True, "rank": 4}})
    assert on.component("trainer").lora == on.component("generator").lora == on.lora  # one value, both parts
    assert tuple(on.lora.targets) == LORA_TARGETS  # default: attention and MLP projections
    with pytest.raises(ConfigError, match=r"lora.targets: 'vproj' is not a projection.*did you mean 'v_proj'"):
        RunConfig.from_dict({"lora": {"enabled": True, "targets": ["q_proj", "vproj"]}})
    with pytest.raises(ConfigError, match=r"'lm_head' cannot be a LoRA target: .*never be applied"):
        RunConfig.from_dict({"lora": {"targets": ["lm_head"]}})
    with pytest.raises(ConfigError, match=r"lora.rank must be an integer in \[1, 512\]"):
        RunConfig.from_dict({"lora": {"rank": 0}})
    with pytest.raises(ConfigError, match=r"lora.reference must be one of"):
        RunConfig.from_dict({"lora": {"reference": "ref"}})
    # trainer.activation_checkpointing "auto" (the default): on with LoRA only; true/false force it
    assert not cfg.component("trainer").checkpoints_activations() and on.component("trainer").checkpoints_activations()
    forced = RunConfig.from_dict({"lora": {"enabled": True}, "trainer": {"activation_checkpointing": False}})
    assert not forced.component("trainer").checkpoints_activations()
    with pytest.raises(ConfigError, match=r"activation_checkpointing.*must be true, false or 'auto'"):
        RunConfig.from_dict({"trainer": {"activation_checkpointing": "yes"}})


def test_spawn_plan_takes_the_reference_from_the_base():
    from forgelab.config import RunConfig
    from forgelab.engines.spawn import component_configs, reference_process

    assert reference_process(RunConfig())  # full fine-tuning: the reference process as before
    on = RunConfig.from_dict({"lora": {"enabled": True}})
    assert not reference_process(on) and component_configs(on)["trainer"].lora.reference == "base"
    sep = RunConfig.from_dict({"lora": {"enabled": True, "reference": "process"}})
    assert reference_process(sep)  # a reference that is not the base keeps its process
    none = RunConfig.from_dict({"lora": {"enabled": True}, "placement": {"reference": False}})
    assert not reference_process(none) and component_configs(none)["trainer"].lora.reference == "process"


def test_plan_models_lora(model_dir):
    """The planner: adapters counted as the trainer builds them (155,648 for rank 8 on the tiny model's seven
    projections in 4 layers: 4 x 8 x (512 + 384 + 384 + 512 + 1024 + 1024 + 1024)), no base gradients or
    AdamW state, no output-projection gradient, the adapter as the shared file, no reference process."""
    from forgelab.config import RunConfig
    from forgelab.engines.titan import read_hf_config
    from forgelab.memory_plan import ModelShape, plan_memory

    shape = ModelShape.from_hf(read_hf_config(model_dir))
    assert shape.lora_params(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 8) == 155_648
    full = plan_memory(RunConfig.from_dict({"model": {"path": model_dir}}))
    lora = plan_memory(RunConfig.from_dict({"model": {"path": model_dir}, "lora": {"enabled": True}}))
    by_name = lambda plan: {p.name: p for p in plan.processes}  # noqa: E731
    assert "reference" in by_name(full) and "reference" not in by_name(lora)
    tf, tl = by_name(full)["trainer"].terms, by_name(lora)["trainer"].terms
    assert tl["optimizer (AdamW)"] == 8 * 155_648 and tf["optimizer (AdamW)"] == 8 * shape.params
    assert tl.get("projection grad", 0) == 0 and tl.get("embedding grad (temporary)", 0) == 0
    assert lora.shared_bytes == 4 * 155_648 and full.shared_bytes == 4 * shape.params


@numerics
def test_adapter_on_fused_qkv_is_peft_per_projection(model_dir, tmp_path):
    """In one process: random B on every projection (llama3 q/k rows permuted on export); HF + peft on the
    exported adapter, and HF with the adapter merged, against the float64 merged model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from forgelab.config.components import LoraConfig
    from forgelab.engines.lora_adapters import adapter_config, adapters, add_adapters, adapters_disabled, peft_tensors
    from forgelab.engines.titan import build_from_hf, to_hf_state_dict
    from forgelab.engines.titan_forward import model_logprobs
    from forgelab.weights.adapter import merge_adapter, write_adapter

    torch.manual_seed(0)
    model, ckpt = build_from_hf(model_dir)
    base_hf = to_hf_state_dict(model, ckpt)
    tokens = torch.randint(10, 100, (3, 24))
    base_lp = model_logprobs(model, tokens)
    cfg = LoraConfig(enabled=True, rank=RANK, alpha=ALPHA, targets=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"])
    add_adapters(model, ckpt, cfg, seed=0)
    assert torch.equal(model_logprobs(model, tokens), base_lp)  # B = 0: out + 0, bit for bit
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if ".lora." in n}
    with torch.no_grad():
        for a in adapters(model):
            for t in a.B:
                a.B[t].normal_(0, 0.02)
    with torch.no_grad():
        lp = model_logprobs(model, tokens)
    with adapters_disabled(model):
        assert torch.equal(model_logprobs(model, tokens), base_lp)
    with pytest.raises(ValueError, match="no HF name.*LoRA adapters"):
        to_hf_state_dict(model, ckpt)  # the export refuses to drop the adapters silently
    tensors = peft_tensors(model, ckpt)
    write_adapter(str(tmp_path / "a"), tensors, adapter_config(cfg, model_dir))
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                           str(tmp_path / "a")).eval()
    exact = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    exact.load_state_dict(merge_adapter({k: v.double() for k, v in base_hf.items()}, tensors, ALPHA / RANK))
    base32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base64 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    with torch.no_grad():
        def lp_of(m):
            return torch.log_softmax(m(tokens).logits[:, :-1].double(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
        truth, peft_lp, base_truth = lp_of(exact), lp_of(peft_model), lp_of(base64)
        base_err = float((lp_of(base32) - base_truth).abs().max())
    # Bound: the model's float32 forward bound at these logprobs' scale (numerics.model_tol); an adapter adds two
    # rank-8 GEMMs per projection, shorter reductions than the base's, inside the same chain.
    tol = model_tol(model_dir, max_abs(truth))
    assert base_err <= tol  # float32 HF on the base itself
    # the adapter matters: a wrong row order (which scrambles its contribution) would show
    assert float((truth - base_truth).abs().max()) > 10 * tol
    for name, x in (("trainer", lp.double()), ("peft", peft_lp)):
        check(float((x - truth).abs().max()), tol, f"{name} with the adapter vs float64 merged")


def test_adapter_dropout_is_seeded_and_off_outside_training(model_dir):
    """Dropout masks the adapters' inputs only under `dropout_seed`: one seed draws one mask (pass 1 and the
    backward pass 2 of a micro-batch agree bit for bit), another seed another; without a seed (rollouts,
    the reference, evaluation) the forward is the plain LoRA forward."""
    from forgelab.config.components import LoraConfig
    from forgelab.engines.lora_adapters import adapters, add_adapters, dropout_seed, step_dropout
    from forgelab.engines.titan import build_from_hf
    from forgelab.engines.titan_forward import model_logprobs

    model, ckpt = build_from_hf(model_dir)
    cfg = LoraConfig(enabled=True, rank=4, dropout=0.5)
    add_adapters(model, ckpt, cfg, seed=0)
    with torch.no_grad():
        for a in adapters(model):
            for t in a.B:
                a.B[t].normal_(0, 0.05)
        tokens = torch.randint(10, 100, (2, 16))
        plain = model_logprobs(model, tokens)
        with dropout_seed(model, 7):
            d7 = model_logprobs(model, tokens)
        with dropout_seed(model, 7):
            again = model_logprobs(model, tokens)
        with dropout_seed(model, 8):
            d8 = model_logprobs(model, tokens)
        assert torch.equal(model_logprobs(model, tokens), plain)  # the seed is gone after the block
        with step_dropout(model, LoraConfig(enabled=True, dropout=0.0), 0, 3, 0, 1):
            assert torch.equal(model_logprobs(model, tokens), plain)  # no dropout configured: a no-op
    assert torch.equal(d7, again) and not torch.equal(d7, d8) and not torch.equal(d7, plain)


def test_activation_checkpointing_changes_nothing_but_memory(model_dir):
    """trainer.activation_checkpointing recomputes each block in backward: with LoRA adapters and dropout
    (the recomputed forward must draw the same masks), two steps give the same losses, gradient norms and
    parameters bit for bit (the same float32 operations, replayed), and the names are unchanged."""
    import torch.distributed as dist

    from forgelab.config.components import LoraConfig, TrainerConfig
    from forgelab.engines.trainer_state import TrainerState

    created = not dist.is_initialized()
    batches = random_batches(105, 2, B=8, seed=0, with_ref=False, shared_prompts=True)
    out = {}
    try:
        for ac in (False, True):
            cfg = TrainerConfig(model_dir=model_dir, lr=1e-3, device="cpu", loss_kwargs={"kl_coef": 0.05},
                                lora=LoraConfig(enabled=True, rank=4, dropout=0.1), activation_checkpointing=ac)
            state = TrainerState.create(cfg, 0, 1)
            out[ac] = ([state.train_step(b) for b in batches], state.fingerprint(), sorted(state.model.state_dict()))
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
    (m0, fp0, names0), (m1, fp1, names1) = out[False], out[True]
    assert [(m["loss"], m["grad_norm"]) for m in m0] == [(m["loss"], m["grad_norm"]) for m in m1]
    assert fp0["params"] == fp1["params"] and fp0["optim"] == fp1["optim"] and names0 == names1


# ---------------------------------------------------------------------------------------- real processes
@integration
def test_b_zero_trainer_and_generator_logprobs_equal_the_base(loop, parts, batches):
    """A fresh adapter (B = 0) adds exact zeros: the trainer's logprobs equal its base's (adapters off), and
    the generator serving the pushed B = 0 adapter returns the base's greedy tokens and logprobs, bit for bit."""
    t1, _, gen = parts
    tokens = batches[0]["tokens_B_L"]
    lp, base = loop.run_until_complete(_gather(t1.call_one("logprobs", tokens), t1.call_one("base_logprobs", tokens)))
    assert torch.equal(lp, base)
    before = _greedy(loop, gen)
    assert all(c.policy_version == 0 for c in before)
    report = loop.run_until_complete(t1.call("push_weights", 1, [gen.actor]))[0]
    assert report["sent"] == 1 and not report["failed"], report
    info = loop.run_until_complete(t1.call_one("info"))
    assert report["bytes"] == info["trainable_params"] * 4  # the adapter alone (float32)
    after = _greedy(loop, gen)
    assert all(c.policy_version == 1 for c in after)
    for b, a in zip(before, after):
        assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs


@numerics
@integration
def test_two_fsdp_ranks_equal_one_rank_on_lora_steps(loop, parts, batches, model_dir, tmp_path):
    """Two LoRA steps (the reference from the base, kl_coef 0.05) on 1 rank with 1-row micro-batches and on
    2 FSDP2 ranks: the same metrics and the same adapters, as in test_trainer's 1 vs 2 processes.

    Step 1 starts from the same weights (B = 0: the base): each metric is a mean of smooth functions of the
    logprobs, so its relative error is their absolute error, the forward bound `tol` (numerics.model_tol); the
    gradient norm too. A step moves the two adapters apart by at most 2 * (lr / eps) * |dg| (m and v each carry
    the gradient; the (clipped) gradient's error is < 2 * tol times its norm, at most max_grad_norm = 1) plus one
    rounding of every weight; the next step's loss moves by at most grad_norm * |w1 - w2| more.
    """
    from safetensors.torch import load_file

    t1, t2, _ = parts

    def adapters(handle, name):
        loop.run_until_complete(handle.call("export_adapter", str(tmp_path / name)))
        return load_file(str(tmp_path / name / "adapter_model.safetensors"))

    def l2(a, b=None):
        return sum(float(((a[k].double() - (0 if b is None else b[k].double())) ** 2).sum()) for k in a) ** 0.5

    initial = adapters(t1, "initial")
    gap, gap_tol = 0.0, 0.0
    for step, batch in enumerate(batches[:2], start=1):
        tol = model_tol(model_dir, max_abs(loop.run_until_complete(t1.call_one("logprobs", batch["tokens_B_L"]))))
        m1, m2s = loop.run_until_complete(_gather(t1.call_one("train_step", batch), t2.call("train_step", batch)))
        assert m1["skipped"] == 0 and m1["step"] == step and m1["ref_from_base"] == 1.0, m1
        if step == 1:
            assert m1["kl_ref"] == 0.0  # B = 0: the policy is the base exactly
        for m2 in m2s:
            check(abs(m1["loss"] - m2["loss"]), tol * max(1.0, abs(m1["loss"])) + m1["grad_norm"] * gap,
                  f"step {step} loss")
            if step == 1:
                for key in ("grad_norm", "entropy", "kl_ref"):
                    check(abs(m1[key] - m2[key]), tol * max(1.0, abs(m1[key])), f"step 1 {key}")
                # a token whose ratio is within rounding of the clip edge may count on either side
                check(abs(m1["clip_frac"] - m2["clip_frac"]), 1.0 / m1["n_tokens"], "step 1 clip_frac")
        a1, a2 = adapters(t1, f"one-{step}"), adapters(t2, f"two-{step}")
        gap = l2(a1, a2)
        gap_tol += 2 * (m1["lr"] / ADAM_EPS) * 2 * tol * min(m1["grad_norm"], 1.0) + EPS * l2(a1)
        check(gap, gap_tol, f"|adapters(1 rank) - adapters(2 ranks)| (L2) after step {step}")
    assert l2(a1, initial) > 20 * gap_tol, "the adapters did not move: the comparison would prove nothing"
    # the 2-rank trainer's logprobs are HF + peft's on its own export (the same weights, two float32 forwards)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = batches[2]["tokens_B_L"]
    lp2 = loop.run_until_complete(t2.call("logprobs", tokens))[0]
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                     str(tmp_path / "two-2")).eval()
    with torch.no_grad():
        logits = peft(tokens[:, :-1]).logits
    want = torch.log_softmax(logits.double(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    check(max_abs_diff(lp2, want), model_tol(model_dir, max(max_abs(logits), max_abs(want))),
          "2-rank trainer vs HF + peft on its adapters: logprobs")
    info = loop.run_until_complete(t2.call("info"))[0]
    assert info["lora"] and info["trainable_params"] < info["params"] / 20


@numerics
@integration
def test_pushed_adapter_generator_equals_peft_and_trainer_merged(loop, parts, model_dir, tmp_path):
    """After the training steps: the generator with the pushed adapter, HF + peft on the exported adapter and
    HF with the trainer's merged export give the same logprobs on the generated sequences, each within 4x the
    float32 base model's distance to float64 of the float64 merged model (see test_adapter_on_fused_qkv...)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    t1, _, gen = parts
    report = loop.run_until_complete(t1.call("push_weights", 2, [gen.actor]))[0]
    assert report["sent"] == 1 and not report["failed"], report
    completions = _greedy(loop, gen, n_tokens=12)
    assert all(c.policy_version == 2 for c in completions)
    adapter_dir, merged_dir = str(tmp_path / "adapter"), str(tmp_path / "merged")
    loop.run_until_complete(t1.call("export_adapter", adapter_dir))
    loop.run_until_complete(t1.call("export_hf", merged_dir))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter_dir))

    def hf(path, dtype):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()

    peft_lp = _hf_logprobs(PeftModel.from_pretrained(hf(model_dir, torch.float32), adapter_dir).eval(), completions)
    merged_lp = _hf_logprobs(hf(merged_dir, torch.float32), completions)
    truth = _hf_logprobs(PeftModel.from_pretrained(hf(model_dir, torch.float64), adapter_dir).eval(), completions)
    base_err = _max_gap(_hf_logprobs(hf(model_dir, torch.float32), completions),
                        _hf_logprobs(hf(model_dir, torch.float64), completions))
    gen_lp = [torch.tensor(c.logprobs, dtype=torch.float64) for c in completions]
    base_gen = _hf_logprobs(hf(model_dir, torch.float64), completions)
    # the model's float32 forward bound at these logprobs' scale (numerics.model_tol; see test_adapter_on_fused_qkv)
    tol = model_tol(model_dir, max(max_abs(x) for x in truth))
    assert base_err <= tol  # float32 HF on the base itself
    assert _max_gap(truth, base_gen) > 10 * tol, "the adapter does not change the logprobs: nothing is compared"
    for name, lp in (("generator", gen_lp), ("peft", peft_lp), ("trainer merged", merged_lp)):
        check(_max_gap(lp, truth), tol, f"{name} vs float64 HF + peft")


def _check_cli_export(loop, trainer, ckpt: str, tmp_path) -> None:
    """`forgelab export CKPT [--merge]` (a separate process, no actor) writes what the live trainer exports."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    live_adapter, live_merged = str(tmp_path / "live-adapter"), str(tmp_path / "live-merged")
    loop.run_until_complete(trainer.call("export_adapter", live_adapter))
    loop.run_until_complete(trainer.call("export_hf", live_merged))
    for flags, live, name in (([], live_adapter, "adapter_model.safetensors"),
                              (["--merge"], live_merged, "model.safetensors")):
        out = str(tmp_path / f"cli{len(flags)}")
        proc = subprocess.run([sys.executable, "-m", "forgelab.cli", "export", ckpt, "--out", out, *flags],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        assert summary["kind"] == ("merged" if flags else "adapter") and summary["out"] == out
        got, want = load_file(os.path.join(out, name)), load_file(os.path.join(live, name))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)  # the same tensors


@integration
def test_lora_checkpoint_resumes_exactly_and_refuses_another_base(loop, parts, batches, tmp_path):
    _, t2, _ = parts
    ckpt = str(tmp_path / "ckpt")
    loop.run_until_complete(t2.call("save", ckpt))
    import math

    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora." in k for k in model_keys)  # the adapters, not one base weight
    elements = sum(math.prod(v.size) for k, v in saved.items() if getattr(v, "size", None) and "step" not in k)
    info = loop.run_until_complete(t2.call("info"))[0]
    assert elements == 3 * info["trainable_params"]  # adapters + AdamW's two moments
    _check_cli_export(loop, t2, ckpt, tmp_path)
    first = loop.run_until_complete(t2.call("train_step", batches[2]))
    fp_first = loop.run_until_complete(t2.call("fingerprint"))
    loop.run_until_complete(t2.call("load", ckpt))
    again = loop.run_until_complete(t2.call("train_step", batches[2]))
    assert [m["loss"] for m in again] == [m["loss"] for m in first]  # bit-identical
    assert loop.run_until_complete(t2.call("fingerprint")) == fp_first
    other = str(tmp_path / "other-base")
    shutil.copytree(ckpt, other)
    for rank in (0, 1):
        path = os.path.join(other, f"trainer_rank{rank}.pkl")
        with open(path, "rb") as f:
            extra = pickle.load(f)
        extra["lora"]["base_sha256"] = "0" * 64  # as saved by a trainer on another base
        with open(path, "wb") as f:
            pickle.dump(extra, f)
    with pytest.raises(Exception, match="LoRA adapters trained on the base"):
        loop.run_until_complete(t2.call("load", other))


@integration
@pytest.mark.timeout(600)
def test_lora_run_swaps_loss_compares_losses_and_resumes_exactly(loop, lora_pool, tmp_path):
    """A synchronous LoRA run (max_policy_age 0: its learning metrics are a function of the seed): a loss swap
    asked after step 2 lands at step 3, `compare_losses` runs on the adapters, a run resumed from the step-4
    checkpoint and a fork of it (`Run.fork_from`, no overrides) reproduce steps 5-6 exactly
    (`forgelab.experiments.replay.compare_metrics`: every learning column), and `Run.replay` of the run
    reproduces all six steps with the swap at its recorded step."""
    import pandas as pd

    from forgelab.config.components import LoraConfig
    from forgelab.config.run_config import EvalConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig
    from forgelab.experiments.replay import compare_metrics
    from forgelab.run import Run

    def config(name: str) -> RunConfig:
        return RunConfig(
            name=name, lora=LoraConfig(enabled=True, rank=RANK, alpha=ALPHA),
            rollout=RolloutConfig(task="addition", group_size=8, prompts_per_rollout=2, concurrency=2, max_tokens=8),
            train=TrainConfig(steps=6, batch_size=16, lr=2e-3, warmup_steps=1, max_policy_age=0, seed=3,
                              loss_kwargs={"kl_coef": 0.02}),
            eval=EvalConfig(every=0, n=16), tracking=TrackingConfig(out_dir=str(tmp_path), wandb=False,
                                                                     checkpoint_every=4))

    # the four runs share one set of LoRA processes (the module's, spawned by the first): re-initialised
    # per run (each run still restores its own state: a resume or fork from its checkpoint, the replay from the
    # manifest)
    pool = lora_pool
    run = Run(config("lora-a"), spawn=pool)
    swaps = []
    run.add_listener(lambda row: row.get("step") == 2 and swaps.append(asyncio.ensure_future(run.set_loss("dapo"))))
    try:
        loop.run_until_complete(run.start())
        loop.run_until_complete(run.wait())
        loop.run_until_complete(asyncio.gather(*swaps))
        assert run.state == "finished", run.message
        ab = loop.run_until_complete(run.compare_losses(["grpo", "dapo"]))
        print(ab)
        assert ab.unchanged and all(r["ok"] and r["grad_norm"] > 0 for r in ab.losses)  # gradients of the adapters
    finally:
        loop.run_until_complete(run.shutdown())
    original = pd.read_csv(run.out_dir / "metrics.csv")
    at = [e["applies_at_step"] for e in run.events if e["kind"] == "loss_swapped"]
    assert len(at) == 1 and at[0] >= 3  # asked after step 2: lands at a later step boundary, recorded
    assert list(original["loss_name"]) == ["grpo"] * (at[0] - 1) + ["dapo"] * (7 - at[0])
    # grpo (kl_coef 0.02) takes the reference from the base; dapo as set_loss sets it (kl_coef 0) reads none: no
    # base pass, no kl_ref (issue 42)
    grpo_rows = original["loss_name"] == "grpo"
    assert (original.loc[grpo_rows, "ref_from_base"] == 1.0).all() and original.loc[grpo_rows, "kl_ref"].iloc[-1] > 0
    assert original.loc[~grpo_rows, "kl_ref"].isna().all() and original.loc[~grpo_rows, "ref_from_base"].isna().all()
    resumed = Run(config("lora-b"), resume_from=str(run.out_dir / "checkpoints"), spawn=pool)
    try:
        loop.run_until_complete(resumed.start())
        assert resumed.step == 4
        loop.run_until_complete(resumed.wait())
        assert resumed.state == "finished", resumed.message
    finally:
        loop.run_until_complete(resumed.shutdown())
    again = pd.read_csv(resumed.out_dir / "metrics.csv")
    assert list(again["step"])[-2:] == [5, 6]
    assert compare_metrics(original[original["step"] > 4], again[again["step"] > 4]) == []
    # a fork of the step-4 checkpoint with no overrides trains steps 5-6 as the parent did
    child = loop.run_until_complete(Run.fork_from(run.out_dir / "checkpoints" / "step_000004", name="lora-fork",
                                                 pool=pool))
    try:
        assert child.config.lora.enabled and child.reference is None
        loop.run_until_complete(child.wait())
        assert child.state == "finished", child.message
    finally:
        loop.run_until_complete(child.shutdown())
    forked = pd.read_csv(child.out_dir / "metrics.csv")
    assert list(forked["step"])[-2:] == [5, 6]  # the child's metrics start with the parent's rows 1-4
    assert compare_metrics(original[original["step"] > 4], forked[forked["step"] > 4]) == []
    # the replay re-runs all 6 steps from the manifest, the loss swap at its recorded step included
    report = loop.run_until_complete(Run.replay(run.out_dir, name="lora-replay", spawn=pool))
    print(report)
    assert report.ok and report.steps == 6, report
    print(pool, pool.last_note)


@integration
@pytest.mark.timeout(600)
def test_lora_grpo_raises_heldout_addition_accuracy(loop, grpo_config, lora_pool, tmp_path):
    """LoRA GRPO on the shipped model (rank 8 on every projection, lr 2e-3, 150 steps of 64 episodes; the
    reference from the base, no reference process): held-out greedy accuracy on 200 problems rises by >= 15
    points. Measured here: 0.25 -> 0.495 and 0.25 -> 0.45 (two runs; asynchronous runs are not bit-reproducible),
    1.6-2.8 min on 2 busy cores; 100 steps gave 0.25 -> 0.425, lr 4e-3 was unstable (0.13 at step 25).
    With a share q of the 200 problems flipping either way the paired standard error of the rise is sqrt(q / 200):
    <= 0.042 for q <= 0.35, so a run that truly gains ~0.22 misses 0.15 with probability ~5 % at worst.
    Not shortened (issue #39): 100 steps gave 0.25 -> 0.425 before and 0.25 -> 0.41 (train.seed 0, 2026-11-27),
    a rise 0.01-0.025 above the threshold; it takes the swap test's processes (`lora_pool`) instead of a cold
    start."""
    from forgelab.config.components import LoraConfig
    from forgelab.run import Run

    cfg = grpo_config(tmp_path, name="lora", steps=150)
    cfg.train.lr = 2e-3
    cfg.lora = LoraConfig(enabled=True, rank=RANK, alpha=ALPHA)
    run = Run(cfg, spawn=lora_pool)
    try:
        loop.run_until_complete(run.start())
        assert run.reference is None  # the base is the reference: no process for it
        loop.run_until_complete(run.wait())
        assert run.state == "finished", run.message
        before, after = run.accuracy_history[0][1], run.accuracy_history[-1][1]
        print(f"LoRA GRPO held-out accuracy {before:.3f} -> {after:.3f}; {run.accuracy_history}")
        assert after - before >= 0.15, run.accuracy_history
        df = run.metrics
        assert df["kl_ref"].iloc[-10:].mean() > 0  # the reference (the base) and the policy have parted
    finally:
        loop.run_until_complete(run.shutdown())
