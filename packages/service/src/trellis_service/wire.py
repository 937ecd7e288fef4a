"""The Tinker SDK's protobuf wire format: forward/backward requests in (zstd or not), forward/backward
outputs and samples out, on the SDK's own message classes (``tinker.proto.tinker_public_pb2``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import zstandard
from tinker.proto import tinker_public_pb2 as pb

from trellis_service.errors import UserError

PROTOBUF = "application/x-protobuf"
_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclass
class WireDatum:
    """One ``Datum``: its input tokens and its loss inputs as dense numpy arrays."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]


@dataclass
class FwdBwdRequest:
    """A decoded ``/api/v1/forward_backward`` body."""

    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[WireDatum] = field(default_factory=list)


def read_body(body: bytes, encoding: str | None) -> bytes:
    """The request body, zstd-decompressed when ``Content-Encoding: zstd`` says so."""
    if encoding == "zstd":
        return zstandard.ZstdDecompressor().decompressobj().decompress(body)
    if encoding not in (None, "", "identity"):
        raise UserError(f"Content-Encoding {encoding!r} is not supported; send zstd or none")
    return body


def _dense(tensor: pb.Tensor, name: str) -> np.ndarray:
    dtype = _DTYPES.get(tensor.dtype)
    if dtype is None:
        raise UserError(f"loss_fn_inputs[{name!r}]: dtype {pb.DType.Name(tensor.dtype)} is not supported; send float32 or int64")
    shape = tuple(tensor.shape)
    if tensor.HasField("sparse_csr"):
        csr = tensor.sparse_csr
        if len(shape) != 2:
            raise UserError(f"loss_fn_inputs[{name!r}]: a sparse tensor must be 2-D, its shape is {list(shape)}")
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        if len(crow) != shape[0] + 1 or len(col) != len(values) or (len(col) and col.max() >= shape[1]):
            raise UserError(f"loss_fn_inputs[{name!r}]: sparse CSR indices do not fit its shape {list(shape)}")
        out = np.zeros(shape, dtype=dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        out[rows, col] = values
        return out
    flat = np.frombuffer(tensor.dense, dtype=dtype)
    if shape and int(np.prod(shape)) != flat.size:
        raise UserError(f"loss_fn_inputs[{name!r}]: {flat.size} values do not fill its shape {list(shape)}")
    return flat.reshape(shape) if shape else flat


def _tokens(chunks) -> list[int]:
    tokens: list[int] = []
    for chunk in chunks:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise UserError(f"model_input: {kind} chunks are not supported by this server (text models only); send encoded_text chunks")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    return tokens


def decode_forward_backward(body: bytes) -> FwdBwdRequest:
    """A protobuf ``ForwardBackwardRequest`` as a :class:`FwdBwdRequest`."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # noqa: BLE001 - protobuf raises its own DecodeError
        raise UserError(f"the forward_backward body is not a ForwardBackwardRequest protobuf: {exc}") from exc
    config: dict[str, float | str] = {k: v for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():  # the SDK writes both; v2 carries strings too
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    if any(d.model_input_spans or d.loss_fn_input_spans for d in msg.data):
        raise UserError("data: provenance spans (Datum.with_provenance) are read only by stable_reinforce, which this server does not support")
    data = [WireDatum(_tokens(d.model_input), {k: _dense(v, k) for k, v in d.loss_fn_inputs.items()}) for d in msg.data]
    return FwdBwdRequest(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


def _batched(arrays: list[np.ndarray], dtype) -> pb.BatchedTensor:
    flat = [np.ascontiguousarray(a, dtype=dtype).reshape(-1) for a in arrays]
    sizes = np.cumsum([0] + [a.nbytes for a in flat], dtype=np.int64)
    trailing = list(arrays[0].shape[1:]) if arrays else []
    proto_dtype = pb.DTYPE_FLOAT32 if dtype == np.float32 else pb.DTYPE_INT64
    return pb.BatchedTensor(data=b"".join(a.tobytes() for a in flat), offsets=sizes.tobytes(), dtype=proto_dtype, trailing_shape=trailing)


def encode_forward_backward(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A protobuf ``ForwardBackwardOutput``: each datum's float32 outputs (``logprobs``...) in one
    ``ArrayRecord``, and the metrics."""
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in outputs[0] if outputs else ():
        record.fields[name].CopyFrom(_batched([o[name] for o in outputs], np.float32))
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    msg.loss_fn_outputs.append(record)
    return msg.SerializeToString()


@dataclass
class Sequence:
    """One sampled sequence: its tokens, their log-probs, why it stopped (``stop`` or ``length``) and,
    when asked, its top-k log-probs ``(tokens, k)`` with their ids."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    topk: tuple[np.ndarray, np.ndarray] | None = None


def _topk(ids: np.ndarray, logprobs: np.ndarray) -> pb.TopkLogprobs:
    return pb.TopkLogprobs(
        token_ids=np.ascontiguousarray(ids, dtype=np.int32).tobytes(),
        logprobs=np.ascontiguousarray(logprobs, dtype=np.float32).tobytes(),
        k=ids.shape[1],
        length=ids.shape[0],
    )


def encode_samples(sequences: list[Sequence], prompt_logprobs: np.ndarray | None, prompt_topk: tuple[np.ndarray, np.ndarray] | None) -> bytes:
    """A protobuf ``SampleResponse``: prompt log-probs ``(prompt_len,)`` with NaN where none (the
    first token), the prompt's top-k ``(ids, logprobs)`` each ``(prompt_len, k)``."""
    msg = pb.SampleResponse()
    for s in sequences:
        seq = msg.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if s.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
        if s.topk is not None:
            seq.topk_sampled_logprobs.CopyFrom(_topk(*s.topk))
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if prompt_topk is not None:
        msg.topk_prompt_logprobs.CopyFrom(_topk(*prompt_topk))
    return msg.SerializeToString()
