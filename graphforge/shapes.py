"""Shape and type inference for passes that need every tensor's dtype and rank (autodiff)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnx

from graphforge.errors import InvalidModelError
from graphforge.graph import PROTOBUF_LIMIT, Model, load, save


def infer_shapes(model: Model) -> Model:
    """A copy of ``model`` whose tensors carry the dtypes and shapes ONNX inference finds.

    Symbolic dims stay symbolic (data propagation is on, so shapes computed from
    ``Shape`` ops are found too). Models over 2 GiB go through a temporary file.
    """
    proto = model.to_proto()
    try:
        if proto.ByteSize() > PROTOBUF_LIMIT:
            with tempfile.TemporaryDirectory(prefix="graphforge-shapes-") as tmp:
                path = save(proto, Path(tmp) / "model.onnx", external_data=True)
                onnx.shape_inference.infer_shapes_path(str(path), str(path), data_prop=True)

                inferred = load(path)
        else:
            inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except onnx.shape_inference.InferenceError as exc:
        raise InvalidModelError(f"shape inference failed: {str(exc).strip().splitlines()[0]}") from None
    return Model.from_proto(inferred)
