"""The Model that passes work on: an onnx-graphsurgeon graph plus the model-level fields it
does not keep, and its way to and from a ModelProto without copying the weights more than once
(large values stay in the TensorProto they were read from, stand-ins while exporting).

Files are read and written by ``graphforge/model_io.py``; stand-ins, and every read and write
of a constant's stored values, are ``graphforge/stand_ins.py``'s.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

from graphforge.ir import (
    TORCH_FOLDED,
    TORCH_KINDS,
    TORCH_MODULES,
    TORCH_PADDING_ROWS,
    TORCH_TRAINING_BATCHNORMS,
    all_graphs,
    torch_folded_parameters,
    torch_input_kinds,
    torch_linear_modules,
    torch_padding_rows,
    torch_training_batchnorms,
)
from graphforge.model_io import load
from graphforge.roles import metadata_of
from graphforge.stand_ins import (
    can_leave_out,
    exported_constants,
    is_stand_in,
    lazy_tensor,
    stand_ins_for_export,
    store_values,
    take_back_values,
    without_values,
)


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
        large = [t for t in proto.graph.initializer if can_leave_out(t)]
        shared = {t.name: t for t in large}
        if len(shared) != len(large):  # two of one name: which is which?
            return cls.from_proto(load(proto))
        model = cls.from_proto(without_values(proto, shared))
        for constant in exported_constants(model.graph):
            lazy = lazy_tensor(constant)
            if lazy is not None and is_stand_in(lazy) and constant.name in shared:
                tensor = shared[constant.name]
                store_values(constant, tensor)
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
            modules = torch_linear_modules(proto)
            if modules:
                metadata[TORCH_MODULES] = json.dumps(modules, sort_keys=True)
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
            take_back_values(model.graph, values_from.graph)
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
        with stand_ins_for_export(self.graph, values=values) as left_out:
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
    source = lazy_tensor(constant)
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
        source = lazy_tensor(left_out[name]) if name in left_out else None
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
