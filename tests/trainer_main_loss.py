"""Run as a script (``__main__``): a loss defined here must reach the trainer's process and run there.

    python tests/trainer_main_loss.py MODEL_DIR   -> prints one JSON line
"""
import asyncio
import json
import sys

import torch

from forgelab.engines.trainer import Trainer, TrainerConfig


def nll_main(logprobs_B_T, *, mask_B_T, **_):
    """Token-level negative log-likelihood, marked so the caller can tell it ran."""
    mask = mask_B_T.float()
    return -(logprobs_B_T * mask).sum() / mask.sum(), {"from_main": 1.0}


def scaled(factor):
    def loss(logprobs_B_T, *, mask_B_T, **_):  # a closure over a controller-side value
        mask = mask_B_T.float()
        return -factor * (logprobs_B_T * mask).sum() / mask.sum(), {"factor": float(factor)}
    return loss


async def main(model_dir: str) -> dict:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from trainer_actors import random_batches

    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    b1, b2 = random_batches(vocab, 2, seed=3)
    trainer = await Trainer.options(procs=1).as_actor(TrainerConfig(model_dir=model_dir, lr=1e-4, loss=nll_main))
    try:
        lp = await trainer.call_one("logprobs", b1["tokens_B_L"])
        m1 = await trainer.call_one("train_step", b1)
        expected1 = float(-(lp * b1["mask_B_T"]).sum() / b1["mask_B_T"].sum())
        await trainer.call_one("set_loss", scaled(3.0))
        lp2 = await trainer.call_one("logprobs", b2["tokens_B_L"])
        m2 = await trainer.call_one("train_step", b2)
        expected2 = float(-3.0 * (lp2 * b2["mask_B_T"]).sum() / b2["mask_B_T"].sum())
    finally:
        await trainer.shutdown()
    def scalars(m: dict) -> dict:  # the step's metrics, without its per-token values (tensors: not JSON)
        return {k: v for k, v in m.items() if isinstance(v, (bool, int, float, str))}

    return {"m1": scalars(m1), "m2": scalars(m2), "expected1": expected1, "expected2": expected2,
            "scale1": float(lp.abs().max()), "scale2": float(lp2.abs().max())}


if __name__ == "__main__":
    print("RESULT " + json.dumps(asyncio.run(main(sys.argv[1]))), flush=True)
