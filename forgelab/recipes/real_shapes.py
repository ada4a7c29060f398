"""Random-weight HF checkpoints with the shapes of real models (no download).

    python -m forgelab.recipes.real_shapes qwen3-0.6b [--layers 2] [--out DIR] [--config-only]

No hub is reachable from forgelab's machines, but an architecture is just a
config: random weights of the real shapes go through every code path that
matters (vocabulary-sized logits, tied embeddings, grouped-query attention,
qk-norm, head_dim decoupled from the width). ``SHAPES`` holds the published
``config.json`` values of:

- ``qwen3-0.6b``: 28 layers, width 1024, 16/8 heads of 128, vocab 151,936, tied embeddings;
- ``qwen3-1.7b``: 28 layers, width 2048, 16/8 heads of 128, vocab 151,936, tied embeddings;
- ``llama-3.2-1b``: 16 layers, width 2048, 32/8 heads of 64, vocab 128,256, tied embeddings, llama3 RoPE scaling.

``layers=`` keeps the full width and vocabulary but fewer blocks (tests use 1-2).
The tokenizer is forgelab's character tokenizer padded with inert filler
tokens to the model's vocabulary size, so ids, chat template and EOS work as
with the tiny model. Weights are float32, ``initializer_range`` normal (HF's
own init, seeded); they are written under a cache directory
(``$FORGELAB_CACHE`` or ``~/.cache/forgelab``), never into the repository.

    d = real_shape_checkpoint("qwen3-0.6b", layers=2)   # ~0.9 GB, built once, reused
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

__all__ = ["SHAPES", "real_shape_config", "real_shape_checkpoint", "build_tokenizer_of_size", "cache_dir"]

_QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu", "attention_bias": False,
    "attention_dropout": 0.0, "head_dim": 128, "num_attention_heads": 16, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "vocab_size": 151936,
    "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28,
    "initializer_range": 0.02, "num_hidden_layers": 28,
}

#: Published ``config.json`` values (architecture fields only) of each shape.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {**_QWEN3_COMMON, "hidden_size": 1024, "intermediate_size": 3072},
    "qwen3-1.7b": {**_QWEN3_COMMON, "hidden_size": 2048, "intermediate_size": 6144},
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 131072, "vocab_size": 128256,
        "tie_word_embeddings": True, "initializer_range": 0.02,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
}


def cache_dir() -> str:
    """Where built checkpoints live: ``$FORGELAB_CACHE/real_shapes`` or ``~/.cache/forgelab/real_shapes``."""
    root = os.environ.get("FORGELAB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "forgelab")
    return os.path.join(root, "real_shapes")


def build_tokenizer_of_size(vocab_size: int):
    """forgelab's character tokenizer with filler tokens ``<|fill_k|>`` up to exactly ``vocab_size`` ids.

    The fillers are ordinary vocabulary entries the character pre-tokenizer
    never produces: encoding is the tiny model's, while every id a
    random-weight model can sample decodes to something.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from forgelab.data import tokenizer as ct

    base = ct.SPECIAL_TOKENS + ct.CHARS
    if vocab_size < len(base):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the character tokenizer's {len(base)} tokens")
    vocab = {tok: i for i, tok in enumerate(base)}
    vocab.update({f"<|fill_{k}|>": len(base) + k for k in range(vocab_size - len(base))})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=ct.UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(ct.SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=ct.PAD, bos_token=ct.BOS, eos_token=ct.END, unk_token=ct.UNK,
        additional_special_tokens=[ct.EOS, ct.USER, ct.ASSISTANT, ct.SYSTEM, ct.TOOL],
        chat_template=ct.CHAT_TEMPLATE, clean_up_tokenization_spaces=False, model_max_length=4096,
        padding_side="left",
    )


def real_shape_config(name: str, *, layers: int | None = None, max_position_embeddings: int | None = None,
                      tokenizer=None) -> dict[str, Any]:
    """The HF ``config.json`` dict of shape ``name``, optionally with fewer ``layers`` or a shorter RoPE table."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    cfg = json.loads(json.dumps(SHAPES[name]))
    if layers is not None:
        if not 1 <= layers <= cfg["num_hidden_layers"]:
            raise ValueError(f"layers must be in 1..{cfg['num_hidden_layers']} for {name}, got {layers}")
        cfg["num_hidden_layers"] = layers
        if "max_window_layers" in cfg:
            cfg["max_window_layers"] = layers
    if max_position_embeddings is not None:
        cfg["max_position_embeddings"] = int(max_position_embeddings)
    if tokenizer is not None:
        cfg.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    cfg["torch_dtype"] = "float32"
    return cfg


def _dir_name(name: str, layers: int | None, max_pos: int | None) -> str:
    depth = f"-L{layers}" if layers is not None else ""
    pos = f"-P{max_pos}" if max_pos is not None else ""
    return f"{name}{depth}{pos}"


def real_shape_checkpoint(name: str, *, layers: int | None = None, out: str | None = None, seed: int = 0,
                          max_position_embeddings: int | None = 4096, config_only: bool = False) -> str:
    """Write (once) a random-weight HF directory of shape ``name``; return its path.

    Args:
        name: a key of ``SHAPES``.
        layers: keep this many blocks (full width and vocabulary); None = the real depth.
        out: the directory; default ``cache_dir()/<name>[-L<layers>]-P<max_pos>[-config]``.
        seed: seeds the weights.
        max_position_embeddings: the RoPE table length written in the config (the real
            values, 40,960 / 131,072, cost every engine a long table for nothing here); None keeps the real one.
        config_only: write config and tokenizer only (enough for ``forgelab plan``).

    A directory holding ``.complete`` is reused as is. The directory is written beside its final name and renamed
    into place whole, so processes asking for it at once (two test workers, a benchmark beside a notebook) each
    read a complete one: the first rename wins, a later builder drops its copy. A builder that was killed leaves
    its private copy (``.<name>.<pid>.*``); the next build removes those whose process is gone.
    """
    import shutil
    import tempfile

    from forgelab.data.tokenizer import save_tokenizer
    from forgelab.runtime.supervision import pid_alive

    out = out or os.path.join(cache_dir(), _dir_name(name, layers, max_position_embeddings)
                              + ("-config" if config_only else ""))
    if os.path.exists(os.path.join(out, ".complete")):
        return out
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    if os.path.isdir(out) and not os.listdir(out):
        os.rmdir(out)  # an empty directory (a caller's mkdir) is taken as the place to write
    base = os.path.basename(out)
    for other in os.listdir(parent):  # copies of builders that died before their rename
        pid = other[len(base) + 2:].split(".", 1)[0]
        if other.startswith(f".{base}.") and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(os.path.join(parent, other), ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=f".{base}.{os.getpid()}.", dir=parent)
    try:
        tok = build_tokenizer_of_size(SHAPES[name]["vocab_size"])
        cfg = real_shape_config(name, layers=layers, max_position_embeddings=max_position_embeddings, tokenizer=tok)
        save_tokenizer(tok, tmp)
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                       "pad_token_id": tok.pad_token_id}, f, indent=2)
        if not config_only:
            _write_weights(cfg, tmp, seed)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        with open(os.path.join(tmp, ".complete"), "w") as f:
            f.write(json.dumps({"shape": name, "layers": layers, "seed": seed}) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        try:
            os.rename(tmp, out)  # atomic; fails when `out` exists (another builder's, or a partial old one)
        except OSError:
            if not os.path.exists(os.path.join(out, ".complete")):
                raise RuntimeError(f"real_shape_checkpoint: {out} exists without .complete (a build that did not "
                                   "finish, or files of something else): remove it and call again") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_weights(cfg: dict[str, Any], out: str, seed: int) -> None:
    """HF's own random init of the architecture, saved as one float32 safetensors file (tied: embedding only)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)  # the same storage as the embedding; loaders re-tie
    save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="fewer blocks (full width and vocabulary)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-only", action="store_true", help="config and tokenizer only (for forgelab plan)")
    args = ap.parse_args(argv)
    path = real_shape_checkpoint(args.shape, layers=args.layers, out=args.out, seed=args.seed,
                                 config_only=args.config_only)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
