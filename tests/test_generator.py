"""Generator: a real vLLM engine in a real Monarch process, checked against HF transformers.

One generator on the shipped tiny model serves every test up to the weight
update (tests run in file order); the last test starts a 2-replica service.
Golden values come from an independent computation: HF `generate` / a plain
HF forward pass with the same weights.
"""
from __future__ import annotations

import asyncio
import os

import pytest
import torch

from forgelab.data import format_prompt
from forgelab.engines.generator import Generator, GeneratorConfig, SamplingConfig
from numerics import check, model_tol

integration = pytest.mark.integration
pytestmark = [integration, pytest.mark.timeout(600)]

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "forgelab", "assets", "tiny-llama")
MODEL_DIR = os.environ.get("FORGELAB_TEST_MODEL", SHIPPED)
GREEDY = SamplingConfig(temperature=0.0, max_tokens=12)
PROBLEMS = [
    "Compute 12+345", "Compute 7+5", "Compute 99+1", "Compute 3+4",
    "Compute 250+250", "Compute 8+80", "Compute (7+5)*3-4", "Compute 2*3+4",
    "Compute 61+17", "Compute 5-9",
]


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(MODEL_DIR):
        pytest.fail(f"no model at {MODEL_DIR}: build it with `python -m forgelab.recipes.tiny_model`")
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def prompts(hf):
    _, tok = hf
    return [format_prompt(tok, p) for p in PROBLEMS]


@pytest.fixture(scope="module")
def gen(loop, hf):
    handle = loop.run_until_complete(Generator.options(procs=1).as_actor(GeneratorConfig(model_dir=MODEL_DIR)))
    yield handle
    loop.run_until_complete(handle.shutdown())


@pytest.fixture(scope="module")
def shipped_weights(hf):
    model, _ = hf
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def new_weights(hf, shipped_weights):
    """The shipped weights plus seeded noise: a different policy with the same names and shapes."""
    g = torch.Generator().manual_seed(1234)
    return {k: v + 0.05 * v.std().clamp_min(1e-3) * torch.randn(v.shape, generator=g) if v.ndim > 1 else v.clone()
            for k, v in shipped_weights.items()}


@torch.no_grad()
def hf_greedy_ids(model, tok, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    new = out[0, len(prompt_ids):].tolist()
    return new[: new.index(tok.eos_token_id) + 1] if tok.eos_token_id in new else new


@torch.no_grad()
def hf_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """log softmax of a plain forward's logits, gathered at each completion token."""
    ids_T = torch.tensor([prompt_ids + completion_ids])
    logprobs_T_V = torch.log_softmax(model(ids_T).logits[0].float(), dim=-1)
    P = len(prompt_ids)
    return logprobs_T_V[P - 1 : P - 1 + len(completion_ids)].gather(1, torch.tensor(completion_ids)[:, None])[:, 0].tolist()


@torch.no_grad()
def logprob_gap(model, completions) -> tuple[float, float]:
    """``(max |vLLM logprob - HF logprob|, its bound)`` over ``completions``' tokens.

    vLLM's CPU kernels and HF's eager forward are two float32 forwards of the same weights: the model's forward
    bound (numerics.model_tol) at the scale of the logits and logprobs compared. Logprobs from other weights
    (the shipped ones vs the perturbed ones these tests load) differ by orders of magnitude more.
    """
    gap = scale = 0.0
    for c in completions:
        ids_T = torch.tensor([c.prompt_ids + c.completion_ids])
        logits = model(ids_T).logits[0].float()
        ref = hf_logprobs(model, c.prompt_ids, c.completion_ids)
        gap = max([gap] + [abs(a - b) for a, b in zip(c.logprobs, ref)])
        scale = max([scale, float(logits.abs().max())] + [abs(b) for b in ref])
    return gap, model_tol(model.config, scale)


def _greedy(loop, gen, prompts):
    groups = loop.run_until_complete(gen.generate.call_one(prompts, n=1, sampling=GREEDY))
    return [g[0] for g in groups]


def test_greedy_matches_hf(gen, hf, prompts, loop):
    model, tok = hf
    outs = _greedy(loop, gen, prompts)
    assert len(outs) == len(prompts) >= 8
    for prompt, c in zip(prompts, outs):
        assert c.prompt_ids == tok.encode(prompt, add_special_tokens=False)
        assert c.completion_ids == hf_greedy_ids(model, tok, c.prompt_ids, GREEDY.max_tokens), prompt
        assert c.policy_version == 0 and c.prompt == prompt
        assert len(c.logprobs) == len(c.completion_ids)
        assert c.finish_reason in ("stop", "length")
        assert c.text == tok.decode(c.completion_ids, skip_special_tokens=True)


def test_token_id_prompts_round_trip(gen, hf, prompts, loop):
    _, tok = hf
    ids_P = [tok.encode(p, add_special_tokens=False) for p in prompts[:4]]
    by_ids = _greedy(loop, gen, ids_P)
    by_text = _greedy(loop, gen, prompts[:4])
    for ids, a, b in zip(ids_P, by_ids, by_text):
        assert a.prompt_ids == ids
        assert a.completion_ids == b.completion_ids


def test_bad_requests_are_refused_with_a_clear_message(gen, prompts, loop):
    from monarch.actor import ActorError

    with pytest.raises(ActorError, match="each prompt must be a str or a non-empty list of token ids"):
        loop.run_until_complete(gen.generate.call_one([[]]))
    with pytest.raises(ActorError, match="exceeds max_model_len=512"):
        loop.run_until_complete(gen.generate.call_one(prompts[:1], sampling=SamplingConfig(max_tokens=600)))
    with pytest.raises(ActorError, match="top_p must be in"):
        loop.run_until_complete(gen.generate.call_one(prompts[:1], sampling=SamplingConfig(top_p=0.0)))
    assert len(loop.run_until_complete(gen.generate.call_one(prompts[:1]))[0]) == 1  # still serving


def test_config_validation_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="model_dir"):
        GeneratorConfig(model_dir=str(tmp_path)).validate()
    with pytest.raises(ValueError, match="kv_cache_gib"):
        GeneratorConfig(model_dir=MODEL_DIR, kv_cache_gib=-1).validate()
    with pytest.raises(ValueError, match="sampling.max_tokens"):
        GeneratorConfig(model_dir=MODEL_DIR, sampling=SamplingConfig(max_tokens=0)).validate()


@pytest.mark.numerics
def test_sampled_logprobs_match_plain_forward(gen, hf, prompts, loop):
    model, _ = hf
    groups = loop.run_until_complete(
        gen.generate.call_one(prompts[:4], n=4, sampling=SamplingConfig(temperature=1.0, max_tokens=12))
    )
    for group in groups:
        assert len(group) == 4
        for c in group:
            assert len(c.logprobs) == len(c.completion_ids) > 0
    gap, tol = logprob_gap(model, [c for g in groups for c in g])
    print(f"max |vLLM logprob - HF logprob| over the sampled tokens: {gap:.2e} (bound {tol:.2e})")
    check(gap, tol, "vLLM vs HF logprobs")
    # Sampling at temperature 1 without a fixed seed: a group is not 4 copies of one sample.
    assert any(len({tuple(c.completion_ids) for c in g}) > 1 for g in groups)


def test_concurrent_calls_are_batched(gen, prompts, loop):
    before = loop.run_until_complete(gen.stats.call_one())

    async def many():
        return await asyncio.gather(*(gen.generate.call_one([p], n=1, sampling=GREEDY) for p in (prompts * 2)[:16]))

    results = loop.run_until_complete(many())
    after = loop.run_until_complete(gen.stats.call_one())
    assert len(results) == 16 and all(len(r) == 1 and len(r[0]) == 1 for r in results)
    tokens = after["tokens_generated"] - before["tokens_generated"]
    steps = after["steps"] - before["steps"]
    print(f"16 concurrent calls: {tokens} tokens in {steps} engine steps")
    # One step adds at most one token per running request: > 2 tokens/step means
    # several calls shared steps (serialized calls would give <= 1).
    assert after["requests"] - before["requests"] == 16
    assert tokens / steps > 2
    # Same prompt, same greedy completion whichever call carried it.
    assert results[0][0][0].completion_ids == results[len(prompts)][0][0].completion_ids


def test_group_shares_prompt_prefix(gen, hf, loop):
    _, tok = hf
    # Prefix caching shares whole KV blocks (32 tokens on CPU): use a prompt longer than one block.
    prompt = format_prompt(tok, "Compute " + "+".join(str(i) for i in range(1, 20)))
    assert len(tok.encode(prompt, add_special_tokens=False)) > 40
    before = loop.run_until_complete(gen.stats.call_one())
    (group,) = loop.run_until_complete(gen.generate.call_one([prompt], n=8, sampling=SamplingConfig(max_tokens=4)))
    after = loop.run_until_complete(gen.stats.call_one())
    cached = [c.num_cached_tokens for c in group]
    print("num_cached_tokens per sample:", cached)
    assert sum(x > 0 for x in cached) >= 7
    assert after["cached_prompt_tokens"] - before["cached_prompt_tokens"] == sum(cached) > 0


def test_bad_weights_are_refused_and_old_ones_keep_serving(gen, hf, prompts, new_weights, loop):
    from monarch.actor import ActorError

    before = _greedy(loop, gen, prompts[:4])
    wrong_name = dict(new_weights)
    wrong_name["model.layers.0.mlp.gate.weight"] = wrong_name.pop("model.layers.0.mlp.gate_proj.weight")
    wrong_shape = dict(new_weights)
    wrong_shape["lm_head.weight"] = wrong_shape["lm_head.weight"][:-1]
    for bad, needle in ((wrong_name, "model.layers.0.mlp.gate.weight"), (wrong_shape, "lm_head.weight: shape")):
        with pytest.raises(ActorError) as info:
            loop.run_until_complete(gen.update_weights.call_one(1, bad))
        message = str(info.value)
        assert needle in message and "keeps serving version 0" in message, message
    with pytest.raises(ActorError, match="greater than the serving version"):
        loop.run_until_complete(gen.update_weights.call_one(0, new_weights))
    assert loop.run_until_complete(gen.version.call_one()) == 0
    after = _greedy(loop, gen, prompts[:4])
    assert [c.completion_ids for c in after] == [c.completion_ids for c in before]


@pytest.mark.numerics
def test_update_weights_serves_new_policy(gen, hf, prompts, new_weights, loop):
    model, tok = hf
    old = _greedy(loop, gen, prompts)
    assert loop.run_until_complete(gen.update_weights.call_one(1, new_weights)) == 1
    assert loop.run_until_complete(gen.version.call_one()) == 1
    new = _greedy(loop, gen, prompts)
    model.load_state_dict(new_weights)
    for c in new:
        assert c.policy_version == 1
        assert c.completion_ids == hf_greedy_ids(model, tok, c.prompt_ids, GREEDY.max_tokens)
    # The update changed the policy (otherwise this test could not fail).
    assert [c.completion_ids for c in new] != [c.completion_ids for c in old]
    (group,) = loop.run_until_complete(gen.generate.call_one(prompts[:1], n=4, sampling=SamplingConfig(max_tokens=8)))
    gap, tol = logprob_gap(model, group)
    print(f"after update: max logprob diff {gap:.2e} (bound {tol:.2e})")
    check(gap, tol, "vLLM vs HF logprobs after the update")
    status = loop.run_until_complete(gen.status.call_one())
    assert status["version"] == 1 and status["in_flight_requests"] == 0
    assert status["stats"]["weight_updates"] == 1


@pytest.mark.numerics
def test_in_flight_requests_finish_on_old_weights(gen, hf, prompts, shipped_weights, loop):
    """An update sent while requests run waits for them: they finish on (and report) the old weights."""
    model, _ = hf  # holds the version-1 weights since the previous test

    async def body():
        # Monarch delivers one sender's messages in order: generate reaches the actor first.
        pending = gen.generate.call_one(prompts, n=4, sampling=SamplingConfig(max_tokens=12))
        version = await gen.update_weights.call_one(2, shipped_weights)
        return await pending, version

    groups, version = loop.run_until_complete(body())
    assert version == 2
    assert {c.policy_version for g in groups for c in g} == {1}
    # Every token came from the version-1 weights, none from the shipped ones loaded as version 2.
    gap, tol = logprob_gap(model, [c for g in groups for c in g])
    check(gap, tol, "in-flight requests' logprobs vs HF on the version-1 weights")
    assert _greedy(loop, gen, prompts[:1])[0].policy_version == 2


def test_service_fanout_updates_every_replica(gen, hf, prompts, new_weights, loop):
    loop.run_until_complete(gen.shutdown())  # free the cores for the two replicas
    model, tok = hf
    model.load_state_dict(new_weights)

    async def body():
        svc = await Generator.options(num_replicas=2).as_service(GeneratorConfig(model_dir=MODEL_DIR))
        try:
            updated = await svc.fanout("update_weights", 1, new_weights)
            versions = await svc.fanout("version")
            outs = await asyncio.gather(*(svc.route("generate", prompts[:2], n=1, sampling=GREEDY) for _ in range(4)))
        finally:
            await svc.shutdown()
        return updated, versions, outs

    updated, versions, outs = loop.run_until_complete(body())
    assert updated == [1, 1] and versions == [1, 1]
    for groups in outs:
        for g in groups:
            assert g[0].policy_version == 1
            assert g[0].completion_ids == hf_greedy_ids(model, tok, g[0].prompt_ids, GREEDY.max_tokens)


def test_cpu_token_ranks_are_vllms_counts_without_its_compile():
    """On CPU the generator computes the sampled token's rank eagerly (`_eager_token_ranks`, saving vLLM's
    1.7-2.2 s torch.compile at the first request): the counts equal vLLM's compiled function exactly (integers),
    ties included (rows holding their own value several times)."""
    import vllm.v1.sample.ops.logprobs as vllm_ops

    from forgelab.engines.generator import _count_at_least

    g = torch.Generator().manual_seed(0)
    logprobs_B_V = torch.randn(37, 105, generator=g).log_softmax(-1)
    logprobs_B_V[:, 7] = logprobs_B_V[:, 3]  # ties with the chosen token
    chosen_B_1 = logprobs_B_V.gather(-1, torch.randint(0, 105, (37, 1), generator=g))
    chosen_B_1[0, 0] = logprobs_B_V[0, 3]
    ours = _count_at_least(logprobs_B_V, chosen_B_1)
    theirs = vllm_ops.batched_count_greater_than(logprobs_B_V, chosen_B_1)
    assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    assert int(ours.min()) >= 1  # a token counts itself
