"""Shared-prompt packing: run a group's prompt through the model once, not once per completion.

GRPO samples ``G`` completions of each prompt, so a padded ``[B, L]`` batch
runs every prompt token ``G`` times through the trainer and the reference
model, although the prompt's hidden states are the same in every row (causal
attention: a prompt token never sees the completion). `plan_shared_prefix`
packs the rows that share a prompt into one sequence,

    [prompt | completion 1 | completion 2 | ... ]

with a dense attention mask in which each completion sees the prompt and its
own earlier tokens only, and RoPE positions that restart at ``len(prompt)``
for every completion. The logits at each needed position are then exactly
those of the unpacked row (up to float rounding from different matmul
shapes), so logprobs, entropies and their gradients are unchanged, while the
model runs ``P + sum(C_i)`` tokens per group instead of ``G * (P + max C)``.

Which positions are needed is given per row as a span ``(start, end)``: the
row's prompt is ``tokens[b, :start]`` and its tokens ``tokens[b, :end]``
(right padding after ``end`` is never read); logprobs are produced for target
positions ``start - 1 .. end - 2`` (predicting ``tokens[b, start:end]``) and
are 0 elsewhere, forgelab's convention for positions outside the loss mask
(`forgelab.algos.batching`). Rows group by equal prompt tokens, whatever
their order; a group whose pack would exceed ``max_len`` tokens is split into
several packs, each with its own copy of the prompt.

    >>> import torch
    >>> tokens = torch.tensor([[1, 2, 3, 4, 0], [1, 2, 5, 6, 7], [9, 3, 0, 0, 0]])
    >>> spans = torch.tensor([[2, 4], [2, 5], [1, 2]])
    >>> pack = plan_shared_prefix(tokens, spans, max_len=64)
    >>> pack.tokens_N_S.tolist()                 # rows 0 and 1 share [1, 2]
    [[1, 2, 3, 4, 5, 6, 7], [9, 3, 0, 0, 0, 0, 0]]
    >>> pack.positions_N_S[0].tolist()
    [0, 1, 2, 3, 2, 3, 4]
    >>> pack.packed_tokens, pack.plain_tokens    # tokens the model runs: packed vs [B, max end]
    (9, 15)
    >>> pack.allowed_N_S_S[0, 4].int().tolist()  # completion 2's first token sees the prompt and itself
    [1, 1, 0, 0, 1, 0, 0]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PrefixPack", "plan_shared_prefix", "spans_from_mask", "span_mask", "unpack_to_rows", "DEFAULT_MAX_PACK_LEN"]

#: Longest packed sequence `plan_shared_prefix` builds by default: attention over a pack is dense in its
#: length, so a pack is capped where that cost would start to outweigh the shared prompt's saving.
DEFAULT_MAX_PACK_LEN = 1024


@dataclass(frozen=True)
class PrefixPack:
    """A packed batch: what to run through the model and where each logprob goes back.

    Attributes:
        tokens_N_S: packed token ids (padded with id 0, never attended to or read).
        positions_N_S: RoPE positions of each packed token in its own row.
        allowed_N_S_S: ``allowed[n, i, j]``: may packed token ``i`` attend to ``j`` (a padding
            position attends to itself only, so no softmax row is empty).
        src_M: index into the flattened ``[N * S]`` hidden states of each needed target.
        target_M: the token id each of those hidden states predicts.
        dst_M: index into the flattened ``[B * T]`` output (``T = L - 1``).
        shape_B_T: ``(B, T)`` of the unpacked output.
        packed_tokens: real (non-padding) tokens in the packs; plain_tokens: ``B * max(end)``.
    """

    tokens_N_S: torch.Tensor
    positions_N_S: torch.Tensor
    allowed_N_S_S: torch.Tensor
    src_M: torch.Tensor
    target_M: torch.Tensor
    dst_M: torch.Tensor
    shape_B_T: tuple[int, int]
    packed_tokens: int
    plain_tokens: int

    @property
    def padded_tokens(self) -> int:
        """Tokens the model actually runs (packs padded to the longest)."""
        return int(self.tokens_N_S.numel())


def spans_from_mask(mask_B_T: torch.Tensor) -> torch.Tensor:
    """``[B, 2]`` spans ``(start, end)`` covering each row's masked target positions.

    ``start = first masked t + 1`` (the row's prompt length), ``end = last masked t + 2``;
    a row with no masked position gets ``(0, 0)`` (nothing to compute).

    >>> spans_from_mask(torch.tensor([[0., 1., 1., 0.], [0., 0., 1., 0.], [0., 0., 0., 0.]])).tolist()
    [[2, 4], [3, 4], [0, 0]]
    """
    if mask_B_T.dim() != 2:
        raise ValueError(f"spans_from_mask: mask must be [B, T], got {tuple(mask_B_T.shape)}")
    on = mask_B_T != 0
    B, T = on.shape
    idx = torch.arange(T).expand(B, T)
    any_on = on.any(dim=1)
    first = torch.where(on, idx, T).min(dim=1).values
    last = torch.where(on, idx, -1).max(dim=1).values
    return torch.where(any_on.unsqueeze(1), torch.stack([first + 1, last + 2], dim=1), 0).long()


def plan_shared_prefix(tokens_B_L: torch.Tensor, spans_B_2: torch.Tensor, *,
                       max_len: int = DEFAULT_MAX_PACK_LEN) -> PrefixPack:
    """Pack rows that share a prompt (see the module docstring).

    Args:
        tokens_B_L: right-padded token ids.
        spans_B_2: per row ``(start, end)``: prompt ``tokens[b, :start]`` (``start >= 1``), row
            ``tokens[b, :end]`` (``start < end <= L``); ``(0, 0)`` marks a row with nothing to compute.
        max_len: a pack holds at most this many tokens unless one row alone is longer.
    """
    if tokens_B_L.dim() != 2 or spans_B_2.shape != (tokens_B_L.shape[0], 2):
        raise ValueError(f"plan_shared_prefix: tokens {tuple(tokens_B_L.shape)} need [B, L] and spans [B, 2], "
                         f"got spans {tuple(spans_B_2.shape)}")
    B, L = tokens_B_L.shape
    T = L - 1
    tok = tokens_B_L.cpu()
    rows_tok = tok.tolist()
    spans = [(int(s), int(e)) for s, e in spans_B_2.tolist()]
    groups: dict[tuple, list[int]] = {}
    for b, (s, e) in enumerate(spans):
        if s == 0 and e == 0:
            continue
        if not (1 <= s < e <= L):
            raise ValueError(f"plan_shared_prefix: row {b} has span ({s}, {e}); need 1 <= start < end <= L = {L}")
        groups.setdefault(tuple(rows_tok[b][:s]), []).append(b)

    packs: list[tuple[tuple, list[int]]] = []  # (prompt, rows), in order of first appearance
    for prompt, rows in groups.items():
        cur, length = [], len(prompt)
        for b in rows:
            n = spans[b][1] - len(prompt)
            if cur and length + n > max_len:
                packs.append((prompt, cur))
                cur, length = [], len(prompt)
            cur.append(b)
            length += n
        packs.append((prompt, cur))

    lengths = [len(p) + sum(spans[b][1] - len(p) for b in rows) for p, rows in packs]
    N, S = len(packs), max(lengths, default=1)
    tokens_N_S = torch.zeros((N, S), dtype=torch.long)  # padding: any valid id, never attended to or read
    positions_N_S = torch.zeros((N, S), dtype=torch.long)
    allowed = torch.zeros((N, S, S), dtype=torch.bool)
    src, target, dst = [], [], []
    causal_S_S = torch.ones((S, S), dtype=torch.bool).tril_()
    for n, (prompt, rows) in enumerate(packs):
        P = len(prompt)
        tokens_N_S[n, :P] = torch.tensor(prompt, dtype=torch.long)
        positions_N_S[n, :P] = torch.arange(P)
        allowed[n, :P, :P] = causal_S_S[:P, :P]
        o = P
        for b in rows:
            e = spans[b][1]
            k = e - P  # this row's own tokens: tokens[b, P:e]
            tokens_N_S[n, o:o + k] = tok[b, P:e]
            positions_N_S[n, o:o + k] = torch.arange(P, e)
            allowed[n, o:o + k, :P] = True
            allowed[n, o:o + k, o:o + k] = causal_S_S[:k, :k]
            # target t predicts tokens[b, t + 1]: t = P - 1 reads the prompt's last hidden state,
            # t = P .. e - 2 read this row's own tokens at o .. o + k - 2
            src.append(n * S + P - 1)
            src.extend(range(n * S + o, n * S + o + k - 1))
            target.extend(rows_tok[b][P:e])
            dst.extend(range(b * T + P - 1, b * T + e - 1))
            o += k
        idle = torch.arange(o, S)
        allowed[n, idle, idle] = True
    used = [e for s, e in spans if e]
    return PrefixPack(
        tokens_N_S=tokens_N_S, positions_N_S=positions_N_S, allowed_N_S_S=allowed,
        src_M=torch.tensor(src, dtype=torch.long), target_M=torch.tensor(target, dtype=torch.long),
        dst_M=torch.tensor(dst, dtype=torch.long), shape_B_T=(B, T),
        packed_tokens=sum(lengths), plain_tokens=B * max(used, default=0),
    )


def unpack_to_rows(values_M: torch.Tensor, pack: PrefixPack) -> torch.Tensor:
    """Scatter per-target values back to ``[B, T]`` (0 outside the spans); differentiable.

    >>> import torch
    >>> pack = plan_shared_prefix(torch.tensor([[1, 2, 3], [1, 2, 4]]), torch.tensor([[2, 3], [2, 3]]))
    >>> unpack_to_rows(torch.tensor([-0.5, -0.25]), pack).tolist()
    [[0.0, -0.5], [0.0, -0.25]]
    """
    B, T = pack.shape_B_T
    out = values_M.new_zeros(B * T)
    return out.index_put((pack.dst_M.to(values_M.device),), values_M).view(B, T)


def span_mask(spans_B_2: torch.Tensor, T: int) -> torch.Tensor:
    """``[B, T]`` bool: the target positions ``start - 1 .. end - 2`` each span covers.

    >>> span_mask(torch.tensor([[2, 4], [0, 0]]), 4).int().tolist()
    [[0, 1, 1, 0], [0, 0, 0, 0]]
    """
    t = torch.arange(T)
    start, end = spans_B_2[:, :1].cpu(), spans_B_2[:, 1:].cpu()
    return (t >= start - 1) & (t <= end - 2) & (end > 0)
