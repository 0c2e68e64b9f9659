"""Shape and type inference for passes that need every tensor's dtype and rank (autodiff)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.importers.onnx_importer import (
    get_numpy_type,
    get_onnx_tensor_dtype,
    get_onnx_tensor_shape,
    get_onnx_tensor_type,
)
from onnx_graphsurgeon.util.exception import OnnxGraphSurgeonException

from graphforge.errors import InvalidModelError
from graphforge.graph import Model, exceeds_protobuf_limit, load, save
from graphforge.ir import subgraphs_of


def infer_shapes(model: Model, *, in_place: bool = False) -> Model:
    """``model``'s tensors with the dtypes and shapes ONNX inference finds: a copy, or with
    ``in_place`` the model itself, annotated (for a pass, which owns the model it is given).

    Symbolic dims stay symbolic (data propagation is on, so shapes computed from
    ``Shape`` ops are found too). Inference runs on an export that leaves the values of
    large floating-point initializers out (it reads only their types and shapes); the copy
    shares those values with ``model`` instead of copying them. In place, the types found
    are written onto the model's own tensors instead of importing the result again, which
    on GPT-2 small's program is most of the time this takes. Models still over 2 GiB go
    through a temporary file.
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
    if in_place and _annotate(model.graph, inferred.graph):
        return model
    return Model.from_proto(inferred, values_from=model)


def _annotate(graph: gs.Graph, inferred: onnx.GraphProto) -> bool:
    """Write the types of ``inferred`` (``graph``'s export after inference) onto ``graph``'s
    variables, as an import of it would give them. False, with nothing written, for a graph
    with subgraphs, whose inner names may repeat from one body to another, or with two
    tensors of one name."""
    if any(True for _ in subgraphs_of(inferred.node)):
        return False
    try:
        tensors = graph.tensors(check_duplicates=True)
    except OnnxGraphSurgeonException:  # two tensors of one name, which an import makes one
        return False
    infos = {v.name: v for v in (*inferred.input, *inferred.value_info, *inferred.output) if v.type.ByteSize()}
    for name, tensor in tensors.items():
        info = infos.get(name)
        if info is None or not isinstance(tensor, gs.Variable):
            continue
        if info.type.HasField("tensor_type"):
            tensor.dtype, tensor.type = _numpy_type(info.type.tensor_type.elem_type), "tensor_type"
        else:
            tensor.dtype, tensor.type = get_onnx_tensor_dtype(info), get_onnx_tensor_type(info)
        tensor.shape = get_onnx_tensor_shape(info)
    return True


@functools.cache
def _numpy_type(elem_type: int):
    """The dtype graphsurgeon's import gives a tensor of ONNX type ``elem_type`` (it works the
    list of ONNX types out again at each call: a third of the time an annotation took)."""
    found = get_numpy_type(elem_type)
    return elem_type if found is None else found
