"""Model verification: the ONNX checker with strict shape inference.

Whether onnxruntime also loads a model is the runtime's question
(``graphforge.runtime.sessions.check_loads``); the PassManager asks both.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnx

from graphforge.errors import InvalidModelError, one_line
from graphforge.graph import Model
from graphforge.model_io import save
from graphforge.payloads import exceeds_protobuf_limit
from graphforge.stand_ins import (
    LEFT_OUT,
    copy_leaving_values_out,
    has_left_out,
    is_stand_in,
    known_long_enough,
    stand_ins_long_enough,
)

#: what the ONNX checker and its strict shape inference raise for an invalid model
CHECK_ERRORS = (onnx.checker.ValidationError, onnx.shape_inference.InferenceError)


def verify_model(
    proto: onnx.ModelProto,
    *,
    where: str = "model",
    values_from: Model | None = None,
) -> None:
    """Raise InvalidModelError unless ``proto`` passes the checker and strict shape inference.

    The checker reads large floating-point weights only to check their length, which is
    checked here instead, so it is given a copy with their values left out (stand-ins, see
    ``graph.copy_leaving_values_out``): serializing and parsing hundreds of megabytes of
    weights was nearly all of its time. Should that check fail, the whole model is checked
    as it is, so the verdict and its message are always the checker's own. ``proto`` may
    itself leave values out (``Model.to_proto(values=False)``) when ``values_from`` is the
    model they come from; a whole ``proto`` with ``values_from`` is that model's whole export,
    whose values ``values_from`` knows to be long enough are not measured again. Models over
    2 GiB cannot be checked in memory (protobuf's limit), so they are checked from a temporary
    copy written with external data. The message is one line.
    """
    if values_from is None and any(is_stand_in(t) for t in proto.graph.initializer):
        problem = light_problem(proto)  # weights left out on purpose: there are none to check
        if problem is not None:
            raise InvalidModelError(f"{where} is not a valid ONNX model: {problem}")
        return
    stand_ins = values_from is not None and any(is_stand_in(t) for t in proto.graph.initializer)
    whole = None if stand_ins else proto
    try:
        if stand_ins:
            light = proto if stand_ins_long_enough(proto, values_from.graph) else None
        else:  # the whole model: what ``values_from`` (its source) knows of lengths need not be measured
            light = copy_leaving_values_out(
                proto, known_long_enough(values_from.graph) if values_from is not None else ()
            )
        if light is None or not _passes(light):
            if light is not None and values_from is not None and has_left_out(values_from.graph):  # no whole model
                raise InvalidModelError(f"{where} is not a valid ONNX model: {light_problem(light)}")
            whole = values_from.to_proto() if whole is None else whole
            _check(whole)
    except CHECK_ERRORS as exc:
        raise InvalidModelError(f"{where} is not a valid ONNX model: {one_line(exc)}") from None


def _passes(light: onnx.ModelProto) -> bool:
    """Whether the checker accepts ``light``, a model whose large weights are stand-ins."""
    return not exceeds_protobuf_limit(light) and light_problem(light) is None


def light_problem(light: onnx.ModelProto) -> str | None:
    """The checker's (full check) first complaint about ``light``, a model whose large weights
    may be stand-ins (their lengths checked by the caller), as one line; None when it passes."""
    try:
        if not any(is_stand_in(t) for t in light.graph.initializer):
            onnx.checker.check_model(light, full_check=True)
            return None
        with tempfile.TemporaryDirectory(prefix="graphforge-verify-") as tmp:
            path = Path(tmp) / "model.onnx"
            path.write_bytes(light.SerializeToString())
            (Path(tmp) / LEFT_OUT).touch()  # the checker wants the stand-ins' data file to exist
            onnx.checker.check_model(str(path), full_check=True)
    except CHECK_ERRORS as exc:
        return one_line(exc)
    return None


def _check(proto: onnx.ModelProto) -> None:
    if exceeds_protobuf_limit(proto):
        with tempfile.TemporaryDirectory(prefix="graphforge-verify-") as tmp:
            path = save(proto, Path(tmp) / "model.onnx", external_data=True, runtime_compatible=False)
            onnx.checker.check_model(str(path), full_check=True)
    else:
        onnx.checker.check_model(proto, full_check=True)
