"""The rewrite engine under the fusion passes: a rule is a pattern, a check and a replacement.

- A **pattern** is a small DAG of ops written the way the graph computes it
  (``p.op("Where", p.op("Greater", p.var("y"), p.var("zero")), p.var("dy"), p.var("zero"))``);
  its last op is the root, whose outputs the replacement takes over. A variable used twice
  must bind the same tensor; an input the pattern names is matched by position, and a node
  must have exactly the inputs the pattern gives it, or up to ``optional`` more (a Conv's
  bias: the replacement reads them from the matched node).
- The **check** gets the match and returns None to accept it or the reason it refuses (a
  window that overlaps, a kernel the provider lacks). Reasons are counted, so the pass can
  say why a candidate was left alone.
- The **replacement** builds the new nodes with a Builder and returns the tensors that stand
  for the root's outputs. The root's output tensors keep their names (roles and graph outputs
  point at them): the new producer writes them. New nodes are named in the root's scope
  (``grad::/1/Relu/Mul_3`` for ``grad::/1/Relu/Where_7``), so they keep its origin (the
  backward stays the backward for recompute, profiles and ``diff``), and they are placed in
  the file where the root was, which is about when onnxruntime runs them.

Matching is networkx's VF2 subgraph monomorphism over the graph's node DAG cut down to the
pattern's op types, with edges labelled (output index, input index), one weakly connected
component at a time. onnxscript's rewriter, the other candidate, needs the model converted to
its IR and back (gs → proto → onnx_ir → proto → gs) and lives in the torch extra, not in
graphforge's core dependencies, and matching one rule took it a few hundred times
longer on a gradient program (``benchmarks/fusion_bench.py``'s ``engines()``; docs/benchmarks.md,
"Fusion").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import networkx as nx
import onnx_graphsurgeon as gs
from networkx.algorithms import isomorphism

from graphforge import roles
from graphforge.builder import Builder
from graphforge.ir import live_nodes, remove_nodes_left_dead


@dataclass(frozen=True)
class Ref:
    """Output ``index`` of the pattern node ``node``."""

    node: str
    index: int = 0


@dataclass(frozen=True)
class Var:
    """A pattern input that matches any tensor (the same one wherever the name appears)."""

    name: str


@dataclass(frozen=True)
class PatternNode:
    op: str
    inputs: tuple[Ref | Var, ...]
    domain: str = ""
    optional: int = 0


class Pattern:
    """A DAG of ops; built by ``Pattern.of(build)`` where ``build(p)`` returns the root."""

    def __init__(self) -> None:
        self.nodes: dict[str, PatternNode] = {}
        self.root = ""

    @classmethod
    def of(cls, build: Callable[[Pattern], Ref]) -> Pattern:
        pattern = cls()
        pattern.root = build(pattern).node
        if not nx.is_weakly_connected(pattern.digraph()):
            raise ValueError(f"pattern rooted at {pattern.root!r} is not connected")
        return pattern

    def var(self, name: str) -> Var:
        return Var(name)

    def op(self, op_type: str, *inputs: Ref | Var, name: str | None = None, domain: str = "", optional: int = 0) -> Ref:
        """A node of the pattern; ``name`` (default: the op type) is how the check and the
        replacement find the graph node it matched; ``optional``: how many more inputs than
        ``inputs`` the node may have."""
        name = name or op_type
        if name in self.nodes:
            raise ValueError(f"pattern node {name!r} twice: give the second one a name")
        self.nodes[name] = PatternNode(op_type, tuple(inputs), domain, optional)
        return Ref(name)

    def ops(self) -> set[tuple[str, str]]:
        return {(n.domain, n.op) for n in self.nodes.values()}

    def digraph(self) -> nx.MultiDiGraph:
        g = nx.MultiDiGraph()
        for name, node in self.nodes.items():
            g.add_node(name, op=(node.domain, node.op))
        for name, node in self.nodes.items():
            for slot, x in enumerate(node.inputs):
                if isinstance(x, Ref):
                    g.add_edge(x.node, name, slot=(x.index, slot))
        return g


@dataclass
class Match:
    """A place where a pattern matched: its nodes by pattern name, its variables' tensors."""

    nodes: dict[str, gs.Node]
    vars: dict[str, gs.Tensor]
    root: gs.Node


@dataclass(frozen=True)
class Context:
    """What checks may ask: the onnxruntime provider the program is fused for, the opset.
    ``restore``: the forward nodes (the user's, not a pass's) that rules rewrote, which
    ``apply`` records for ``prune`` to put back (the root's first output name -> the match's
    forward nodes in graph order, the root last: op, domain, name, input and output names,
    attributes), so that an exported model holds the ops as the user wrote them, not a form
    tuned to this machine's kernels."""

    provider: str
    opset: int
    restore: dict[str, list[dict]] = field(default_factory=dict)


@dataclass(frozen=True)
class Rule:
    """``why``: what the rule buys, as measured (the pass's documentation shows it)."""

    name: str
    pattern: Pattern
    check: Callable[[Match, Context], str | None]
    replace: Callable[[Builder, Match, Context], Sequence[gs.Tensor]]
    why: str
    #: its check reads shapes a backward tensor is only given by shape inference
    shapes: bool = False


@dataclass
class Report:
    """How often each rule fired, and why it refused the candidates it refused."""

    fired: Counter = field(default_factory=Counter)
    refused: dict[str, Counter] = field(default_factory=dict)

    def note(self) -> str:
        done = ", ".join(f"{name} ×{n}" for name, n in self.fired.items()) or "no rule fired"
        why_not = "; ".join(
            f"{name} refused {sum(reasons.values())}: "
            + ", ".join(f"{reason} ×{n}" for reason, n in reasons.most_common())
            for name, reasons in self.refused.items()
        )
        return f"{done}; {why_not}" if why_not else done

    def to_json(self) -> dict:
        return {"fired": dict(self.fired), "refused": {k: dict(v) for k, v in self.refused.items()}}


def apply(graph: gs.Graph, rules: Sequence[Rule], context: Context) -> Report:
    """Apply ``rules`` in order to the top-level graph, each to every match it accepts; nodes a
    rule replaced and left dead are removed. A node is rewritten by one match at most per rule."""
    report = Report()
    # made at the first rewrite (each a whole-graph walk, not paid when no rule fires)
    live: set[int] | None = None
    builder: Builder | None = None
    made: dict[int, list[gs.Node]] = {}  # root id -> the nodes that replace it, placed before it
    position: dict[int, int] = {}  # node id -> place in the graph as given (matches are of those nodes)
    restored: list[tuple[str, str]] = []  # (rule, restore key) for each rewritten forward root
    for rule in rules:
        taken: set[int] = set()
        for match in list(_matches(graph, rule.pattern)):
            ids = {id(n) for n in match.nodes.values()}
            if ids & taken or any(not n.outputs for n in match.nodes.values()):
                continue  # overlaps a match of this rule already rewritten
            reason = rule.check(match, context)
            if reason:
                report.refused.setdefault(rule.name, Counter())[reason] += 1
                continue
            if live is None:
                live, builder = live_nodes(graph), Builder(graph)
            first_new = len(graph.nodes)
            root = match.root
            with builder.scope(root.name.rsplit("/", 1)[0] if "/" in (root.name or "") else (root.name or "fused")):
                outputs = list(rule.replace(builder, match, context))
            if roles.node_origin(root.name or "") is None:  # the match's forward nodes, root last
                position = position or {id(n): i for i, n in enumerate(graph.nodes)}
                forward = [n for n in match.nodes.values() if roles.node_origin(n.name or "") is None]
                context.restore[root.outputs[0].name] = [
                    _record(n) for n in sorted(forward, key=lambda n: position[id(n)])
                ]
                restored.append((rule.name, root.outputs[0].name))
            _take_over(root, outputs)
            made.setdefault(id(root), []).extend(graph.nodes[first_new:])
            del graph.nodes[first_new:]
            taken |= ids
            report.fired[rule.name] += 1
    if live is not None:
        graph.nodes = [x for node in graph.nodes for x in (*made.get(id(node), ()), node)]
        remove_nodes_left_dead(graph, live)
    if restored:
        _check_restorable(graph, restored, context.restore)
    return report


def _check_restorable(graph: gs.Graph, restored: list[tuple[str, str]], restore: dict[str, list[dict]]) -> None:
    """prune puts rewritten forward nodes back onto the tensors they read, so every such tensor
    from outside the match must still be in the graph: a replacement that stopped reading one
    (reading the source of a Transpose instead, say) left it to be removed with its producer."""
    tensors = graph.tensors()
    for rule, key in restored:
        records = restore[key]
        produced = {name for r in records for name in r["outputs"]}
        gone = [n for r in records for n in r["inputs"] if n and n not in produced and n not in tensors]
        if gone:
            raise RuntimeError(
                f"rule {rule} rewrote {records[-1]['op']} {records[-1]['name']!r} and left its input(s) "
                f"{', '.join(map(repr, dict.fromkeys(gone)))} unread, which prune needs to put the node back"
            )


def _record(node: gs.Node) -> dict:
    return {
        "op": node.op,
        "domain": node.domain,  # None or "" as the node had it: the export writes them differently
        "name": node.name,
        "inputs": [t.name for t in node.inputs],
        "outputs": [t.name for t in node.outputs],
        # pairs, in the node's order (the model's metadata sorts a JSON object's keys)
        "attrs": [[k, list(v) if isinstance(v, tuple | list) else v] for k, v in node.attrs.items()],
    }


def _take_over(root: gs.Node, outputs: list[gs.Tensor]) -> None:
    """The replacement's producers write the root's output tensors (same names, same readers);
    the root is left without outputs."""
    if len(outputs) != len(root.outputs):
        raise ValueError(f"{root.name}: the replacement gives {len(outputs)} outputs for {len(root.outputs)}")
    old = list(root.outputs)
    root.outputs.clear()
    for before, after in zip(old, outputs, strict=True):
        producer = after.inputs[0]
        producer.outputs[producer.outputs.index(after)] = before


def _matches(graph: gs.Graph, pattern: Pattern):
    """Every match of ``pattern`` in ``graph``'s top level, variables bound consistently."""
    wanted = pattern.ops()
    index = {id(n): i for i, n in enumerate(graph.nodes)}
    g = nx.MultiDiGraph()
    for i, node in enumerate(graph.nodes):
        if (node.domain or "", node.op) in wanted:
            g.add_node(i, op=(node.domain or "", node.op))
    for i in list(g.nodes):
        for slot, tensor in enumerate(graph.nodes[i].inputs):
            for producer in tensor.inputs:
                j = index.get(id(producer))
                if j in g:
                    g.add_edge(j, i, slot=(producer.outputs.index(tensor), slot))
    shape = pattern.digraph()
    needed = Counter(op for _, op in shape.nodes(data="op"))
    # a pattern is connected, so each match lies in one component of the cut-down graph; most
    # components are a lone node (a Reshape among hundreds), and VF2 over all of them at once
    # tried every combination (minutes on GPT-2 small)
    for component in nx.weakly_connected_components(g):
        have = Counter(g.nodes[i]["op"] for i in component)
        if any(have[op] < n for op, n in needed.items()):
            continue
        matcher = isomorphism.MultiDiGraphMatcher(
            g.subgraph(component),
            shape,
            node_match=lambda a, b: a["op"] == b["op"],
            edge_match=lambda a, b: {e["slot"] for e in b.values()} <= {e["slot"] for e in a.values()},
        )
        for mapping in matcher.subgraph_monomorphisms_iter():
            nodes = {name: graph.nodes[i] for i, name in mapping.items()}
            match = _bind(pattern, nodes)
            if match is not None:
                yield match


def _bind(pattern: Pattern, nodes: dict[str, gs.Node]) -> Match | None:
    bound: dict[str, gs.Tensor] = {}
    for name, spec in pattern.nodes.items():
        node = nodes[name]
        if not len(spec.inputs) <= len(node.inputs) <= len(spec.inputs) + spec.optional:
            return None
        for x, tensor in zip(spec.inputs, node.inputs[: len(spec.inputs)], strict=True):
            if isinstance(x, Ref):
                producer = nodes[x.node]
                if x.index >= len(producer.outputs) or producer.outputs[x.index] is not tensor:
                    return None
            elif bound.setdefault(x.name, tensor) is not tensor:
                return None
    return Match(nodes, bound, nodes[pattern.root])
