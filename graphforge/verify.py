"""Model verification: the ONNX checker with strict shape inference, optionally onnxruntime's loader."""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnx

from graphforge.errors import InvalidModelError
from graphforge.graph import PROTOBUF_LIMIT, save


def verify_model(proto: onnx.ModelProto, *, with_ort: bool = False, where: str = "model") -> None:
    """Raise InvalidModelError unless ``proto`` passes the checker and strict shape inference.

    Models over 2 GiB cannot be checked in memory (protobuf's limit), so they are checked
    from a temporary copy written with external data.
    """
    try:
        if proto.ByteSize() > PROTOBUF_LIMIT:
            with tempfile.TemporaryDirectory(prefix="graphforge-verify-") as tmp:
                path = save(proto, Path(tmp) / "model.onnx", external_data=True)
                onnx.checker.check_model(str(path), full_check=True)
        else:
            onnx.checker.check_model(proto, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise InvalidModelError(f"{where} is not a valid ONNX model: {_first_line(exc)}") from None
    if with_ort:
        from graphforge.runtime.sessions import create_session

        try:
            create_session(proto)
        except InvalidModelError:
            raise
        except Exception as exc:
            raise InvalidModelError(f"onnxruntime cannot load {where}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("==>"):
            return line
    return text or type(exc).__name__
