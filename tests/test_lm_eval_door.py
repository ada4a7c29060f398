"""lm-eval through the agent door, on real processes (issue 40, Done-when (f)).

One module-scoped run of the shipped tiny model with the door open, spawned and not started (no training: the
policy is version 0 throughout). `run.lm_eval` runs lm-eval 0.4.13's own `local-completions` client, unmodified,
in a child process against the door, on the two local tasks of `forgelab.serve.lm_eval_door` over the run's first
N held-out problems. Hubs stay off (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE).

- generate_until: lm-eval's exact match equals forgelab's own held-out evaluation (`run.evaluate`) on the same
  problems and version, item by item (the same completion text), and lands in `run.metrics` and the event log;
- multiple_choice: each candidate's log-likelihood lm-eval computed equals the door's prompt logprobs (the real
  `openai` SDK, `echo`) and an independent float32 forward of the checkpoint in transformers, within the float32
  bound; its `acc` is the argmax of the independent forward.
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

N = 24  # held-out problems: 24 generations, 96 log-likelihood requests
GEN, MC = "forgelab_addition_gen", "forgelab_addition_mc"


@pytest.mark.parametrize("completion", ["57", " 57\n", "057", "0057 ", "5 7", "57.", "+57", "-57", "", "57\n58",
                                        "0", "-0", "-00", " -0 ", "00", "-", "x57", "75"])
@pytest.mark.parametrize("target", ["57", "0"])
def test_answer_filter_is_forgelabs_rule(completion, target):
    """The generate_until task's regex filter + lm-eval's exact_match (lm-eval's own code) give forgelab's
    addition reward on the same completion (ASCII digits: forgelab also reads other Unicode digits)."""
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    from forgelab.data.tasks import get_task
    from forgelab.serve.lm_eval_door import ANSWER_REGEX

    (filtered,), = RegexFilter(regex_pattern=ANSWER_REGEX).apply([[completion]], [{}])
    lm = float(exact_match_hf_evaluate([filtered], [target])["exact_match"])
    assert lm == get_task("addition").reward("", completion, target), (completion, filtered)


def test_tracker_annotate_merges_into_the_steps_row(tmp_path):
    """Scores at the last row's step join that row; at a later step they are a row of their own; metrics.csv
    gets the columns."""
    import pandas as pd

    from forgelab.controller.tracking import Tracker
    from forgelab.serve.lm_eval_door import scores_of

    t = Tracker(tmp_path, use_wandb=False)
    t.log({"step": 1, "loss": 0.5})
    scores = scores_of({"t": {"alias": "t", "exact_match,integer": 0.25, "exact_match_stderr,integer": "N/A",
                              "acc,none": 0.5, "acc_stderr,none": 0.1, "sample_len": 4}})
    assert scores == {"lm_eval/t/exact_match": 0.25, "lm_eval/t/acc": 0.5}
    t.annotate(1, scores)
    t.annotate(3, {"lm_eval/t/acc": 0.75})
    df = pd.read_csv(tmp_path / "metrics.csv")
    assert df["step"].tolist() == [1, 3] and df["loss"].tolist()[0] == 0.5
    assert df["lm_eval/t/acc"].tolist() == [0.5, 0.75] and df["lm_eval/t/exact_match"].tolist()[0] == 0.25
    assert t.dataframe()["lm_eval/t/acc"].tolist() == [0.5, 0.75]


@pytest.fixture(scope="module")
def lm_run(loop, tmp_path_factory, engine_pool):
    from forgelab.config.run_config import (DoorConfig, EvalConfig, PlacementConfig, RolloutConfig, RunConfig,
                                            TrackingConfig, TrainConfig)
    from forgelab.run import Run

    cfg = RunConfig(name="lmeval", rollout=RolloutConfig(task="addition", group_size=2, prompts_per_rollout=1,
                                                           max_tokens=8),
                    train=TrainConfig(steps=2, batch_size=8, warmup_steps=0, seed=0),
                    eval=EvalConfig(every=0, n=N), placement=PlacementConfig(reference=False),
                    tracking=TrackingConfig(out_dir=str(tmp_path_factory.mktemp("lmeval")), wandb=False),
                    door=DoorConfig(enabled=True))
    run = Run(cfg, spawn=engine_pool)  # the worker's warm processes when an earlier module left a set
    loop.run_until_complete(run.spawn())
    result = loop.run_until_complete(run.lm_eval(n=N))
    yield run, result
    loop.run_until_complete(run.shutdown())


@pytest.mark.integration
def test_exact_match_equals_forgelab_evaluation(lm_run, loop):
    """(f) lm-eval's exact match on the generate_until task is forgelab's held-out accuracy on the same problems
    and policy version, item by item, and it is in the run's metrics and events."""
    from forgelab.engines.generator import SamplingConfig
    from forgelab.envs.episode import final_answer

    run, result = lm_run
    problems = list(run.heldout)[:N]
    samples = sorted(result.samples[GEN], key=lambda s: s["doc_id"])
    assert [s["doc"]["question"] for s in samples] == [p.prompt for p in problems]

    async def forgelab_side():
        acc = await run.evaluate(n=N)  # forgelab's own evaluation (recorded in its history)
        greedy = SamplingConfig(temperature=0.0, max_tokens=run.config.rollout.max_tokens)
        groups = await run.evaluator.source.play(problems, 1, greedy)  # the same path, per item
        return acc, [final_answer(ep, run.tokenizer) for (ep,) in groups]

    acc, texts = loop.run_until_complete(forgelab_side())
    assert run.version == 0
    # the same tokens served both ways: lm-eval's raw response is forgelab's completion text
    assert [s["resps"][0][0] for s in samples] == texts
    rewards = [run.evaluator.reward(p.prompt, t, p.target, **p.info) for p, t in zip(problems, texts)]
    assert [float(s["exact_match"]) for s in samples] == rewards
    score = result.scores[f"lm_eval/{GEN}/exact_match"]
    assert score == acc == sum(rewards) / N
    print(f"lm-eval exact match {score:.3f} == forgelab held-out accuracy {acc:.3f} on {N} problems")

    m = run.metrics
    col = f"lm_eval/{GEN}/exact_match"
    assert col in m.columns and m[col].dropna().tolist() == [score]
    ev = [e for e in run.events if e["kind"] == "lm_eval"]
    assert len(ev) == 1 and ev[0]["scores"][col] == score and ev[0]["version_start"] == ev[0]["version_end"] == 0


@pytest.mark.integration
def test_loglikelihoods_equal_door_and_independent_forward(lm_run, loop):
    """The multiple_choice task's per-candidate log-likelihoods equal the door's prompt logprobs (the openai SDK,
    echo) and a float32 transformers forward of the checkpoint, within the float32 bound; `acc` follows."""
    import openai
    import torch
    from transformers import AutoModelForCausalLM

    run, result = lm_run
    tok = run.tokenizer
    samples = sorted(result.samples[MC], key=lambda s: s["doc_id"])
    assert len(samples) == N
    pairs = [(ctx, cont) for s in samples for ctx, cont in s["arguments"]]
    got = [float(r[0][0]) for s in samples for r in s["resps"]]
    assert len(pairs) == len(got) == 4 * N

    def encode_pair(ctx, cont):  # lm-eval's definition: the continuation's ids are the whole's after the context's
        whole = tok.encode(ctx + cont, add_special_tokens=False)
        c = tok.encode(ctx, add_special_tokens=False)
        return c, whole[len(c):]

    ids = [encode_pair(*p) for p in pairs]

    async def door_side():
        client = openai.AsyncOpenAI(base_url=run.openai_base_url, api_key=run.door_key, max_retries=0)
        r = await client.completions.create(model=run.door.model_name, prompt=[c + k for c, k in ids], echo=True,
                                            logprobs=1, max_tokens=1, temperature=0.0)
        by_index = sorted(r.choices, key=lambda ch: ch.index)
        return [sum(ch.logprobs.token_logprobs[len(c): len(c) + len(k)]) for ch, (c, k) in zip(by_index, ids)]

    door = loop.run_until_complete(door_side())

    model = AutoModelForCausalLM.from_pretrained(run.config.model.path, dtype=torch.float32).eval()
    ref = []
    with torch.no_grad():
        for c, k in ids:
            x = torch.tensor([c + k])
            lp_T_V = torch.log_softmax(model(x).logits[0].double(), -1)
            pos = range(len(c) - 1, len(c) + len(k) - 1)  # the logits at t predict token t + 1
            ref.append(sum(float(lp_T_V[t, x[0, t + 1]]) for t in pos))

    # Bound per continuation token (as tests/test_agent_door.py derives it): a float32 forward's error per
    # reduction is <= K * 2^-24 relative (K = 768, the longest reduction), over 4 layers x 3 chained matmuls:
    # <= 12 * 768 * 2^-24 relative on logits of magnitude < 20, 1.1e-2 absolute per token; a candidate has at most
    # 3 tokens. A log-likelihood of the wrong tokens or positions (an off-by-one, a dropped token) is off by > 0.1.
    k_max = max(len(k) for _, k in ids)
    bound = k_max * 12 * 768 * 2.0 ** -24 * 20
    d_door = max(abs(a - b) for a, b in zip(got, door))
    d_ref = max(abs(a - b) for a, b in zip(got, ref))
    print(f"lm-eval log-likelihoods: max |diff| vs door echo {d_door:.3g}, vs transformers float32 {d_ref:.3g} "
          f"(bound {bound:.3g}, {len(got)} candidates)")
    assert d_door <= bound and d_ref <= bound, (d_door, d_ref, bound)
    assert max(abs(a) for a in got) > 0.1  # real log-likelihoods, not zeros

    # acc: the gold candidate (index 0) is the most likely, where the independent forward is clear about it
    acc_items = [float(s["acc"]) for s in samples]
    for i, s in enumerate(samples):
        lls = ref[4 * i: 4 * i + 4]
        margin = lls[0] - max(lls[1:])
        if abs(margin) > 2 * bound:
            assert acc_items[i] == float(margin > 0), (i, lls)
    assert result.scores[f"lm_eval/{MC}/acc"] == sum(acc_items) / N
    assert f"lm_eval/{MC}/acc" in run.metrics.columns


@pytest.mark.integration
def test_echo_gives_prompt_top_logprobs(lm_run, loop):
    """The door's echo gives each prompt token (after the first) its `logprobs` most likely alternatives, as for
    sampled tokens (lm-eval's log-likelihood parser reads them to tell a greedy continuation): the top-1 is the
    float32 transformers forward's argmax wherever the forward's top-2 margin exceeds the float32 bound."""
    import openai
    import torch
    from transformers import AutoModelForCausalLM

    run, _ = lm_run
    prompt = run.tokenizer.encode("<|bos|><|user|>35+47=<|end|><|assistant|>82", add_special_tokens=False)

    async def call():
        client = openai.AsyncOpenAI(base_url=run.openai_base_url, api_key=run.door_key, max_retries=0)
        return await client.completions.create(model=run.door.model_name, prompt=prompt, echo=True, logprobs=2,
                                               max_tokens=1, temperature=0.0)

    lp = loop.run_until_complete(call()).choices[0].logprobs
    assert lp.top_logprobs[0] is None and lp.token_logprobs[0] is None
    model = AutoModelForCausalLM.from_pretrained(run.config.model.path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref_T_V = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1)
    bound = 12 * 768 * 2.0 ** -24 * 20  # one token's float32 forward bound (test above)
    for i in range(1, len(prompt)):
        top = lp.top_logprobs[i]
        assert lp.tokens[i] in top and top[lp.tokens[i]] == lp.token_logprobs[i]
        assert 1 <= len(top) <= 3  # the 2 most likely, and the prompt's own token when it is not among them
        best2 = ref_T_V[i - 1].topk(2)
        assert abs(max(top.values()) - float(best2.values[0])) <= bound
        if float(best2.values[0] - best2.values[1]) > 2 * bound:
            want = run.tokenizer.decode([int(best2.indices[0])])
            assert max(top, key=top.get) == want, (i, top, want)
