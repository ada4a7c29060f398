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


@pytest.mark.integration
def test_generator_logprobs_equal_hf_with_exported_weights(loop, run, qwen3_dir, tmp_path):
    """After the run's last weight push (tied embedding included), vLLM scores a fixed sequence as HF does with
    the trainer's exported weights, and both differ from the step-0 weights by much more than the tolerance."""
    from forgelab.generator import SamplingConfig

    async def go():
        versions = await run.generators.fanout("version")
        prompt = run.tokenizer.encode("12+34=", add_special_tokens=False)
        groups = await run.generators.route("generate", [prompt], n=1,
                                            sampling=SamplingConfig(temperature=1.0, max_tokens=8))
        out = str(tmp_path / "export")
        await run.trainer.call("export_hf", out)
        trainer_lp = (await run.trainer.call("logprobs", torch.tensor([prompt + groups[0][0].completion_ids])))[0]
        return versions, prompt, groups[0][0], out, trainer_lp

    versions, prompt, completion, out, trainer_lp = loop.run_until_complete(go())
    assert all(v == run.version for v in versions), (versions, run.version)
    assert completion.policy_version == run.version
    ids = prompt + completion.completion_ids
    hf_lp = _hf_logprobs(out, ids, len(prompt))
    gen_lp = torch.tensor(completion.logprobs, dtype=torch.float64)
    print("generator", gen_lp.tolist(), "\nHF export", hf_lp.tolist())
    assert (gen_lp - hf_lp).abs().max() < 1e-4, (gen_lp - hf_lp).abs().max()
    assert (trainer_lp[0, len(prompt) - 1:].double() - hf_lp).abs().max() < 1e-4
    # the check can fail: the step-0 weights score the same tokens differently
    step0 = _hf_logprobs(qwen3_dir, ids, len(prompt))
    assert (step0 - hf_lp).abs().max() > 1e-2, (step0 - hf_lp).abs().max()
    import safetensors

    with safetensors.safe_open(f"{out}/model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: the embedding is the output projection


@pytest.mark.integration
def test_resume_is_exact(loop, run, tmp_path):
    """save -> step -> load -> the same step: identical parameters, optimizer state and loss."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 151936, (2, 10), generator=g)

    async def go():
        tr = run.trainer
        gen_lp = (await tr.call("logprobs", tokens))[0]
        batch = {"tokens_B_L": tokens, "mask_B_T": torch.ones(2, 9), "generator_logprobs_B_T": gen_lp,
                 "advantages_B": torch.tensor([1.0, -1.0])}
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
