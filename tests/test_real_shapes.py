"""Real architectures through the whole loop, random weights (`forgelab.recipes.real_shapes`), reduced depth,
full width and vocabulary: the Qwen3-0.6B shape (tied embeddings, 151,936 tokens) and the Llama-3.2-1B shape
(tied embeddings, 128,256 tokens, llama3 RoPE scaling).

One Run per shape is shared by the module (vLLM generator, torchtitan trainer, shared-memory weight sync; the
Qwen3 run also a reference model). Tests take the run through ``@on(...)`` (indirect parametrization of the
module-scoped fixture), so pytest runs every Qwen3 test, tears that run down, then starts the Llama one: the two
never hold memory together. The run-free chunked-logprobs check comes first in the file, before any run exists.
Within a shape the tests run in file order: the weight-sync check reads the state the run ended in, the resume
and FSDP checks then take extra trainer steps.
"""
import math
import os

import pytest
import torch

from numerics import check, fp32_tol, max_abs, max_abs_diff, model_tol

LAYERS = 2
STEPS = {"qwen3-0.6b": 2, "llama-3.2-1b": 1}
"""Run steps per shape: the Llama run only needs one step to move its weights before the sync check."""


def on(*shapes):
    """Run the test on the shared Run of each shape in ``shapes``."""
    return pytest.mark.parametrize("run", shapes, indirect=True)


def _checkpoint(shape: str) -> str:
    from forgelab.recipes.real_shapes import real_shape_checkpoint

    return real_shape_checkpoint(shape, layers=LAYERS, max_position_embeddings=512)


def _vocab(run) -> int:
    import json
    import os

    with open(os.path.join(run.config.model.path, "config.json")) as f:
        return json.load(f)["vocab_size"]


@pytest.fixture(scope="module", autouse=True)
def _every_core():
    """This file runs alone (the root conftest's EXCLUSIVE), so its own float64 and HF work takes every core: the
    suite's conftest gives a test worker one thread, for files that run beside the other worker."""
    threads = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def qwen3_dir():
    return _checkpoint("qwen3-0.6b")


@pytest.fixture(scope="module")
def run(request, loop, tmp_path_factory):
    from forgelab.config.run_config import EvalConfig, ModelConfig, PlacementConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig
    from forgelab.run import Run

    shape = request.param
    cfg = RunConfig(
        name=shape.split("-")[0],
        model=ModelConfig(path=_checkpoint(shape), max_model_len=64),
        rollout=RolloutConfig(task="addition", group_size=2, prompts_per_rollout=2, concurrency=1, max_tokens=4),
        # lr 1e-3: a step moves logprobs by far more than the 1e-4 sync tolerance (checked below)
        train=TrainConfig(steps=STEPS[shape], batch_size=4, lr=1e-3, warmup_steps=STEPS[shape] - 1, max_policy_age=1,
                          seed=0),
        eval=EvalConfig(every=0, n=2),
        tracking=TrackingConfig(out_dir=str(tmp_path_factory.mktemp("run")), wandb=False),
        # the reference is the same code on either shape: the Qwen3 run checks it, the Llama run saves its memory
        placement=PlacementConfig(reference=shape.startswith("qwen3")),
    )
    r = Run(cfg)
    # a random model never answers: this reward varies between samples so advantages (and gradients) are not zero
    r.add_reward("char_code", lambda prompt, completion, target, **info: sum(map(ord, completion)) % 7 / 7)
    loop.run_until_complete(r.start())
    loop.run_until_complete(r.wait())
    yield r
    loop.run_until_complete(r.shutdown())


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


def _fp32_bounds(h_B_T_D, w_V_D, y_B_T, a_B_T, b_B_T) -> dict[str, float]:
    """How far float32 `_grads` results may be from the float64 truth, from float64 magnitudes (numerics.py).

    z = h @ w.T sums D products: dz = fp32_tol(max sum_d |h||w|, n=D). logprob z_y - logsumexp(z): 2 dz, plus
    the logsumexp's V-term sum (the log carries its relative error: fp32_tol(1, n=V)). Entropy H: dH/dz_v =
    -p_v (log p_v + H) sums to at most 2H in absolute value, so 2H * dz, plus its own V-term sum of p |log p|
    (which add up to H): fp32_tol(H, n=V). Gradients: dL/dz = a (onehot - p) - b p (log p + H) =: g, whose
    p-terms carry the logprobs' and entropy's errors (relative to E = |a| p + |b| p (|log p + H| + 1), at
    most tol_lp + tol_ent); dL/dh = g @ w sums V terms, dL/dw = g.T @ h sums the B*T rows:
    fp32_tol(max |g| @ |w|, n=V) + max E @ |w| * (tol_lp + tol_ent), and the same with g.T @ |h|, n=B*T.
    """
    h, w = h_B_T_D.double().flatten(0, 1), w_V_D.double()
    y, a, b = y_B_T.flatten(), a_B_T.double().flatten()[:, None], b_B_T.double().flatten()[:, None]
    (N, D), V = h.shape, w.shape[0]
    z = h @ w.t()
    dz = fp32_tol(float((h.abs() @ w.abs().t()).max()), n=D)
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    H = -(p * logp).sum(-1, keepdim=True)
    tol_lp = 2 * dz + fp32_tol(1.0, n=V)
    tol_ent = 2 * float(H.max()) * dz + fp32_tol(float(H.max()), n=V)
    g = -a * p - b * p * (logp + H)
    g[torch.arange(N), y] += a[:, 0]
    E = (a.abs() + b.abs() * ((logp + H).abs() + 1)) * p
    return {"logprobs": tol_lp, "entropy": tol_ent,
            "grad_h": fp32_tol(float((g.abs() @ w.abs()).max()), n=V) + float((E @ w.abs()).max()) * (tol_lp + tol_ent),
            "grad_w": fp32_tol(float((g.abs().t() @ h.abs()).max()), n=N) + float((E.t() @ h.abs()).max()) * (tol_lp + tol_ent)}


@pytest.mark.numerics
@pytest.mark.slow  # writes the 748 MB reduced-depth checkpoint, float64 over the full vocabulary
def test_chunked_logprobs_entropy_and_gradients_equal_full(qwen3_dir):
    """Chunked logprobs, entropy and their gradients equal the full-logits computation.

    float32, vocabulary 4,096 and the real output projection (the tied embedding, 151,936 x 1,024): chunked
    and full results are each within the float32 bound of the float64 textbook computation (`_fp32_bounds`:
    from the lengths of the sums and the float64 magnitudes of their terms), whatever the kernels' order.
    A chunk's share of the tied embedding's gradient lost puts grad_w 3.2 off (bound 1.3e-4, vocabulary
    4,096); the entropy's gradient dropped, grad_h 1.1e-2 off (bound 2.6e-4) and, on the real projection,
    grad_w 1.2e-3 (bound 2.3e-5).
    float64: equal to the textbook formulas to 1e-10 (float64 rounding of these sums is ~1e-13), and
    torch.autograd.gradcheck passes.
    """
    from safetensors import safe_open

    from forgelab.algos.logprobs import chunked_logprobs_entropy

    g = torch.Generator().manual_seed(0)
    B, T = 2, 5
    y_B_T = torch.randint(0, 4096, (B, T), generator=g)
    a_B_T, b_B_T = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    names = ("logprobs", "entropy", "grad_h", "grad_w")

    h0, w0 = torch.randn(B, T, 256, generator=g), 0.05 * torch.randn(4096, 256, generator=g)
    truth = _grads(h0.double(), w0.double(), y_B_T, a_B_T.double(), b_B_T.double(), None)
    tol = _fp32_bounds(h0, w0, y_B_T, a_B_T, b_B_T)
    for chunk in (None, 1, 3, 4, 64):
        for name, x, exact in zip(names, _grads(h0, w0, y_B_T, a_B_T, b_B_T, chunk), truth):
            check(max_abs_diff(x, exact), tol[name], f"V=4096, chunk {chunk or 'none (full)'}: {name} vs float64")

    with safe_open(f"{qwen3_dir}/model.safetensors", "pt") as f:
        w_V_D = f.get_tensor("model.embed_tokens.weight")
    V, D = w_V_D.shape
    assert (V, D) == (151936, 1024)
    y_B_T = torch.randint(0, V, (B, T), generator=g)
    h0 = torch.randn(B, T, D, generator=g)
    truth = _grads(h0.double(), w_V_D.double(), y_B_T, a_B_T.double(), b_B_T.double(), None)
    tol = _fp32_bounds(h0, w_V_D, y_B_T, a_B_T, b_B_T)
    for chunk in (None, 3, 64):
        for name, x, exact in zip(names, _grads(h0, w_V_D, y_B_T, a_B_T, b_B_T, chunk), truth):
            print(f"chunk {chunk} {name}: vs fp64 {max_abs_diff(x, exact):.2e} (bound {tol[name]:.2e})")
            check(max_abs_diff(x, exact), tol[name], f"V={V}, chunk {chunk or 'none (full)'}: {name} vs float64")

    # the maths, in float64 (no rounding to hide behind)
    chunked = _grads(h0.double(), w_V_D.double(), y_B_T, a_B_T.double(), b_B_T.double(), 3)
    for name, x, exact in zip(names, chunked, truth):
        assert _rel(x, exact) <= 1e-10, (name, _rel(x, exact))
    small_h = torch.randn(2, 3, 8, dtype=torch.float64, generator=g, requires_grad=True)
    small_w = torch.randn(11, 8, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda hh, ww: chunked_logprobs_entropy(hh, ww, y_B_T[:, :3] % 11, chunk=4), (small_h, small_w)
    )


def _hf_logprobs(model_dir: str, ids: list[int], n_prompt: int) -> torch.Tensor:
    """HF transformers' fp32 logprobs of ``ids[n_prompt:]`` given what precedes each (independent of forgelab).

    Random weights: the logits are near 0 and the logprobs near -log V, so the logprobs' magnitude is the scale
    of the forward bound below."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "HF did not tie"
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    return torch.tensor([float(logp[t - 1, ids[t]]) for t in range(n_prompt, len(ids))])


@pytest.mark.integration
@on("qwen3-0.6b", "llama-3.2-1b")
def test_run_trains_a_few_steps(run):
    assert run.state == "finished", run.message
    df = run.metrics
    assert len(df) == run.config.train.steps
    cols = ("loss", "grad_norm", "entropy", "weight_sync_ms") + (("kl_ref",) if run.config.placement.reference else ())
    for col in cols:
        assert df[col].map(math.isfinite).all(), (col, df[col].tolist())
    # random weights: near-uniform next-token distributions over the full vocabulary
    V = _vocab(run)
    assert 0.5 * math.log(V) < df["entropy"].iloc[0] <= math.log(V) + 1e-3
    assert (df["grad_norm"] > 0).all()


async def _sample_and_export(run, out: str | None, trainer=None):
    """A fresh sample from the generator, the HF export (to ``out``; None: none) and logprobs of the same tokens
    of ``trainer`` (the run's)."""
    from forgelab.engines.generator import SamplingConfig

    trainer = trainer or run.trainer
    versions = await run.generators.fanout("version")
    prompt = run.tokenizer.encode("12+34=", add_special_tokens=False)
    groups = await run.generators.route("generate", [prompt], n=1,
                                        sampling=SamplingConfig(temperature=1.0, max_tokens=8))
    if out is not None:
        await trainer.call("export_hf", out)
    ids = prompt + groups[0][0].completion_ids
    trainer_lp = (await trainer.call("logprobs", torch.tensor([ids])))[0][0, len(prompt) - 1:]
    return versions, prompt, groups[0][0], trainer_lp


def _check_sync(completion, prompt, out, trainer_lp, old_dir):
    ids = prompt + completion.completion_ids
    hf_lp = _hf_logprobs(out, ids, len(prompt))
    gen_lp = torch.tensor(completion.logprobs, dtype=torch.float64)
    print("generator", gen_lp.tolist(), "\nHF export", hf_lp.tolist())
    print(f"max |generator - HF| {float((gen_lp - hf_lp).abs().max()):.2e}, "
          f"max |trainer - HF| {float((trainer_lp.double() - hf_lp).abs().max()):.2e}")
    # vLLM, the trainer and HF: float32 forwards of the same weights, the model's forward bound (numerics.py)
    tol = model_tol(out, max_abs(hf_lp))
    check(max_abs_diff(gen_lp, hf_lp), tol, "generator vs HF on the export: logprobs")
    check(max_abs_diff(trainer_lp, hf_lp), tol, "trainer vs HF on the export: logprobs")
    # the check can fail: a generator still on the previous weights would be outside the bound (they score the
    # same tokens more than 2 bounds away, so its own rounding cannot bring it back inside)
    before = _hf_logprobs(old_dir, ids, len(prompt))
    print(f"previous weights vs HF on the export: {max_abs_diff(before, hf_lp):.2e} (bound {tol:.2e})")
    assert max_abs_diff(before, hf_lp) > 2 * tol, (max_abs_diff(before, hf_lp), tol)


def _batch(tokens_B_L: torch.Tensor, gen_lp_B_T: torch.Tensor) -> dict:
    B, L = tokens_B_L.shape
    return {"tokens_B_L": tokens_B_L, "mask_B_T": torch.ones(B, L - 1), "generator_logprobs_B_T": gen_lp_B_T,
            "advantages_B": torch.linspace(1.0, -1.0, B)}


@pytest.mark.integration
@pytest.mark.numerics
@on("qwen3-0.6b", "llama-3.2-1b")
def test_generator_logprobs_equal_hf_with_exported_weights(loop, run, tmp_path):
    """After a weight push (tied embedding included), vLLM scores a sequence as HF does with the trainer's
    exported weights: through shared memory (the run's own pushes), then through a message after one more step."""
    out1 = str(tmp_path / "export1")
    versions, prompt, completion, trainer_lp = loop.run_until_complete(_sample_and_export(run, out1))
    assert all(v == run.version for v in versions), (versions, run.version)
    assert completion.policy_version == run.version
    _check_sync(completion, prompt, out1, trainer_lp, run.config.model.path)
    import safetensors

    with safetensors.safe_open(f"{out1}/model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: the embedding is the output projection

    async def step_and_push_by_message():
        tokens = torch.randint(0, _vocab(run), (2, 10), generator=torch.Generator().manual_seed(1))
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
@on("qwen3-0.6b")
def test_resume_is_exact(loop, run, tmp_path):
    """save -> step -> load -> the same step: identical parameters, optimizer state and loss."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, _vocab(run), (2, 10), generator=g)

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


@pytest.mark.integration
@pytest.mark.numerics
@on("qwen3-0.6b")
def test_two_fsdp_ranks_equal_one_on_the_tied_shape(loop, run, tmp_path):
    """A 2-rank FSDP trainer (gloo) restored from the run's 1-rank trainer takes the same step: same loss and
    grad norm, same exported weights (the tied embedding is one FSDP parameter, sharded), and its push lands
    in the generator, which then scores as HF does on the 2-rank export."""
    import safetensors

    from forgelab.engines.spawn import component_configs
    from forgelab.engines.trainer import Trainer

    tokens = torch.randint(0, _vocab(run), (4, 12), generator=torch.Generator().manual_seed(2))
    ck, out0, out1, out2 = (str(tmp_path / n) for n in ("ck", "before", "export1", "export2"))

    async def go():
        import asyncio

        spawn = asyncio.ensure_future(
            Trainer.options(procs=2, threads=run.config.placement.threads).as_actor(component_configs(run.config)["trainer"]))
        try:  # the 1-rank trainer's work overlaps the 2-rank spawn
            t1 = run.trainer
            # off-policy and uneven advantages: a non-zero loss, so equal losses mean something
            lp = (await t1.call("logprobs", tokens))[0]
            batch = {**_batch(tokens, lp - 0.1 * torch.rand(lp.shape, generator=torch.Generator().manual_seed(3))),
                     "advantages_B": torch.tensor([1.0, -0.5, 0.25, 2.0])}
            await t1.call("save", ck)
            await t1.call("export_hf", out0)
            t2 = await spawn
        except BaseException:
            spawn.cancel()
            raise
        try:
            infos = await t2.call("load", ck)
            assert [i["world"] for i in infos] == [2, 2], infos
            m1 = (await t1.call("train_step", batch))[0]
            m2 = await t2.call("train_step", batch)
            await asyncio.gather(t1.call("export_hf", out1), t2.call("export_hf", out2))
            version = max(await run.generators.fanout("version")) + 1
            actors = [h.actor for h in run.generators.handles() if h is not None]
            push = (await t2.call("push_weights", version, actors))[0]
            synced = await _sample_and_export(run, None, trainer=t2)  # what it pushed is what it exported
            return m1, m2, push, version, synced, lp, batch
        finally:
            await t2.shutdown()

    m1, m2, push, version, (versions, prompt, completion, trainer_lp), lp, batch = loop.run_until_complete(go())
    assert not m1["skipped"] and all(not m["skipped"] for m in m2), (m1, m2)
    assert abs(m1["loss"]) > 1e-3, m1
    # Same weights, two float32 forwards and backwards (1 rank; 2 ranks, gradients summed by FSDP): the logprobs
    # are within the model's forward bound `tol` (numerics.py). The loss is a mean of A * r terms, r = exp(lp -
    # gen) in [1, e^0.1] here, plus the reference KL: each term's relative error is the logprobs' absolute
    # error, so |d loss| <= tol * (1.2 max|A| + 1). The gradient norm: its relative error, the same tol.
    tol = model_tol(run.config.model.path, max_abs(lp))
    for m in m2:  # both ranks report the global batch's metrics
        print(f"loss 1 rank {m1['loss']:.8f}, 2 ranks {m['loss']:.8f}; grad_norm {m1['grad_norm']:.6f} {m['grad_norm']:.6f}")
        check(abs(m["loss"] - m1["loss"]), tol * (1.2 * max_abs(batch["advantages_B"]) + 1), "loss, 2 ranks vs 1")
        check(abs(m["grad_norm"] - m1["grad_norm"]), tol * m1["grad_norm"], "grad_norm, 2 ranks vs 1")
    with safetensors.safe_open(f"{out1}/model.safetensors", "pt") as f1, \
            safetensors.safe_open(f"{out2}/model.safetensors", "pt") as f2, \
            safetensors.safe_open(f"{out0}/model.safetensors", "pt") as f0:
        assert set(f1.keys()) == set(f2.keys()) == set(f0.keys()) and "lm_head.weight" not in f2.keys()
        # AdamW moves a weight by lr * m / (sqrt(v) + eps), v holding this step's g^2 (weight (1 - b2) / (1 - b2^t)):
        # a gradient off by a fraction d moves the update by about lr * d, d <= tol as above, plus one rounding of
        # the weight itself: `fine` = 2 lr tol + EPS |w|. An element whose gradient cancels to within its own
        # rounding is the exception: AdamW (eps 1e-8) can move it by up to ~lr either way. Such elements are rare
        # (4 of the embedding's 155M under MKL_CBWR=COMPATIBLE); up to a fraction tol of a tensor may exceed
        # `fine`. A tied embedding's gradient lost or counted twice on one rank, or an optimizer state misaligned
        # by the resharding, moves most elements by ~lr (one rank's gradient counted twice: 83% of the embedding's
        # elements beyond `fine`, and the gradient norm 640 bounds off).
        diffs, over, moved, fine = {}, {}, {}, {}
        for k in f1.keys():
            w1, w2 = f1.get_tensor(k), f2.get_tensor(k)
            fine[k] = 2 * m1["lr"] * tol + fp32_tol(max_abs(w1))
            d = (w1 - w2).abs()
            diffs[k], over[k] = float(d.max()), float((d > fine[k]).double().mean())
            moved[k] = float((w1 - f0.get_tensor(k)).abs().median())
    print(f"lr {m1['lr']:.1e}; max |1 rank - 2 ranks| after the step {max(diffs.values()):.1e} "
          f"(embedding {diffs['model.embed_tokens.weight']:.1e}, beyond the rounding bound: a fraction "
          f"{over['model.embed_tokens.weight']:.1e}); the step moved the median weight by {min(moved.values()):.1e} "
          f"or more (embedding {moved['model.embed_tokens.weight']:.1e})")
    for k in diffs:
        check(over[k], tol, f"{k}: fraction of elements beyond the rounding bound, 1 rank vs 2 ranks")
    # the comparison can fail: the step itself moved the median embedding weight far beyond the bound
    emb = "model.embed_tokens.weight"
    assert moved[emb] > 20 * fine[emb], (moved[emb], fine[emb])
    assert push["transport"] != "none" and not push["failed"], push
    assert all(v == version for v in versions) and completion.policy_version == version, (versions, version)
    _check_sync(completion, prompt, out2, trainer_lp, run.config.model.path)


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "qwen3-1.7b", "llama-3.2-1b"])
def test_plan_counts_the_real_parameters(shape):
    """The planner's parameter count is HF's for each shape (its model built on the meta device; tied counted once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from forgelab.memory_plan import ModelShape
    from forgelab.recipes.real_shapes import real_shape_config

    cfg = real_shape_config(shape)
    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    assert ModelShape.from_hf(cfg).params == sum(p.numel() for p in model.parameters())


def test_plan_says_what_does_not_fit(tmp_path):
    from forgelab.config.run_config import RunConfig
    from forgelab.memory_plan import plan_memory
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


def test_checkpoint_asked_for_by_several_builders_at_once_is_whole(tmp_path):
    """Builders racing for one directory (two test workers, a benchmark beside a notebook) each get it complete:
    every file is written in a private directory renamed into place whole; the losers' copies are removed."""
    import json
    import os
    import threading

    from forgelab.recipes.real_shapes import real_shape_checkpoint

    out, got, errors = str(tmp_path / "llama"), [], []

    def build():
        try:
            got.append(real_shape_checkpoint("llama-3.2-1b", out=out, config_only=True))
        except Exception as e:  # reported below, not swallowed
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == [out] * 3
    assert {".complete", "config.json", "tokenizer.json", "generation_config.json"} <= set(os.listdir(out))
    assert json.load(open(os.path.join(out, "config.json")))["vocab_size"] == 128256
    assert os.listdir(tmp_path) == ["llama"]  # no builder's private copy left behind
    # a directory there without `.complete` (an interrupted build of an older version) is named, not overwritten
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="without .complete"):
        real_shape_checkpoint("llama-3.2-1b", out=str(stale), config_only=True)
    assert os.listdir(stale) == ["config.json"] and sorted(os.listdir(tmp_path)) == ["llama", "stale"]
    # a builder killed before its rename left its private copy: the next build removes it (its pid is gone),
    # and keeps a live builder's
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    dead, live = tmp_path / f".again.{gone.pid}.x1", tmp_path / f".again.{os.getpid()}.x2"
    for d in (dead, live):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    again = real_shape_checkpoint("llama-3.2-1b", out=str(tmp_path / "again"), config_only=True)
    assert (tmp_path / "again" / ".complete").exists() and oct(os.stat(again).st_mode & 0o777) == "0o755"
    assert not dead.exists() and live.exists()
