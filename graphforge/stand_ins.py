"""Weights left out: payload-free stand-ins, and every mark that says a value was left out.

Shape inference and the checker read an initializer's type and shape, and its values only
when they are a small constant input (a Reshape's shape, Range's bounds, Resize's scales); the
checker also checks the values are long enough. Checking, inferring shapes of, or copying a
model with large weights spends nearly all of its time serializing and parsing them, so the
copies made here leave the large floating-point ones out (integers are kept: shapes are
integers). A stand-in is a TensorProto with a name, a type and a shape, marked as external data
at ``LEFT_OUT``, which the checker and shape inference both accept without reading; the checker
needs a file of that name beside the model it checks.

onnx-graphsurgeon keeps a constant's values in a private field (a NumPy array, or a lazy
reference to the TensorProto they were read from). This module is the one place that reads
or writes that field: graph.py's imports and exports, constant folding and CSE go through
``stored_values`` and ``store_values``, and a constant whose values are a stand-in
(``is_left_out``: a model compiled for its shapes alone) is made and reshaped here. Which
constants an export of a graph writes as stand-ins (``export_stand_in``), and how they get
their values back, is decided here too; graph.py only runs the export.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import dtype_to_onnx
from onnx_graphsurgeon.ir.tensor import LazyValues, SparseValues

from graphforge.ir import FLOAT_TYPES, all_graphs
from graphforge.payloads import (
    ELEMENT_BITS,
    EXTERNAL_DATA_THRESHOLD,
    TENSOR_DATA_FIELDS,
    copy_without_initializers,
    raw_data_size,
)

#: the external-data location that a tensor whose values were left out names (a stand-in);
#: no file of that name is ever read: the checker only sees that one exists
LEFT_OUT = "graphforge-values-left-out"

#: set on a constant's lazy values whose tensor's raw_data was found long enough: its bytes
#: never change, and measuring them copies them (``long_enough``), once per pass otherwise
_LENGTH_CHECKED = "graphforge_length_checked"


# --------------------------------------------------------------------------- stand-ins of TensorProtos


def stand_in(name: str, data_type: int, dims) -> onnx.TensorProto:
    """A tensor of ``name``, type and shape, whose values are left out."""
    tensor = onnx.TensorProto(name=name, data_type=data_type, dims=list(dims))
    mark_left_out(tensor)
    return tensor


def mark_left_out(tensor: onnx.TensorProto) -> None:
    """Mark ``tensor`` as a stand-in (its payload, if any, is the caller's to drop)."""
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=LEFT_OUT)


def is_stand_in(tensor: onnx.TensorProto) -> bool:
    """Whether ``tensor`` is a stand-in whose values were left out of a copy."""
    return tensor.data_location == onnx.TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == LEFT_OUT for e in tensor.external_data
    )


def can_leave_out(tensor: onnx.TensorProto) -> bool:
    """A floating-point initializer of at least EXTERNAL_DATA_THRESHOLD bytes, held in
    raw_data alone (the one storage whose check is only its length, see ``long_enough``)."""
    if tensor.data_type not in FLOAT_TYPES or tensor.data_type not in ELEMENT_BITS:
        return False
    if tensor.data_location == onnx.TensorProto.EXTERNAL or not tensor.HasField("raw_data"):
        return False
    return raw_data_size(tensor) >= EXTERNAL_DATA_THRESHOLD and not any(
        len(getattr(tensor, f)) for f in TENSOR_DATA_FIELDS[1:]
    )


def long_enough(tensor: onnx.TensorProto) -> bool:
    """What the checker checks of a tensor ``can_leave_out`` accepts: enough bytes for its
    shape. (Measuring raw_data copies it, ~0.15 ms per MB, so only verification does.)"""
    return len(tensor.raw_data) >= raw_data_size(tensor)


def copy_leaving_values_out(proto: onnx.ModelProto, known: Collection[str] = ()) -> onnx.ModelProto | None:
    """A copy of ``proto`` for the checker, whose large floating-point main-graph
    initializers are stand-ins, their lengths checked here (but for those named in
    ``known``, known to be long enough: ``known_long_enough``); None when there is none."""
    initializers = proto.graph.initializer
    left_out = [can_leave_out(t) and (t.name in known or long_enough(t)) for t in initializers]
    if not any(left_out):
        return None
    out = copy_without_initializers(proto)
    for tensor, leave_out in zip(initializers, left_out, strict=True):
        if leave_out:
            out.graph.initializer.append(stand_in(tensor.name, tensor.data_type, tensor.dims))
        else:
            out.graph.initializer.add().CopyFrom(tensor)
    return out


def without_values(proto: onnx.ModelProto, names: Collection[str]) -> onnx.ModelProto:
    """A copy of ``proto`` whose main-graph initializers named in ``names`` are stand-ins
    (``is_stand_in``: name, type and shape, no values), for a holder that gets their values
    elsewhere; the others are copied."""
    out = copy_without_initializers(proto)
    for tensor in proto.graph.initializer:
        if tensor.name in names:
            out.graph.initializer.append(stand_in(tensor.name, tensor.data_type, tensor.dims))
        else:
            out.graph.initializer.add().CopyFrom(tensor)
    return out


def weights_left_out(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``proto`` whose weights are stand-ins: each large floating-point main-graph
    initializer, and each one held in an external file (a model read without its external
    data), left out. What compiles for shapes and costs alone (``PassManager(shapes_only=True)``):
    the planner's programs, of a model however large, in no more memory than its graph."""
    external = onnx.TensorProto.EXTERNAL
    names = {t.name for t in proto.graph.initializer if t.data_location == external or can_leave_out(t)}
    return without_values(proto, names)


# --------------------------------------------------------------------------- onnx-graphsurgeon's constants


def stored_values(constant: gs.Constant) -> object:
    """What ``constant`` holds its values in, never loaded: a NumPy array, or onnx-graphsurgeon's
    lazy reference to a TensorProto (``constant.values`` would load lazy values in place, and
    convert types NumPy lacks, bfloat16 and float8, to float32)."""
    return constant._values


def stored_export_dtype(constant: gs.Constant) -> object:
    """The type ``constant`` exports its values as, as onnx-graphsurgeon stores it (its
    ``export_dtype`` property refuses to answer with the installed onnx)."""
    return constant._export_dtype


def store_values(constant: gs.Constant, values: object) -> None:
    """Give ``constant`` values: what ``stored_values`` returned (of it or of another
    constant), or a TensorProto to read them from when they are needed, not copied."""
    constant._values = LazyValues(values) if isinstance(values, onnx.TensorProto) else values


def take_values(constant: gs.Constant, source: gs.Constant) -> None:
    """Make ``constant`` hold ``source``'s values as they are: shared, not copied, with the
    type ``source`` exports and where its data lives."""
    store_values(constant, stored_values(source))
    constant.data_location = source.data_location
    constant._export_dtype = source._export_dtype


def lazy_tensor(constant: gs.Constant) -> onnx.TensorProto | None:
    """The TensorProto a constant imported from a file still reads its values from, if any."""
    values = constant._values
    if isinstance(values, LazyValues) and not isinstance(values, SparseValues):
        return values.tensor
    return None


def is_left_out(constant: gs.Constant) -> bool:
    """Whether ``constant`` has no values, only its type and shape: a weight of a model
    compiled for its shapes alone (``weights_left_out``)."""
    tensor = lazy_tensor(constant)
    return tensor is not None and is_stand_in(tensor)


def left_out_as(constant: gs.Constant, shape: Sequence[int]) -> None:
    """Make ``constant`` (``is_left_out``) stand in for a tensor of ``shape``: its slice, say."""
    tensor = lazy_tensor(constant)
    store_values(constant, stand_in(constant.name, tensor.data_type, list(shape)))


def exported_constants(graph: gs.Graph) -> Iterator[gs.Constant]:
    """The constants an export writes as initializers (the main graph's, then those its
    subgraphs read, which the export moves to the main graph), each object once, and each
    name once; cheaper than ``graph.tensors()``, which also maps every variable."""
    seen: set[int] = set()
    names: set[str] = set()
    for g in all_graphs(graph):
        for tensors in (g.inputs, *(node.inputs for node in g.nodes), g.outputs):
            for tensor in tensors:
                if isinstance(tensor, gs.Constant) and id(tensor) not in seen and tensor.name not in names:
                    seen.add(id(tensor))
                    names.add(tensor.name)
                    yield tensor


def has_left_out(graph: gs.Graph) -> bool:
    """Whether some weight of ``graph`` is ``is_left_out``: it compiles for its shapes alone."""
    return any(is_left_out(c) for c in exported_constants(graph))


# --------------------------------------------------------------------------- lengths the checker would check


def _length_checked(constant: gs.Constant) -> bool:
    return getattr(constant._values, _LENGTH_CHECKED, False)


def _mark_length_checked(constant: gs.Constant) -> None:
    setattr(constant._values, _LENGTH_CHECKED, True)


def stand_ins_long_enough(proto: onnx.ModelProto, graph: gs.Graph) -> bool:
    """Whether the values that ``proto`` (an export of ``graph`` without its values) left out
    hold enough bytes for their shapes, as the checker requires (NumPy arrays always do)."""
    left_out = {t.name for t in proto.graph.initializer if is_stand_in(t)}
    for constant in exported_constants(graph):
        tensor = lazy_tensor(constant) if constant.name in left_out else None
        if tensor is None or is_stand_in(tensor) or _length_checked(constant):
            continue  # (a model compiled for its shapes alone has no values to measure)
        if not long_enough(tensor):
            return False
        _mark_length_checked(constant)
    return True


def known_long_enough(graph: gs.Graph) -> set[str]:
    """The names of ``graph``'s constants whose values its export writes with enough bytes for
    their shapes: NumPy arrays, and values read from a file that were checked."""
    return {c.name for c in exported_constants(graph) if isinstance(stored_values(c), np.ndarray) or _length_checked(c)}


def mark_lengths_checked(graph: gs.Graph) -> None:
    """Record that the values ``graph`` reads from its source model are long enough for their
    shapes: that model passed ``verify_model``, which checks that (``stand_ins_long_enough``
    then does not measure them again)."""
    for constant in exported_constants(graph):
        if lazy_tensor(constant) is not None:
            _mark_length_checked(constant)


# --------------------------------------------------------------------------- stand-ins while a graph is exported


def export_stand_in(constant: gs.Constant, values: bool) -> onnx.TensorProto | None:
    """The stand-in an export writes for ``constant``, or None to export it as it is.

    With ``values`` (the stand-in is filled afterwards): every constant still read from a
    TensorProto, so the export never touches that TensorProto (onnx-graphsurgeon's renames
    it), and every large NumPy one. Without: the large floating-point ones (``can_leave_out``)."""
    tensor = lazy_tensor(constant)
    if tensor is not None:
        if values or can_leave_out(tensor):
            return stand_in(constant.name, tensor.data_type, tensor.dims)
        return None
    array = stored_values(constant)
    if not isinstance(array, np.ndarray) or array.nbytes < EXTERNAL_DATA_THRESHOLD:
        return None
    data_type = dtype_to_onnx(constant.export_dtype)
    if not values and data_type not in FLOAT_TYPES:
        return None
    return stand_in(constant.name, data_type, array.shape)


@contextlib.contextmanager
def stand_ins_for_export(graph: gs.Graph, *, values: bool) -> Iterator[dict[str, gs.Constant]]:
    """While exporting, the main graph's constants that ``export_stand_in`` picks hold their
    stand-ins; yields them by name, and gives them their values back on exit."""
    swapped: list[tuple[gs.Constant, object]] = []
    private: list[tuple[gs.Constant, object]] = []
    try:
        # onnx-graphsurgeon sets the name of a TensorProto it exports from to the constant's,
        # which would change the source model (its bytes, perhaps the caller's own ModelProto)
        # behind the caller's back: a constant renamed since, and a tensor attribute (a
        # Constant's value, ConstantOfShape's) still read from the source, are exported from a copy
        def export_from_copy(constant: gs.Constant, tensor: onnx.TensorProto) -> None:
            copy = onnx.TensorProto()
            copy.CopyFrom(tensor)
            private.append((constant, stored_values(constant)))
            store_values(constant, copy)

        for constant in exported_constants(graph):
            replacement = export_stand_in(constant, values)
            if replacement is not None:
                swapped.append((constant, stored_values(constant)))
                store_values(constant, replacement)
            elif (tensor := lazy_tensor(constant)) is not None and tensor.name != constant.name:
                export_from_copy(constant, tensor)
        for g in all_graphs(graph):
            for node in g.nodes:
                for value in node.attrs.values():
                    tensor = lazy_tensor(value) if isinstance(value, gs.Constant) else None
                    if tensor is not None:
                        export_from_copy(value, tensor)
        yield {constant.name: constant for constant, _ in swapped}
    finally:
        for constant, original in [*swapped, *private]:
            store_values(constant, original)


def take_back_values(graph: gs.Graph, source: gs.Graph) -> None:
    """Give ``graph``'s stand-in constants (an import of an export without values) the values
    of ``source``'s constants of the same name."""
    originals = {constant.name: constant for constant in exported_constants(source)}
    for constant in exported_constants(graph):
        lazy = lazy_tensor(constant)
        if lazy is None or not is_stand_in(lazy):
            continue
        original = originals.get(constant.name)
        if original is None:
            raise ValueError(f"the values of constant {constant.name!r} were left out, and the source lacks them")
        take_values(constant, original)
