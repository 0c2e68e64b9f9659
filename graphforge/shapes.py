"""Shape and type inference for passes that need every tensor's dtype and rank (autodiff)."""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys
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
from graphforge.graph import Model
from graphforge.ir import subgraphs_of
from graphforge.model_io import load, save
from graphforge.payloads import exceeds_protobuf_limit
from graphforge.stand_ins import is_stand_in


def infer_shapes(model: Model, *, in_place: bool = False, relate: bool = False) -> Model:
    """``model``'s tensors with the dtypes and shapes ONNX inference finds: a copy, or with
    ``in_place`` the model itself, annotated (for a pass, which owns the model it is given).
    ``relate``: equal dims then get one name too (``relate_dims``, on the same export).

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
    result = (
        model if in_place and _annotate(model.graph, inferred.graph) else Model.from_proto(inferred, values_from=model)
    )
    if relate:
        relate_dims(result, proto)
    return result


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


#: the prefix of the dims ``relate_dims`` names (never one of ONNX inference's ``unk__<n>``)
RELATED_PREFIX = "dim:"


def relate_dims(model: Model, proto: onnx.ModelProto | None = None) -> int:
    """Give the dims that are equal one name, on the model's own tensors (after ``infer_shapes``).

    ONNX's inference names each dim it cannot work out afresh (``unk__<n>``): after a Reshape
    to a computed shape, a residual ``Add`` adds ``[unk__21, unk__19, 768]`` to ``[unk__0,
    unk__2, 768]``, and nothing says the two are of one shape. onnxruntime's symbolic shape
    inference follows dims through such shape arithmetic (sympy): both become ``[batch, seq,
    768]``. Where it finds a dim ONNX's inference could not, its name (prefixed
    RELATED_PREFIX, unless it is a graph input's own dim name) or value is written onto the
    tensor (never over a size, or a name the model or ONNX's inference derived). It never merges
    two dims on a guess (``auto_merge`` off: a broadcast of two
    unknown dims stays unknown). Returns how many tensors changed; none where it cannot run
    (a build without onnxruntime's tools, a model with subgraphs, an op it does not follow).
    ``proto``: the model's export without values, where the caller has one (``infer_shapes``).
    """
    variables = [t for t in model.graph.tensors().values() if isinstance(t, gs.Variable) and t.shape is not None]
    if not any(_unknown(d) for t in variables for d in t.shape):
        return 0  # nothing to find: spares the import of sympy (most of a small model's compile)
    proto = model.to_proto(values=False) if proto is None else proto
    if any(True for _ in subgraphs_of(proto.graph.node)):  # inner names may repeat from body to body
        return 0
    shapes = symbolic_shapes(proto)
    if not shapes:
        return 0
    inputs = {d for t in model.graph.inputs for d in (t.shape or ()) if isinstance(d, str)}
    changed = 0
    for name, tensor in model.graph.tensors().items():
        found = shapes.get(name)
        if not isinstance(tensor, gs.Variable) or tensor.shape is None or found is None:
            continue
        if len(found) != len(tensor.shape):
            continue
        shape = list(tensor.shape)
        for i, (ours, theirs) in enumerate(zip(tensor.shape, found, strict=True)):
            if theirs is None or not _unknown(ours):  # a size, or a name the model or ONNX's inference gave
                continue
            if isinstance(theirs, int):
                shape[i] = theirs
            elif isinstance(theirs, str) and theirs:
                shape[i] = theirs if theirs in inputs else RELATED_PREFIX + theirs
        if shape != list(tensor.shape):
            tensor.shape = shape
            changed += 1
    return changed


def _unknown(dim) -> bool:
    """A dim ONNX's inference could not tell: none, or a fresh ``unk__<n>``."""
    if isinstance(dim, str):
        return not dim or dim.startswith("unk__")
    return dim is None or (isinstance(dim, int) and dim < 0)


def symbolic_shapes(proto: onnx.ModelProto) -> dict[str, list] | None:
    """Each value's shape as onnxruntime's symbolic shape inference finds it (int, str, or None
    per dim), or None when it cannot run. Its class is driven step by step as its own
    ``infer_shapes`` does, less the file that writes into the working folder when a value
    stays unknown."""
    module = _symbolic_shape_infer()
    if module is None:
        return None
    proto = _stand_ins_as_inputs(proto)
    SymbolicShapeInference, get_shape_from_value_info = module.SymbolicShapeInference, module.get_shape_from_value_info
    quiet = logging.getLogger("onnxruntime.tools.symbolic_shape_infer")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # it warns of every broadcast it will not guess
    try:
        inference = SymbolicShapeInference(2**31 - 1, False, False, 0)
        inference._preprocess(proto)
        while inference.run_:
            inference._infer_impl()
        known = inference.known_vi_
        return {
            name: [d if isinstance(d, int | str) else None for d in get_shape_from_value_info(value)]
            for name, value in known.items()
            if value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape")
        }
    except Exception:  # a model it cannot follow: ONNX's own names stay
        return None
    finally:
        quiet.setLevel(level)


def _stand_ins_as_inputs(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto``, or where it holds stand-ins (weights left out, ``to_proto(values=False)``) a copy
    in which they are graph inputs of their type and shape: the symbolic inference reads the
    values of the initializers an op's rule may fold (a norm's weight under a Mul), and a
    stand-in has none."""
    left_out = [t for t in proto.graph.initializer if is_stand_in(t)]
    if not left_out:
        return proto
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    kept = [t for t in copy.graph.initializer if not is_stand_in(t)]
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(kept)
    inputs = {i.name for i in copy.graph.input}
    copy.graph.input.extend(
        onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in left_out if t.name not in inputs
    )
    return copy


@functools.cache
def _symbolic_shape_infer():
    """onnxruntime's ``tools/symbolic_shape_infer.py``, loaded from its file: importing it as
    ``onnxruntime.tools.symbolic_shape_infer`` first runs the package's ``__init__``, which
    imports torch for an unrelated export helper (3-5 s of a 13-node model's compile here);
    the module itself needs only onnx, numpy and sympy. None where it is not there."""
    name = "onnxruntime.tools.symbolic_shape_infer"
    if name in sys.modules:
        return sys.modules[name]
    try:
        package = importlib.util.find_spec("onnxruntime")
    except (ImportError, ValueError):
        return None
    path = Path(package.origin).parent / "tools" / "symbolic_shape_infer.py" if package and package.origin else None
    if path is None or not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("graphforge_symbolic_shape_infer", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError:  # no sympy
        return None
    return module
