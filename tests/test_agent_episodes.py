"""The agent door's recording without processes: the pure stitching functions, the chat continuation on the
shipped tokenizer, the sessions' bounds (expiry, max sessions, max segments, admission, groups) with an in-process
sink, and the HTTP door over the fakes through the real `openai` SDK."""
from __future__ import annotations

import asyncio

import pytest

from forgelab.algos.agent_episodes import (Call, Choice, extend_segment, extends, run_lengths, segment_episode,
                                           start_segment)
from forgelab.controller.agent_sessions import AgentSessions, DoorBusy, DoorLimits, DoorRefused, UnknownSession


def _choice(ids, version=0, text="", runs=()):
    return Choice(completion_ids=list(ids), logprobs=[-0.1 * (i + 1) for i in range(len(ids))], version=version,
                  token_versions=list(runs), text=text)


def test_stitching_masks_generated_tokens_only():
    seg = start_segment(Call(prompt_ids=[1, 2, 3], choices=[_choice([10, 11], 0, "a"), _choice([12], 0, "b")]))
    # the second call continues choice 1 ([12]), then the template/tool tokens [7, 7], then its own answer
    call2 = Call(prompt_ids=[1, 2, 3, 12, 7, 7], choices=[_choice([13, 14, 8], 1, "c", [(1, 0), (2, 2)])])
    assert extends(seg, call2.prompt_ids) == 1
    seg2 = extend_segment(seg, 1, call2, role="tool")
    ep = segment_episode(seg2)
    assert ep.prompt_ids == [1, 2, 3]
    assert ep.completion_ids == [12, 7, 7, 13, 14, 8]
    assert ep.loss_mask == [1, 0, 0, 1, 1, 1]
    assert ep.generator_logprobs == [-0.1, 0.0, 0.0, -0.1, -0.2, pytest.approx(-0.3)]
    assert ep.policy_version == 0 and ep.info["token_versions"] == [[0, 0], [1, 3], [2, 5]]
    assert ep.info["turns"] == [(0, 1, "assistant"), (1, 3, "tool"), (3, 6, "assistant")]
    assert seg.completion_ids == [] and len(seg.tail) == 2  # the arguments are unchanged


def test_extends_refuses_edits_and_prefers_the_named_choice():
    seg = start_segment(Call(prompt_ids=[1, 2], choices=[_choice([5]), _choice([5, 6])]))
    assert extends(seg, [1, 3, 5, 6, 9]) is None          # the prompt was edited
    assert extends(seg, [1, 2, 5]) is None                # nothing after the completion: not a continuation
    assert extends(seg, [1, 2, 5, 6, 9]) == 1             # the longest choice that fits
    assert extends(seg, [1, 2, 5, 6, 9], prefer=0) == 0   # the one the agent sent back, when it fits
    with pytest.raises(ValueError, match="does not continue"):
        extend_segment(seg, 0, Call(prompt_ids=[1, 2, 4, 4], choices=[_choice([1])]))
    assert run_lengths([-1, 2, 2, -1, 3]) == [[2, 1], [3, 4]]


def test_chat_continuation_equals_the_full_rendering_on_the_shipped_template():
    """The prompt built from stored ids equals the template's rendering when nothing was re-tokenized differently
    (the shipped character tokenizer), for a turn ended by eos and one cut by max_tokens."""
    from forgelab.data.tokenizer import build_tokenizer
    from forgelab.serve.chat import ChatRenderer, normalize_messages

    tok = build_tokenizer()
    r = ChatRenderer(tok)
    m1 = normalize_messages([{"role": "user", "content": [{"type": "text", "text": "1+2="}]}])
    p1 = r.prompt_ids(m1)
    for ids, text in ((tok.encode("3", add_special_tokens=False) + [tok.eos_token_id], "3"),
                      (tok.encode("34", add_special_tokens=False), "34")):  # eos sampled; cut by max_tokens
        seg = start_segment(Call(prompt_ids=p1, choices=[_choice([0]), _choice(ids, text=text)]))
        m2 = m1 + [{"role": "assistant", "content": text}, {"role": "tool", "content": "ok"}]
        ids2, k, role = r.continuation(m1, seg, m2)
        assert (ids2, k, role) == (r.prompt_ids(m2), 1, "tool")
        assert r.continuation(m1, seg, m2[:1] + [{"role": "assistant", "content": "other"}] + m2[2:]) is None
        assert r.continuation([{"role": "user", "content": "9"}], seg, m2) is None
    with pytest.raises(ValueError, match="tool_calls"):
        normalize_messages([{"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]}])


class _Sink:
    """An in-process `EpisodeSink`: ids from a counter, a closed flag for admission, what was closed/dropped."""

    def __init__(self):
        self.next, self.admitting, self.closed, self.dropped, self.forgotten = 0, True, [], [], []

    async def open(self):
        if not self.admitting:
            return None
        self.next += 1
        return self.next - 1

    async def close(self, groups):
        self.closed += groups

    async def discard(self, episodes, reason):
        self.dropped += [(ep.id, reason) for ep in episodes]

    async def forget(self, episode_id):
        self.forgotten.append(episode_id)

    async def wait_open(self):
        return await self.open()


def test_sessions_bounds_expiry_and_groups():
    now = [0.0]
    sink = _Sink()
    sessions = AgentSessions(DoorLimits(idle_timeout_s=10, max_sessions=2, max_segments=2, group_size=2), sink,
                             clock=lambda: now[0])
    c1 = Call(prompt_ids=[1, 2], choices=[_choice([3], text="x")])

    async def call(sid, call, prefer=None):
        s = sessions.session(sid)
        async with s.lock:
            k = await sessions.plan(s, call.prompt_ids, prefer)
            sessions.record(s, k, call)

    async def body():
        await call("a", c1)
        await call("a", Call(prompt_ids=[1, 2, 3, 4], choices=[_choice([5])]))      # continues: same segment
        await call("b", c1)
        with pytest.raises(DoorBusy):                                              # max_sessions = 2
            sessions.session("c")
        await call("a", Call(prompt_ids=[9, 9], choices=[_choice([5])]))           # edited: segment 2
        with pytest.raises(DoorRefused, match="max_segments"):
            await call("a", Call(prompt_ids=[8], choices=[_choice([5])]))
        assert sessions.counters()["agent/retokenized_segments"] == 1
        assert [ep.info["calls"] for ep in sessions.export("a")] == [2, 1]
        # a closed admission is a 429, and the slot a failed call took is given back
        sink.admitting = False
        s = sessions.session("b")
        with pytest.raises(DoorBusy, match="admits no new episode"):
            await sessions.plan(s, [7, 7])
        other = AgentSessions(DoorLimits(max_sessions=1), sink)
        with pytest.raises(DoorBusy, match="admits no new episode"):  # refused at its first call: holds no place
            await other.plan(other.session("e"), [1])
        assert other.counters()["agent/open_sessions"] == 0
        sink.admitting = True
        await sessions.plan(s, [7, 7])
        await sessions.abandon(s)
        assert sink.forgotten == [sink.next - 1]
        # rewards: a group of 2 sessions closes together; "a" has 2 segments -> 2 episodes
        assert await sessions.reward("a", 1.0, group="g") == [0, 2]
        assert sink.closed == []
        now[0] = 5.0
        assert await sessions.reward("b", 0.0, group="g") == [1]
        assert [[ep.id for ep in g] for g in sink.closed] == [[0, 2, 1]]
        with pytest.raises(UnknownSession):
            await sessions.reward("a", 1.0)
        # expiry: an idle session's episode is dropped, counted
        await call("d", c1)
        now[0] = 100.0
        assert (await sessions.sweep())["expired_sessions"] == 1
        assert sink.dropped == [(4, "session_expired")]
        assert sessions.counters()["agent/open_sessions"] == 0

    asyncio.run(body())


def test_door_over_fakes(tmp_path):
    """The HTTP door over the in-process fakes through the real `openai` SDK: unknown model, malformed JSON, n above
    the maximum, a prompt over the context length, an unknown session, and 429 with Retry-After when admission is
    closed; none of them stops the door."""
    import httpx
    import openai

    from forgelab.config.run_config import (DoorConfig, EvalConfig, PlacementConfig, RolloutConfig, RunConfig,
                                            TrackingConfig, TrainConfig)
    from forgelab.run import Run
    from forgelab.testing.fakes import fake_spawn

    cfg = RunConfig(name="fake", rollout=RolloutConfig(group_size=2, prompts_per_rollout=1, max_tokens=8),
                    train=TrainConfig(steps=2, batch_size=2, max_policy_age=0, warmup_steps=0),
                    eval=EvalConfig(every=0, n=2), placement=PlacementConfig(reference=False),
                    tracking=TrackingConfig(out_dir=str(tmp_path), wandb=False),
                    door=DoorConfig(enabled=True, max_n=2))

    async def body():
        run = Run(cfg, spawn=fake_spawn)
        await run.spawn()
        try:
            client = openai.AsyncOpenAI(base_url=run.openai_base_url, api_key=run.door_key, max_retries=0)
            m = [{"role": "user", "content": "1+2="}]
            assert [x.id for x in (await client.models.list()).data] == ["fake"]
            with pytest.raises(openai.NotFoundError, match="not served here"):
                await client.chat.completions.create(model="nope", messages=m)
            with pytest.raises(openai.BadRequestError, match="'n'"):
                await client.chat.completions.create(model="fake", messages=m, n=3)
            with pytest.raises(openai.BadRequestError, match="context length"):
                await client.chat.completions.create(model="fake", messages=m, max_tokens=10_000)
            with pytest.raises(openai.BadRequestError, match="tools"):
                await client.chat.completions.create(model="fake", messages=m, tools=[{"type": "function",
                                                     "function": {"name": "f", "parameters": {}}}])
            async with httpx.AsyncClient() as http:
                auth = {"Authorization": f"Bearer {run.door_key}"}
                bad = await http.post(run.openai_base_url + "/chat/completions", content=b"{nope", headers=auth)
                assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
                lost = await http.post(run.openai_base_url + "/forgelab/sessions/zz/reward", json={"reward": 1},
                                       headers=auth)
                assert lost.status_code == 404
            # batch 2, max_policy_age 0: two sessions fill admission; a third gets 429 with Retry-After
            for s in ("s0", "s1"):
                key = openai.AsyncOpenAI(base_url=run.openai_base_url, api_key=f"{run.door_key}.{s}", max_retries=0)
                await key.chat.completions.create(model="fake", messages=m, max_tokens=4)
            third = openai.AsyncOpenAI(base_url=run.openai_base_url, api_key=f"{run.door_key}.s2", max_retries=0)
            with pytest.raises(openai.RateLimitError) as busy:
                await third.chat.completions.create(model="fake", messages=m, max_tokens=4)
            assert busy.value.response.headers["retry-after"] == "1"
            ok = await client.chat.completions.create(model="fake", messages=m, max_tokens=4)  # no session: served
            assert ok.choices[0].message.content
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {run.door_key}"}) as http:
                stats = (await http.get(run.openai_base_url + "/forgelab/stats")).json()
                assert stats["agent/sessions"] == 3 and stats["agent/calls"] == 2 and stats["agent/busy"] == 1
                ep = (await http.get(run.openai_base_url + "/forgelab/sessions/s0/episodes")).json()["episodes"]
                assert len(ep) == 1 and ep[0]["loss_mask"] == [1] * len(ep[0]["completion_ids"])
            run.buffer.check_accounting()
        finally:
            await run.shutdown()
        # shutting down dropped the open sessions' episodes, counted
        assert run.buffer.counts()["dropped_reasons"] == {"door_closed": 2}
        run.buffer.check_accounting()

    asyncio.run(body())


def test_agent_counters_are_metrics_columns(tmp_path):
    """A run with the door logs the door's ``agent/*`` counters in its metrics rows (here over the fakes)."""
    from forgelab.config.run_config import (DoorConfig, EvalConfig, PlacementConfig, RolloutConfig, RunConfig,
                                            TrackingConfig, TrainConfig)
    from forgelab.run import Run
    from forgelab.testing.fakes import fake_spawn

    cfg = RunConfig(name="rows", rollout=RolloutConfig(group_size=2, prompts_per_rollout=2, max_tokens=8),
                    train=TrainConfig(steps=2, batch_size=4, warmup_steps=0), eval=EvalConfig(every=0, n=2),
                    placement=PlacementConfig(reference=False),
                    tracking=TrackingConfig(out_dir=str(tmp_path), wandb=False), door=DoorConfig(enabled=True))

    async def body():
        run = Run(cfg, spawn=fake_spawn)
        await run.start()
        await run.wait()
        await run.shutdown()
        return run

    run = asyncio.run(body())
    assert run.state == "finished", run.message
    assert (run.metrics["agent/retokenized_segments"] == 0).all() and "agent/open_sessions" in run.metrics
    assert run.door is None and run.openai_base_url is None  # closed with the run


def test_door_config_is_validated():
    from forgelab.config.run_config import ConfigError, RunConfig

    cfg = RunConfig.from_dict({"door": {"enabled": True, "idle_timeout_s": 30, "group_size": 4}})
    assert cfg.door.enabled and cfg.door.idle_timeout_s == 30 and cfg.door.group_size == 4
    from forgelab.controller.rollout import determinism

    cfg.train.max_policy_age = 0  # synchronous, but agent sessions take ids in arrival order: no exact replay
    assert determinism(cfg)[0] is False and "door.enabled" in determinism(cfg)[1]
    for bad, name in (({"max_sessions": 0}, "door.max_sessions"), ({"idle_timeout_s": -1}, "door.idle_timeout_s"),
                      ({"port": 70000}, "door.port"), ({"enabled": "yes"}, "door.enabled"),
                      ({"group_size": 0}, "door.group_size")):
        with pytest.raises(ConfigError, match=name):
            RunConfig.from_dict({"door": bad})


def test_disconnect_mid_generation_is_accounted(tmp_path):
    """(k, first half) A client that goes away while its call generates: the door stops waiting, gives back the
    slot that call took, marks the session's episode, and the session goes on."""
    import httpx

    from forgelab.config.run_config import (DoorConfig, EvalConfig, PlacementConfig, RolloutConfig, RunConfig,
                                            TrackingConfig, TrainConfig)
    from forgelab.run import Run
    from forgelab.testing.fakes import fake_spawn

    cfg = RunConfig(name="dc", rollout=RolloutConfig(group_size=2, prompts_per_rollout=1, max_tokens=8),
                    train=TrainConfig(steps=2, batch_size=2, warmup_steps=0), eval=EvalConfig(every=0, n=2),
                    placement=PlacementConfig(reference=False),
                    tracking=TrackingConfig(out_dir=str(tmp_path), wandb=False), door=DoorConfig(enabled=True))

    class Held:  # the fakes' generator, held until released
        def __init__(self, inner):
            self.inner, self.release = inner, asyncio.Event()

        async def generate(self, request):
            await self.release.wait()
            return await self.inner.generate(request)

    async def body():
        run = Run(cfg, spawn=fake_spawn)
        await run.spawn()
        api = run.door.api
        url, auth = run.openai_base_url + "/chat/completions", {"Authorization": f"Bearer {run.door_key}.d"}
        m = [{"role": "user", "content": "1+2="}]
        try:
            async with httpx.AsyncClient() as http:
                first = await http.post(url, json={"model": "dc", "messages": m, "max_tokens": 4}, headers=auth)
                reply = first.json()["choices"][0]["message"]["content"]
                held = api.generators = Held(api.generators)
                edited = [{"role": "user", "content": "5+5="}]  # a new segment: it takes a slot
                with pytest.raises(httpx.ReadTimeout):
                    await http.post(url, json={"model": "dc", "messages": edited, "max_tokens": 4}, headers=auth,
                                    timeout=0.5)
                for _ in range(500):  # the server notices the closed connection
                    if api.disconnects:
                        break
                    await asyncio.sleep(0.01)
                assert api.disconnects == 1 and api.in_flight == 0
                assert run.buffer.reserved == 1  # the first segment's slot only: the new one was given back
                held.release.set()
                m2 = m + [{"role": "assistant", "content": reply}, {"role": "user", "content": "ok"}]
                again = await http.post(url, json={"model": "dc", "messages": m2, "max_tokens": 4}, headers=auth)
                assert again.status_code == 200
            ep, = run.door.sessions.export("d")
            assert ep.info["client_disconnects"] == 1 and ep.info["calls"] == 2
        finally:
            await run.shutdown()
        run.buffer.check_accounting()

    asyncio.run(body())


def test_stream_pieces_sum_to_the_text():
    """A streamed completion's pieces (one per token) add up to exactly its text, a stop string cut off included."""
    from forgelab.data.tokenizer import build_tokenizer
    from forgelab.serve.http import LoopbackServer
    from forgelab.serve.openai_api import OpenAIDoor
    from forgelab.types import Completion

    tok = build_tokenizer()
    door = OpenAIDoor(LoopbackServer("p"), None, tok, None, model_name="m", max_model_len=64)
    ids = tok.encode("12+3", add_special_tokens=False)
    for text, extra in (("12+3", [tok.eos_token_id]), ("12", [])):  # eos sampled; stopped at the string "+3"
        c = Completion(prompt_ids=[1], completion_ids=ids + extra, logprobs=[0.0] * (len(ids) + len(extra)),
                       text=text, finish_reason="stop", policy_version=0)
        pieces = door._pieces(c)
        assert len(pieces) == len(c.completion_ids) and "".join(pieces) == text


def test_door_on_shared_engines_serves_its_lora_slot(tmp_path):
    """A run on shared engines (`forgelab.experiments.variants.SharedEngines`) holds `SlotGenerators` as its
    generators, and the door is opened over the run's generators: every door call reaches the shared service with
    the run's LoRA slot (served with that slot's adapter and version by a `SlotGenerator` engine), and an abort goes
    to the shared service too. Here the shared service is the fakes' generators behind a recorder."""
    import dataclasses

    import openai

    from forgelab.config.run_config import (DoorConfig, EvalConfig, PlacementConfig, RolloutConfig, RunConfig,
                                            TrackingConfig, TrainConfig)
    from forgelab.engines.shared_parts import SlotGenerators
    from forgelab.run import Run
    from forgelab.testing.fakes import fake_spawn

    cfg = RunConfig(name="slot", rollout=RolloutConfig(group_size=2, prompts_per_rollout=1, max_tokens=8),
                    train=TrainConfig(steps=2, batch_size=2, warmup_steps=0), eval=EvalConfig(every=0, n=2),
                    placement=PlacementConfig(reference=False),
                    tracking=TrackingConfig(out_dir=str(tmp_path), wandb=False), door=DoorConfig(enabled=True))

    class SharedService:  # what SlotGenerators calls: records the slot, serves with the fakes
        def __init__(self, inner):
            self.inner, self.slots, self.aborts = inner, [], []

        async def generate(self, request):
            self.slots.append(request.lora_slot)
            return await self.inner.generate(dataclasses.replace(request, lora_slot=None))

        async def abort(self, key):
            self.aborts.append(key)
            return [0]

    async def body():
        run = Run(cfg, spawn=fake_spawn)
        await run.spawn()
        try:
            shared = SharedService(run.door.api.generators)
            run.door.api.generators = SlotGenerators(shared, "b")  # type: ignore[arg-type]  # the recorder stands in
            client = openai.AsyncOpenAI(base_url=run.openai_base_url, api_key=f"{run.door_key}.s", max_retries=0)
            await client.chat.completions.create(model="slot", messages=[{"role": "user", "content": "1+2="}],
                                                 max_tokens=4)
            await client.completions.create(model="slot", prompt="1+2=", max_tokens=4)
            await run.door.api._abort("door-x")
            return shared
        finally:
            await run.shutdown()

    shared = asyncio.run(body())
    assert shared.slots == ["b", "b"] and shared.aborts == ["door-x"]
