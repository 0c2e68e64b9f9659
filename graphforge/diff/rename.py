"""An anonymized copy of a model: every node and tensor renamed, nothing else touched.

Used to check that the diff matches by structure (a renamed copy must be structurally
identical) and by the diff benchmark. One mapping serves every nesting level, so a
subgraph's reads of enclosing-scope tensors stay connected.
"""

from __future__ import annotations

import onnx


def rename_all(model: onnx.ModelProto, *, node_prefix: str = "node_", tensor_prefix: str = "t_") -> onnx.ModelProto:
    """A copy of ``model`` whose node names are ``<node_prefix><n>`` and tensor names
    ``<tensor_prefix><n>`` (graph inputs, outputs and initializers included)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    names: dict[str, str] = {}
    nodes = 0

    def tensor(name: str) -> str:
        if not name:
            return name
        found = names.get(name)
        if found is None:
            found = names[name] = f"{tensor_prefix}{len(names)}"
        return found

    stack = [copy.graph]
    while stack:
        graph = stack.pop()
        for value in (*graph.input, *graph.output, *graph.value_info):
            value.name = tensor(value.name)
        for init in graph.initializer:
            init.name = tensor(init.name)
        for sparse in graph.sparse_initializer:
            sparse.values.name = tensor(sparse.values.name)
            sparse.indices.name = tensor(sparse.indices.name)
        for node in graph.node:
            node.name = f"{node_prefix}{nodes}"
            nodes += 1
            node.input[:] = [tensor(t) for t in node.input]
            node.output[:] = [tensor(t) for t in node.output]
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    stack.append(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    stack.extend(attr.graphs)
    return copy
