"""Gradients of composite ops through what they are made of: subgraph bodies (If branches),
ONNX function bodies (RMSNormalization, Attention, Swish, ...) and decompositions written
with the builder (GridSample). Each is differentiated by the driver itself, so a composite
op's gradient is exactly that of its definition, built from the rules of basic ops.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from graphforge.passes.autodiff.context import GradContext
from graphforge.passes.autodiff.driver import build_subgraph_gradients
from graphforge.passes.autodiff.values import Value, raw

from graphforge.builder import Builder
from graphforge.constants import CONSTANT_ELEMENTS, constant_value
from graphforge.dag import outer_inputs
from graphforge.ir import all_graphs, onnx_dtype


def body_reads(body: gs.Graph) -> list[gs.Tensor]:
    """The outer tensors (initializers included) a body reads."""
    return outer_inputs(gs.Node("Body", attrs={"body": body}), constants=True)


def copy_body(body: gs.Graph, prefix: str) -> gs.Graph:
    """A copy of ``body`` reading the same outer tensors, its own tensors and nodes renamed
    ``prefix + name`` (names stay unique in the model)."""
    outer = {t.name: t for t in body_reads(body)}
    copy = body.copy(tensor_map=outer)
    shared = {id(t) for t in outer.values()}
    ids = itertools.count()
    for graph in all_graphs(copy):
        for n in graph.nodes:  # graphsurgeon's copy copies the constants a body reads: share them again
            for i, t in enumerate(n.inputs):
                if isinstance(t, gs.Constant) and t.name in outer and t is not outer[t.name]:
                    n.inputs[i] = outer[t.name]
        for t in [*graph.inputs, *(o for n in graph.nodes for o in n.outputs)]:
            if id(t) not in shared and not t.is_empty() and not t.name.startswith(prefix):
                t.name = prefix + t.name
        for n in graph.nodes:
            n.name = f"{prefix}{n.op}_{next(ids)}"
    return copy


def gradients_through(
    ctx: GradContext, expansion: gs.Graph, dys: Sequence[gs.Tensor | None], wrt: Sequence[gs.Tensor], prefix: str
) -> dict[int, gs.Tensor]:
    """Differentiate ``expansion`` (a graph whose outputs are the node's, recomputed from outer
    tensors) with its outputs receiving ``dys``; its backward nodes are appended to it.
    Returns ``id(outer tensor) -> gradient`` for the tensors of ``wrt`` that get one."""
    seeds = [(o, raw(dy)) for o, dy in zip(expansion.outputs, dys, strict=False) if dy is not None and not o.is_empty()]
    return build_subgraph_gradients(expansion, seeds, wrt, opset=ctx.opset, prefix=prefix)


def differentiate_expansion(ctx: GradContext, expansion: gs.Graph, dys) -> list[gs.Tensor | None]:
    """The gradients of ctx's node inputs, as those of ``expansion`` (outputs in the node's
    order, reading the node's inputs), whose nodes (forward, recomputed, and backward) join
    the main graph; what the backward does not read is removed by the final cleanup."""
    prefix = ctx.b.fresh_name("expansion") + "/"
    wrt = [x for x in ctx.inputs if ctx.wants(x)]
    grads = gradients_through(ctx, expansion, dys, wrt, prefix)
    ctx.b.graph.nodes.extend(expansion.nodes)
    # a tensor fed to several inputs (Attention(q, q, q)) has one total: give it once
    first = {id(x): i for i, x in reversed(list(enumerate(ctx.inputs)))}
    return [grads.get(id(x)) if ctx.wants(x) and first[id(x)] == i else None for i, x in enumerate(ctx.inputs)]


def decomposed(forward: Callable[[GradContext], Sequence[Value]]):
    """A rule from a decomposition: ``forward(ctx)`` recomputes the node's outputs from its
    inputs with basic ops, ``ctx`` emitting into a graph of their own; the gradient is that
    decomposition's."""

    def rule(ctx: GradContext, dys):
        expansion = gs.Graph(opset=ctx.opset)
        b = Builder(expansion, prefix=ctx.b.fresh_name("decomposed") + "/")
        expansion.outputs = [raw(t) for t in forward(ctx.emitting_to(b))]
        return differentiate_expansion(ctx, expansion, dys)

    rule.__module__ = forward.__module__
    return rule


# ----------------------------------------------------------------------------- ONNX function bodies


def function_body(ctx: GradContext, dys):
    """A rule for an op ONNX defines by a function: differentiate the function body, expanded
    for this node (its attributes, input types and the model's opset) by onnx itself."""
    return differentiate_expansion(ctx, _expand_function(ctx), dys)


def _expand_function(ctx: GradContext) -> gs.Graph:
    import onnx.inliner
    from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

    node, opset = ctx.node, ctx.opset
    schema = onnx.defs.get_schema(node.op, opset, node.domain or "")
    proto = OnnxExporter.export_node(node)
    inputs = [t for t in node.inputs]
    types = [_type_proto(t) for t in inputs]
    if schema.has_function:
        body = schema.function_body
    else:
        data = schema.get_context_dependent_function_with_opset_version(
            opset, proto.SerializeToString(), [t.SerializeToString() for t in types]
        )
        body = onnx.FunctionProto.FromString(data)
    # call the body as a local function so that onnx's inliner binds attributes and renames
    fn = onnx.FunctionProto()
    fn.CopyFrom(body)
    fn.domain, fn.name = "graphforge.expand", node.op
    call = onnx.helper.make_node(node.op, list(proto.input), list(proto.output), domain=fn.domain)
    call.attribute.extend(proto.attribute)
    # the values of small constant inputs (shapes, sizes) let inference and folding see through
    # the body; never of an input the gradient is wanted for: folding it would cut it off
    values = {t.name: _small_constant(t, opset) for t in inputs if t.name and not ctx.wants(t)}
    graph = onnx.helper.make_graph(
        [call],
        "expansion",
        [onnx.helper.make_value_info(t.name, ty) for t, ty in zip(inputs, types, strict=True) if t.name],
        [onnx.helper.make_value_info(t.name, onnx.TypeProto()) for t in node.outputs if t.name],
        [onnx.numpy_helper.from_array(v, name) for name, v in values.items() if v is not None],
    )
    imports = [onnx.helper.make_opsetid("", opset), onnx.helper.make_opsetid(fn.domain, 1)]
    model = onnx.helper.make_model(graph, opset_imports=imports, functions=[fn])
    model = onnx.inliner.inline_local_functions(model)
    expansion = gs.import_onnx(onnx.shape_inference.infer_shapes(model, data_prop=True))
    for _ in range(4):  # shape arithmetic on static dims: folded, then inferred again
        if not _fold(expansion, opset):
            break
        expansion = gs.import_onnx(onnx.shape_inference.infer_shapes(gs.export_onnx(expansion), data_prop=True))
    _fill_ranks(expansion)
    return _rebind(expansion, ctx)


def _small_constant(t: gs.Tensor, opset: int) -> np.ndarray | None:
    if t.shape is None or not all(isinstance(d, int) for d in t.shape) or np.prod(t.shape) > CONSTANT_ELEMENTS:
        return None
    return constant_value(t, opset)


def _fold(graph: gs.Graph, opset: int) -> bool:
    """Replace the inputs that small constant subgraphs compute by their values, and Ifs on a
    constant condition by the branch taken (function bodies branch on input ranks)."""
    changed = False
    for n in list(graph.nodes):
        cond = constant_value(n.inputs[0], opset) if n.op == "If" else None
        if cond is not None:
            branch = n.attrs["then_branch" if bool(np.asarray(cond).reshape(-1)[0]) else "else_branch"]
            graph.nodes.extend(branch.nodes)
            for out, result in zip(list(n.outputs), branch.outputs, strict=True):
                graph.nodes.append(gs.Node("Identity", inputs=[result], outputs=[out]))
            n.inputs.clear()
            n.outputs.clear()
            graph.nodes.remove(n)
            changed = True
    if changed:
        graph.toposort()
    folded: dict[int, gs.Constant | None] = {}
    for n in graph.nodes:
        for i, t in enumerate(n.inputs):
            if isinstance(t, gs.Variable) and t.inputs and t.inputs[0].op != "Constant":
                if id(t) not in folded:
                    value = _small_constant(t, opset) if t.shape is not None else constant_value(t, opset)
                    folded[id(t)] = None if value is None else gs.Constant(t.name + "_folded", value)
                if folded[id(t)] is not None:
                    n.inputs[i] = folded[id(t)]
                    changed = True
    if changed:
        graph.cleanup()
    return changed


#: ops whose output has the rank of their first input, or of their broadcast inputs
_SAME_RANK = frozenset({"Split", "Slice", "Transpose", "Concat", "Softmax", "LogSoftmax", "Cast", "CastLike",
                        "Identity", "Neg", "Exp", "Tanh", "Sigmoid", "Sqrt", "Reciprocal", "Sin", "Cos", "Abs",
                        "Pad", "Trilu", "CumSum", "Erf", "Relu"})  # fmt: skip
_BROADCAST = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Where", "Max", "Min", "Sum", "Equal", "Less", "Greater"})


def _fill_ranks(graph: gs.Graph) -> None:
    """Give outputs that shape inference left without a shape their rank (dims unknown), where
    the op keeps its inputs' rank: rules need ranks, not sizes."""
    for n in graph.nodes:
        ranks = [len(t.shape) if t.shape is not None else None for t in n.inputs if not t.is_empty()]
        if n.op in _SAME_RANK and ranks and ranks[0] is not None:
            r = ranks[0]
        elif n.op in _BROADCAST and ranks and None not in ranks:
            r = max(ranks)
        else:
            continue
        for t in n.outputs:
            if t.shape is None and not t.is_empty():
                t.shape = [None] * r


def _rebind(expansion: gs.Graph, ctx: GradContext) -> gs.Graph:
    """Make the imported expansion read the node's own input tensors, and name its tensors uniquely."""
    by_name = {t.name: t for t in ctx.node.inputs if not t.is_empty()}
    prefix = ctx.b.fresh_name("function") + "/"
    for n in expansion.nodes:
        for i, t in enumerate(n.inputs):
            if t.name in by_name:
                n.inputs[i] = by_name[t.name]
    produced = {t.name: t for t in expansion.outputs}
    outputs = [produced.get(t.name, gs.Variable.empty()) if not t.is_empty() else t for t in ctx.node.outputs]
    ids = itertools.count()
    outer = {id(t) for t in by_name.values()}
    renamed: set[int] = set()
    for graph in all_graphs(expansion):
        for n in graph.nodes:
            n.name = f"{prefix}{n.op}_{next(ids)}"
            for t in [*n.outputs, *(i for i in n.inputs if isinstance(i, gs.Constant))]:
                if id(t) not in outer and id(t) not in renamed and not t.is_empty():
                    renamed.add(id(t))
                    t.name = prefix + t.name
    expansion.inputs = []
    expansion.outputs = outputs
    return expansion


def _type_proto(t: gs.Tensor) -> onnx.TypeProto:
    elem = onnx_dtype(t.dtype) or onnx.TensorProto.FLOAT
    if t.shape is None:
        return onnx.helper.make_tensor_type_proto(elem, None)
    dims = [
        int(d) if isinstance(d, int | np.integer) and d >= 0 else d if isinstance(d, str) else None for d in t.shape
    ]
    return onnx.helper.make_tensor_type_proto(elem, dims)
