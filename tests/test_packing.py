"""Shared-prompt packing (forgelab.algos.packing): a group's prompt runs once, and nothing a loss reads changes.

The golden values are Hugging Face transformers' own logits, row by row and unpacked (an implementation that
shares no code with the packed path); gradients are compared with forgelab's plain [B, L] forward, which
test_titan.py checks against transformers.
"""
from __future__ import annotations

import random

import pytest
import torch

from forgelab.algos.batching import collate
from forgelab.algos.packing import plan_shared_prefix, span_mask, spans_from_mask
from forgelab.engines.titan import build_from_hf
from forgelab.engines.titan_forward import model_logprobs_entropy, use_packing
from forgelab.types import Episode
from numerics import check, fp32_tol, max_abs, max_abs_diff, model_tol
from test_titan import llama_dir, qwen3_dir  # noqa: F401 -- module fixtures


def _groups(vocab: int, *, seed: int, groups: int = 4, size: int = 5, empty_row: bool = True):
    """Right-padded rows of `groups` prompts x `size` completions (different lengths), shuffled, plus the spans;
    one extra row with nothing to compute (span (0, 0))."""
    rng = random.Random(seed)
    rows, spans = [], []
    for _ in range(groups):
        P = rng.randint(1, 9)
        prompt = [rng.randrange(1, vocab) for _ in range(P)]
        for _ in range(size):
            C = rng.randint(1, 7)
            rows.append(prompt + [rng.randrange(1, vocab) for _ in range(C)])
            spans.append((P, P + C))
    order = list(range(len(rows)))
    rng.shuffle(order)
    rows, spans = [rows[i] for i in order], [spans[i] for i in order]
    if empty_row:
        rows.append([rng.randrange(1, vocab) for _ in range(4)])
        spans.append((0, 0))
    L = max(map(len, rows)) + 2  # extra right padding is never read
    tokens = torch.zeros(len(rows), L, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    return tokens, torch.tensor(spans)


def _hf_logprobs_entropy(model_dir: str, tokens: torch.Tensor, spans: torch.Tensor):
    """Each row alone through transformers, unpadded: ``[B, T]`` logprobs and entropies (0 outside the spans),
    and the largest magnitude of the logits they came from."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    B, L = tokens.shape
    lp, ent, logit_max = torch.zeros(B, L - 1), torch.zeros(B, L - 1), 0.0
    with torch.no_grad():
        for b, (s, e) in enumerate(spans.tolist()):
            if e == 0:
                continue
            logits = hf(tokens[b : b + 1, : e - 1]).logits[0]
            logp = torch.log_softmax(logits.double(), -1)
            t = torch.arange(s - 1, e - 1)
            lp[b, t] = logp[t, tokens[b, t + 1]].float()
            ent[b, t] = (-(logp.exp() * logp).sum(-1))[t].float()
            logit_max = max(logit_max, max_abs(logits[t]))
    return lp, ent, logit_max


@pytest.mark.numerics
@pytest.mark.parametrize("which", ["llama", "qwen3"])
@pytest.mark.parametrize("max_len", [1024, 12])
def test_packed_logprobs_and_entropy_match_transformers_row_by_row(which, max_len, llama_dir, qwen3_dir):  # noqa: F811
    model_dir = llama_dir if which == "llama" else qwen3_dir
    model, ckpt = build_from_hf(model_dir)
    tokens, spans = _groups(ckpt.hf_config["vocab_size"], seed=1)
    pack = plan_shared_prefix(tokens, spans, max_len=max_len)
    if max_len == 12:
        assert pack.tokens_N_S.shape[0] > 4  # groups were split over several packs
    else:
        assert pack.tokens_N_S.shape[0] == 4 and pack.packed_tokens < pack.plain_tokens  # the (0, 0) row: no pack
    with torch.no_grad():
        lp, ent = model_logprobs_entropy(model, tokens, need_entropy=True, spans_B_2=spans, share_prompts="on",
                                         max_pack_len=max_len)
    want_lp, want_ent, logit_max = _hf_logprobs_entropy(model_dir, tokens, spans)
    # Two float32 forwards of the same weights (packed titan, HF row by row): the model's forward bound at the
    # scale of the logits and logprobs (numerics.model_tol: 1.2e-3 for the tiny llama's logprobs down to -18,
    # 7.5e-5 for the small random qwen3's). The entropy -sum p log p moves with the logits as the logprobs do
    # (its derivative is -p (log p + H)). RoPE positions that do not restart for each completion in a pack put
    # the logprobs 4.7 (llama) and 0.07 (qwen3) off.
    tol = model_tol(model_dir, max(logit_max, max_abs(want_lp), max_abs(want_ent)))
    check(max_abs_diff(lp, want_lp), tol, "packed vs HF row by row: logprobs")
    check(max_abs_diff(ent, want_ent), tol, "packed vs HF row by row: entropy")
    outside = ~span_mask(spans, tokens.shape[1] - 1)
    assert bool((lp[outside] == 0).all()) and bool((ent[outside] == 0).all())


@pytest.mark.numerics
@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_packed_gradients_equal_the_plain_forward(which, llama_dir, qwen3_dir):  # noqa: F811
    model_dir = llama_dir if which == "llama" else qwen3_dir
    model, ckpt = build_from_hf(model_dir)
    tokens, spans = _groups(ckpt.hf_config["vocab_size"], seed=2)
    g = torch.randn(tokens.shape[0], tokens.shape[1] - 1, generator=torch.Generator().manual_seed(0))

    def grads(mode: str) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        lp, ent = model_logprobs_entropy(model, tokens, need_entropy=True, spans_B_2=spans, share_prompts=mode)
        ((lp * g).sum() + 0.1 * (ent * g).sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, packed = grads("off"), grads("on")
    assert plain.keys() == packed.keys()
    # The backward is the forward's chain again (its activations, then the transposed reductions): relative to
    # each gradient's largest magnitude, twice the model's chain bound (numerics.fp32_tol; 1.3e-4 for the tiny
    # llama). The loss is linear in lp, and the entropy's gradient -p (log p + H) carries the logits' error.
    c = ckpt.hf_config
    rel = fp32_tol(1.0, n=max(c["hidden_size"], c["intermediate_size"]), depth=2 * (c["num_hidden_layers"] + 1))
    for name in plain:
        check(max_abs_diff(plain[name], packed[name]), rel * max_abs(plain[name]), f"packed vs plain gradient {name}")


def test_spans_from_a_collated_batch_are_prompt_and_row_lengths():
    eps = [Episode(id=i, group_id=0, prompt_ids=[1] * p, completion_ids=[2] * c, generator_logprobs=[0.0] * c,
                   policy_version=0) for i, (p, c) in enumerate([(3, 2), (1, 5), (4, 1)])]
    eps.append(Episode(id=9, group_id=1, prompt_ids=[1, 1], completion_ids=[2, 3, 4], generator_logprobs=[0.0] * 3,
                       policy_version=0, loss_mask=[1, 0, 1]))  # an environment token inside the span
    batch = collate(eps, pad_id=0)
    assert spans_from_mask(batch["mask_B_T"]).tolist() == [[3, 5], [1, 6], [4, 5], [2, 5]]


def test_auto_packs_only_when_it_runs_fewer_tokens(llama_dir):  # noqa: F811
    vocab = 100
    tokens, spans = _groups(vocab, seed=3, groups=2, size=8, empty_row=False)
    assert use_packing(plan_shared_prefix(tokens, spans))
    # every row its own prompt: packing saves nothing, auto runs the plain batch
    distinct = tokens.clone()
    distinct[:, 0] = torch.arange(1, len(distinct) + 1)
    pack = plan_shared_prefix(distinct, spans)
    assert pack.tokens_N_S.shape[0] == len(distinct) and not use_packing(pack)
    # no row with anything to compute: the plain forward, whatever the setting
    model, _ = build_from_hf(llama_dir)
    none = torch.zeros_like(spans)
    with torch.no_grad():
        lp, _ = model_logprobs_entropy(model, tokens, spans_B_2=none, share_prompts="on")
    assert lp.shape == (tokens.shape[0], tokens.shape[1] - 1) and bool((lp == 0).all())


def test_bad_spans_are_named():
    from forgelab.engines.contracts import check_spans

    tokens = torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match=r"row 1 has span \(3, 3\)"):
        plan_shared_prefix(tokens, torch.tensor([[1, 4], [3, 3]]))
    with pytest.raises(ValueError, match=r"row 0 is \(2, 7\).*L = 6"):
        check_spans(torch.tensor([[2, 7], [1, 2]]), tokens)
    with pytest.raises(ValueError, match=r"\[B, 2\] = \[2, 2\]"):
        check_spans(torch.tensor([[2, 4]]), tokens)
    assert check_spans(None, tokens) is None


@pytest.mark.numerics
def test_trainer_step_is_the_same_packed_or_not(llama_dir, tmp_path):  # noqa: F811
    """One GRPO step (KL to a reference, entropy metric) on a grouped batch: the loss, the gradient norm and the
    metrics agree with and without packing (the gradients themselves: the test above; Adam's first step is
    sign(g), which would amplify rounding on near-zero gradients, so weights are not compared)."""
    import torch.distributed as dist

    from forgelab.config.components import TrainerConfig
    from forgelab.engines.trainer_state import TrainerState

    created = not dist.is_initialized()
    tokens, spans = _groups(100, seed=4, groups=3, size=4, empty_row=False)
    eps = []
    for i, (row, (s, e)) in enumerate(zip(tokens.tolist(), spans.tolist())):
        eps.append(Episode(id=i, group_id=i % 3, prompt_ids=row[:s], completion_ids=row[s:e],
                           generator_logprobs=[-1.0 - 0.1 * j for j in range(e - s)], policy_version=0,
                           advantage=(i % 5 - 2) / 2.0, ref_logprobs=[-1.2] * (e - s)))
    batch = collate(eps, pad_id=0)
    out = {}
    try:
        for mode in ("off", "on"):
            cfg = TrainerConfig(model_dir=llama_dir, lr=1e-3, share_prompts=mode, device="cpu",
                                loss_kwargs={"kl_coef": 0.04})
            state = TrainerState.create(cfg, 0, 1)
            scale = max_abs(state.logprobs(batch["tokens_B_L"]))
            metrics = state.train_step(batch)
            out[mode] = metrics
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
    m_off, m_on = out["off"], out["on"]
    assert m_off["skipped"] == 0 and m_on["skipped"] == 0
    keys = {k for k, v in m_off.items() if isinstance(v, float)} - {"step_time_s", "lr"}
    assert {"loss", "grad_norm", "entropy", "n_tokens"} <= keys
    # The same weights, two float32 forwards: kl_ref (a mean of exp(ref - lp) - (ref - lp) - 1, which dominates
    # the loss), the ratios and the entropy are means of smooth functions of the logprobs, so their relative
    # error is the logprobs' absolute error, the forward bound; the gradient norm's too (the backward's own
    # chain is below it). clip_frac counts tokens: one whose ratio is within rounding of the edge may flip.
    tol = model_tol(llama_dir, scale)
    assert m_on["n_tokens"] == m_off["n_tokens"]
    for key in sorted(keys - {"n_tokens"}):
        bound = 1.0 / m_off["n_tokens"] if key == "clip_frac" else tol * max(1.0, abs(m_off[key]))
        check(abs(m_on[key] - m_off[key]), bound, f"packed vs plain step: {key}")
