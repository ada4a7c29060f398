"""The agent door on real processes, through the real `openai` SDK: one module-scoped run of the shipped tiny
model, spawned and not started (no native rollouts, no training: the door's calls have the generator alone).

(a) a two-turn chat gives the native episode loop's tokens, mask and versions; (b) an edited history starts a new
segment, counted; (c) 64 concurrent interleaved sessions each export only their own calls; (h) streaming returns the
non-streaming tokens; a wrong key is 401, an unsupported parameter 400 naming it; (j) posted rewards put the
episodes in the buffer and the accounting identity holds.
"""
from __future__ import annotations

import asyncio
import os

import pytest
from door_clients import door_client

pytestmark = pytest.mark.integration

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

FIRST, SECOND = "12+34=", "again, 21+5="


@pytest.fixture(scope="module")
def door_run(loop, tmp_path_factory, engine_pool):
    from forgelab.config.run_config import (DoorConfig, EvalConfig, PlacementConfig, RolloutConfig, RunConfig,
                                            TrackingConfig, TrainConfig)
    from forgelab.run import Run

    cfg = RunConfig(name="door", rollout=RolloutConfig(task="addition", group_size=2, prompts_per_rollout=1,
                                                         max_tokens=8),
                    # 72 admission slots ((0 + 8 + 1) * 8): room for the 64 concurrent sessions of (c)
                    train=TrainConfig(steps=2, batch_size=8, max_policy_age=8, warmup_steps=0, seed=0),
                    eval=EvalConfig(every=0, n=4), placement=PlacementConfig(reference=False),
                    tracking=TrackingConfig(out_dir=str(tmp_path_factory.mktemp("door")), wandb=False),
                    door=DoorConfig(enabled=True, group_size=2, max_n=4))
    run = Run(cfg, spawn=engine_pool)  # the worker's warm processes when an earlier module left a set
    loop.run_until_complete(run.spawn())
    yield run
    loop.run_until_complete(run.shutdown())


async def _chat(client, messages, seed, **kw):
    return await client.chat.completions.create(model="door", messages=messages, seed=seed, max_tokens=8,
                                                temperature=1.0, logprobs=True, **kw)


def test_two_turn_chat_matches_native_episode(door_run, loop):
    """(a) The door's episode is the native loop's (`run_episode`) on the same prompt ids and seeds."""
    from forgelab.config.components import SamplingConfig
    from forgelab.envs.episode import ChatFormat, EpisodeLimits, run_episode
    from forgelab.generation import GenerateRequest

    run = door_run

    class TwoTurns:  # the native environment of the same conversation
        async def reset(self, task):
            return FIRST

        async def step(self, text):
            self.n = getattr(self, "n", 0) + 1
            return (SECOND, 0.0, False, {"role": "user"}) if self.n == 1 else (None, 0.0, True, {})

    async def body():
        client = door_client(run, "a")
        m1 = [{"role": "user", "content": FIRST}]
        r1 = await _chat(client, m1, seed=11)
        m2 = m1 + [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": SECOND}]
        r2 = await _chat(client, m2, seed=12)
        door_ep, = run.door.sessions.export("a")
        seeds = [11, 12]

        async def generate(ids, sampling):
            return (await run.generators.generate(GenerateRequest(prompts_P=[ids], sampling=sampling,
                                                                  seeds_P_G=[[seeds.pop(0)]])))[0][0]

        native = await run_episode(TwoTurns(), None, generate, ChatFormat(run.tokenizer),
                                   SamplingConfig(temperature=1.0, max_tokens=8),
                                   EpisodeLimits(max_turns=2, max_total_tokens=run.config.model.max_model_len))
        return r1, r2, door_ep, native

    r1, r2, ep, native = loop.run_until_complete(body())
    assert native.info["outcome"] == "done"
    assert ep.prompt_ids == native.prompt_ids == r1.model_extra["prompt_token_ids"]
    assert ep.completion_ids == native.completion_ids
    assert ep.loss_mask == native.loss_mask and sum(ep.loss_mask) == len(r1.choices[0].token_ids) + len(r2.choices[0].token_ids)
    assert ep.policy_version == native.policy_version and ep.info["turn_versions"] == native.info["turn_versions"]
    # the second call's prompt is the stored ids continued, not a re-rendering
    assert r2.model_extra["prompt_token_ids"] == ep.prompt_ids + ep.completion_ids[: ep.info["turns"][1][1]]
    # the sampling logprobs the SDK received are the ones recorded
    sdk_lps = [t.logprob for r in (r1, r2) for t in r.choices[0].logprobs.content]
    assert sdk_lps == [lp for lp, m in zip(ep.generator_logprobs, ep.loss_mask) if m]
    # Both paths ran alone on the engine (no rollouts): the same tokens through the same kernels, except that
    # vLLM's prefix cache may serve a prompt's KV computed by the other path's earlier request (a prefill of
    # another length). A float32 forward's error per reduction is <= K * 2^-24 relative (K = 768, the longest
    # reduction), over 4 layers x 3 chained matmuls: <= 12 * 768 * 6e-8 = 5.5e-4 relative on logits, whose
    # magnitude here is < 20 (|logprob| < 20): 1.1e-2 absolute at worst; an off-by-one token or a dropped
    # logprob moves a value by > 0.1.
    bound = 12 * 768 * 2.0 ** -24 * 20
    diffs = [abs(a - b) for a, b in zip(ep.generator_logprobs, native.generator_logprobs)]
    assert max(diffs) <= bound, (max(diffs), bound)
    print(f"door vs native logprobs: max |diff| {max(diffs):.3g} (bound {bound:.3g})")


def test_edited_history_starts_a_new_segment(door_run, loop):
    """(b) An agent that rewrites its history gets a new segment, counted; an honest continuation does not."""
    run = door_run

    async def body():
        client = door_client(run, "b")
        before = run.door.counters()["agent/retokenized_segments"]
        m1 = [{"role": "user", "content": FIRST}]
        r1 = await _chat(client, m1, seed=1)
        m2 = m1 + [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": SECOND}]
        await _chat(client, m2, seed=2)
        assert run.door.counters()["agent/retokenized_segments"] == before
        edited = [{"role": "user", "content": "99+1="}] + m2[1:]  # the first message rewritten
        await _chat(client, edited, seed=3)
        return before

    before = loop.run_until_complete(body())
    assert run.door.counters()["agent/retokenized_segments"] == before + 1
    eps = run.door.sessions.export("b")
    assert len(eps) == 2 and eps[0].info["calls"] == 2 and eps[1].info["calls"] == 1
    assert run.tokenizer.decode(eps[1].prompt_ids).count("99+1=") == 1


def test_concurrent_sessions_export_only_their_own_calls(door_run, loop):
    """(c) 64 sessions, interleaved, each with its own first message: each session's episode holds its calls."""
    run = door_run
    S = 64

    async def agent(s):
        client = door_client(run, f"c{s}")
        m = [{"role": "user", "content": f"{s}+{s}="}]
        r = await _chat(client, m, seed=s)
        await asyncio.sleep(0)  # let the others interleave between the turns
        m += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": f"#{s}"}]
        r2 = await _chat(client, m, seed=1000 + s)
        return r, r2

    async def body():
        return await asyncio.gather(*(agent(s) for s in range(S)))

    results = loop.run_until_complete(body())
    for s, (r1, r2) in enumerate(results):
        ep, = run.door.sessions.export(f"c{s}")
        text = run.tokenizer.decode(ep.prompt_ids + ep.completion_ids)
        assert f"{s}+{s}=" in text and f"#{s}" in text and ep.info["calls"] == 2
        generated = [t for t, m in zip(ep.completion_ids, ep.loss_mask) if m]
        assert generated == r1.choices[0].token_ids + r2.choices[0].token_ids


def test_streaming_errors_and_keys(door_run, loop):
    """(h) A seeded streamed call returns the non-streamed call's tokens; a wrong key is 401; an unsupported
    parameter is 400 naming it; n > 1 gives n choices."""
    import openai

    run = door_run

    async def body():
        client = door_client(run)  # no session: served, not recorded
        m = [{"role": "user", "content": FIRST}]
        plain = await _chat(client, m, seed=5)
        pieces, ids = [], []
        async for chunk in await _chat(client, m, seed=5, stream=True):
            for ch in chunk.choices:
                pieces.append(ch.delta.content or "")
                ids += (ch.model_extra or {}).get("token_ids") or []
        assert "".join(pieces) == plain.choices[0].message.content and ids == plain.choices[0].token_ids
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=run.openai_base_url, api_key="tml-wrong", max_retries=0) \
                .chat.completions.create(model="door", messages=m)
        with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
            await client.chat.completions.create(model="door", messages=m, frequency_penalty=0.5)
        top = await _chat(client, m, seed=5, top_logprobs=2)  # same seed: the same tokens, with alternatives
        assert top.choices[0].token_ids == plain.choices[0].token_ids
        for e in top.choices[0].logprobs.content:  # raw logprobs: the best alternative is at least the sampled one
            assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob >= -1e30
            assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        many = await client.chat.completions.create(model="door", messages=m, n=3, max_tokens=4, seed=9)
        assert len(many.choices) == 3 and many.usage.completion_tokens == sum(len(c.token_ids) for c in many.choices)
        echo = await client.completions.create(model="door", prompt=FIRST, max_tokens=2, echo=True, logprobs=0, seed=1)
        lp = echo.choices[0].logprobs
        assert lp.token_logprobs[0] is None and len(lp.tokens) == len(FIRST) + len(echo.choices[0].model_extra["token_ids"])

    loop.run_until_complete(body())


def test_door_listens_on_loopback_only(door_run):
    """(item 7) The door's port is bound to 127.0.0.1 and nothing else (docs/security.md's listener table)."""
    import psutil

    port = door_run.door.server.port
    mine = [c for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port]
    assert mine and {c.laddr.ip for c in mine} == {"127.0.0.1"}
    assert door_run.openai_base_url == f"http://127.0.0.1:{port}/v1"


def test_rewarded_sessions_enter_the_buffer(door_run, loop):
    """(j) Two sessions rewarded in one group: their episodes are buffered with group advantages; the accounting
    identity holds; a reward without the run's key is refused."""
    import httpx

    run = door_run

    async def body():
        for s in ("j0", "j1"):
            await _chat(door_client(run, s), [{"role": "user", "content": FIRST}], seed=len(s))
        url = run.openai_base_url + "/forgelab/sessions/{}/reward"
        async with httpx.AsyncClient() as http:
            refused = await http.post(url.format("j0"), json={"reward": 1.0}, headers={"Authorization": "Bearer tml-x"})
            assert refused.status_code == 401
            auth = {"Authorization": f"Bearer {run.door_key}"}
            ids = []
            for s, reward in (("j0", 1.0), ("j1", 0.0)):
                r = await http.post(url.format(s), json={"reward": reward, "group": "g"}, headers=auth)
                assert r.status_code == 200, r.text
                ids += r.json()["episodes"]
            gone = await http.post(url.format("j0"), json={"reward": 1.0}, headers=auth)
            assert gone.status_code == 404
        return ids

    ids = loop.run_until_complete(body())
    buffered = {ep.id: ep for ep in run.buffer.buffered()}
    assert set(ids) <= set(buffered)
    a0, a1 = (buffered[i].advantage for i in ids)
    assert a0 > 0 > a1 and buffered[ids[0]].group_id == buffered[ids[1]].group_id
    # like native episodes: in the run's episode view (the inspector's source) with their mask, then the rollout log
    view = run.rollouts.set_index("id")
    assert view.loc[ids[0], "status"] == "buffered" and list(view.loc[ids[0], "loss_mask"]) == buffered[ids[0]].loss_mask
    c = run.buffer.check_accounting()
    assert c["generated"] == c["trained"] + c["evicted"] + c["dropped"] + c["buffered"] + c["in_flight"]
