"""Supervised fine-tuning of the shipped model: the one training loop both recipes run.

    tiny_model       pretrains the tiny Llama from scratch on one stream of (prompt, answer) pairs
    tool_warmstart   fine-tunes it on two streams at once (tool transcripts and direct answers)

The data is right-padded ``(ids_N_T, labels_N_T)`` (`pad_right`): labels equal the ids where the loss is
taken and are ``IGNORE`` elsewhere (prompt, tool turns, padding). No attention mask is needed: padding is
on the right, so under the causal mask no real token attends to a pad token, and pads carry no label.

Each step of `train_sft` draws ``batch_size`` rows from every `Stream` (each stream walks its own shuffled
order and reshuffles when fewer than a batch remain; every order comes from one generator seeded with
``seed``, drawn in stream order), takes the next-token cross-entropy at the labelled positions, and makes
one AdamW step (betas 0.9 / 0.95, gradient norm clipped to 1, linear warmup then constant learning rate).

The one choice the recipes make differently is how a step's loss is averaged (``average``):

- ``"mean"``: one stream; ``F.cross_entropy``'s own mean over the batch's labelled tokens, the batch at
  the data's full padded width (`sft_loss`). The shipped tiny model was made this way.
- ``"tokens"``: any number of streams; the cross-entropies summed over the labelled tokens of every
  stream's batch, each batch first trimmed to its last label (`masked_ce_sum`), divided by their count.
  A stream therefore weighs by its labelled tokens, not by its batch size. The tool warm start.

With one stream the two are the same mean; they differ in the last bits of float32 (trimming changes the
shapes the kernels see; the division happens inside or outside ``cross_entropy``), and each recipe keeps
the one its shipped checkpoint was made with: the loop gives each recipe the same bits it gave before it
was shared.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch

IGNORE = -100
"""The label of a position that carries no loss (``F.cross_entropy``'s ``ignore_index``)."""

__all__ = ["IGNORE", "SFTResult", "Stream", "masked_ce_sum", "pad_right", "sft_loss", "train_sft", "warmup_lr"]


def pad_right(rows: Sequence[Sequence[int]], labels: Sequence[Sequence[int]],
              pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids_N_T, labels_N_T)``: the rows right-padded with ``pad_id``, their labels with ``IGNORE``.

    >>> pad_right([[5, 6, 7], [8]], [[IGNORE, 6, 7], [8]], pad_id=0)
    (tensor([[5, 6, 7],
            [8, 0, 0]]), tensor([[-100,    6,    7],
            [   8, -100, -100]]))
    """
    T = max(map(len, rows))
    ids_N_T = torch.full((len(rows), T), pad_id, dtype=torch.long)
    labels_N_T = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    for i, (r, l) in enumerate(zip(rows, labels)):
        ids_N_T[i, : len(r)] = torch.tensor(r)
        labels_N_T[i, : len(l)] = torch.tensor(l)
    return ids_N_T, labels_N_T


def sft_loss(model: torch.nn.Module, ids_B_T: torch.Tensor, labels_B_T: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled positions (``average="mean"``)."""
    logits_B_T_V = model(input_ids=ids_B_T).logits
    return torch.nn.functional.cross_entropy(
        logits_B_T_V[:, :-1].flatten(0, 1), labels_B_T[:, 1:].flatten(), ignore_index=IGNORE
    )


def masked_ce_sum(model: torch.nn.Module, ids_B_T: torch.Tensor,
                  labels_B_T: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(sum of next-token cross-entropies over labelled positions, their count)`` (``average="tokens"``);
    the batch is trimmed to its last label first."""
    T = int((labels_B_T != IGNORE).nonzero()[:, 1].max()) + 1
    logits_B_T_V = model(input_ids=ids_B_T[:, :T]).logits
    targets = labels_B_T[:, 1:T].flatten()
    loss = torch.nn.functional.cross_entropy(logits_B_T_V[:, :-1].flatten(0, 1), targets, ignore_index=IGNORE,
                                             reduction="sum")
    return loss, int((targets != IGNORE).sum())


def warmup_lr(step: int, lr: float, warmup_steps: int) -> float:
    """The learning rate of 0-based ``step``: linear warmup over ``warmup_steps``, then constant, so a run of
    k steps is exactly the first k steps of a longer one.

    >>> [warmup_lr(s, 1e-3, 4) for s in (0, 3, 10)]
    [0.00025, 0.001, 0.001]
    """
    return lr * min(1.0, (step + 1) / warmup_steps)


@dataclass
class Stream:
    """One source of training rows: right-padded ``(ids_N_T, labels_N_T)`` and the rows it gives per step."""

    ids_N_T: torch.Tensor
    labels_N_T: torch.Tensor
    batch_size: int


@dataclass
class SFTResult:
    """What `train_sft` returns: the loss of every step (floats) and the seconds spent training."""

    losses: list[float]
    train_seconds: float
    """Wall-clock seconds of the steps, excluding the time spent in ``after_step``."""


def train_sft(model: torch.nn.Module, streams: Sequence[Stream], *, steps: int, lr: float, warmup_steps: int,
              seed: int, average: Literal["mean", "tokens"], weight_decay: float = 0.0, log_every: int = 50,
              after_step: Callable[[int, SFTResult], None] | None = None) -> SFTResult:
    """Fine-tune ``model`` in place for ``steps`` AdamW steps on ``streams`` (see the module docstring).

    Prints ``step k  loss L  Ns`` at step 1 and every ``log_every`` steps, L the mean of the last
    ``log_every`` losses. ``after_step(k, so_far)`` is called after step k (1-based) with the result so far,
    e.g. to save a snapshot; its time is left out of ``train_seconds`` and of the printed seconds.
    """
    if average not in ("mean", "tokens"):
        raise ValueError(f"train_sft: average must be 'mean' or 'tokens', got {average!r}")
    if average == "mean" and len(streams) != 1:
        raise ValueError(f"train_sft(average='mean') takes one stream, got {len(streams)}; "
                         "use average='tokens' to pool several")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(seed)
    orders = [torch.randperm(len(s.ids_N_T), generator=gen) for s in streams]
    cursors = [0] * len(streams)
    losses: list[float] = []
    t_train = time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = warmup_lr(step, lr, warmup_steps)
        batches = []
        for k, s in enumerate(streams):
            if cursors[k] + s.batch_size > len(orders[k]):
                orders[k], cursors[k] = torch.randperm(len(s.ids_N_T), generator=gen), 0
            idx = orders[k][cursors[k]: cursors[k] + s.batch_size]
            cursors[k] += s.batch_size
            batches.append((s.ids_N_T[idx], s.labels_N_T[idx]))
        if average == "mean":
            loss = sft_loss(model, *batches[0])
        else:
            total, count = torch.zeros(()), 0
            for ids_B_T, labels_B_T in batches:
                loss_sum, n = masked_ce_sum(model, ids_B_T, labels_B_T)
                total, count = total + loss_sum, count + n
            loss = total / count
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % log_every == 0 or step == 0:
            window = losses[-log_every:]
            print(f"step {step + 1:5d}  loss {sum(window) / len(window):.4f}  "
                  f"{time.perf_counter() - t_train:.0f}s", flush=True)
        if after_step is not None:
            t = time.perf_counter()
            after_step(step + 1, SFTResult(losses=list(losses), train_seconds=t - t_train))
            t_train += time.perf_counter() - t
    return SFTResult(losses=losses, train_seconds=time.perf_counter() - t_train)
