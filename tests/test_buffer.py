"""ReplayBuffer eviction, size bound, accounting under random operations, never-train-twice; collate alignment."""

import json
import random

import pytest
import torch

from forgelab.algos.batching import collate
from forgelab.algos.logprobs import shift_for_targets
from forgelab.controller.buffer import EpisodeAlreadyTrained, ReplayBuffer
from forgelab.types import Episode

_next_id = iter(range(10**9))


def make_group(group_id, size, version, *, prompt_len=2, completion_len=3):
    return [
        Episode(
            id=next(_next_id),
            group_id=group_id,
            prompt_ids=list(range(1, prompt_len + 1)),
            completion_ids=list(range(10, 10 + completion_len)),
            generator_logprobs=[-0.5] * completion_len,
            policy_version=version,
        )
        for _ in range(size)
    ]


def test_sample_returns_none_until_enough_then_oldest_whole_groups():
    buf = ReplayBuffer(batch_size=4, max_policy_age=10)
    g0, g1, g2 = make_group(0, 2, 0), make_group(1, 3, 0), make_group(2, 2, 1)
    buf.add(g0)
    assert buf.sample(current_version=0) is None
    buf.add(g1)
    buf.add(g2)
    batch = buf.sample(current_version=1)
    # g0 (2) fits whole; g1 (3) does not fit in the 2 left; g2 (2) does.
    assert [e.id for e in batch] == [e.id for e in g0 + g2]
    batch2 = buf.sample(current_version=1)
    assert batch2 is None  # only g1's 3 episodes remain
    buf.add(make_group(3, 3, 1))
    batch3 = buf.sample(current_version=1)
    # no whole group fits after g1 (3): the rest is filled with the oldest episode of group 3.
    assert [e.group_id for e in batch3] == [1, 1, 1, 3]


def test_eviction_by_policy_age():
    buf = ReplayBuffer(batch_size=2, max_policy_age=1)
    old, mid, new = make_group(0, 2, 0), make_group(1, 2, 1), make_group(2, 2, 2)
    for g in (old, mid, new):
        buf.add(g)
    batch = buf.sample(current_version=2)  # age 2 > 1: old evicted; age 1 allowed
    assert [e.id for e in batch] == [e.id for e in mid]
    assert all(buf.status(e.id) == "evicted" for e in old)
    assert buf.counts()["evicted"] == 2
    assert buf.sample(current_version=4) is None  # new is now age 2: evicted, nothing left
    assert buf.counts()["evicted"] == 4 and len(buf) == 0
    buf.check_accounting()


def test_on_policy_age_zero():
    buf = ReplayBuffer(batch_size=1, max_policy_age=0)
    buf.add(make_group(0, 1, 3))
    assert buf.sample(current_version=4) is None
    assert buf.counts()["evicted"] == 1


def test_max_size_drops_oldest_with_reason():
    buf = ReplayBuffer(batch_size=2, max_policy_age=5, max_size=5)
    g0, g1 = make_group(0, 3, 0), make_group(1, 3, 0)
    buf.add(g0)
    dropped = buf.add(g1)
    assert [e.id for e in dropped] == [g0[0].id]
    assert buf.status(g0[0].id) == "dropped" and buf.status(g0[1].id) == "buffered"
    c = buf.check_accounting()
    assert c["dropped"] == 1 and c["dropped_reasons"] == {"buffer_full": 1} and c["buffered"] == 5
    with pytest.raises(ValueError, match="max_size"):
        ReplayBuffer(batch_size=4, max_policy_age=0, max_size=3)


def test_never_trained_twice_and_only_in_flight_can_be_marked():
    buf = ReplayBuffer(batch_size=2, max_policy_age=5)
    g = make_group(0, 2, 0)
    buf.add(g)
    with pytest.raises(ValueError, match="not in flight"):
        buf.mark_trained(g)  # not sampled yet
    batch = buf.sample(0)
    buf.mark_trained(batch)
    with pytest.raises(EpisodeAlreadyTrained, match=str(batch[0].id)):
        buf.mark_trained(batch[:1])
    with pytest.raises(ValueError, match="already seen"):
        buf.add(batch[:1])  # re-adding a trained episode would let it be trained again
    with pytest.raises(ValueError, match="already trained"):
        buf.drop(batch[:1], "late")
    buf.add(make_group(1, 2, 0))
    batch2 = buf.sample(0)
    with pytest.raises(EpisodeAlreadyTrained, match="twice"):
        buf.mark_trained([batch2[0], batch2[0]])
    assert buf.status(batch2[0].id) == "in_flight"  # the failed call changed nothing
    assert buf.counts()["trained"] == 2
    buf.check_accounting()


def test_drop_before_buffer_and_record_generated():
    buf = ReplayBuffer(batch_size=2, max_policy_age=5)
    bad = make_group(0, 2, 0)
    buf.drop(bad, "reward_error:format")
    buf.record_generated(3, "zero_variance")
    buf.add(make_group(1, 2, 0))
    buf.drop(buf.buffered()[:1], "manual")
    batch = buf.sample(0)
    assert batch is None
    c = buf.check_accounting()
    assert c["generated"] == 7 and c["dropped"] == 6 and c["buffered"] == 1
    assert c["dropped_reasons"] == {"reward_error:format": 2, "zero_variance": 3, "manual": 1}


def test_accounting_identity_under_random_operations():
    """A shadow model tracks every episode's status independently; counts must agree after every operation."""
    rng = random.Random(1234)
    batch_size, max_age, max_size = 4, 2, 12
    buf = ReplayBuffer(batch_size=batch_size, max_policy_age=max_age, max_size=max_size)
    status: dict[int, str] = {}
    order: list[int] = []  # shadow buffered ids, oldest first
    versions: dict[int, int] = {}
    extra_generated = 0
    extra_dropped = 0
    version = 0
    in_flight: list[Episode] = []
    trained_ids: set[int] = set()

    def shadow_overflow():
        while len(order) > max_size:
            status[order.pop(0)] = "dropped"

    for step in range(400):
        op = rng.choice(["add", "add", "sample", "train", "drop_flight", "requeue", "drop_new", "drop_buffered",
                         "record", "bump"])
        if op == "add":
            group = make_group(step, rng.randint(1, 4), max(0, version - rng.randint(0, 3)))
            buf.add(group)
            for e in group:
                status[e.id] = "buffered"
                versions[e.id] = e.policy_version
                order.append(e.id)
            shadow_overflow()
        elif op == "sample":
            for i in [i for i in order if version - versions[i] > max_age]:
                order.remove(i)
                status[i] = "evicted"
            batch = buf.sample(version)
            if len(order) < batch_size:
                assert batch is None
            else:
                assert len(batch) == batch_size
                assert len({e.id for e in batch}) == batch_size
                for e in batch:
                    assert status[e.id] == "buffered" and version - e.policy_version <= max_age
                    order.remove(e.id)
                    status[e.id] = "in_flight"
                in_flight.append(batch)
        elif op == "train" and in_flight:
            batch = in_flight.pop(rng.randrange(len(in_flight)))
            buf.mark_trained(batch)
            for e in batch:
                assert e.id not in trained_ids
                trained_ids.add(e.id)
                status[e.id] = "trained"
        elif op == "drop_flight" and in_flight:
            batch = in_flight.pop(0)
            buf.mark_dropped(batch, "step_skipped")
            for e in batch:
                status[e.id] = "dropped"
        elif op == "requeue" and in_flight:
            batch = in_flight.pop()
            buf.requeue(batch)
            order[:0] = [e.id for e in batch]
            for e in batch:
                status[e.id] = "buffered"
            shadow_overflow()
        elif op == "drop_new":
            group = make_group(step, rng.randint(1, 3), version)
            buf.drop(group, "reward_error:x")
            for e in group:
                status[e.id] = "dropped"
        elif op == "drop_buffered" and order:
            i = order.pop(rng.randrange(len(order)))
            [e] = [e for e in buf.buffered() if e.id == i]
            buf.drop([e], "manual")
            status[i] = "dropped"
        elif op == "record":
            n = rng.randint(0, 3)
            buf.record_generated(n, "zero_variance")
            extra_generated += n
            extra_dropped += n
        elif op == "bump":
            version += 1

        c = buf.check_accounting()
        shadow = {s: sum(1 for v in status.values() if v == s) for s in
                  ("trained", "evicted", "dropped", "buffered", "in_flight")}
        shadow["dropped"] += extra_dropped
        assert {k: c[k] for k in shadow} == shadow, (step, op)
        assert c["generated"] == len(status) + extra_generated
        assert [e.id for e in buf.buffered()] == order
    assert c["trained"] > 0 and c["evicted"] > 0 and c["dropped_reasons"]["buffer_full"] > 0


def test_state_dict_roundtrip_restores_counters_and_guards():
    buf = ReplayBuffer(batch_size=2, max_policy_age=3, max_size=10)
    buf.add(make_group(0, 2, 0))
    buf.add(make_group(1, 2, 0))
    trained = buf.sample(0)
    buf.mark_trained(trained)
    in_flight = buf.sample(0)
    buf.drop(make_group(2, 1, 0), "reward_error:f")
    state = json.loads(json.dumps(buf.state_dict()))  # plain data

    restored = ReplayBuffer(batch_size=2, max_policy_age=3, max_size=10)
    restored.load_state_dict(state)
    c = restored.check_accounting()
    assert c["generated"] == 5 and c["trained"] == 2 and c["dropped"] == 1
    assert c["buffered"] == 2 and c["in_flight"] == 0  # in-flight episodes come back as buffered
    assert restored.status(trained[0].id) == "trained"
    with pytest.raises(ValueError, match="already seen"):
        restored.add(trained[:1])
    again = restored.sample(0)
    assert [e.id for e in again] == [e.id for e in in_flight]
    assert again[0] == in_flight[0]  # episodes survive the round trip intact


def _saved_buffer():
    """A buffer with every status: 2 trained, 2 evicted, 1 dropped before the buffer, 6 held (2 of them in flight)."""
    buf = ReplayBuffer(batch_size=2, max_policy_age=1, max_size=20)
    buf.add(make_group(0, 2, 0))
    buf.mark_trained(buf.sample(0))
    buf.add(make_group(1, 2, 0))
    buf.drop(make_group(2, 1, 0), "reward_error:f")
    for g in range(3, 6):
        buf.add(make_group(g, 2, 2))
    buf.sample(2)  # group 1 (version 0) is evicted at version 2; group 3 goes in flight
    return buf, json.loads(json.dumps(buf.state_dict()))


def _corrupt(state, how):
    state = json.loads(json.dumps(state))
    if how == "format":
        state["format"] = 3
    elif how == "missing_key":
        del state["closed"]
    elif how == "negative":
        state["trained"] = -1
    elif how == "reasons_sum":
        state["dropped_reasons"]["reward_error:f"] = 5
    elif how == "closed_status":
        state["closed"][0][1] = "lost"
    elif how == "closed_count":
        state["closed"] = [c for c in state["closed"] if c[1] != "evicted"]
    elif how == "bad_episode":  # counters are valid and come first: a naive loader installs them before failing here
        state["episodes"][-1]["not_a_field"] = 1
    elif how == "duplicate_episode":
        state["episodes"][-1]["id"] = state["episodes"][0]["id"]
    elif how == "held_and_closed":
        state["episodes"][0]["id"] = state["closed"][0][0]
    elif how == "identity":
        state["generated"] += 1
    return state


CORRUPTIONS = ["format", "missing_key", "negative", "reasons_sum", "closed_status", "closed_count", "bad_episode",
               "duplicate_episode", "held_and_closed", "identity"]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_load_state_dict_is_atomic(how):
    _, good = _saved_buffer()
    target = ReplayBuffer(batch_size=2, max_policy_age=1, max_size=20)
    target.add(make_group(100, 2, 7))
    batch = target.sample(7)
    target.add(make_group(101, 2, 7))
    before = (target.counts(), [e.id for e in target.buffered()], [e.id for e in target.in_flight()])
    with pytest.raises(ValueError, match="unchanged"):
        target.load_state_dict(_corrupt(good, how))
    assert (target.counts(), [e.id for e in target.buffered()], [e.id for e in target.in_flight()]) == before
    target.check_accounting()
    target.mark_trained(batch)  # still a working buffer
    assert target.counts()["trained"] == 2
    target.load_state_dict(good)  # and the good state loads into it afterwards
    assert target.check_accounting()["generated"] == 11


def test_load_state_dict_into_a_smaller_buffer_drops_the_oldest_as_buffer_full():
    buf, state = _saved_buffer()
    held = [e.id for e in buf.in_flight()] + [e.id for e in buf.buffered()]  # state_dict order: oldest first
    assert len(held) == 6
    small = ReplayBuffer(batch_size=2, max_policy_age=1, max_size=4)
    dropped = small.load_state_dict(state)
    assert [e.id for e in dropped] == held[:2]
    assert [e.id for e in small.buffered()] == held[2:]
    c = small.check_accounting()
    assert c["generated"] == 11 and c["trained"] == 2 and c["evicted"] == 2 and c["buffered"] == 4
    assert c["dropped"] == 1 + 2 and c["dropped_reasons"] == {"reward_error:f": 1, "buffer_full": 2}
    assert all(small.status(i) == "dropped" for i in held[:2])
    big = ReplayBuffer(batch_size=2, max_policy_age=1, max_size=None)
    assert big.load_state_dict(state) == [] and len(big) == 6


# --- collate ----------------------------------------------------------------------


def _episode(rng, i, *, with_ref, multi_turn):
    P, C = rng.randint(1, 4), rng.randint(0, 5)
    return Episode(
        id=i,
        group_id=i // 2,
        prompt_ids=[rng.randint(1, 50) for _ in range(P)],
        completion_ids=[rng.randint(1, 50) for _ in range(C)],
        generator_logprobs=[-rng.random() for _ in range(C)],
        ref_logprobs=[-rng.random() for _ in range(C)] if with_ref else None,
        loss_mask=[rng.choice([0, 1]) for _ in range(C)] if multi_turn and i % 2 else None,
        advantage=rng.uniform(-1, 1),
        policy_version=rng.randint(0, 3),
    )


@pytest.mark.parametrize("with_ref,multi_turn", [(False, False), (True, True)])
def test_collate_alignment_matches_loop(with_ref, multi_turn):
    rng = random.Random(7)
    eps = [_episode(rng, i, with_ref=with_ref, multi_turn=multi_turn) for i in range(6)]
    eps[0].completion_ids, eps[0].generator_logprobs = [], []  # an empty completion must not break anything
    if with_ref:
        eps[0].ref_logprobs = []
    if multi_turn:
        eps[0].loss_mask = []
    batch = collate(eps, pad_id=99)
    L = max(len(e.prompt_ids) + len(e.completion_ids) for e in eps)
    assert batch["tokens_B_L"].shape == (6, L) and batch["mask_B_T"].shape == (6, L - 1)
    _, targets = shift_for_targets(batch["tokens_B_L"])
    for b, e in enumerate(eps):
        row = e.prompt_ids + e.completion_ids
        assert batch["tokens_B_L"][b].tolist() == row + [99] * (L - len(row))
        want_mask = [0.0] * (L - 1)
        want_gen = [0.0] * (L - 1)
        want_ref = [0.0] * (L - 1)
        for j, tok in enumerate(e.completion_ids):
            t = len(e.prompt_ids) - 1 + j
            assert targets[b, t].item() == tok  # target position t predicts completion token j
            m = 1.0 if e.loss_mask is None else float(e.loss_mask[j])
            want_mask[t] = m
            want_gen[t] = e.generator_logprobs[j] if m else 0.0
            if with_ref:
                want_ref[t] = e.ref_logprobs[j] if m else 0.0
        assert batch["mask_B_T"][b].tolist() == want_mask
        assert batch["generator_logprobs_B_T"][b].tolist() == pytest.approx(want_gen)
        if with_ref:
            assert batch["ref_logprobs_B_T"][b].tolist() == pytest.approx(want_ref)
    assert (batch["ref_logprobs_B_T"] is None) == (not with_ref)
    assert batch["advantages_B"].tolist() == pytest.approx([e.advantage for e in eps])
    assert batch["policy_version_B"].tolist() == [e.policy_version for e in eps]
    assert batch["episode_id_B"].tolist() == [e.id for e in eps]
    assert batch["advantages_B"].dtype == torch.float32 and batch["tokens_B_L"].dtype == torch.long


def test_collate_pad_to_and_errors():
    rng = random.Random(8)
    eps = [_episode(rng, i, with_ref=False, multi_turn=False) for i in range(2)]
    assert collate(eps, pad_id=0, pad_to=32)["tokens_B_L"].shape[1] == 32
    eps[1].ref_logprobs = [0.0] * len(eps[1].completion_ids)
    with pytest.raises(ValueError, match="ref_logprobs"):
        collate(eps, pad_id=0)
    bad = Episode(id=9, group_id=0, prompt_ids=[], completion_ids=[1], generator_logprobs=[0.0], policy_version=0)
    with pytest.raises(ValueError, match="empty prompt_ids"):
        collate([bad], pad_id=0)
    bad = Episode(id=9, group_id=0, prompt_ids=[1], completion_ids=[1, 2], generator_logprobs=[0.0], policy_version=0)
    with pytest.raises(ValueError, match="generator_logprobs has 1 entries"):
        collate([bad], pad_id=0)
    with pytest.raises(ValueError, match="no episodes"):
        collate([], pad_id=0)
