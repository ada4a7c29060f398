"""Build a torchtitan llama3 model config that matches a Hugging Face Llama config.

torchtitan's llama3 flavors are fixed presets ("debugmodel", "8B", ...); a
checkpoint such as forgelab's tiny model needs one built from its own
``config.json``. ``titan_llama3_config_from_hf`` is that pure mapping; the
weights then go through torchtitan's ``Llama3StateDictAdapter.from_hf``:

    cfg = titan_llama3_config_from_hf(json.load(open(f"{d}/config.json")))
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))   # rope cache
    hf_sd = safetensors.torch.load_file(f"{d}/model.safetensors")
    model.load_state_dict(Llama3StateDictAdapter(cfg, d).from_hf(hf_sd))
    logits_B_T_V = model(tokens_B_T)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, TypedDict, cast

from forgelab.engines.titan_import import import_titan_models

if TYPE_CHECKING:
    from torchtitan.models.common.decoder import Decoder, TransformerBlock
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.qwen3 import Qwen3Model
    from torchtitan.protocols.module import ParamInit
    from torchtitan.protocols.state_dict_adapter import StateDictAdapter

ATTN_BACKENDS = ("sdpa", "flex", "varlen")


class RopeParams(TypedDict, total=False):
    """The RoPE fields of a HF config (``rope_parameters`` in transformers 5, ``rope_scaling`` in 4)."""

    rope_theta: float
    rope_type: str
    type: str
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


class RopeScaling(TypedDict, total=False):
    """The scaling keyword arguments of torchtitan's ``RoPE.Config``."""

    scaling: Literal["none", "llama", "yarn"]
    scaling_factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


class HFConfig(TypedDict, total=False):
    """The fields of a HF ``config.json`` forgelab reads or writes (a real one holds more)."""

    model_type: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int | None
    head_dim: int | None
    vocab_size: int
    rms_norm_eps: float
    num_hidden_layers: int
    intermediate_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str
    attention_bias: bool
    mlp_bias: bool
    use_sliding_window: bool
    num_experts: int | None
    rope_theta: float
    rope_parameters: RopeParams | None
    rope_scaling: RopeParams | None
    torch_dtype: str
    dtype: str


def _rope_scaling(hf: HFConfig) -> tuple[float, RopeScaling]:
    """``(theta, ComplexRoPE scaling kwargs)`` from the HF rope fields (transformers 4 or 5 layout)."""
    params: RopeParams = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, {"scaling": "none"}
    if rope_type == "llama3":
        return theta, {
            "scaling": "llama",
            "scaling_factor": float(params["factor"]),
            "low_freq_factor": float(params["low_freq_factor"]),
            "high_freq_factor": float(params["high_freq_factor"]),
            "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
        }
    raise ValueError(
        f"rope type {rope_type!r} in the HF config has no torchtitan llama3 equivalent; "
        "supported: 'default', 'llama3'"
    )


def titan_llama3_config_from_hf(hf_config: HFConfig, *, attn_backend: str = "sdpa") -> Llama3Model.Config:
    """A ``torchtitan.models.llama3.Llama3Model.Config`` with the shapes of ``hf_config``.

    Args:
        hf_config: a Llama ``config.json`` as a dict (``LlamaConfig.to_dict()`` works too).
        attn_backend: "sdpa" (plain causal ``scaled_dot_product_attention``; the one
            with a backward pass on CPU), or torchtitan's "flex" / "varlen"
            (document-masked, need ``positions``).

    The fused-QKV layout is used, as in torchtitan's own llama3 flavors, because
    ``Llama3StateDictAdapter`` maps HF q/k/v onto it. Parameter inits are
    torchtitan's llama3 ones, so the config can also train from scratch.
    """
    import_titan_models()  # its import-time compiles deferred (forgelab.engines.titan_import)
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.config_utils import (
        get_attention_config,
        make_ffn_config,
        make_gqa_config,
    )
    from torchtitan.models.common.param_init import depth_scaled_std
    from torchtitan.models.llama3 import Llama3Model, Llama3TransformerBlock
    import torch.nn as nn
    from functools import partial

    if hf_config.get("model_type", "llama") != "llama":
        raise ValueError(f"expected a llama config, got model_type={hf_config.get('model_type')!r}")
    if attn_backend not in ATTN_BACKENDS:
        raise ValueError(f"attn_backend {attn_backend!r} unknown; choose one of {ATTN_BACKENDS}")
    for flag in ("attention_bias", "mlp_bias"):
        if hf_config.get(flag):
            raise ValueError(f"HF config sets {flag}=True; torchtitan llama3 has no biases")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_config['hidden_act']!r} unsupported; llama3 uses silu")

    dim = int(hf_config["hidden_size"])
    n_heads = int(hf_config["num_attention_heads"])
    n_kv_heads = int(hf_config.get("num_key_value_heads") or n_heads)
    head_dim = int(hf_config.get("head_dim") or dim // n_heads)
    vocab = int(hf_config["vocab_size"])
    eps = float(hf_config.get("rms_norm_eps", 1e-5))
    theta, scaling = _rope_scaling(hf_config)
    from forgelab.engines.titan_attention import MaskedSDPA

    inner_attention = (
        MaskedSDPA.Config()
        if attn_backend == "sdpa"
        else get_attention_config(attn_backend)
    )

    linear_init: ParamInit = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    norm_init: ParamInit = {"weight": nn.init.ones_}
    out_std = dim**-0.5
    out_init: ParamInit = {
        "weight": partial(nn.init.trunc_normal_, std=out_std, a=-3 * out_std, b=3 * out_std),
        "bias": nn.init.zeros_,
    }

    layers: list[TransformerBlock.Config] = []
    for layer_id in range(int(hf_config["num_hidden_layers"])):
        depth_init: ParamInit = {
            "weight": partial(nn.init.trunc_normal_, std=depth_scaled_std(0.02, layer_id)),
            "bias": nn.init.zeros_,
        }
        layers.append(
            Llama3TransformerBlock.Config(
                attention_norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=norm_init),
                ffn_norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=norm_init),
                attention=make_gqa_config(
                    dim=dim,
                    n_heads=n_heads,
                    n_kv_heads=n_kv_heads,
                    head_dim=head_dim if head_dim != dim // n_heads else None,
                    wqkv_param_init=linear_init,
                    wo_param_init=depth_init,
                    inner_attention=inner_attention,
                    fuse_qkv=True,
                    rope=ComplexRoPE.Config(
                        dim=head_dim,
                        max_seq_len=int(hf_config.get("max_position_embeddings", 2048)),
                        theta=theta,
                        **scaling,
                    ),
                ),
                feed_forward=make_ffn_config(
                    dim=dim,
                    hidden_dim=int(hf_config["intermediate_size"]),
                    w1_param_init=linear_init,
                    w2w3_param_init=depth_init,
                ),
            )
        )
    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab,
            embedding_dim=dim,
            param_init={"weight": partial(nn.init.normal_, std=1.0)},
        ),
        norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=norm_init),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=out_init),
        layers=layers,
        enable_weight_tying=bool(hf_config.get("tie_word_embeddings", False)),
    )


# --- beyond the llama3 config mapping: qwen3, loading, export, logprobs ----------
# Everything a trainer needs between a HF directory and a torchtitan model:
#
#     model, ckpt = build_from_hf("forgelab/assets/tiny-llama")   # float32, SDPA, meta-built
#     logprobs_B_T = model_logprobs(model, tokens_B_L)   # chunked over the vocabulary projection
#     export_hf(model, ckpt, "/tmp/out")      # config.json + safetensors + tokenizer files
#
# Export uses the adapter's ``to_hf`` over the plain ``model.state_dict()``
# with DTensors gathered by ``full_tensor()``:
# ``get_model_state_dict(full_state_dict=True)`` fails on the fused QKV module.

import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402

#: Files copied from the source HF directory into an export (when present).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


@dataclass
class TitanCheckpoint:
    """Where a built model came from: enough to convert its weights back to HF."""

    family: str
    """``"llama3"`` or ``"qwen3"``."""
    config: Decoder.Config
    """The torchtitan model config (``Llama3Model.Config`` / ``Qwen3Model.Config``)."""
    hf_config: HFConfig
    """The source ``config.json`` as a dict (written back on export)."""
    model_dir: str | None = None
    """The source HF directory (tokenizer files are copied from it on export)."""

    def adapter(self) -> StateDictAdapter:
        """A fresh torchtitan state-dict adapter for this model."""
        import_titan_models()
        # ``family`` names the config's class (``titan_config_from_hf`` returns them together)
        if self.family == "llama3":
            from torchtitan.models.llama3 import Llama3StateDictAdapter

            return Llama3StateDictAdapter(cast("Llama3Model.Config", self.config), None)
        from torchtitan.models.qwen3 import Qwen3StateDictAdapter

        return Qwen3StateDictAdapter(cast("Qwen3Model.Config", self.config), None)


def titan_qwen3_config_from_hf(hf_config: HFConfig) -> Qwen3Model.Config:
    """A ``torchtitan.models.qwen3.Qwen3Model.Config`` (dense, SDPA attention) with the shapes of ``hf_config``.

    FFN hidden size is exactly ``intermediate_size``; ``head_dim`` is decoupled
    from ``hidden_size`` as in Qwen3; q/k RMSNorms and every other norm use
    ``rms_norm_eps``; RoPE is torchtitan's cos/sin layout, which
    ``Qwen3StateDictAdapter`` expects (no Q/K permutation).
    """
    import_titan_models()  # its import-time compiles deferred (forgelab.engines.titan_import)
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers

    from forgelab.engines.titan_attention import MaskedSDPA

    hf = hf_config
    if hf.get("model_type", "qwen3") != "qwen3":
        raise ValueError(f"expected a qwen3 config, got model_type={hf.get('model_type')!r}")
    for flag in ("attention_bias", "use_sliding_window"):
        if hf.get(flag):
            raise ValueError(f"HF config sets {flag}=True; forgelab maps dense full-attention Qwen3 without biases only")
    if hf.get("num_experts"):
        raise ValueError("HF config describes a Qwen3 mixture of experts; only dense Qwen3 is mapped")
    dim = int(hf["hidden_size"])
    n_heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or dim // n_heads)
    vocab = int(hf["vocab_size"])
    eps = float(hf.get("rms_norm_eps", 1e-6))
    theta, scaling = _rope_scaling(hf)
    if scaling.get("scaling", "none") != "none":
        raise ValueError("qwen3: rope scaling is not mapped; use a checkpoint with default RoPE")
    layers = _build_qwen3_layers(
        n_layers=int(hf["num_hidden_layers"]),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        hidden_dim=int(hf["intermediate_size"]),
        fuse_qkv=True,
        attn_backend="flex",  # replaced below: FlexAttention has no backward on CPU
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=int(hf.get("max_position_embeddings", 2048)), theta=theta),
    )
    for layer in layers:
        layer.attention_norm.eps = eps
        layer.ffn_norm.eps = eps
        layer.attention.qk_norm.eps = eps
        layer.attention.inner_attention = MaskedSDPA.Config()
    return Qwen3Model.Config(
        dim=dim,
        vocab_size=vocab,
        enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim, eps=eps),
        lm_head=Linear.Config(in_features=dim, out_features=vocab),
        layers=layers,
    )


def titan_config_from_hf(hf_config: HFConfig) -> tuple[str, Decoder.Config]:
    """``(family, torchtitan config)`` for a HF config dict, by ``model_type`` (llama or qwen3)."""
    model_type = hf_config.get("model_type", "")
    if model_type == "llama":
        return "llama3", titan_llama3_config_from_hf(hf_config)
    if model_type == "qwen3":
        return "qwen3", titan_qwen3_config_from_hf(hf_config)
    raise ValueError(f"HF model_type {model_type!r} is not supported by forgelab.engines.titan; supported: 'llama', 'qwen3'")


def read_hf_config(model_dir: str) -> HFConfig:
    """The ``config.json`` of a HF model directory, as a dict."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{model_dir!r} is not a HF model directory: no config.json")
    with open(path) as f:
        loaded: object = json.load(f)
    if not isinstance(loaded, dict):
        raise ValueError(f"{path!r} holds {type(loaded).__name__}, not a JSON object")
    return cast(HFConfig, loaded)


def load_hf_state_dict(model_dir: str) -> dict[str, torch.Tensor]:
    """All tensors of a HF safetensors checkpoint (one file, or shards with an index)."""
    from safetensors.torch import load_file

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(model_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{model_dir!r} holds no model.safetensors (nor an index); save with safetensors")
    sd: dict[str, torch.Tensor] = {}
    for name in files:
        sd.update(load_file(os.path.join(model_dir, name)))
    return sd


def build_model(config: Decoder.Config, *, device: str | torch.device = "cpu", init_params: bool = True) -> torch.nn.Module:
    """Build on the meta device, materialise on ``device``, initialise the RoPE cache and (``init_params``) parameters.

    ``init_params=False`` leaves parameters uninitialised memory, for a caller that loads
    every one of them next (`build_from_hf`): torchtitan's truncated-normal init of a
    128k x 2048 embedding alone takes ~20 s on this CPU, all of it overwritten.
    """
    device = torch.device(device)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    with torch.no_grad():
        if init_params:
            model.init_states(buffer_device=device)
        else:
            _init_buffers(model, device)
    return model


def _init_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """What ``init_states`` does besides parameter init: re-tie tied embeddings, compute buffers (RoPE caches)."""
    if getattr(model, "enable_weight_tying", False):
        tok_embeddings, lm_head = model.get_submodule("tok_embeddings"), model.get_submodule("lm_head")
        tok_embeddings.weight = lm_head.weight  # to_empty may have untied them (see Decoder.init_states)
    for module in model.modules():
        init = getattr(module, "_init_self_buffers", None)
        if callable(init):
            init(buffer_device=device)


def build_from_hf(
    model_dir: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, TitanCheckpoint]:
    """A torchtitan model holding a HF checkpoint's weights, and where it came from.

    Args:
        model_dir: HF directory with ``config.json`` and safetensors.
        device: where the model lives.
        dtype: parameter dtype (the RoPE cache keeps its own).
    """
    hf_config = read_hf_config(model_dir)
    family, config = titan_config_from_hf(hf_config)
    ckpt = TitanCheckpoint(family=family, config=config, hf_config=hf_config, model_dir=model_dir)
    model = build_model(config, device=device, init_params=False)  # every parameter is loaded below
    titan_sd = ckpt.adapter().from_hf(load_hf_state_dict(model_dir))
    missing, unexpected = model.load_state_dict(titan_sd, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{model_dir}: HF weights do not fit the mapped torchtitan {family} model; "
            f"missing={missing[:5]} unexpected={unexpected[:5]}"
        )
    if dtype != torch.float32:
        # Not model.to(dtype): that also casts llama3's complex RoPE cache to a
        # real dtype, silently dropping its imaginary part.
        with torch.no_grad():
            for param in model.parameters():
                param.data = param.data.to(dtype)
    return model, ckpt


def checkpoint_blocks(model: torch.nn.Module) -> int:
    """Activation checkpointing per decoder block: a block keeps only its input for backward and runs its
    forward again there (non-reentrant `torch.utils.checkpoint`, RNG state restored). Module and parameter
    names do not change (the block's ``forward`` is wrapped, not the block), so checkpoints and HF export
    are unaffected. Returns the number of blocks wrapped."""
    import functools

    from torch.utils.checkpoint import checkpoint

    blocks = list(model.get_submodule("layers").children())  # a ModuleDict's values or a ModuleList's items, in order
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return len(blocks)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every DTensor gathered (a collective under FSDP: call it on every rank)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach()
    return out


def titan_to_hf(titan_sd: dict[str, torch.Tensor], ckpt: TitanCheckpoint) -> dict[str, torch.Tensor]:
    """The torchtitan adapter's ``to_hf``, refusing any parameter it would drop.

    torchtitan's adapters skip names they do not know without a word; a model carrying anything
    else (LoRA adapters, a new module) would then export, and push, only part of itself. Each name
    is mapped on its own with a meta tensor of its shape first (no data is copied for the check).
    """
    adapter = ckpt.adapter()
    tied = bool(getattr(ckpt.config, "enable_weight_tying", False))
    unmapped: list[str] = []
    for key, value in titan_sd.items():
        if tied and key == "lm_head.weight":
            continue  # the tied output projection is the embedding: HF saves it once
        try:
            mapped = adapter.to_hf({key: torch.empty(tuple(value.shape), dtype=value.dtype, device="meta")})
        except KeyError:
            mapped = {}
        if not mapped:
            unmapped.append(key)
    if unmapped:
        hint = (" (LoRA adapters: export them with forgelab.engines.lora_adapters.peft_tensors, or merge them with "
                "merged_hf_state_dict)" if any(".lora." in k for k in unmapped) else "")
        raise ValueError(f"{len(unmapped)} torchtitan parameters have no HF name in the {ckpt.family} adapter, "
                         f"e.g. {unmapped[:4]}; refusing to export part of the model{hint}")
    return {k: v.to("cpu").contiguous() for k, v in adapter.to_hf(dict(titan_sd)).items()}


def to_hf_state_dict(model: torch.nn.Module, ckpt: TitanCheckpoint) -> dict[str, torch.Tensor]:
    """HF-named full tensors of ``model`` (contiguous, CPU); every parameter must map (`titan_to_hf`).
    Collective under FSDP."""
    return titan_to_hf(full_state_dict(model), ckpt)


def save_hf(out_dir: str, hf_state_dict: dict[str, torch.Tensor], ckpt: TitanCheckpoint) -> str:
    """Write a HF directory: ``config.json``, ``model.safetensors`` and the source's tokenizer files."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    hf_config = dict(ckpt.hf_config)
    dtypes = {v.dtype for v in hf_state_dict.values()}
    if len(dtypes) == 1:
        name = str(next(iter(dtypes))).removeprefix("torch.")
        hf_config["torch_dtype"] = name
        if "dtype" in hf_config:
            hf_config["dtype"] = name
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    tensors = dict(hf_state_dict)
    if hf_config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)  # safetensors refuses shared storage; HF re-ties on load
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    if ckpt.model_dir:
        for name in TOKENIZER_FILES:
            src, dst = os.path.join(ckpt.model_dir, name), os.path.join(out_dir, name)
            if os.path.exists(src) and os.path.abspath(src) != os.path.abspath(dst):
                shutil.copyfile(src, dst)
    return out_dir


def export_hf(model: torch.nn.Module, ckpt: TitanCheckpoint, out_dir: str) -> str:
    """``save_hf(out_dir, to_hf_state_dict(model, ckpt), ckpt)`` (single process)."""
    return save_hf(out_dir, to_hf_state_dict(model, ckpt), ckpt)
