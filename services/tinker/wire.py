"""The SDK's protobuf messages, read and written with the SDK's own generated module.

The Tinker SDK sends forward/forward_backward as protobuf (`application/x-protobuf`)
and reads ForwardBackwardOutput and SampleResponse back as protobuf; everything
else is JSON. The schema is the SDK's (`tinker.proto.tinker_public_pb2`, from the
`tinker` extra), imported here so the wire format cannot drift from the client's:
this module is the only one that knows it. Arrays travel as little-endian bytes:
tokens int32, logprobs float32, loss inputs in their declared dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from services.tinker.core import Datum, TinkerUserError, UnsupportedInput
from services.tinker.model import Sequence


def _pb() -> Any:
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as e:  # the server's own extra; the CLI checks it before serving
        raise RuntimeError(
            "the tinker service needs the `tinker` package (pip install 'flywheel[tinker]')"
        ) from e
    return tinker_public_pb2


def sdk_missing() -> str | None:
    """None if the SDK's protobuf module imports, else why not."""
    try:
        _pb()
    except RuntimeError as e:
        return str(e)
    return None


@dataclass(frozen=True)
class ForwardBackward:
    model_id: str
    seq_id: int | None
    loss: str
    data: list[Datum]
    forward_only: bool
    config: dict[str, float | str]  # loss_fn_config (empty when none was sent)


def read_forward_backward(body: bytes) -> ForwardBackward:
    pb = _pb()
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError: not the SDK's message
        raise TinkerUserError(f"forward_backward body is not a ForwardBackwardRequest: {e}") from e
    data = [_datum(pb, i, d) for i, d in enumerate(msg.data)]
    return ForwardBackward(
        model_id=msg.model_id,
        seq_id=msg.seq_id or None,  # the SDK's seq_ids start at 1; 0 is "none sent"
        loss=msg.loss_fn,
        data=data,
        forward_only=msg.forward_only,
        config=_loss_config(msg),
    )


def _loss_config(msg: Any) -> dict[str, float | str]:
    # The SDK writes both maps (v2 carries strings too); v2 wins where it is set.
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    return config


def _datum(pb: Any, index: int, d: Any) -> Datum:
    tokens: list[int] = []
    for chunk in d.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise UnsupportedInput(
                f"datum {index}: model_input chunk {kind!r}: this server takes token chunks only"
            )
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").tolist())
    inputs = {name: _tensor(pb, index, name, t) for name, t in d.loss_fn_inputs.items()}
    return Datum(tokens=tuple(tokens), inputs=inputs)


def _tensor(pb: Any, index: int, name: str, t: Any) -> np.ndarray:
    dtypes = {pb.DTYPE_FLOAT32: "<f4", pb.DTYPE_INT64: "<i8", pb.DTYPE_INT32: "<i4"}
    if t.WhichOneof("encoding") != "dense":
        raise UnsupportedInput(f"datum {index}: loss_fn_inputs[{name!r}] is sparse; send it dense")
    if t.dtype not in dtypes:
        raise UnsupportedInput(f"datum {index}: loss_fn_inputs[{name!r}] has dtype {t.dtype}")
    arr = np.frombuffer(t.dense, dtype=dtypes[t.dtype])
    shape = tuple(t.shape) or (arr.size,)
    if int(np.prod(shape)) != arr.size:
        raise TinkerUserError(
            f"datum {index}: loss_fn_inputs[{name!r}] holds {arr.size} values "
            f"for shape {list(shape)}"
        )
    return arr.reshape(shape)


def write_forward_backward_output(
    outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]
) -> bytes:
    """ForwardBackwardOutput: one ArrayRecord batching every datum's 1-D float outputs
    (per field: the concatenated values and the byte offset where each datum starts)."""
    pb = _pb()
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in outputs[0] if outputs else ():
        arrays = [np.ascontiguousarray(o[name], dtype="<f4") for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype="<i8")
        bt = record.fields[name]
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
        bt.dtype = pb.DTYPE_FLOAT32
    # deterministic: maps (fields, metrics) in key order; protobuf's own order follows a
    # hash seeded per process, and a replay (journal.py) compares its answer byte for byte.
    return bytes(msg.SerializeToString(deterministic=True))


def write_sample_response(seqs: list[Sequence], prompt_logprobs: list[float] | None) -> bytes:
    pb = _pb()
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    msg = pb.SampleResponse()
    for s in seqs:
        msg.sequences.add(
            stop_reason=reasons[s.stop_reason],
            tokens=np.asarray(s.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(s.logprobs, dtype="<f4").tobytes(),
        )
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype="<f4").tobytes()
    return bytes(msg.SerializeToString(deterministic=True))
