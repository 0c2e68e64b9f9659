"""The expand_gradient pass: replace ONNX's Gradient operator by its gradient graph in standard ops."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs
from graphforge.passes.autodiff.driver import GRAD_PREFIX, build_gradients, is_differentiable_type

from graphforge.builder import Builder
from graphforge.dag import topological_order
from graphforge.errors import PassError
from graphforge.graph import Model
from graphforge.ir import every_graph, replace_uses
from graphforge.pass_infra import Pass, PassResult
from graphforge.shapes import infer_shapes

#: the domain of ONNX's training operators (Gradient, Adagrad, Adam, Momentum)
PREVIEW_TRAINING = "ai.onnx.preview.training"


@dataclass(frozen=True)
class ExpandGradient(Pass):
    """Expand every ``Gradient`` node (domain ai.onnx.preview.training) into standard ONNX ops.

    The ONNX spec defines ``Gradient(xs=[...], zs=[...], y=Y)``: output i is dY/d(xs[i]),
    where Y is computed in the same graph from the tensors xs and zs name. onnxruntime has
    no kernel for it; this pass builds the gradient with the autodiff driver instead.
    1. The node's inputs are the tensors xs and zs name (the usual form): the backward graph
       of Y is appended and output i becomes dY/d(xs[i]). Y must hold one element.
    2. Inputs that differ from the named tensors ask for the gradient at another point: the
       part of the graph between xs/zs and Y is copied with those inputs substituted, and
       the copy is differentiated.
    3. An x that Y does not depend on gets zeros of its shape; an empty output is skipped.
    4. Gradient nodes are expanded one at a time, each after those its Y depends on, so a
       Gradient of another Gradient's output (a higher-order derivative) differentiates
       that expansion.
    5. The ai.onnx.preview.training opset import is dropped once no node uses it.
    Gradient nodes inside subgraphs (If/Loop/Scan bodies) are refused.
    """

    name = "expand_gradient"

    def run(self, model: Model) -> PassResult:
        _refuse_nested(model.graph)
        if not _gradient_nodes(model.graph):
            return PassResult(model, False)
        while _gradient_nodes(model.graph):
            model = infer_shapes(model, in_place=True)  # each expansion adds tensors later ones need shapes of
            graph = model.graph
            _expand(graph, _next_ready(graph))
            graph.nodes = [graph.nodes[i] for i in topological_order(graph)]
        _drop_unused_import(model.graph)
        return PassResult(model, True)


def _is_gradient(node: gs.Node) -> bool:
    return node.op == "Gradient" and node.domain == PREVIEW_TRAINING


def _gradient_nodes(graph: gs.Graph) -> list[gs.Node]:
    return [n for n in graph.nodes if _is_gradient(n)]


def _refuse_nested(graph: gs.Graph) -> None:
    for sub in graph.subgraphs(recursive=True):
        node = next((n for n in sub.nodes if _is_gradient(n)), None)
        if node is not None:
            raise PassError(
                f"a Gradient node inside the subgraph {sub.name!r} cannot be expanded; "
                "only Gradient nodes of the main graph are supported",
                node=node.name,
                op_type=node.op,
            )


def _next_ready(graph: gs.Graph) -> gs.Node:
    """A Gradient node whose y does not depend on any Gradient node's output (case 4)."""
    producer = {id(t): n for n in graph.nodes for t in n.outputs}
    tensors = graph.tensors()
    pending = _gradient_nodes(graph)
    for node in pending:
        y = tensors.get(node.attrs.get("y", ""))
        if y is None or not any(_is_gradient(n) for n in _ancestors(y, producer)):
            return node
    names = ", ".join(repr(n.name) for n in pending)
    raise PassError(f"the Gradient nodes {names} depend on each other's outputs in a cycle")


def _ancestors(t: gs.Tensor, producer: dict[int, gs.Node]) -> list[gs.Node]:
    """The nodes ``t`` is computed from (iteratively: graphs can be deep)."""
    seen, stack, found = {id(t)}, [t], []
    while stack:
        node = producer.get(id(stack.pop()))
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        found.append(node)
        for x in node.inputs:
            if id(x) not in seen:
                seen.add(id(x))
                stack.append(x)
    return found


def _expand(graph: gs.Graph, node: gs.Node) -> None:
    xs, zs, y = _operands(graph, node)
    y, wrt = _at_inputs(graph, node, xs, zs, y)  # case 2
    grads = build_gradients(graph, y, wrt) if wrt else {}
    outputs = list(node.outputs)
    node.inputs.clear()
    node.outputs.clear()
    graph.nodes.remove(node)
    b = Builder(graph, prefix=GRAD_PREFIX)
    taken: dict[int, gs.Tensor] = {}  # id(gradient) -> the output that took over its producer
    for x, out in zip(wrt, outputs, strict=False):
        if out.is_empty():
            continue
        grad = grads.get(id(x))
        if grad is None:  # case 3
            with b.scope(node.name or "Gradient"):
                grad = b.zeros_like(x)
        _produce(graph, grad, out, taken)
        out.dtype = x.dtype
        out.shape = list(x.shape) if x.shape is not None else None


def _operands(graph: gs.Graph, node: gs.Node) -> tuple[list[gs.Tensor], list[gs.Tensor], gs.Tensor]:
    """The tensors the attributes xs, zs and y name, checked against the spec."""

    def fail(message: str):
        raise PassError(f"cannot expand Gradient: {message}", node=node.name, op_type=node.op)

    tensors = {name: t for name, t in graph.tensors().items() if name}
    names_x, names_z = list(node.attrs.get("xs", [])), list(node.attrs.get("zs", []))
    y_name = node.attrs.get("y")
    if not names_x:
        fail("the attribute xs is missing or empty")
    if not y_name:
        fail("the attribute y is missing")
    unknown = [n for n in [*names_x, *names_z, y_name] if n not in tensors]
    if unknown:
        fail(f"{', '.join(map(repr, unknown))} named in xs/zs/y is not a tensor of the graph")
    if len(node.inputs) != len(names_x) + len(names_z):
        fail(f"it has {len(node.inputs)} input(s), but xs and zs name {len(names_x) + len(names_z)} tensor(s)")
    if len(node.outputs) > len(names_x):
        fail(f"it has {len(node.outputs)} outputs, but xs names only {len(names_x)} tensor(s)")
    y = tensors[y_name]
    if not is_differentiable_type(y):
        fail(f"y {y_name!r} is {np.dtype(y.dtype)}, not floating-point")
    if y.shape is None or not all(isinstance(d, int | np.integer) and d == 1 for d in y.shape):
        fail(f"y {y_name!r} must be a scalar (one element), but its shape is {y.shape}")
    for name in names_x:
        if not is_differentiable_type(tensors[name]):
            fail(f"x {name!r} is {np.dtype(tensors[name].dtype)}, not floating-point")
    return [tensors[n] for n in names_x], [tensors[n] for n in names_z], y


def _at_inputs(
    graph: gs.Graph, node: gs.Node, xs: list[gs.Tensor], zs: list[gs.Tensor], y: gs.Tensor
) -> tuple[gs.Tensor, list[gs.Tensor]]:
    """y and the tensors to differentiate with respect to, at the values the node's inputs
    give: the graph itself when they are the named tensors (case 1), else a copy of the
    nodes between xs/zs and y reading the node's inputs instead (case 2)."""
    named, fed = [*xs, *zs], list(node.inputs)
    mapping = {id(n): f for n, f in zip(named, fed, strict=True) if n is not f}
    if not mapping:
        return y, xs
    producer = {id(t): n for n in graph.nodes for t in n.outputs}
    upstream = {id(n) for n in _ancestors(y, producer)}
    b = Builder(graph, prefix=f"{node.name or 'Gradient'}::at_inputs")
    for i in topological_order(graph):
        forward = graph.nodes[i]
        if id(forward) not in upstream or not any(id(t) in mapping for t in forward.inputs):
            continue
        if any(True for _ in forward.subgraphs()):
            raise PassError(
                f"cannot evaluate the Gradient at inputs other than xs/zs through node {forward.name!r}, "
                "which has subgraphs",
                node=node.name,
                op_type=node.op,
            )
        outs = [gs.Variable.empty() if t.is_empty() else gs.Variable(b.fresh_name(t.name)) for t in forward.outputs]
        graph.nodes.append(
            gs.Node(
                forward.op,
                name=b.fresh_name(forward.name or forward.op),
                attrs=dict(forward.attrs),
                inputs=[mapping.get(id(t), t) for t in forward.inputs],
                outputs=outs,
                domain=forward.domain,
            )
        )
        for old, new in zip(forward.outputs, outs, strict=True):
            if not old.is_empty():
                new.dtype, new.shape = old.dtype, old.shape
                mapping[id(old)] = new
    return mapping.get(id(y), y), fed[: len(xs)]


def _produce(graph: gs.Graph, grad: gs.Tensor, out: gs.Tensor, taken: dict[int, gs.Tensor]) -> None:
    """Make ``out`` (a Gradient output, now without a producer) hold ``grad``: take over
    grad's producer when grad is a fresh backward tensor, else go through Identity (grad is
    a forward tensor, a constant, or already given to another output)."""
    if id(grad) in taken:
        grad = taken[id(grad)]
    elif (
        isinstance(grad, gs.Variable)
        and len(grad.inputs) == 1
        and grad.name.startswith(GRAD_PREFIX)
        and not any(grad is o for o in graph.outputs)
    ):
        producer = grad.inputs[0]
        replace_uses(grad, out)
        k = next(i for i, t in enumerate(producer.outputs) if t is grad)
        producer.outputs[k] = out
        taken[id(grad)] = out
        return
    graph.nodes.append(gs.Node("Identity", name=f"{GRAD_PREFIX}{out.name}/Identity", inputs=[grad], outputs=[out]))


def _drop_unused_import(graph: gs.Graph) -> None:
    """Case 5: remove the preview-training opset import when nothing uses that domain."""
    if graph.import_domains is None:
        return
    used = any(n.domain == PREVIEW_TRAINING for g in every_graph(graph) for n in g.nodes)
    if not used:
        graph.import_domains = [d for d in graph.import_domains if d.domain != PREVIEW_TRAINING]


__all__ = ["PREVIEW_TRAINING", "ExpandGradient"]
