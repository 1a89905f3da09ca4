"""The service's binary wire format (docs/tinker-protocol.md, sections 8, 12.6, 15 and 16):
``forward_backward`` requests in, ``ForwardBackwardOutput`` and ``SampleResponse`` results
out, all protobuf messages of the Tinker SDK's own schema (``tinker.proto.tinker_public_pb2``,
loaded lazily: :func:`.backend.require_tinker`).

Raw buffers are little-endian and C-ordered: token ids int32; loss inputs float32 or int64,
dense or sparse CSR (unlisted cells 0); result tensors concatenated per datum with int64 byte
offsets. A request this module cannot use raises :class:`WireError` naming what is wrong.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from grpoflow.tinker.backend import require_tinker
from rl_core.tinker import Datum, SampledSequence

__all__ = ["FwdBwdRequest", "METRIC_REDUCTIONS", "WireError", "clean_metrics",
           "decode_forward_backward", "encode_forward_backward_output", "encode_sample_response",
           "prompt_tokens"]

log = logging.getLogger(__name__)

# The reductions the SDK merges chunk metrics with; a key with any other is dropped by the
# SDK, and a key without exactly one ':' crashes it (docs/tinker-protocol.md, 8.6).
METRIC_REDUCTIONS = frozenset({"mean", "sum", "min", "max", "slack", "hash2", "unique"})
MAX_BODY_BYTES = 1 << 30  # a decompressed forward_backward request larger than this is refused


class WireError(ValueError):
    """A request body the service cannot use (answered 400, or a failed future of category
    ``user`` once the request holds its place in its model's order)."""


@dataclass
class FwdBwdRequest:
    """A decoded ``ForwardBackwardRequest``: the addressing, the loss and its config, and
    the datums, or the reason they could not be decoded (``data_error``; the request still
    takes its turn in its model's order and fails there)."""

    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    config: dict[str, float | str] = field(default_factory=dict)
    data: list[Datum] = field(default_factory=list)
    data_error: str | None = None


def _decompress(body: bytes, encoding: str | None) -> bytes:
    enc = (encoding or "identity").strip().lower()
    if enc in ("", "identity"):
        return body
    if enc != "zstd":
        raise WireError(f"Content-Encoding {encoding!r} is not supported (zstd or none)")
    import zstandard

    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
            out = reader.read(MAX_BODY_BYTES + 1)
    except zstandard.ZstdError as exc:
        raise WireError(f"the zstd request body does not decompress: {exc}") from None
    if len(out) > MAX_BODY_BYTES:
        raise WireError(f"the request body is over {MAX_BODY_BYTES} bytes decompressed")
    return out


def _np_dtype(pb: Any, dtype: int, what: str) -> tuple[np.dtype, np.dtype]:  # noqa: ANN401
    """(the wire element type, the type handed to the backend) of a proto ``DType``."""
    table = {pb.DTYPE_FLOAT32: (np.float32, np.float32), pb.DTYPE_INT64: (np.int64, np.int64),
             pb.DTYPE_INT32: (np.int32, np.int64), pb.DTYPE_BFLOAT16: (np.uint16, np.float32)}
    if dtype not in table:
        raise WireError(f"{what}: unsupported tensor dtype {dtype} (float32 or int64)")
    wire, out = table[dtype]
    return np.dtype(wire), np.dtype(out)


def _buffer(raw: bytes, wire: np.dtype, out: np.dtype, what: str) -> np.ndarray:
    if len(raw) % wire.itemsize:
        raise WireError(f"{what}: {len(raw)} bytes is not a whole number of {wire} elements")
    arr = np.frombuffer(raw, dtype=wire)
    if wire == np.uint16:  # bfloat16: the upper half of a float32
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(out, copy=True)


def _tensor(pb: Any, t: Any, what: str) -> np.ndarray:  # noqa: ANN401
    """A proto ``Tensor`` as a dense numpy array (float32 or int64)."""
    wire, out = _np_dtype(pb, t.dtype, what)
    shape = [int(s) for s in t.shape]
    if any(s < 0 for s in shape):
        raise WireError(f"{what}: negative dimension in shape {shape}")
    if t.WhichOneof("encoding") == "sparse_csr":
        if len(shape) != 2:
            raise WireError(f"{what}: a sparse CSR tensor needs a 2-D shape, got {shape}")
        csr = t.sparse_csr
        values = _buffer(csr.values, wire, out, what)
        crow = _buffer(csr.crow_indices, np.dtype(np.int64), np.dtype(np.int64), what)
        col = _buffer(csr.col_indices, np.dtype(np.int64), np.dtype(np.int64), what)
        rows, cols = shape
        if (len(crow) != rows + 1 or crow[0] != 0 or np.any(np.diff(crow) < 0)
                or crow[-1] != len(col) or len(col) != len(values)
                or (len(col) and (col.min() < 0 or col.max() >= cols))):
            raise WireError(f"{what}: inconsistent sparse CSR indices for shape {shape}")
        dense = np.zeros(shape, dtype=out)
        dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
        return dense
    arr = _buffer(t.dense, wire, out, what)
    if not shape:  # TensorData built without a shape: 1-D
        return arr
    if int(np.prod(shape)) != arr.size:
        raise WireError(f"{what}: {arr.size} values do not fill shape {shape}")
    return arr.reshape(shape)


def _datum(pb: Any, d: Any, i: int) -> Datum:  # noqa: ANN401
    tokens: list[int] = []
    for chunk in d.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(f"datum {i}: {kind or 'empty'} model-input chunks are not supported "
                            "by this server (text tokens only)")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise WireError(f"datum {i}: token bytes are not int32")
        tokens.extend(np.frombuffer(raw, dtype="<i4").tolist())
    # Provenance spans (which sampled sequence each token came from) are read only by
    # stable_reinforce, which this server refuses by name; tinker-cookbook 0.6.1 attaches them
    # to every RL datum whatever the loss, as Tinker accepts, so they are ignored here.
    inputs = {name: _tensor(pb, t, f"datum {i} {name}") for name, t in d.loss_fn_inputs.items()}
    return Datum(tokens=tokens, inputs=inputs)


def decode_forward_backward(body: bytes, content_encoding: str | None = None) -> FwdBwdRequest:
    """A ``/api/v1/forward_backward`` body (zstd when ``content_encoding`` says so). Raises
    :class:`WireError` when the message itself is unreadable; a datum that is (an image, a
    bad tensor) is reported in ``data_error``."""
    pb = require_tinker()
    from google.protobuf.message import DecodeError

    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(_decompress(body, content_encoding))
    except DecodeError as exc:
        raise WireError(f"the body is not a ForwardBackwardRequest protobuf: {exc}") from None
    if not msg.model_id:
        raise WireError("ForwardBackwardRequest.model_id is empty")
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():  # preferred: it also carries strings
        kind = v.WhichOneof("value")
        if kind == "number":
            config[k] = float(v.number)
        elif kind == "text":
            config[k] = v.text
    req = FwdBwdRequest(model_id=msg.model_id, seq_id=int(msg.seq_id), loss_fn=msg.loss_fn,
                        forward_only=bool(msg.forward_only), config=config)
    try:
        req.data = [_datum(pb, d, i) for i, d in enumerate(msg.data)]
    except WireError as exc:
        req.data_error = str(exc)
    return req


def clean_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """The metrics the SDK can merge: ``name:reduction`` keys (one ':' and a known
    reduction) with finite-or-not float values; others are dropped with a warning."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name, sep, reduction = str(key).partition(":")
        if not sep or not name or ":" in reduction or reduction not in METRIC_REDUCTIONS:
            log.warning("dropping metric %r: the Tinker SDK needs name:reduction keys "
                        "(reduction one of %s)", key, ", ".join(sorted(METRIC_REDUCTIONS)))
            continue
        out[str(key)] = float(value)
    return out


def encode_forward_backward_output(logprobs: Sequence[np.ndarray],
                                   metrics: Mapping[str, float]) -> bytes:
    """A ``ForwardBackwardOutput``: one ``logprobs`` entry per datum (float32, datum order;
    one ``ArrayRecord`` per run of datums with the same trailing shape) and the metrics."""
    pb = require_tinker()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    arrays = [np.ascontiguousarray(np.asarray(a, dtype="<f4")) for a in logprobs]
    arrays = [a.reshape(1) if a.ndim == 0 else a for a in arrays]
    start = 0
    while start < len(arrays):
        trailing = arrays[start].shape[1:]
        end = start
        while end < len(arrays) and arrays[end].shape[1:] == trailing:
            end += 1
        group = arrays[start:end]
        record = out.loss_fn_outputs.add(num_datums=len(group))
        bt = record.fields["logprobs"]
        bt.dtype = pb.DTYPE_FLOAT32
        bt.data = b"".join(a.tobytes() for a in group)
        bt.offsets = np.cumsum([0] + [a.nbytes for a in group], dtype=np.int64).astype(
            "<i8").tobytes()
        bt.trailing_shape.extend(int(s) for s in trailing)
        start = end
    for key, value in clean_metrics(metrics).items():
        out.metrics[key] = value
    return out.SerializeToString()


def encode_sample_response(sequences: Sequence[SampledSequence],
                           prompt_logprobs: Sequence[float | None] | None = None) -> bytes:
    """A ``SampleResponse``: each sequence's int32 tokens, float32 log-probs and stop reason;
    the prompt's log-probs (NaN where there is none: the first token) when given."""
    pb = require_tinker()
    out = pb.SampleResponse()
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    for seq in sequences:
        if seq.stop_reason not in reasons:
            raise ValueError(f"stop_reason {seq.stop_reason!r} is neither 'stop' nor 'length'")
        if len(seq.logprobs) != len(seq.tokens):
            raise ValueError(f"{len(seq.tokens)} sampled tokens but {len(seq.logprobs)} "
                             "log-probs")
        out.sequences.add(stop_reason=reasons[seq.stop_reason],
                          tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
                          logprobs=np.asarray(seq.logprobs, dtype="<f4").tobytes())
    if prompt_logprobs is not None:
        values = [np.nan if v is None else float(v) for v in prompt_logprobs]
        out.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    return out.SerializeToString()


def prompt_tokens(prompt: Mapping[str, Any]) -> list[int]:
    """A JSON ``ModelInput`` (``{"chunks": [{"type": "encoded_text", "tokens": [...]}]}``)
    as one token list."""
    chunks = prompt.get("chunks")
    if not isinstance(chunks, list):
        raise WireError("prompt.chunks must be a list of chunks")
    tokens: list[int] = []
    for i, chunk in enumerate(chunks):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise WireError(f"prompt chunk {i}: {kind} chunks are not supported by this "
                            "server (text tokens only)")
        toks = chunk.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                 for t in toks):
            raise WireError(f"prompt chunk {i}: tokens must be a list of integers")
        tokens.extend(toks)
    return tokens
