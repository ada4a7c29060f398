"""A one-process probe of on-policy distillation's learning signal (issue #28), outside forgelab's engines.

    .venv/bin/python tools/distill_probe.py --loss exact --seed 0      # the exact per-position reverse KL
    .venv/bin/python tools/distill_probe.py --loss sampled --seed 0    # the sampled token's log-ratio (forgelab's)
    .venv/bin/python tools/distill_probe.py --loss grpo --seed 0       # GRPO's group advantage, for the ratio

Why it exists: `forgelab.bench distill` measures forgelab's distillation (the sampled token's
``teacher logprob - student logprob`` as a per-token advantage under GRPO's clipped loss) against GRPO, and it
misses the issue's goal (a third of GRPO's steps). The trainer's loss API takes the sampled tokens' logprobs
only (its backward pass pushes ``dL/dlogprob`` of those tokens through the model), so a loss over the whole
next-token distribution, the exact reverse KL ``sum_v p_s(v) (log p_s(v) - log p_t(v))`` at every completion
position, cannot be written as a forgelab loss today. This probe asks whether it would be worth building: the
same student (the shipped base), teacher (`forgelab.recipes.distill_teacher()`), task, batch (8 problems x 8
samples at temperature 1, 8 tokens), AdamW, warmup and clipping as the demo, in one process with HF models and
plain PyTorch; every 10 steps the held-out greedy accuracy on the run's 200 test problems
(`greedy_accuracy_hf`), stopping at the target (90 % of the teacher's). The three arms differ only in the loss.
Not a benchmark of forgelab: no engines, no asynchrony (each step samples from the current weights), one
thread. The last line is JSON: ``{"loss", "seed", "steps_to_target" (None: not reached), "curve"}``.
"""
from __future__ import annotations

import argparse
import json
import random
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loss", choices=("exact", "sampled", "grpo"), default="exact")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=5, help="linear warmup steps (the demo's 5)")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (forgelab's default 1.0)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--teacher-temperature", type=float, default=1.0, help="the teacher's logits / this")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    from forgelab.algos.advantages import group_zscore_unbiased
    from forgelab.controller.evaluate import greedy_accuracy_hf, load_model_and_tokenizer
    from forgelab.data.prompts import format_prompt
    from forgelab.data.tasks import get_task
    from forgelab.recipes import distill_teacher
    from forgelab.config.run_config import SHIPPED_MODEL

    teacher = distill_teacher()
    student, tok = load_model_and_tokenizer(SHIPPED_MODEL)
    tmodel, _ = load_model_and_tokenizer(teacher["path"])
    tmodel.requires_grad_(False)
    task = get_task("addition")
    train, held = task.make("train", 5000, 0), task.make("test", 200, 0)
    t_acc, s_acc = greedy_accuracy_hf(tmodel, tok, held), greedy_accuracy_hf(student, tok, held)
    target = round(0.9 * t_acc, 4)
    print(f"teacher {t_acc:.3f}, student {s_acc:.3f}, target {target}; loss {args.loss}, lr {args.lr}, "
          f"seed {args.seed}", flush=True)
    opt = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0)
    rng = random.Random(args.seed)
    tok.padding_side = "left"
    curve, reached, t0 = [(0, s_acc)], None, time.time()
    for step in range(1, args.steps + 1):
        problems = rng.sample(train, 8)
        prompts = [format_prompt(tok, p.prompt) for p in problems for _ in range(8)]
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        student.eval()
        with torch.no_grad():
            ids = student.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        P = enc["input_ids"].shape[1]
        comp = ids[:, P:]
        is_eos = comp == tok.eos_token_id
        mask = ((is_eos.long().cumsum(1) - is_eos.long()) == 0).float()  # up to and including the first end
        attn = torch.cat([enc["attention_mask"], mask.long()], 1)
        student.train()
        ls = student(input_ids=ids, attention_mask=attn).logits[:, P - 1:-1].log_softmax(-1)
        lp = ls.gather(-1, comp.unsqueeze(-1)).squeeze(-1)
        per_seq = lambda x: ((x * mask).sum(1) / mask.sum(1)).mean()  # noqa: E731  (token mean per sequence)
        if args.loss == "grpo":
            texts = tok.batch_decode(comp, skip_special_tokens=True)
            r = torch.tensor([task.reward(p.prompt, c, p.target, **p.info)
                              for p, c in zip([p for p in problems for _ in range(8)], texts)]).view(8, 8)
            adv = group_zscore_unbiased(r).view(-1, 1)  # unbiased std, eps 1e-4
            loss = per_seq(-adv * torch.exp(lp - lp.detach()))
        else:
            with torch.no_grad():
                lt = (tmodel(input_ids=ids, attention_mask=attn).logits[:, P - 1:-1]
                      / args.teacher_temperature).log_softmax(-1)
            if args.loss == "exact":
                loss = per_seq((ls.exp() * (ls - lt)).sum(-1))
            else:  # the sampled token's log-ratio as a per-token advantage (ratio 1: on-policy)
                adv = (lt.gather(-1, comp.unsqueeze(-1)).squeeze(-1) - lp).detach()
                loss = per_seq(-adv * torch.exp(lp - lp.detach()))
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, step / max(args.warmup, 1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), args.clip)
        opt.step()
        if step % args.every == 0:
            acc = greedy_accuracy_hf(student, tok, held)
            curve.append((step, acc))
            print(f"  step {step}: held-out {acc:.3f} ({time.time() - t0:.0f} s)", flush=True)
            if acc >= target:
                reached = step
                break
    print(json.dumps({"loss": args.loss, "seed": args.seed, "lr": args.lr, "target": target,
                      "teacher_accuracy": t_acc, "steps_to_target": reached, "curve": curve}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
