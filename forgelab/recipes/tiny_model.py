"""Build the shipped tiny model: a 3.2 M-parameter Llama, briefly SFT'd on the toy tasks.

    python -m forgelab.recipes.tiny_model [--out DIR] [--steps N] [--seed S]

What it does, on CPU with at most 2 threads (a few minutes):

1. builds the character tokenizer (``forgelab.data.tokenizer``);
2. builds ``LlamaForCausalLM`` (4 layers, hidden 256, 4 heads, 2 KV heads,
   untied embeddings, float32) with ``torch.manual_seed(seed)``;
3. supervised pretraining with AdamW on chat-templated (prompt, answer) pairs
   from the TRAIN split of every task in ``forgelab.data.tasks.TASKS``; the loss
   covers only the answer tokens and the end-of-turn token (the loop is
   ``forgelab.recipes.sft.train_sft``, one stream, ``average="mean"``);
4. saves model (safetensors), tokenizer and generation config (eos = ``<|end|>``)
   to ``--out``, measures greedy accuracy on each task's TEST split with
   ``forgelab.controller.evaluate.greedy_accuracy_hf``, and writes ``model_card.json`` and
   ``README.md`` there.

The step count is chosen so the model is deliberately weak -- well-formed
answers, often right on addition, rarely on multistep -- leaving room for RL.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field

import torch

from forgelab.data import format_prompt
from forgelab.controller.evaluate import greedy_accuracy_hf
from forgelab.data.tasks import TASKS, Problem
from forgelab.data.tokenizer import build_tokenizer, save_tokenizer
from forgelab.recipes.sft import IGNORE, SFTResult, Stream, pad_right, sft_loss, train_sft, warmup_lr

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "tiny-llama")
__all__ = ["DEFAULT_OUT", "IGNORE", "TinyRecipe", "encode_sft", "evaluate_all", "lr_at", "main", "model_config",
           "render_readme", "save_with_card", "sft_loss", "train"]


@dataclass(kw_only=True)
class TinyRecipe:
    """Hyper-parameters of the tiny model's SFT run (the defaults make the shipped model)."""

    out: str = DEFAULT_OUT
    """Output directory."""
    steps: int = 300
    """Optimizer steps."""
    seed: int = 0
    """Seeds the weights, the training-batch order and the task data."""
    batch_size: int = 128
    """Sequences per step."""
    lr: float = 1e-3
    """AdamW learning rate (linear warmup, then constant)."""
    warmup_steps: int = 50
    """Linear warmup steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    n_train: dict[str, int] = field(default_factory=lambda: {"addition": 8_000, "multistep": 4_000})
    """Train problems per task (their ratio is the mixing ratio; addition is the RL target)."""
    n_test: int = 500
    """Held-out test problems per task for the model card."""
    threads: int = 2
    """``torch.set_num_threads`` (at most 2 on the shared machine)."""
    save_every: int = 0
    """If > 0, also save an evaluated snapshot to ``out/step<k>`` every this many steps (for tuning)."""


def model_config(tokenizer):
    """The tiny Llama's ``LlamaConfig`` (untied embeddings: vLLM's weight reload mishandles tied ones)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        initializer_range=0.02,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def encode_sft(tokenizer, problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids_N_T, labels_N_T)``, right-padded; labels are IGNORE except answer + end token."""
    rows, labels = [], []
    for p in problems:
        prompt_ids = tokenizer.encode(format_prompt(tokenizer, p.prompt), add_special_tokens=False)
        answer_ids = tokenizer.encode(p.target, add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append(prompt_ids + answer_ids)
        labels.append([IGNORE] * len(prompt_ids) + answer_ids)
    return pad_right(rows, labels, tokenizer.pad_token_id)


def lr_at(step: int, r: TinyRecipe) -> float:
    """Linear warmup, then constant: a run of k steps is exactly the first k steps of a longer
    run, so snapshots of one long run (``--save-every``) show what each ``--steps`` gives."""
    return warmup_lr(step, r.lr, r.warmup_steps)


def evaluate_all(model, tokenizer, n: int, seed: int) -> dict[str, float]:
    """Greedy accuracy on the first ``n`` test problems of every task."""
    return {
        name: greedy_accuracy_hf(model, tokenizer, task.make("test", n, seed))
        for name, task in TASKS.items()
    }


def save_with_card(model, tokenizer, r: TinyRecipe, out: str, *, steps: int, losses: list[float],
                   train_s: float) -> dict:
    """Save model + tokenizer + generation config to ``out``, evaluate, write the model card."""
    from transformers import GenerationConfig

    model.eval()
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    os.chmod(os.path.join(out, "model.safetensors"), 0o644)  # written 0600; it ships in git
    save_tokenizer(tokenizer, out)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out)
    accuracy = evaluate_all(model, tokenizer, r.n_test, r.seed)
    model.train()
    defaults = TinyRecipe()
    flags = [f"--steps {steps}", f"--seed {r.seed}"]
    flags += [f"--{k.replace('_', '-')} {getattr(r, k)}" for k in ("lr", "batch_size", "threads")
              if getattr(r, k) != getattr(defaults, k)]
    card = {
        "n_params": sum(p.numel() for p in model.parameters()),
        "architecture": "LlamaForCausalLM: 4 layers, hidden 256, 4 heads, 2 KV heads, "
        "intermediate 768, untied embeddings, rope_theta 10000, float32",
        "vocab_size": len(tokenizer),
        "recipe": {k: v for k, v in asdict(r).items() if k not in ("out", "save_every")} | {"steps": steps},
        "command": "python -m forgelab.recipes.tiny_model " + " ".join(flags),
        "train_problems": r.n_train,
        "train_steps": steps,
        "train_seconds": round(train_s, 1),
        "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
        "eval": {
            "function": "forgelab.controller.evaluate.greedy_accuracy_hf",
            "split": "test",
            "n_per_task": r.n_test,
            "seed": r.seed,
            "max_new_tokens": 8,
            "accuracy": {k: round(v, 4) for k, v in accuracy.items()},
        },
        "torch_version": torch.__version__,
    }
    with open(os.path.join(out, "model_card.json"), "w") as f:
        json.dump(card, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(render_readme(card))
    return card


def train(r: TinyRecipe) -> dict:
    """Run the recipe; returns the model card dict (also written to ``r.out``). The process's torch thread count
    is the recipe's while it trains and the caller's again after."""
    before = torch.get_num_threads()
    torch.set_num_threads(min(r.threads, 2))
    try:
        return _train(r)
    finally:
        torch.set_num_threads(before)


def _train(r: TinyRecipe) -> dict:
    from transformers import LlamaForCausalLM

    tokenizer = build_tokenizer()
    train_problems = [p for name, n in r.n_train.items() for p in TASKS[name].make("train", n, r.seed)]
    ids_N_T, labels_N_T = encode_sft(tokenizer, train_problems)

    torch.manual_seed(r.seed)
    model = LlamaForCausalLM(model_config(tokenizer)).float()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params: {n_params:,}  train sequences: {len(ids_N_T):,} x {ids_N_T.shape[1]} tokens")

    def snapshot(step: int, so_far: SFTResult) -> None:
        if r.save_every and step % r.save_every == 0 and step < r.steps:
            snap = save_with_card(model, tokenizer, r, os.path.join(r.out, f"step{step}"),
                                  steps=step, losses=so_far.losses, train_s=so_far.train_seconds)
            print(f"  snapshot @{step}: {snap['eval']['accuracy']}", flush=True)

    result = train_sft(model, [Stream(ids_N_T, labels_N_T, r.batch_size)], steps=r.steps, lr=r.lr,
                       warmup_steps=r.warmup_steps, weight_decay=r.weight_decay, seed=r.seed, average="mean",
                       log_every=50, after_step=snapshot)
    losses, train_s = result.losses, result.train_seconds
    card = save_with_card(model, tokenizer, r, r.out, steps=r.steps, losses=losses, train_s=train_s)
    print(json.dumps({k: card[k] for k in ("n_params", "final_loss", "train_seconds", "eval")}))
    return card


def render_readme(card: dict) -> str:
    """The model card, in Markdown, from the machine-readable card dict."""
    ev = card["eval"]
    acc_rows = "\n".join(f"| {k} | {100 * v:.1f} % |" for k, v in ev["accuracy"].items())
    return f"""# tiny-llama (forgelab)

A deliberately weak {card['n_params'] / 1e6:.2f} M-parameter character-level Llama,
the base model for forgelab's RL tutorials. Built by `forgelab/recipes/tiny_model.py`.

- **Architecture**: {card['architecture']}; vocabulary {card['vocab_size']}
  (one token per character + special tokens, `forgelab/data/tokenizer.py`).
- **Parameters**: {card['n_params']:,}.
- **Chat format**: `<|bos|><|user|>12+345=<|end|><|assistant|>357<|end|>`;
  `<|end|>` is the eos token and ends every turn.
- **Data**: chat-templated (prompt, answer) pairs from the train split of the
  tasks (`forgelab/data/tasks.py`) {', '.join(f'{k}: {v:,} problems' for k, v in card['train_problems'].items())},
  seed {card['recipe']['seed']}, shuffled together;
  loss on the answer tokens and the end token only.
- **Training**: AdamW, lr {card['recipe']['lr']}, batch {card['recipe']['batch_size']},
  {card['train_steps']} steps ({card['train_seconds']} s, {card['recipe']['threads']} CPU thread(s){'; ' + card['train_seconds_note'] if 'train_seconds_note' in card else ''}),
  final loss (mean of the last 50 steps) {card['final_loss']}.
- **Seed**: {card['recipe']['seed']} (weights, batch order, data).
- **Reproduce**: `{card['command']}`

## Base greedy accuracy (held-out test split)

`{ev['function']}` on the first {ev['n_per_task']} test problems per task
(`Task.make("test", {ev['n_per_task']}, seed={ev['seed']})`), greedy,
max_new_tokens={ev['max_new_tokens']}, exact-answer reward:

| task | accuracy |
|---|---|
{acc_rows}

Machine-readable: `model_card.json`.
"""


def main(argv: list[str] | None = None) -> dict:
    defaults = TinyRecipe()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=defaults.out)
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--threads", type=int, default=defaults.threads)
    p.add_argument("--save-every", type=int, default=0)
    a = p.parse_args(argv)
    return train(TinyRecipe(out=a.out, steps=a.steps, seed=a.seed, lr=a.lr,
                            batch_size=a.batch_size, threads=a.threads,
                            save_every=a.save_every))


if __name__ == "__main__":
    main(sys.argv[1:])
