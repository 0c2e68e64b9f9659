"""A networkx view of one graph level, and a stable topological order built on it."""

from __future__ import annotations

import networkx as nx
import onnx_graphsurgeon as gs

from graphforge.errors import PassError


def outer_inputs(node: gs.Node, *, constants: bool = False) -> list[gs.Tensor]:
    """Tensors a node's subgraphs read from the enclosing scope (implicit inputs); outer
    initializers too with ``constants`` (the autodiff driver differentiates them).

    Walked with an explicit stack: deeply nested control flow must not hit Python's
    recursion limit.
    """
    found: dict[int, gs.Tensor] = {}
    stack: list[tuple[gs.Graph, frozenset[int]]] = [(g, frozenset()) for g in node.subgraphs()]
    while stack:
        graph, enclosing_local = stack.pop()
        local = set(enclosing_local) | {id(t) for t in graph.inputs}
        local |= {id(t) for n in graph.nodes for t in n.outputs}
        for n in graph.nodes:
            for t in n.inputs:
                if id(t) not in local and (constants or not isinstance(t, gs.Constant)) and not t.is_empty():
                    found.setdefault(id(t), t)
            stack.extend((g, frozenset(local)) for g in n.subgraphs())
    return list(found.values())


def to_digraph(graph: gs.Graph) -> nx.DiGraph:
    """Nodes are indices into ``graph.nodes``; an edge u→v means v reads a tensor u writes
    (subgraph reads of outer tensors count as reads by the node that owns the subgraph).

    A subgraph's read of an outer tensor is also matched by name: onnx-graphsurgeon imports
    a subgraph that reads a tensor produced *later* in the file as a separate tensor of the
    same name (ONNX names are unique across nested scopes, so the name is the link).
    """
    producer: dict[int, int] = {}
    by_name: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        for t in node.outputs:
            producer[id(t)] = i
            if t.name:
                by_name[t.name] = i
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(graph.nodes)))
    for i, node in enumerate(graph.nodes):
        for t in node.inputs:
            j = producer.get(id(t))
            if j is not None:
                dag.add_edge(j, i)
        for t in outer_inputs(node):
            j = producer.get(id(t), by_name.get(t.name))
            if j is not None:
                dag.add_edge(j, i)
    return dag


def topological_order(graph: gs.Graph) -> list[int]:
    """Indices of ``graph.nodes`` in a topological order that keeps the current order
    wherever it is already valid (ties go to the node that came first)."""
    dag = to_digraph(graph)
    try:
        return list(nx.lexicographical_topological_sort(dag))
    except nx.NetworkXUnfeasible:
        cycle = nx.find_cycle(dag)
        names = " -> ".join(graph.nodes[u].name or graph.nodes[u].op for u, _ in cycle)
        first = graph.nodes[cycle[0][0]]
        raise PassError(f"the graph has a cycle: {names}", node=first.name, op_type=first.op) from None


def placed_early(nodes: list[gs.Node], kept: set[int]) -> list[gs.Node]:
    """``nodes`` with each one not in ``kept`` (by id) moved to right after the last producer
    of its inputs, then made topological without moving what already is (onnxruntime runs
    a graph in about its file's order, so this is when it runs)."""
    old = [n for n in nodes if id(n) in kept]
    made_at = {id(t): i for i, n in enumerate(old) for t in n.outputs}
    after: dict[int, list[gs.Node]] = {}
    for node in nodes:
        if id(node) in kept:
            continue
        at = max((made_at.get(id(t), -1) for t in node.inputs), default=-1)
        after.setdefault(at, []).append(node)
        made_at.update({id(t): at for t in node.outputs})
    placed = list(after.get(-1, []))
    for i, node in enumerate(old):
        placed.append(node)
        placed.extend(after.get(i, []))
    return [placed[i] for i in topological_order(gs.Graph(nodes=placed))]
