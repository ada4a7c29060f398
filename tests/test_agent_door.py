"""The agent door on real processes, through the real `openai` SDK: one module-scoped run of the shipped tiny
model, spawned and not started (no native rollouts, no training: the door's calls have the generator alone).

(a) a two-turn chat gives the native episode loop's tokens, mask and versions; (b) an edited history starts a new
segment, counted; (c) 64 concurrent interleaved sessions each export only their own calls; (h) streaming returns the
non-streaming tokens; a wrong key is 401, an unsupported parameter 400 naming it; (j) posted rewards put the
episodes in the buffer and the accounting identity holds; (k) an expired session's episode is dropped and counted,
and a client that disconnects mid-generation has its samples aborted in the engine; a reward given as a target is
the door's reward functions over the final transcript.
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
                    door=DoorConfig(enabled=True, group_size=2, max_n=4, rewards={"exact_answer": 1.0}))
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


async def _until(predicate, timeout=60.0, what="the condition"):
    """Wait until ``predicate()`` holds (re-checked every 10 ms), at most ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def _accounting_holds(run):
    c = run.buffer.check_accounting()
    return c["generated"] == c["trained"] + c["evicted"] + c["dropped"] + c["buffered"] + c["in_flight"]


def test_expired_session_is_dropped_and_counted(door_run, loop):
    """(k) A session idle past door.idle_timeout_s expires on the run: its episode is dropped as session_expired
    (in the buffer's accounting), the counter moves, and the session is gone (its reward is a 404)."""
    import httpx

    run = door_run

    async def body():
        await _chat(door_client(run, "k-old"), [{"role": "user", "content": FIRST}], seed=3)
        ep, = run.door.sessions.export("k-old")
        before = run.door.counters()["agent/expired_sessions"]
        # the session's clock set back by the idle timeout (instead of waiting door.idle_timeout_s = 600 s);
        # the sweep is the one the door runs every idle_timeout_s / 4
        run.door.sessions.get("k-old").last_used -= run.config.door.idle_timeout_s
        done = await run.door.sessions.sweep()
        async with httpx.AsyncClient() as http:
            late = await http.post(run.openai_base_url + "/forgelab/sessions/k-old/reward", json={"reward": 1.0},
                                   headers={"Authorization": f"Bearer {run.door_key}"})
        return ep, before, done, late

    ep, before, done, late = loop.run_until_complete(body())
    assert done["expired_sessions"] >= 1 and run.door.counters()["agent/expired_sessions"] == before + done["expired_sessions"]
    assert run.buffer.status(ep.id) == "dropped" and run.buffer.drop_reason(ep.id) == "session_expired"
    assert late.status_code == 404 and "expired" in late.json()["error"]["message"]
    assert _accounting_holds(run)


def test_disconnect_aborts_the_engine_requests(door_run, loop):
    """(k) A client that disconnects while its call generates: the engine aborts the call's samples (they never
    finish: the engine's aborted counter moves by n and its finished-request counter does not), nothing is recorded
    for the call, the session's episode counts the disconnect, and the accounting identity holds."""
    import httpx

    run = door_run
    n, long = 4, 200  # min_tokens = max_tokens: each sample would run 200 engine steps if not aborted

    async def stats():
        s, = await run.generators.engine_stats()
        return s

    async def body():
        client = door_client(run, "k-gone")
        m = [{"role": "user", "content": FIRST}]
        r1 = await _chat(client, m, seed=4)
        s0 = await stats()
        gone0 = (await _door_stats())["agent/disconnects"]
        m2 = m + [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": SECOND}]
        async with httpx.AsyncClient(timeout=120) as http:
            call = asyncio.ensure_future(http.post(
                run.openai_base_url + "/chat/completions", headers={"Authorization": f"Bearer {run.door_key}.k-gone"},
                json={"model": "door", "messages": m2, "n": n, "max_tokens": long, "min_tokens": long, "seed": 5}))
            in_flight = []

            async def poll():
                in_flight.append((await run.generators.engine_status())[0].in_flight_requests)

            deadline = asyncio.get_running_loop().time() + 60
            while not in_flight or in_flight[-1] < n:  # the engine took the call's samples in
                assert asyncio.get_running_loop().time() < deadline and not call.done(), "the call never reached the engine"
                await poll()
            call.cancel()  # the client goes away: httpx closes the connection
            with pytest.raises(asyncio.CancelledError):
                await call
        await _until(lambda: run.door.api.disconnects > gone0 and run.door.api.aborted_requests >= n,
                     what="the door to see the disconnect and abort")
        return s0, await stats()

    async def _door_stats():
        return await run.door.api.stats()

    s0, s1 = loop.run_until_complete(body())
    assert s1.aborted_requests - s0.aborted_requests == n
    assert s1.requests == s0.requests  # none of the n samples finished
    assert s1.tokens_generated - s0.tokens_generated == 0  # tokens count only when a request finishes
    ep, = run.door.sessions.export("k-gone")
    assert ep.info["client_disconnects"] == 1 and ep.info["calls"] == 1  # the aborted call was not recorded
    assert _accounting_holds(run)


def test_reward_from_the_transcript(door_run, loop):
    """A reward posted as a target is the door's reward functions (door.rewards: exact_answer) over the session's
    final transcript: 1.0 against the answer the model gave, 0.0 against another; both join one group, buffered
    with opposite advantages. A target on a door without reward functions, or with a reward too, is refused."""
    import httpx

    from forgelab.rewards.library import extract_answer

    run = door_run

    async def body():
        rs = {}
        for s in ("t-right", "t-wrong"):
            r = await _chat(door_client(run, s), [{"role": "user", "content": FIRST}], seed=21)
            rs[s] = r.choices[0].message.content
        given = extract_answer(rs["t-right"])  # the same seed: the same answer in both sessions
        assert extract_answer(rs["t-wrong"]) == given
        url = run.openai_base_url + "/forgelab/sessions/{}/reward"
        auth = {"Authorization": f"Bearer {run.door_key}"}
        async with httpx.AsyncClient() as http:
            both = await http.post(url.format("t-right"), json={"reward": 1.0, "target": given}, headers=auth)
            assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]
            right = (await http.post(url.format("t-right"), json={"target": given, "group": "tg"}, headers=auth)).json()
            wrong = (await http.post(url.format("t-wrong"), json={"target": given + "1", "group": "tg"},
                                     headers=auth)).json()
        return given, right, wrong

    given, right, wrong = loop.run_until_complete(body())
    assert (right["reward"], wrong["reward"]) == (1.0, 0.0), (given, right, wrong)
    a, b = (run.buffer.buffered_episode(i) if hasattr(run.buffer, "buffered_episode") else
            next(ep for ep in run.buffer.buffered() if ep.id == i) for i in (right["episodes"][0], wrong["episodes"][0]))
    assert a.reward_parts == {"exact_answer": 1.0} and b.reward_parts == {"exact_answer": 0.0}
    assert a.advantage > 0 > b.advantage and a.group_id == b.group_id
    assert _accounting_holds(run)
