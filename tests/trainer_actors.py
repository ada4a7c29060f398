"""Helpers for the trainer tests: a weight-recording stand-in generator and a tiny model directory.

Child processes import this module (it sits on their path like ``runtime_actors``).
"""
from __future__ import annotations

import os

import torch
from monarch.actor import endpoint

from forgelab.runtime import Component

SHIPPED_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "forgelab", "assets", "tiny-llama")


class WeightSink(Component):
    """Stands in for a Generator: records what `update_weights` received."""

    def __init__(self) -> None:
        self.version = 0
        self.weights: dict[str, torch.Tensor] = {}

    @endpoint
    async def update_weights(self, version: int, weights: dict) -> int:
        if version <= self.version:
            raise ValueError(f"version {version} is not newer than {self.version}")
        self.version, self.weights = version, {k: v.clone() for k, v in weights.items()}
        return version

    @endpoint
    async def received(self) -> tuple[int, dict]:
        return self.version, self.weights


def tiny_model_dir(tmp_dir: str) -> str:
    """The shipped tiny Llama when it exists, else a random Llama of the same shape (with the char tokenizer)."""
    if os.path.exists(os.path.join(SHIPPED_MODEL, "model.safetensors")):
        return SHIPPED_MODEL
    from transformers import LlamaForCausalLM

    from forgelab.recipes.tiny_model import model_config
    from forgelab.data.tokenizer import build_tokenizer, save_tokenizer

    out = os.path.join(tmp_dir, "random-tiny-llama")
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        tok = build_tokenizer()
        torch.manual_seed(0)
        LlamaForCausalLM(model_config(tok)).float().save_pretrained(out)
        save_tokenizer(tok, out)
    return out


def random_batches(vocab: int, n: int, *, B: int = 4, seed: int = 0, with_ref: bool = True,
                   shared_prompts: bool = False) -> list[dict]:
    """``n`` collated batches of random episodes (ragged prompts and completions); with ``shared_prompts`` the two
    episodes of a group (``i // 2``) share their prompt, as GRPO's do (what shared-prompt packing packs)."""
    from forgelab.algos.batching import collate
    from forgelab.types import Episode

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        eps = []
        prompt: list[int] = []
        for i in range(B):
            P, C = 3 + i % 3, 4 + (2 * i) % 5
            gen = (-torch.rand(C, generator=g) * 4).tolist()
            if not (shared_prompts and i % 2):
                prompt = torch.randint(3, vocab, (P,), generator=g).tolist()
            eps.append(Episode(
                id=i, group_id=i // 2,
                prompt_ids=list(prompt),
                completion_ids=torch.randint(3, vocab, (C,), generator=g).tolist(),
                generator_logprobs=gen, policy_version=0,
                advantage=float(torch.randn(1, generator=g)),
                ref_logprobs=[x - 0.1 for x in gen] if with_ref else None,
            ))
        out.append(collate(eps, pad_id=0))
    return out
