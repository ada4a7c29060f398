"""Which dtypes the trainer and the reference compute in, from `model.dtype` and the device.

    >>> import torch
    >>> fsdp_dtypes("bfloat16", "cuda")      # FSDP2 mixed precision: bf16 params, fp32 reductions
    (torch.bfloat16, torch.float32)
    >>> fsdp_dtypes("bfloat16", "cpu")       # CPU trains in float32 (no fast 16-bit path there)
    (torch.float32, torch.float32)
    >>> compute_dtype("bfloat16", "cuda"), compute_dtype("float32", "cuda")
    (torch.bfloat16, torch.float32)

Master weights and the optimizer state stay float32 in every case; a 16-bit
dtype only changes what forward/backward run in (FSDP2's
`MixedPrecisionPolicy(param_dtype, reduce_dtype)`), and gradients are reduced
in float32.
"""
from __future__ import annotations

import torch

_16BIT = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype(dtype: str, device_type: str) -> torch.dtype:
    """The forward dtype: the 16-bit `dtype` on CUDA, float32 otherwise."""
    if dtype not in ("float32", *_16BIT):
        raise ValueError(f"dtype {dtype!r} is not one of float32, bfloat16, float16")
    return _16BIT.get(dtype, torch.float32) if device_type == "cuda" else torch.float32


def fsdp_dtypes(dtype: str, device_type: str) -> tuple[torch.dtype, torch.dtype]:
    """`(param_dtype, reduce_dtype)` for FSDP2's MixedPrecisionPolicy: reductions always in float32."""
    return compute_dtype(dtype, device_type), torch.float32


def needs_mixed_precision(dtype: str, device_type: str) -> bool:
    """True when the trainer must be wrapped in FSDP2 (even with one rank) to compute in 16 bits."""
    return compute_dtype(dtype, device_type) != torch.float32
