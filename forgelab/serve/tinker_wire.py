"""The protobuf payloads of Tinker's REST API (SDK 0.38.0), decoded and encoded without the ``tinker`` package.

    data, loss_fn, config, forward_only = decode_forward_backward(body)        # POST /api/v1/forward_backward
    encode_forward_backward_output(out)  -> bytes                             # retrieve_future, Accept: protobuf
    encode_sample_response(resp)         -> bytes

What it really is: the SDK sends ``forward_backward`` as a protobuf message and wants ``ForwardBackwardOutput``
and ``SampleResponse`` back as protobuf (every other payload is JSON). The schema below declares, by field
number, only the fields forgelab reads or writes (protobuf skips the rest when parsing); the message classes
come from the ``protobuf`` runtime (`google.protobuf`) built from that declaration. Map fields are declared as
their wire form (repeated key/value entries) and enums as int32 (both are the same bytes on the wire).
Token ids travel as packed int32 bytes, float tensors as packed little-endian float32, integer tensors int64.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory  # type: ignore[import-untyped]

from forgelab.experiments.primitive_types import Datum, ForwardBackwardOutput, ModelInput, SampleResponse

__all__ = ["decode_forward_backward", "encode_forward_backward_output", "encode_sample_response", "WireError"]

_PKG = "forgelab_tinker_wire"
_F = descriptor_pb2.FieldDescriptorProto
_TYPES = {"bytes": _F.TYPE_BYTES, "string": _F.TYPE_STRING, "int32": _F.TYPE_INT32, "int64": _F.TYPE_INT64,
          "double": _F.TYPE_DOUBLE, "bool": _F.TYPE_BOOL}

# message -> [(field, number, type or message name, repeated)]
_SCHEMA: dict[str, list[tuple[str, int, str, bool]]] = {
    "SparseCsr": [("values", 1, "bytes", False)],
    "Tensor": [("dense", 1, "bytes", False), ("sparse_csr", 2, "SparseCsr", False), ("dtype", 3, "int32", False),
               ("shape", 4, "int64", True)],
    "EncodedTextChunk": [("tokens", 1, "bytes", False)],
    "OtherChunk": [],
    "Chunk": [("encoded_text", 1, "EncodedTextChunk", False), ("image", 2, "OtherChunk", False),
              ("dmel", 3, "OtherChunk", False)],
    "TensorEntry": [("key", 1, "string", False), ("value", 2, "Tensor", False)],
    "Datum": [("model_input", 1, "Chunk", True), ("loss_fn_inputs", 2, "TensorEntry", True)],
    "NumberEntry": [("key", 1, "string", False), ("value", 2, "double", False)],
    "LossConfigValue": [("number", 1, "double", False), ("text", 2, "string", False)],
    "ConfigEntry": [("key", 1, "string", False), ("value", 2, "LossConfigValue", False)],
    "ForwardBackwardRequest": [("model_id", 1, "string", False), ("seq_id", 2, "int32", False),
                               ("data", 3, "Datum", True), ("loss_fn", 4, "string", False),
                               ("loss_fn_config", 5, "NumberEntry", True), ("forward_only", 6, "bool", False),
                               ("loss_fn_config_v2", 7, "ConfigEntry", True)],
    "BatchedTensor": [("data", 1, "bytes", False), ("offsets", 2, "bytes", False), ("dtype", 3, "int32", False),
                      ("trailing_shape", 4, "int64", True)],
    "FieldEntry": [("key", 1, "string", False), ("value", 2, "BatchedTensor", False)],
    "ArrayRecord": [("type_tag", 1, "string", False), ("fields", 2, "FieldEntry", True),
                    ("num_datums", 3, "int64", False)],
    "ForwardBackwardOutput": [("loss_fn_output_type", 1, "string", False), ("loss_fn_outputs", 2, "ArrayRecord", True),
                              ("metrics", 3, "NumberEntry", True)],
    "SampledSequence": [("stop_reason", 1, "int32", False), ("tokens", 2, "bytes", False),
                        ("logprobs", 3, "bytes", False)],
    "SampleResponse": [("sequences", 1, "SampledSequence", True), ("prompt_logprobs", 2, "bytes", False)],
}
DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32 = 1, 2, 3
STOP_REASON = {"stop": 0, "length": 1}


def _classes() -> dict[str, Any]:
    fd = descriptor_pb2.FileDescriptorProto(name=f"{_PKG}.proto", package=_PKG, syntax="proto3")
    for name, fields in _SCHEMA.items():
        m = fd.message_type.add(name=name)
        for fname, number, ftype, repeated in fields:
            f = m.field.add(name=fname, number=number,
                            label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
            if ftype in _TYPES:
                f.type = _TYPES[ftype]
            else:
                f.type, f.type_name = _F.TYPE_MESSAGE, f".{_PKG}.{ftype}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PKG}.{name}"))
            for name in _SCHEMA}


_MSG = _classes()


class WireError(ValueError):
    """A request body forgelab cannot read (not protobuf, or a feature it does not support); the message says which."""


def _tensor(t: Any, where: str) -> torch.Tensor:
    if t.HasField("sparse_csr"):
        raise WireError(f"{where}: sparse (CSR) tensors are not supported; send dense TensorData")
    np_dtype = {DTYPE_FLOAT32: np.float32, DTYPE_INT64: np.int64, DTYPE_INT32: np.int32}.get(t.dtype)
    if np_dtype is None:
        raise WireError(f"{where}: dtype {t.dtype} is not supported (float32 or int64)")
    arr = np.frombuffer(t.dense, dtype=np.dtype(np_dtype).newbyteorder("<")).copy()
    shape = list(t.shape)
    if shape and math.prod(shape) == arr.size:
        arr = arr.reshape(shape)
    return torch.from_numpy(arr.astype(np.int64) if np_dtype is np.int32 else arr)


def decode_forward_backward(body: bytes) -> tuple[str, int, list[Datum], str, dict[str, float], bool]:
    """``(model_id, seq_id, data, loss_fn, loss_fn_config, forward_only)`` of a ``forward_backward`` body."""
    msg = _MSG["ForwardBackwardRequest"]()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise WireError(f"forward_backward: the body is not a Tinker ForwardBackwardRequest protobuf ({e})") from e
    data: list[Datum] = []
    for i, d in enumerate(msg.data):
        chunks: list[tuple[int, ...]] = []
        for c in d.model_input:
            if not c.HasField("encoded_text"):
                raise WireError(f"datum {i}: only token chunks (EncodedTextChunk) are supported, not images or audio")
            chunks.append(tuple(int(t) for t in np.frombuffer(c.encoded_text.tokens, dtype="<i4")))
        inputs = {e.key: _tensor(e.value, f"datum {i} loss_fn_inputs[{e.key!r}]") for e in d.loss_fn_inputs}
        data.append(Datum(model_input=ModelInput(tuple(chunks)), loss_fn_inputs=inputs))
    config: dict[str, float] = {e.key: float(e.value) for e in msg.loss_fn_config}
    for entry in msg.loss_fn_config_v2:  # the SDK writes both; v2 wins, and only it can hold text
        if entry.value.text:
            raise WireError(f"loss_fn_config[{entry.key!r}] is text ({entry.value.text!r}); forgelab's losses take "
                            "numbers")
        config[entry.key] = float(entry.value.number)
    return msg.model_id, int(msg.seq_id), data, msg.loss_fn, config, bool(msg.forward_only)


def _batched(arrays: list[np.ndarray], dtype: int) -> Any:
    bt = _MSG["BatchedTensor"]()
    sizes = [a.nbytes for a in arrays]
    bt.data = b"".join(a.tobytes() for a in arrays)
    bt.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype("<i8").tobytes()
    bt.dtype = dtype
    return bt


def encode_forward_backward_output(out: ForwardBackwardOutput) -> bytes:
    """``out`` as the SDK's ``ForwardBackwardOutput`` protobuf: one record, each output field batched over the
    data (float32 or int64, one 1-D array per datum)."""
    msg = _MSG["ForwardBackwardOutput"](loss_fn_output_type=out.loss_fn_output_type)
    record = msg.loss_fn_outputs.add(num_datums=len(out.loss_fn_outputs))
    names = sorted(out.loss_fn_outputs[0]) if out.loss_fn_outputs else []
    for name in names:
        ts = [o[name] for o in out.loss_fn_outputs]
        is_float = ts[0].dtype.is_floating_point
        arrays = [t.detach().cpu().reshape(-1).numpy().astype("<f4" if is_float else "<i8") for t in ts]
        record.fields.add(key=name).value.CopyFrom(_batched(arrays, DTYPE_FLOAT32 if is_float else DTYPE_INT64))
    for k, v in out.metrics.items():
        msg.metrics.add(key=k, value=float(v))
    return bytes(msg.SerializeToString())


def encode_sample_response(resp: SampleResponse) -> bytes:
    """``resp`` as the SDK's ``SampleResponse`` protobuf (a prompt logprob of None travels as NaN)."""
    msg = _MSG["SampleResponse"]()
    for s in resp.sequences:
        msg.sequences.add(stop_reason=STOP_REASON[s.stop_reason], tokens=np.asarray(s.tokens, dtype="<i4").tobytes(),
                          logprobs=np.asarray(s.logprobs, dtype="<f4").tobytes())
    if resp.prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray([math.nan if x is None else x for x in resp.prompt_logprobs],
                                         dtype="<f4").tobytes()
    return bytes(msg.SerializeToString())
