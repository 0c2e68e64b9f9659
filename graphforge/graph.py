"""Model I/O in one place: load, save, and the Model that passes work on.

Every path in and out of graphforge goes through here so that three rules hold everywhere:
the IR version and opset written are ones the installed onnxruntime reads, external data
never escapes the model's folder, and a save is atomic (temp file + rename).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from google.protobuf.message import DecodeError, EncodeError
from onnx import external_data_helper, numpy_helper
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter, dtype_to_onnx
from onnx_graphsurgeon.ir.tensor import LazyValues, SparseValues

from graphforge.errors import ModelLoadError, ModelSaveError, one_line
from graphforge.ir import (
    FLOAT_TYPES,
    TORCH_FOLDED,
    TORCH_KINDS,
    TORCH_PADDING_ROWS,
    TORCH_TRAINING_BATCHNORMS,
    all_graphs,
    torch_folded_parameters,
    torch_input_kinds,
    torch_padding_rows,
    torch_training_batchnorms,
)
from graphforge.ort_compat import is_runtime_compatible, make_runtime_compatible
from graphforge.roles import metadata_of
from graphforge.tempfiles import temp_folder_beside

#: protobuf refuses to serialize a message of 2 GiB or more
PROTOBUF_LIMIT = 2**31 - 1
#: tensors at least this large go to the external data file when one is written
EXTERNAL_DATA_THRESHOLD = 1024
#: the external-data location that a tensor whose values were left out names (a stand-in);
#: no file of that name is ever read: the checker only sees that one exists
LEFT_OUT = "graphforge-values-left-out"

ModelSource = str | os.PathLike | bytes | onnx.ModelProto


@dataclass
class Model:
    """A model as passes see it: an onnx-graphsurgeon graph plus the model-level fields
    graphsurgeon does not keep (metadata_props, model doc string, domain, version).

    The metadata is where passes record roles (parameters, gradients, loss, ...), so one
    `.onnx` file stays a complete artifact.
    """

    graph: gs.Graph
    metadata: dict[str, str] = field(default_factory=dict)
    doc_string: str = ""
    domain: str = ""
    model_version: int = 0
    #: initializers that are graph inputs too (overridable defaults); graphsurgeon drops
    #: them from the inputs, so they are put back on export while the initializer exists
    initializer_inputs: list[str] = field(default_factory=list)
    #: the input order of the file, kept for the initializer inputs put back
    input_order: list[str] = field(default_factory=list)

    @classmethod
    def reading(cls, proto: onnx.ModelProto) -> Model:
        """Import a copy of ``proto`` but for its large floating-point weights, which the model
        reads from ``proto`` itself instead (a copy of GPT-2 small's took 0.28 s). For a
        caller's model, which is then only read: onnx-graphsurgeon's exports rename the
        TensorProto they write a constant from (``Model.to_proto`` never does), so a pass that
        renames a weight and exports the graph itself would rename it in ``proto`` too; read it
        within ``names_kept(proto)``, which puts the names back."""
        large = [t for t in proto.graph.initializer if _can_leave_out(t)]
        shared = {t.name: t for t in large}
        if len(shared) != len(large):  # two of one name: which is which?
            return cls.from_proto(load(proto))
        model = cls.from_proto(without_values(proto, shared))
        for constant in _constants(model.graph):
            lazy = _lazy_tensor(constant)
            if lazy is not None and is_stand_in(lazy) and constant.name in shared:
                tensor = shared[constant.name]
                constant._values = LazyValues(tensor)
                constant.data_location = tensor.data_location if tensor.HasField("data_location") else None
        return model

    @classmethod
    def from_proto(cls, proto: onnx.ModelProto, *, values_from: Model | None = None) -> Model:
        """Import ``proto``. With ``values_from``, its stand-ins (a ``to_proto(values=False)``
        export, after shape inference say) take back the values of ``values_from``'s
        constants of the same names, shared, not copied."""
        init_names = {t.name for t in proto.graph.initializer}
        metadata = metadata_of(proto)
        kinds = torch_input_kinds(proto)  # value metadata, which graphsurgeon drops: kept as model metadata
        if kinds and TORCH_KINDS not in metadata:
            metadata[TORCH_KINDS] = json.dumps(kinds, sort_keys=True)
            folded = torch_folded_parameters(proto)
            if folded:
                metadata[TORCH_FOLDED] = json.dumps(folded)
            batchnorms = torch_training_batchnorms(proto)
            if batchnorms:
                metadata[TORCH_TRAINING_BATCHNORMS] = json.dumps(batchnorms)
            padding = torch_padding_rows(proto)
            if padding:
                metadata[TORCH_PADDING_ROWS] = json.dumps(padding, sort_keys=True)
        model = cls(
            graph=gs.import_onnx(proto),
            metadata=metadata,
            doc_string=proto.doc_string,
            domain=proto.domain,
            model_version=proto.model_version,
            initializer_inputs=[v.name for v in proto.graph.input if v.name in init_names],
            input_order=[v.name for v in proto.graph.input],
        )
        if values_from is not None:
            _take_values(model.graph, values_from.graph)
        _type_empty_constant_lists(model.graph)
        return model

    def to_proto(self, *, values: bool = True, over: onnx.ModelProto | None = None) -> onnx.ModelProto:
        """Export to ONNX. Each initializer's bytes are copied once, straight into the result
        (onnx-graphsurgeon's export copies them twice, and renames the TensorProto it reads).

        ``values=False`` leaves the values of the large floating-point initializers out: each
        is a stand-in (``is_stand_in``) with its name, type and shape, which is all that shape
        inference and the checker read of such tensors, so no weight is copied. Give it back
        to ``Model.from_proto(..., values_from=self)`` to have the values again.

        ``over``: the ModelProto this model was imported from, which the caller gives up. The
        export is written over it, and the initializers the model still reads from it stay
        where they are instead of being copied (a model's weights, once more in memory). The
        result is the one a plain export gives, and is ``over`` itself."""
        with _values_left_out(self.graph, values=values) as left_out:
            proto = gs.export_onnx(self.graph, do_type_check=False)
        _hoist_subgraph_initializers(proto.graph)
        if values and over is not None and _write_over(proto, left_out, over):
            proto = over
        elif values:
            _put_values_back(proto.graph, left_out)
        self._restore_initializer_inputs(proto)
        del proto.metadata_props[:]
        for key in sorted(self.metadata):
            proto.metadata_props.add(key=key, value=self.metadata[key])
        proto.doc_string = self.doc_string
        proto.domain = self.domain
        proto.model_version = self.model_version
        return proto

    def _restore_initializer_inputs(self, proto: onnx.ModelProto) -> None:
        graph = proto.graph
        inits = {t.name: t for t in graph.initializer}
        current = {v.name: v for v in graph.input}
        restored = {
            name: onnx.helper.make_tensor_value_info(name, inits[name].data_type, list(inits[name].dims))
            for name in self.initializer_inputs
            if name in inits and name not in current
        }
        if not restored:
            return
        available = {**current, **restored}
        order = [n for n in self.input_order if n in available]
        order += [n for n in [*current, *restored] if n not in order]
        new_inputs = [available[n] for n in order]
        del graph.input[:]
        graph.input.extend(new_inputs)

    def copy(self) -> Model:
        return Model(
            self.graph.copy(),
            dict(self.metadata),
            self.doc_string,
            self.domain,
            self.model_version,
            list(self.initializer_inputs),
            list(self.input_order),
        )


def _type_empty_constant_lists(graph: gs.Graph) -> None:
    """A Constant node's empty ``value_ints``/``value_floats`` (the dynamo exporter writes
    them) becomes the equal empty ``value`` tensor: onnx-graphsurgeon keeps an empty list,
    whose type its export cannot tell."""
    for g in all_graphs(graph):
        for node in g.nodes:
            for key, dtype in (("value_ints", np.int64), ("value_floats", np.float32)):
                if node.op == "Constant" and isinstance(node.attrs.get(key), list) and not node.attrs[key]:
                    del node.attrs[key]
                    node.attrs["value"] = gs.Constant(node.name or key, np.zeros(0, dtype))


# --------------------------------------------------------------------------- values left out
#
# Shape inference and the checker read an initializer's type and shape, and its values only
# when they are a small constant input (a Reshape's shape, Range's bounds, Resize's scales);
# the checker also checks the values are long enough. A model with hundreds of megabytes of
# weights spends nearly all of its inference and checking time serializing and parsing them,
# so these copies leave the large floating-point ones out (integers are kept: shapes are
# integers). A stand-in is marked as external data at LEFT_OUT, which both tools accept
# without reading; the checker needs a file of that name beside the model it checks.


def _stand_in(name: str, data_type: int, dims) -> onnx.TensorProto:
    tensor = onnx.TensorProto(name=name, data_type=data_type, dims=list(dims))
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=LEFT_OUT)
    return tensor


def is_stand_in(tensor: onnx.TensorProto) -> bool:
    """Whether ``tensor`` is a stand-in whose values were left out of a copy."""
    return tensor.data_location == onnx.TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == LEFT_OUT for e in tensor.external_data
    )


def _can_leave_out(tensor: onnx.TensorProto) -> bool:
    """A floating-point initializer of at least EXTERNAL_DATA_THRESHOLD bytes, held in
    raw_data alone (the one storage whose check is only its length, see ``_long_enough``)."""
    if tensor.data_type not in FLOAT_TYPES or tensor.data_type not in _ELEMENT_BITS:
        return False
    if tensor.data_location == onnx.TensorProto.EXTERNAL or not tensor.HasField("raw_data"):
        return False
    return _raw_data_size(tensor) >= EXTERNAL_DATA_THRESHOLD and not any(
        len(getattr(tensor, f)) for f in _TENSOR_DATA_FIELDS[1:]
    )


def _long_enough(tensor: onnx.TensorProto) -> bool:
    """What the checker checks of a tensor ``_can_leave_out`` accepts: enough bytes for its
    shape. (Measuring raw_data copies it, ~0.15 ms per MB, so only verification does.)"""
    return len(tensor.raw_data) >= _raw_data_size(tensor)


def copy_leaving_values_out(proto: onnx.ModelProto, long_enough: Collection[str] = ()) -> onnx.ModelProto | None:
    """A copy of ``proto`` for the checker, whose large floating-point main-graph
    initializers are stand-ins, their lengths checked here (but for those named in
    ``long_enough``, known to be: ``known_long_enough``); None when there is none."""
    initializers = proto.graph.initializer
    left_out = [_can_leave_out(t) and (t.name in long_enough or _long_enough(t)) for t in initializers]
    if not any(left_out):
        return None
    out = copy_without_initializers(proto)
    for tensor, leave_out in zip(initializers, left_out, strict=True):
        if leave_out:
            out.graph.initializer.append(_stand_in(tensor.name, tensor.data_type, tensor.dims))
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
            out.graph.initializer.append(_stand_in(tensor.name, tensor.data_type, tensor.dims))
        else:
            out.graph.initializer.add().CopyFrom(tensor)
    return out


#: set on a LazyValues whose tensor's raw_data was found long enough: its bytes never change,
#: and measuring them copies them (``_long_enough``), once per pass otherwise
_LENGTH_CHECKED = "graphforge_length_checked"


def stand_ins_long_enough(proto: onnx.ModelProto, model: Model) -> bool:
    """Whether the values that ``proto`` (``model.to_proto(values=False)``) left out hold enough
    bytes for their shapes, as the checker requires (NumPy arrays always do)."""
    left_out = {t.name for t in proto.graph.initializer if is_stand_in(t)}
    for constant in _constants(model.graph):
        tensor = _lazy_tensor(constant) if constant.name in left_out else None
        if tensor is None or getattr(constant._values, _LENGTH_CHECKED, False):
            continue
        if not _long_enough(tensor):
            return False
        setattr(constant._values, _LENGTH_CHECKED, True)
    return True


def known_long_enough(model: Model) -> set[str]:
    """The names of ``model``'s constants whose values its export writes with enough bytes for
    their shapes: NumPy arrays, and values read from a file that were checked (``_LENGTH_CHECKED``)."""
    return {
        c.name
        for c in _constants(model.graph)
        if isinstance(c._values, np.ndarray) or getattr(c._values, _LENGTH_CHECKED, False)
    }


def mark_lengths_checked(model: Model) -> None:
    """Record that the values ``model`` reads from its source model are long enough for their
    shapes: that model passed ``verify_model``, which checks that (``stand_ins_long_enough``
    then does not measure them again)."""
    for constant in _constants(model.graph):
        if _lazy_tensor(constant) is not None:
            setattr(constant._values, _LENGTH_CHECKED, True)


def _lazy_tensor(constant: gs.Constant) -> onnx.TensorProto | None:
    """The TensorProto a constant imported from a file still reads its values from, if any."""
    values = constant._values
    if isinstance(values, LazyValues) and not isinstance(values, SparseValues):
        return values.tensor
    return None


def _constants(graph: gs.Graph) -> Iterator[gs.Constant]:
    """The constants an export writes as initializers (the main graph's, then those its
    subgraphs read, which ``_hoist_subgraph_initializers`` moves to the main graph), each object
    once, and each name once; cheaper than ``graph.tensors()``, which also maps every variable."""
    seen: set[int] = set()
    names: set[str] = set()
    for g in all_graphs(graph):
        for tensors in (g.inputs, *(node.inputs for node in g.nodes), g.outputs):
            for tensor in tensors:
                if isinstance(tensor, gs.Constant) and id(tensor) not in seen and tensor.name not in names:
                    seen.add(id(tensor))
                    names.add(tensor.name)
                    yield tensor


def _hoist_subgraph_initializers(graph: onnx.GraphProto) -> None:
    """onnx-graphsurgeon writes an outer initializer that If/Loop/Scan bodies read into each
    of those bodies (a copy each, and a stand-in of it when values are left out): move them to
    the main graph, once, where the bodies read them from the enclosing scope. A body's own
    initializer whose name the main graph holds with other contents stays in the body."""
    main = {t.name: t for t in graph.initializer}
    stack = [graph]
    while stack:
        g = stack.pop()
        for node in g.node:
            for attr in node.attribute:
                stack.extend([attr.g] if attr.HasField("g") else attr.graphs)
        if g is graph or not len(g.initializer):
            continue
        kept = []
        for tensor in g.initializer:
            have = main.get(tensor.name)
            if have is None:
                main[tensor.name] = graph.initializer.add()
                main[tensor.name].CopyFrom(tensor)
            elif have != tensor:
                kept.append(tensor)
        if len(kept) != len(g.initializer):
            del g.initializer[:]
            g.initializer.extend(kept)


def _stand_in_for(constant: gs.Constant, values: bool) -> onnx.TensorProto | None:
    """The stand-in an export writes for ``constant``, or None to export it as it is.

    With ``values`` (the stand-in is filled afterwards): every constant still read from a
    TensorProto, so the export never touches that TensorProto (onnx-graphsurgeon's renames
    it), and every large NumPy one. Without: the large floating-point ones (``_can_leave_out``)."""
    tensor = _lazy_tensor(constant)
    if tensor is not None:
        if values or _can_leave_out(tensor):
            return _stand_in(constant.name, tensor.data_type, tensor.dims)
        return None
    array = constant._values
    if not isinstance(array, np.ndarray) or array.nbytes < EXTERNAL_DATA_THRESHOLD:
        return None
    data_type = dtype_to_onnx(constant.export_dtype)
    if not values and data_type not in FLOAT_TYPES:
        return None
    return _stand_in(constant.name, data_type, array.shape)


@contextlib.contextmanager
def _values_left_out(graph: gs.Graph, *, values: bool) -> Iterator[dict[str, gs.Constant]]:
    """While exporting, the main graph's constants that ``_stand_in_for`` picks hold their
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
            private.append((constant, constant._values))
            constant._values = LazyValues(copy)

        for constant in _constants(graph):
            stand_in = _stand_in_for(constant, values)
            if stand_in is not None:
                swapped.append((constant, constant._values))
                constant._values = LazyValues(stand_in)
            elif (tensor := _lazy_tensor(constant)) is not None and tensor.name != constant.name:
                export_from_copy(constant, tensor)
        for g in all_graphs(graph):
            for node in g.nodes:
                for value in node.attrs.values():
                    tensor = _lazy_tensor(value) if isinstance(value, gs.Constant) else None
                    if tensor is not None:
                        export_from_copy(value, tensor)
        yield {constant.name: constant for constant, _ in swapped}
    finally:
        for constant, original in [*swapped, *private]:
            constant._values = original


def _put_values_back(graph: onnx.GraphProto, left_out: dict[str, gs.Constant]) -> None:
    """Fill the stand-ins of an export with the constants' values: one copy each."""
    if not left_out:
        return
    for tensor in graph.initializer:
        constant = left_out.get(tensor.name)
        if constant is not None:
            _copy_values(constant, tensor)


def _copy_values(constant: gs.Constant, tensor: onnx.TensorProto) -> None:
    """Write ``constant`` (its name and values) into ``tensor``: one copy of its bytes."""
    source = _lazy_tensor(constant)
    tensor.CopyFrom(source if source is not None else OnnxExporter.export_tensor_proto(constant))
    tensor.name = constant.name


@contextlib.contextmanager
def names_kept(proto: onnx.ModelProto) -> Iterator[None]:
    """Give ``proto``'s initializers their names back on exit: a model that reads its weights
    in place (``Model.reading``) may have them renamed by an export other than its own."""
    names = [(tensor, tensor.name) for tensor in proto.graph.initializer]
    try:
        yield
    finally:
        for tensor, name in names:
            if tensor.name != name:
                tensor.name = name


def _write_over(exported: onnx.ModelProto, left_out: dict[str, gs.Constant], target: onnx.ModelProto) -> bool:
    """Make ``target`` the whole model ``exported`` (an export whose main-graph constants
    ``left_out`` are stand-ins) stands for. Each initializer of ``target`` that a constant of
    ``left_out`` reads from stays in place, renamed to that constant (protobuf can copy a
    message into another, not move it); the others go, and the remaining constants' values
    are copied in. False, with nothing changed, when the export holds two initializers of
    one name (their order could not be restored)."""
    order = {tensor.name: i for i, tensor in enumerate(exported.graph.initializer)}
    if len(order) != len(exported.graph.initializer):
        return False
    owned = {id(tensor) for tensor in target.graph.initializer}
    staying: dict[int, str] = {}  # id of a target initializer -> the constant that keeps it
    for name in order:
        source = _lazy_tensor(left_out[name]) if name in left_out else None
        if source is not None and id(source) in owned and id(source) not in staying:
            staying[id(source)] = name
    initializers = target.graph.initializer
    for i in reversed(range(len(initializers))):
        if id(initializers[i]) not in staying:
            del initializers[i]
    for tensor in initializers:
        tensor.name = staying[id(tensor)]
    kept = set(staying.values())
    for tensor in exported.graph.initializer:
        if tensor.name in kept:
            continue
        constant = left_out.get(tensor.name)
        added = initializers.add()
        if constant is None:
            added.CopyFrom(tensor)
        else:
            _copy_values(constant, added)
    initializers.sort(key=lambda tensor: order[tensor.name])
    # everything else is the export's: clear it from `target`, then merge the export in
    # without its initializers (merging appends repeated fields and sets the scalars set)
    del exported.graph.initializer[:]
    for name in target.graph.DESCRIPTOR.fields_by_name:
        if name != "initializer":
            target.graph.ClearField(name)
    target.graph.MergeFrom(exported.graph)
    exported.ClearField("graph")
    for name in target.DESCRIPTOR.fields_by_name:
        if name != "graph":
            target.ClearField(name)
    target.MergeFrom(exported)
    return True


def _take_values(graph: gs.Graph, source: gs.Graph) -> None:
    """Give ``graph``'s stand-in constants the values of ``source``'s constants of the same name."""
    originals = {constant.name: constant for constant in _constants(source)}
    for constant in _constants(graph):
        lazy = _lazy_tensor(constant)
        if lazy is None or not is_stand_in(lazy):
            continue
        original = originals.get(constant.name)
        if original is None:
            raise ValueError(f"the values of constant {constant.name!r} were left out, and the source lacks them")
        constant._values = original._values
        constant.data_location = original.data_location
        constant._export_dtype = original._export_dtype


# --------------------------------------------------------------------------- loading


def load(source: ModelSource, *, load_external_data: bool = True, copy: bool = True) -> onnx.ModelProto:
    """Load a model from a path, bytes or a ModelProto (returned as a copy; with
    ``copy=False``, itself, checked, for a caller that only reads it and would rather not
    copy its weights).

    External data is read from the model's folder; a location that escapes that folder
    (absolute, or with ``..``) is refused before anything is read. Bytes and a ModelProto
    have no folder, so one that still refers to external data is refused unless
    ``load_external_data=False`` (the caller then resolves it).
    """
    if isinstance(source, onnx.ModelProto):
        proto = source
        if copy:
            proto = onnx.ModelProto()
            proto.CopyFrom(source)
        proto = _checked(proto, "<ModelProto>")
        if load_external_data:
            refuse_unresolved_external_data(proto, where="<ModelProto>")
        return proto
    if isinstance(source, bytes | bytearray):
        proto = _checked(_parse(bytes(source), "<bytes>"), "<bytes>")
        if load_external_data:
            refuse_unresolved_external_data(proto, where="<bytes>")
        return proto
    path = Path(source)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file")
    if path.is_dir():
        raise ModelLoadError(f"{path}: is a folder, expected an .onnx file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read ({exc.strerror or exc})") from None
    proto = _checked(_parse(data, str(path)), str(path))
    check_external_data_locations(proto, path.parent, where=str(path))
    if load_external_data and _uses_external_data(proto):
        try:
            external_data_helper.load_external_data_for_model(proto, str(path.parent))
        except (OSError, ValueError, onnx.checker.ValidationError) as exc:
            raise ModelLoadError(f"{path}: cannot read its external data ({one_line(exc)})") from None
    return proto


def _parse(data: bytes, where: str) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError):
        raise ModelLoadError(f"{where}: not an ONNX model (the bytes do not parse as a ModelProto)") from None
    return proto


def _checked(proto: onnx.ModelProto, where: str) -> onnx.ModelProto:
    # protobuf parses many byte strings leniently (unknown fields are skipped), so a text
    # file or random bytes can "parse"; a real model always has an IR version and opsets.
    if proto.ir_version <= 0 or not proto.HasField("graph") or not proto.opset_import:
        raise ModelLoadError(f"{where}: not an ONNX model (no IR version, graph or opset import)")
    return proto


def _uses_external_data(proto: onnx.ModelProto) -> bool:
    return any(external_data_helper.uses_external_data(t) for t in _all_tensors(proto))


def _all_tensors(proto: onnx.ModelProto):
    return external_data_helper._get_all_tensors(proto)


def _external_location(tensor: onnx.TensorProto) -> str:
    return next((e.value for e in tensor.external_data if e.key == "location"), "")


def check_external_data_locations(proto: onnx.ModelProto, base_dir: Path, *, where: str) -> None:
    """Refuse external data that would be read from outside the model's folder."""
    base = base_dir.resolve()
    for tensor in _all_tensors(proto):
        if not external_data_helper.uses_external_data(tensor):
            continue
        location = _external_location(tensor)
        if not location:
            raise ModelLoadError(f"{where}: tensor {tensor.name!r} is marked as external data but names no file")
        target = (base / location).resolve()
        if os.path.isabs(location) or not target.is_relative_to(base):
            raise ModelLoadError(
                f"{where}: tensor {tensor.name!r} stores its data at {location!r}, outside the model's "
                f"folder {base}; refusing to read it"
            )


def refuse_unresolved_external_data(proto: onnx.ModelProto, *, where: str) -> None:
    """Refuse a model held in memory that still refers to external data files.

    Such a model has no folder to read them from (onnxruntime would read them relative to
    the current directory, unchecked), so it must be loaded from its path instead.
    """
    for tensor in _all_tensors(proto):
        if external_data_helper.uses_external_data(tensor):
            raise ModelLoadError(
                f"{where}: tensor {tensor.name!r} keeps its data in the external file "
                f"{_external_location(tensor)!r}, which a model held in memory has no folder to read from; "
                f"load the model from its path instead"
            )


def exceeds_protobuf_limit(proto: onnx.ModelProto) -> bool:
    """Whether ``proto`` is too large to serialize as one protobuf (2 GiB).

    The initializers' payloads are summed first: protobuf's own ByteSize() serializes the
    whole message to measure it, and raises instead of answering for a message over the limit.
    Tensors held in node attributes are left to ByteSize(): finding them walks every node in
    Python, which took longer than ByteSize() itself on the light exports that the checks and
    shape inference measure (GPT-2 small's training program: 23 ms against 3 ms).
    """
    if sum(_raw_data_size(t) for t in proto.graph.initializer) > PROTOBUF_LIMIT:
        return True
    try:
        return proto.ByteSize() > PROTOBUF_LIMIT
    except (EncodeError, ValueError):
        return True


def _element_bits() -> dict[int, int]:
    bits = {}
    for data_type in onnx.TensorProto.DataType.values():
        if data_type in (onnx.TensorProto.UNDEFINED, onnx.TensorProto.STRING):
            continue
        try:
            bits[data_type] = onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize * 8
        except (KeyError, ValueError, TypeError):
            continue
    # packed types: numpy holds one per byte, raw_data packs them; others unknown here are measured
    for name, width in (("INT4", 4), ("UINT4", 4), ("FLOAT4E2M1", 4), ("INT2", 2), ("UINT2", 2)):
        if hasattr(onnx.TensorProto, name):
            bits[getattr(onnx.TensorProto, name)] = width
    for name in ("FLOAT6E2M3", "FLOAT6E3M2"):
        bits.pop(getattr(onnx.TensorProto, name, -1), None)
    return bits


_ELEMENT_BITS = _element_bits()


def _raw_data_size(tensor: onnx.TensorProto) -> int:
    """Bytes in a tensor's raw_data, from its dims and type where they tell: reading the
    field would copy it (a second gigabyte for a gigabyte tensor)."""
    if not tensor.HasField("raw_data"):
        return 0
    bits = _ELEMENT_BITS.get(tensor.data_type)
    if bits is None:
        return len(tensor.raw_data)
    return (math.prod(tensor.dims) * bits + 7) // 8


# --------------------------------------------------------------------------- saving


def save(
    model: onnx.ModelProto | Model,
    path: str | os.PathLike,
    *,
    external_data: bool | None = None,
    runtime_compatible: bool = True,
) -> Path:
    """Write a model atomically, readable by the installed onnxruntime.

    ``external_data=None`` writes tensors to ``<name>.data`` beside the model only when the
    model would not fit in one protobuf (2 GiB); True forces it, False forbids it. The
    caller's model is not modified. Either both files are replaced, or neither is.
    ``runtime_compatible=False`` keeps the IR version and opsets as they are (for a file
    that only onnx's own tools read).
    """
    proto = model.to_proto() if isinstance(model, Model) else model
    path = Path(path)
    if not path.parent.is_dir():
        what = "is not a folder" if path.parent.exists() else "does not exist"
        raise ModelSaveError(f"{path}: folder {path.parent} {what}")
    for tensor in _all_tensors(proto):
        if external_data_helper.uses_external_data(tensor):
            raise ModelSaveError(
                f"{path}: tensor {tensor.name!r} still refers to external data ({_external_location(tensor)!r}); "
                f"load the model with its external data before saving it"
            )
    # A model that needs no change is written as it is (a copy would copy its weights), and
    # serializing it measures it: ByteSize() would serialize it a second time, just to measure.
    serialized = None
    if external_data is not True and (not runtime_compatible or is_runtime_compatible(proto)):
        serialized = _serialized_within_limit(proto)
    if serialized is not None:
        to_external, out, payload_sources, runtime_compatible = False, proto, {}, False
    else:
        over_limit = exceeds_protobuf_limit(proto)
        if external_data is False and over_limit:
            raise ModelSaveError(f"{path}: the model is over 2 GiB and must be saved with external data")
        to_external = over_limit if external_data is None else external_data
        # Moving tensors to external data rewrites them in place: work on a copy. One that will
        # go to the data file leaves the large payloads out, to be read from the caller's model.
        if to_external:
            out, payload_sources = _copy_leaving_out_payloads(proto)
        else:
            out, payload_sources = onnx.ModelProto(), {}
            out.CopyFrom(proto)
    data_name = path.name + ".data"
    data_path = path.parent / data_name
    try:
        with temp_folder_beside(path) as tmp_dir:  # locked: a later run's remove_stale knows it is ours
            tmp_model, tmp_data, backup = tmp_dir / path.name, tmp_dir / data_name, tmp_dir / "previous.data"
            if to_external:
                _move_tensors_to_file(out, tmp_data, location=data_name, sources=payload_sources)
            # after moving the tensors out: onnx's version converter cannot take a model over 2 GiB
            if runtime_compatible:
                make_runtime_compatible(out)
            tmp_model.write_bytes(out.SerializeToString() if serialized is None else serialized)
            del serialized
            if not tmp_data.exists():
                os.replace(tmp_model, path)
                return path
            if data_path.exists():
                _link_or_copy(data_path, backup)
            os.replace(tmp_data, data_path)
            try:
                os.replace(tmp_model, path)
            except OSError:
                if backup.exists():
                    os.replace(backup, data_path)
                else:
                    data_path.unlink()
                raise
    except ModelSaveError as exc:
        raise ModelSaveError(f"{path}: {exc}") from None
    except (OSError, ValueError, EncodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else one_line(exc)
        raise ModelSaveError(f"{path}: cannot write ({reason})") from None
    return path


def _serialized_within_limit(proto: onnx.ModelProto) -> bytes | None:
    """``proto`` serialized, or None when it is over protobuf's limit (2 GiB)."""
    if sum(_raw_data_size(t) for t in _all_tensors(proto)) > PROTOBUF_LIMIT:
        return None
    try:
        data = proto.SerializeToString()
    except (EncodeError, ValueError):
        return None
    return data if len(data) <= PROTOBUF_LIMIT else None


def _copy_leaving_out_payloads(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[int, onnx.TensorProto]]:
    """A copy of ``proto`` without the raw_data of its large main-graph initializers, and
    for each of those (by position) the caller's tensor that still holds it.

    Copying a >2 GiB model whole just to move its weights out would hold them twice.
    """
    out = copy_without_initializers(proto)
    sources: dict[int, onnx.TensorProto] = {}
    for index, tensor in enumerate(proto.graph.initializer):
        copy = out.graph.initializer.add()
        if _raw_data_size(tensor) >= EXTERNAL_DATA_THRESHOLD:
            _copy_fields(tensor, copy, "raw_data")
            sources[index] = tensor
        else:
            copy.CopyFrom(tensor)
    return out, sources


def copy_without_initializers(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``proto`` with everything but its main graph's initializers, which are never
    read (so never copied): the caller adds the ones it keeps, or stand-ins for them."""
    out = onnx.ModelProto()
    _copy_fields(proto, out, "graph")
    _copy_fields(proto.graph, out.graph, "initializer")
    return out


def _copy_fields(src, dst, skip: str) -> None:
    """Copy every field of protobuf message ``src`` into ``dst`` but ``skip``, never reading
    ``skip`` (reading a bytes field copies it)."""
    for field_descriptor in src.DESCRIPTOR.fields:
        name = field_descriptor.name
        if name == skip:
            continue
        repeated = getattr(field_descriptor, "is_repeated", None)
        if repeated is None:  # protobuf before 5: the label tells
            repeated = field_descriptor.label == field_descriptor.LABEL_REPEATED
        if repeated:
            if len(getattr(src, name)):
                getattr(dst, name).extend(getattr(src, name))
        elif src.HasField(name):
            if field_descriptor.message_type is not None:
                getattr(dst, name).CopyFrom(getattr(src, name))
            else:
                setattr(dst, name, getattr(src, name))


def _move_tensors_to_file(
    proto: onnx.ModelProto,
    data_file: Path,
    *,
    location: str,
    sources: dict[int, onnx.TensorProto] | None = None,
) -> None:
    """Write every initializer of at least EXTERNAL_DATA_THRESHOLD bytes to ``data_file``
    and point the tensor at it (``location``, relative to the model's folder). ``sources``
    maps main-graph initializers, by position, to the tensor that holds their payload.

    onnx's own helpers test the location against the current directory and skip tensors
    kept in typed fields (float_data, ...), so this writes the file itself; each tensor's
    payload is copied out of the protobuf once, and offsets are page aligned for mmap.
    """
    sources = sources or {}
    with open(data_file, "wb") as f:
        # the main graph's initializers come first, in order, then those of subgraphs
        for position, tensor in enumerate(external_data_helper._get_initializer_tensors(proto)):
            if tensor.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
                continue
            source = sources.get(position)
            if source is not None:
                payload = source.raw_data
            elif tensor.HasField("raw_data"):
                payload = tensor.raw_data
                if len(payload) < EXTERNAL_DATA_THRESHOLD:
                    continue
            else:  # typed fields hold little-endian values once written raw: from_array does that
                payload = numpy_helper.from_array(numpy_helper.to_array(tensor)).raw_data
                if len(payload) < EXTERNAL_DATA_THRESHOLD:
                    continue
            offset = -f.tell() % 4096 + f.tell()
            f.seek(offset)
            f.write(payload)
            del payload
            for data_field in _TENSOR_DATA_FIELDS:
                tensor.ClearField(data_field)
            tensor.data_location = onnx.TensorProto.EXTERNAL
            length = f.tell() - offset
            for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
                tensor.external_data.add(key=key, value=value)
        if f.tell() == 0:
            f.close()
            data_file.unlink()


_TENSOR_DATA_FIELDS = (
    "raw_data",
    "float_data",
    "int32_data",
    "string_data",
    "int64_data",
    "double_data",
    "uint64_data",
)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
