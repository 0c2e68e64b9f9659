"""Model verification: the ONNX checker with strict shape inference, optionally onnxruntime's loader."""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnx

from graphforge.errors import GraphforgeError, InvalidModelError
from graphforge.graph import exceeds_protobuf_limit, one_line, save


def verify_model(proto: onnx.ModelProto, *, with_ort: bool = False, where: str = "model") -> None:
    """Raise InvalidModelError unless ``proto`` passes the checker and strict shape inference.

    Models over 2 GiB cannot be checked in memory (protobuf's limit), so they are checked
    from a temporary copy written with external data. The message is one line.
    """
    try:
        if exceeds_protobuf_limit(proto):
            with tempfile.TemporaryDirectory(prefix="graphforge-verify-") as tmp:
                path = save(proto, Path(tmp) / "model.onnx", external_data=True, runtime_compatible=False)
                onnx.checker.check_model(str(path), full_check=True)
        else:
            onnx.checker.check_model(proto, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise InvalidModelError(f"{where} is not a valid ONNX model: {one_line(exc)}") from None
    if with_ort:
        from graphforge.runtime.sessions import create_session

        try:
            create_session(proto, where=where)
        except GraphforgeError:
            raise
        except Exception as exc:
            raise InvalidModelError(f"onnxruntime cannot load {where}: {one_line(exc)}") from None
