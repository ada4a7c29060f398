"""forgelab.engines.titan: HF checkpoints <-> torchtitan models, checked against transformers (in-process, no actors)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from forgelab.engines.titan import (
    build_from_hf,
    export_hf,
    load_hf_state_dict,
    read_hf_config,
    titan_config_from_hf,
)
from forgelab.engines.titan_forward import model_logprobs
from numerics import check, max_abs, max_abs_diff, model_tol
from trainer_actors import tiny_model_dir

# Logits and logprobs of titan vs transformers are two float32 forwards of the same weights in different kernels
# and orders: each comparison is bounded by the model's forward bound at the scale of the values compared
# (numerics.model_tol). A wrongly mapped tensor (a transposed or missing weight, a q/k norm left at its
# init) moves logits by orders of magnitude more.


def _hf_logits(model_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(tokens).logits


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = str(tmp_path_factory.mktemp("qwen3"))
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=101, max_position_embeddings=128,
                      rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).float()
    with torch.no_grad():  # non-trivial q/k norms, so a missed mapping shows
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    return out


def _tokens(vocab: int, B: int = 3, L: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (B, L), generator=torch.Generator().manual_seed(seed))


@pytest.mark.numerics
def test_llama_logits_match_hf(llama_dir):
    model, ckpt = build_from_hf(llama_dir)
    tokens = _tokens(ckpt.hf_config["vocab_size"])
    with torch.no_grad():
        logits = model(tokens)
    assert ckpt.family == "llama3"
    want = _hf_logits(llama_dir, tokens)
    check(max_abs_diff(logits, want), model_tol(llama_dir, max_abs(want)), "llama: titan vs HF logits")


@pytest.mark.numerics
def test_qwen3_mapping_and_logits_match_hf(qwen3_dir):
    hf_cfg = read_hf_config(qwen3_dir)
    family, cfg = titan_config_from_hf(hf_cfg)
    layer = cfg.layers[0]
    assert family == "qwen3" and cfg.dim == 64 and cfg.vocab_size == 101 and cfg.enable_weight_tying
    assert layer.feed_forward.w1.out_features == 96  # exactly intermediate_size, no rounding
    assert layer.attention.head_dim == 32 and layer.attention.n_kv_heads == 2
    assert layer.attention.rope.theta == 1e6 and layer.attention.rope.max_seq_len == 128
    assert layer.attention_norm.eps == layer.attention.qk_norm.eps == 1e-6
    model, _ = build_from_hf(qwen3_dir)
    tokens = _tokens(101)
    with torch.no_grad():
        logits = model(tokens)
    want = _hf_logits(qwen3_dir, tokens)
    check(max_abs_diff(logits, want), model_tol(qwen3_dir, max_abs(want)), "qwen3: titan vs HF logits")


@pytest.mark.numerics
@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_export_round_trip(which, llama_dir, qwen3_dir, tmp_path):
    src = llama_dir if which == "llama" else qwen3_dir
    model, ckpt = build_from_hf(src)
    with torch.no_grad():  # move the weights so the export is not just a copy of the source
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out = export_hf(model, ckpt, str(tmp_path / "out"))
    tokens = _tokens(ckpt.hf_config["vocab_size"], seed=1)
    with torch.no_grad():
        titan_logits = model(tokens)
    want = _hf_logits(out, tokens)
    check(max_abs_diff(want, titan_logits), model_tol(out, max_abs(want)), f"{which}: HF on the export vs titan logits")
    exported, source = load_hf_state_dict(out), load_hf_state_dict(src)
    assert exported.keys() == source.keys()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(src, name)):
            assert os.path.exists(os.path.join(out, name))
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["model_type"] == ckpt.hf_config["model_type"]


@pytest.mark.numerics
def test_model_logprobs_is_the_shifted_gather(llama_dir):
    model, ckpt = build_from_hf(llama_dir)
    tokens = _tokens(ckpt.hf_config["vocab_size"], B=2, L=9)
    with torch.no_grad():
        lp = model_logprobs(model, tokens)
        logits = _hf_logits(llama_dir, tokens[:, :-1])
        ref = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    assert lp.shape == (2, 8) and lp.dtype == torch.float32
    check(max_abs_diff(lp, ref), model_tol(llama_dir, max(max_abs(logits), max_abs(ref))), "titan vs HF logprobs")


def test_unsupported_config_is_named():
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        titan_config_from_hf({"model_type": "gpt2"})


def test_build_from_hf_loads_every_parameter_it_leaves_uninitialised(llama_dir, qwen3_dir, tmp_path):
    """build_from_hf skips parameter init (the checkpoint overwrites it): a checkpoint lacking a tensor must fail,
    not leave uninitialised memory; the tied embedding is one tensor, equal to HF's."""
    from safetensors.torch import save_file

    model, _ = build_from_hf(qwen3_dir)
    assert model.lm_head.weight is model.tok_embeddings.weight
    hf_sd = load_hf_state_dict(qwen3_dir)
    assert torch.equal(model.tok_embeddings.weight, hf_sd["model.embed_tokens.weight"])
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(read_hf_config(llama_dir)))
    sd = load_hf_state_dict(llama_dir)
    sd.pop("model.layers.0.mlp.down_proj.weight")
    save_file(sd, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="missing="):
        build_from_hf(str(broken))


def test_torchtitan_import_defers_its_compiles_to_first_use():
    """`import_titan_models` (what forgelab's torchtitan imports go through) leaves torch.compile as it was,
    imports no inductor, and leaves FlexAttention's kernel as a DeferredCompile holding torchtitan's own
    arguments; a DeferredCompile compiles once, on its first call, with those arguments."""
    import subprocess
    import sys

    from forgelab.engines.titan_import import DeferredCompile

    code = (
        "import sys, torch\n"
        "real = torch.compile\n"
        "from forgelab.engines.titan import build_from_hf\n"
        "from forgelab.engines.titan_attention import MaskedSDPA\n"
        "from torchtitan.models.common.attention import FlexAttention\n"
        "from forgelab.engines.titan_import import DeferredCompile\n"
        "k = FlexAttention._compiled_flex_attn\n"
        "assert torch.compile is real\n"
        "assert isinstance(k, DeferredCompile) and k.compile_fn is real and k.compiled is None, k\n"
        "assert k.kwargs == {'options': FlexAttention.inductor_configs}, k.kwargs\n"
        "assert 'torch._inductor.compile_fx' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]

    made = []

    def fake_compile(fn, **kwargs):
        made.append(kwargs)
        return lambda *a: ("compiled", fn(*a))

    d = DeferredCompile(fake_compile, lambda x: x + 1, {"dynamic": False})
    assert made == [] and d.__name__ == "<lambda>"
    assert d(1) == ("compiled", 2) and d(5) == ("compiled", 6)
    assert made == [{"dynamic": False}]  # compiled once, with the deferred arguments
