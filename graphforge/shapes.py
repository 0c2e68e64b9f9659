"""Shape and type inference for passes that need every tensor's dtype and rank (autodiff)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnx

from graphforge.errors import InvalidModelError
from graphforge.graph import Model, exceeds_protobuf_limit, load, save


def infer_shapes(model: Model) -> Model:
    """A copy of ``model`` whose tensors carry the dtypes and shapes ONNX inference finds.

    Symbolic dims stay symbolic (data propagation is on, so shapes computed from
    ``Shape`` ops are found too). Inference runs on an export that leaves the values of
    large floating-point initializers out (it reads only their types and shapes); the copy
    shares those values with ``model`` instead of copying them. Models still over 2 GiB
    go through a temporary file.
    """
    proto = model.to_proto(values=False)
    try:
        if exceeds_protobuf_limit(proto):
            with tempfile.TemporaryDirectory(prefix="graphforge-shapes-") as tmp:
                path = save(model.to_proto(), Path(tmp) / "model.onnx", external_data=True)
                onnx.shape_inference.infer_shapes_path(str(path), str(path), data_prop=True)
                return Model.from_proto(load(path))
        inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except onnx.shape_inference.InferenceError as exc:
        raise InvalidModelError(f"shape inference failed: {str(exc).strip().splitlines()[0]}") from None
    return Model.from_proto(inferred, values_from=model)
