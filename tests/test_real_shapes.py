"""A real architecture through the whole loop: the Qwen3-0.6B shape (tied embeddings, full 151,936 vocabulary,
full width) at reduced depth, random weights (`forgelab.recipes.real_shapes`).

One Run is shared by the module (vLLM generator, torchtitan trainer, reference, shared-memory weight sync);
the tests run in file order: the weight-sync check reads the state the run ended in, the resume check then
takes extra trainer steps.
"""
import math

import pytest
import torch

LAYERS = 2


@pytest.fixture(scope="module")
def qwen3_dir():
    from forgelab.recipes.real_shapes import real_shape_checkpoint

    return real_shape_checkpoint("qwen3-0.6b", layers=LAYERS, max_position_embeddings=512)


@pytest.fixture(scope="module")
def run(loop, qwen3_dir, tmp_path_factory):
    from forgelab.config import EvalConfig, ModelConfig, PlacementConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig
    from forgelab.run import Run

    cfg = RunConfig(
        name="qwen3",
        model=ModelConfig(path=qwen3_dir, max_model_len=64),
        rollout=RolloutConfig(task="addition", group_size=2, prompts_per_rollout=2, concurrency=1, max_tokens=4),
        # lr 1e-3: a step moves logprobs by far more than the 1e-4 sync tolerance (checked below)
        train=TrainConfig(steps=2, batch_size=4, lr=1e-3, warmup_steps=1, max_policy_age=1, seed=0),
        eval=EvalConfig(every=0, n=2),
        tracking=TrackingConfig(out_dir=str(tmp_path_factory.mktemp("run")), wandb=False),
        placement=PlacementConfig(reference=True),
    )
    r = Run(cfg)
    # a random model never answers: this reward varies between samples so advantages (and gradients) are not zero
    r.add_reward("char_code", lambda prompt, completion, target, **info: sum(map(ord, completion)) % 7 / 7)
    loop.run_until_complete(r.start())
    loop.run_until_complete(r.wait())
    yield r
    loop.run_until_complete(r.shutdown())


def _hf_logprobs(model_dir: str, ids: list[int], n_prompt: int) -> torch.Tensor:
    """HF transformers' fp32 logprobs of ``ids[n_prompt:]`` given what precedes each (independent of forgelab)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "HF did not tie"
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    return torch.tensor([float(logp[t - 1, ids[t]]) for t in range(n_prompt, len(ids))])


@pytest.mark.integration
def test_run_trains_a_few_steps(run):
    assert run.state == "finished", run.message
    df = run.metrics
    assert len(df) == 2
    for col in ("loss", "grad_norm", "entropy", "kl_ref", "weight_sync_ms"):
        assert df[col].map(math.isfinite).all(), (col, df[col].tolist())
    # random weights: near-uniform next-token distributions over the full vocabulary
    assert 0.5 * math.log(151936) < df["entropy"].iloc[0] <= math.log(151936) + 1e-3
    assert (df["grad_norm"] > 0).all()


async def _sample_and_export(run, out: str):
    """A fresh sample from the generator, the trainer's HF export and the trainer's logprobs of the same tokens."""
    from forgelab.generator import SamplingConfig

    versions = await run.generators.fanout("version")
    prompt = run.tokenizer.encode("12+34=", add_special_tokens=False)
    groups = await run.generators.route("generate", [prompt], n=1,
                                        sampling=SamplingConfig(temperature=1.0, max_tokens=8))
    await run.trainer.call("export_hf", out)
    ids = prompt + groups[0][0].completion_ids
    trainer_lp = (await run.trainer.call("logprobs", torch.tensor([ids])))[0][0, len(prompt) - 1:]
    return versions, prompt, groups[0][0], trainer_lp


def _check_sync(completion, prompt, out, trainer_lp, old_dir):
    ids = prompt + completion.completion_ids
    hf_lp = _hf_logprobs(out, ids, len(prompt))
    gen_lp = torch.tensor(completion.logprobs, dtype=torch.float64)
    print("generator", gen_lp.tolist(), "\nHF export", hf_lp.tolist())
    assert (gen_lp - hf_lp).abs().max() < 1e-4, (gen_lp - hf_lp).abs().max()
    assert (trainer_lp.double() - hf_lp).abs().max() < 1e-4, (trainer_lp.double() - hf_lp).abs().max()
    # the check can fail: the previous weights score the same tokens differently
    before = _hf_logprobs(old_dir, ids, len(prompt))
    assert (before - hf_lp).abs().max() > 1e-2, (before - hf_lp).abs().max()


def _batch(tokens_B_L: torch.Tensor, gen_lp_B_T: torch.Tensor) -> dict:
    B, L = tokens_B_L.shape
    return {"tokens_B_L": tokens_B_L, "mask_B_T": torch.ones(B, L - 1), "generator_logprobs_B_T": gen_lp_B_T,
            "advantages_B": torch.linspace(1.0, -1.0, B)}


@pytest.mark.integration
def test_generator_logprobs_equal_hf_with_exported_weights(loop, run, qwen3_dir, tmp_path):
    """After a weight push (tied embedding included), vLLM scores a sequence as HF does with the trainer's
    exported weights: through shared memory (the run's own pushes), then through a message after one more step."""
    out1 = str(tmp_path / "export1")
    versions, prompt, completion, trainer_lp = loop.run_until_complete(_sample_and_export(run, out1))
    assert all(v == run.version for v in versions), (versions, run.version)
    assert completion.policy_version == run.version
    _check_sync(completion, prompt, out1, trainer_lp, qwen3_dir)
    import safetensors

    with safetensors.safe_open(f"{out1}/model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: the embedding is the output projection

    async def step_and_push_by_message():
        tokens = torch.randint(0, 151936, (2, 10), generator=torch.Generator().manual_seed(1))
        gen_lp = (await run.trainer.call("logprobs", tokens))[0]
        m = (await run.trainer.call("train_step", _batch(tokens, gen_lp)))[0]
        assert not m["skipped"], m
        actors = [h.actor for h in run.generators.handles() if h is not None]
        return (await run.trainer.call("push_weights", run.version + 1, actors, "message"))[0]

    report = loop.run_until_complete(step_and_push_by_message())
    assert report["transport"] == "message" and not report["failed"], report
    out2 = str(tmp_path / "export2")
    versions, prompt, completion, trainer_lp = loop.run_until_complete(_sample_and_export(run, out2))
    assert all(v == run.version + 1 for v in versions) and completion.policy_version == run.version + 1
    _check_sync(completion, prompt, out2, trainer_lp, out1)


@pytest.mark.integration
def test_resume_is_exact(loop, run, tmp_path):
    """save -> step -> load -> the same step: identical parameters, optimizer state and loss."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 151936, (2, 10), generator=g)

    async def go():
        tr = run.trainer
        batch = _batch(tokens, (await tr.call("logprobs", tokens))[0])
        await tr.call("save", str(tmp_path / "ck"))
        saved = (await tr.call("fingerprint"))[0]
        first = (await tr.call("train_step", batch))[0]
        after_first = (await tr.call("fingerprint"))[0]
        await tr.call("load", str(tmp_path / "ck"))
        loaded = (await tr.call("fingerprint"))[0]
        second = (await tr.call("train_step", batch))[0]
        after_second = (await tr.call("fingerprint"))[0]
        return saved, first, after_first, loaded, second, after_second

    saved, first, after_first, loaded, second, after_second = loop.run_until_complete(go())
    assert not first["skipped"], first
    assert loaded == saved
    assert after_first["params"] != saved["params"]
    assert second["loss"] == first["loss"] and second["grad_norm"] == first["grad_norm"]
    assert after_second == after_first


def _grads(h0, w0, y_B_T, a_B_T, b_B_T, chunk):
    """``(logprobs, entropy, dL/dh, dL/dw)`` of ``L = sum(a * logprobs + b * entropy)``, full logits if chunk is None."""
    from forgelab.algos.logprobs import chunked_logprobs_entropy, gather_logprobs, token_entropy

    h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    if chunk is None:
        z = h @ w.t()
        if h.dtype == torch.float64:  # the textbook formulas, independent of forgelab
            logp = torch.log_softmax(z, -1)
            lp, ent = logp.gather(-1, y_B_T.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)
        else:
            lp, ent = gather_logprobs(z, y_B_T), token_entropy(z)
    else:
        lp, ent = chunked_logprobs_entropy(h, w, y_B_T, chunk=chunk)
    (lp * a_B_T + ent * b_B_T).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _rel(x, ref):
    return float((x.double() - ref.double()).abs().max()) / max(1.0, float(ref.abs().max()))


@pytest.mark.slow  # writes the 748 MB reduced-depth checkpoint, float64 over the full vocabulary
def test_chunked_logprobs_entropy_and_gradients_equal_full(qwen3_dir):
    """Chunked logprobs, entropy and their gradients equal the full-logits computation.

    fp32, vocabulary 4,096: within 1e-6 (relative to the largest magnitude, floor 1).
    The real output projection (the tied embedding, 151,936 x 1,024): values within 1e-6; gradients sum
    151,936 products, where fp32 itself is ~2e-6 from the float64 truth for the full computation too, so
    there the chunked gradients must be as close to float64 as the full ones (within 2x) and within 2e-5 of them.
    float64: equal to the textbook formulas to 1e-10, and torch.autograd.gradcheck passes.
    """
    from safetensors import safe_open

    from forgelab.algos.logprobs import chunked_logprobs_entropy

    g = torch.Generator().manual_seed(0)
    B, T = 2, 5
    y_B_T = torch.randint(0, 4096, (B, T), generator=g)
    a_B_T, b_B_T = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    names = ("logprobs", "entropy", "grad_h", "grad_w")

    h0, w0 = torch.randn(B, T, 256, generator=g), 0.05 * torch.randn(4096, 256, generator=g)
    full = _grads(h0, w0, y_B_T, a_B_T, b_B_T, None)
    for chunk in (1, 3, 4, 64):
        for name, x, ref in zip(names, _grads(h0, w0, y_B_T, a_B_T, b_B_T, chunk), full):
            assert _rel(x, ref) <= 1e-6, (chunk, name, _rel(x, ref))

    with safe_open(f"{qwen3_dir}/model.safetensors", "pt") as f:
        w_V_D = f.get_tensor("model.embed_tokens.weight")
    V, D = w_V_D.shape
    assert (V, D) == (151936, 1024)
    y_B_T = torch.randint(0, V, (B, T), generator=g)
    h0 = torch.randn(B, T, D, generator=g)
    truth = _grads(h0.double(), w_V_D.double(), y_B_T, a_B_T.double(), b_B_T.double(), None)
    full = _grads(h0, w_V_D, y_B_T, a_B_T, b_B_T, None)
    for chunk in (3, 64):
        chunked = _grads(h0, w_V_D, y_B_T, a_B_T, b_B_T, chunk)
        for name, x, ref, exact in zip(names, chunked, full, truth):
            print(f"chunk {chunk} {name}: vs full {_rel(x, ref):.2e}, vs fp64 {_rel(x, exact):.2e} "
                  f"(full vs fp64 {_rel(ref, exact):.2e})")
            if name in ("logprobs", "entropy"):
                assert _rel(x, ref) <= 1e-6, (chunk, name, _rel(x, ref))
            else:
                assert _rel(x, ref) <= 2e-5, (chunk, name, _rel(x, ref))
                assert _rel(x, exact) <= 2 * _rel(ref, exact) + 1e-7, (chunk, name, _rel(x, exact), _rel(ref, exact))

    # the maths, in float64 (no rounding to hide behind)
    chunked = _grads(h0.double(), w_V_D.double(), y_B_T, a_B_T.double(), b_B_T.double(), 3)
    for name, x, exact in zip(names, chunked, truth):
        assert _rel(x, exact) <= 1e-10, (name, _rel(x, exact))
    small_h = torch.randn(2, 3, 8, dtype=torch.float64, generator=g, requires_grad=True)
    small_w = torch.randn(11, 8, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda hh, ww: chunked_logprobs_entropy(hh, ww, y_B_T[:, :3] % 11, chunk=4), (small_h, small_w)
    )


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "qwen3-1.7b", "llama-3.2-1b"])
def test_plan_counts_the_real_parameters(shape):
    """The planner's parameter count is HF's for each shape (its model built on the meta device; tied counted once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from forgelab.plan import ModelShape
    from forgelab.recipes.real_shapes import real_shape_config

    cfg = real_shape_config(shape)
    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    assert ModelShape.from_hf(cfg).params == sum(p.numel() for p in model.parameters())


def test_plan_says_what_does_not_fit(tmp_path):
    from forgelab.config import RunConfig
    from forgelab.plan import plan_memory
    from forgelab.recipes.real_shapes import real_shape_checkpoint

    d = real_shape_checkpoint("qwen3-1.7b", out=str(tmp_path / "q"), config_only=True)
    cfg = RunConfig.from_dict({
        "model": {"path": d, "max_model_len": 2048, "dtype": "bfloat16"},
        "rollout": {"group_size": 16, "prompts_per_rollout": 16}, "train": {"batch_size": 256},
        "placement": {"generator_replicas": 2, "trainer_procs": 4},
        "trainer": {"micro_batch_size": 8}, "reference": {"micro_batch_size": 16},
    })
    ok = plan_memory(cfg, gpus=8, gpu_mem_gib=80)
    assert ok.fits, ok.table()
    trainer = ok.by_name()["trainer"]
    # 16 bytes a parameter (fp32 weights, grads, two AdamW moments), split over the 4 FSDP ranks
    assert trainer.terms["parameters"] + trainer.terms["gradients"] + trainer.terms["optimizer (AdamW)"] == \
        pytest.approx(16 * 1_720_574_976 / 4)
    tight = plan_memory(cfg, gpus=4, gpu_mem_gib=24)
    assert not tight.fits
    text = tight.table()
    assert "7 processes each need their own GPU" in text and "trainer needs" in text, text
    # without micro-batches, a rank's 64 rows x 2,047 tokens of activations is the term that cannot fit
    whole = RunConfig.from_dict({**cfg.to_dict(), "trainer": {"micro_batch_size": None}})
    text = plan_memory(whole, gpus=8, gpu_mem_gib=80).table()
    assert "trainer needs" in text and "largest term: activations" in text, text
