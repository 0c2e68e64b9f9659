"""The diff engine: match two models (match.py), then say what differs along the match."""

from __future__ import annotations

import hashlib
import os
from collections import Counter, defaultdict
from collections.abc import Mapping
from typing import Any

import networkx as nx
import numpy as np
import onnx

from graphforge.diff.match import Anchors, make_anchors, match_nodes
from graphforge.diff.numeric import numeric_report
from graphforge.diff.result import (
    AttributeChange,
    FunctionDiff,
    GraphDiff,
    InitializerChange,
    ModelDiff,
    ModelField,
    NodeChange,
    NodeGroup,
    NodeRef,
    OpCount,
    Rename,
    ValueChange,
    ValueStats,
    WiringChange,
)
from graphforge.diff.source import Side, bytes_equal, model_problem, open_side, tensor_array
from graphforge.diff.stats import value_stats
from graphforge.diff.view import GraphView, Init, NodeRec, Value, function_view, graph_view, opset_map
from graphforge.errors import InvalidModelError
from graphforge.model_io import ModelSource
from graphforge.roles import metadata_of, node_origin


def diff_models(
    a: ModelSource | Side,
    b: ModelSource | Side,
    *,
    allow_invalid: bool = False,
    numeric: bool = False,
    inputs: Mapping[str, np.ndarray] | str | os.PathLike | None = None,
    seed: int = 0,
    dims: Mapping[str, int] | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> ModelDiff:
    """Compare two models (paths, bytes or ModelProtos; see docs/diff-json.md for the result).

    Each side must pass the ONNX checker (full check) unless ``allow_invalid``: then an
    invalid side is diffed all the same and its problem reported (``problems``, ``valid``).

    numeric: also run both in onnxruntime on the same inputs (``inputs``: a mapping or an
    .npz file; missing ones are generated from the declared shapes with a RNG seeded by
    ``seed``, symbolic dims sized by ``dims`` or numeric.DEFAULT_DIM) with every matched
    intermediate tensor exposed, and report how each pair differs, and the first one, in
    topological order, that differs beyond ``rtol``/``atol``.
    """
    side_a, side_b = open_side(a), open_side(b)
    problems = {"a": model_problem(side_a), "b": model_problem(side_b)}
    if not allow_invalid:
        for side, problem in ((side_a, problems["a"]), (side_b, problems["b"])):
            if problem is not None:
                raise InvalidModelError(
                    f"{side.label}: not a valid ONNX model: {problem} (--allow-invalid diffs it anyway)"
                )
    result = diff_sides(side_a, side_b)
    result.problems = problems
    if numeric or inputs is not None or dims:
        result.numeric = numeric_report(
            side_a, side_b, result, inputs=inputs, seed=seed, dims=dims, rtol=rtol, atol=atol
        )
    return result


def diff_sides(side_a: Side, side_b: Side) -> ModelDiff:
    pa, pb = side_a.proto, side_b.proto
    graph = diff_graph(
        graph_view(pa.graph, side_a, opsets=opset_map(pa.opset_import)),
        graph_view(pb.graph, side_b, opsets=opset_map(pb.opset_import)),
        path="main",
    )
    return ModelDiff(
        side_a.label,
        side_b.label,
        model_fields(pa, pb),
        graph,
        diff_functions(pa, pb),
        histogram(pa, pb),
    )


# --------------------------------------------------------------------------- one graph level


def diff_graph(
    va: GraphView,
    vb: GraphView,
    *,
    path: str,
    outer: Mapping[str, str] | None = None,
    owner: tuple[NodeRef, NodeRef, str] | None = None,
) -> GraphDiff:
    anchors = make_anchors(va, vb, dict(outer or {}))
    pairs = match_nodes(va, vb, anchors)
    b2a = {b: a for a, b in pairs.items()}
    init_pairs = pair_initializers(va, vb, pairs, anchors)
    tensors = _tensor_pairs(va, vb, pairs, anchors, init_pairs)
    same = _SameSource(va, vb, pairs, anchors, init_pairs)

    diff = GraphDiff(path, va.name, vb.name, len(pairs), len(va.nodes), len(vb.nodes), owner=owner)
    diff.node_pairs, diff.tensor_pairs, diff.views = pairs, tensors, (va, vb)
    diff.groups = node_groups(va, vb, pairs)
    replaced = _replacements(diff.groups)
    diff.inputs = _value_changes(va.inputs, vb.inputs, anchors.inputs, None, replaced)
    diff.outputs = _value_changes(va.outputs, vb.outputs, anchors.outputs, same, replaced)
    diff.initializers = _initializer_changes(va, vb, init_pairs)
    diff.removed = [_ref(va.nodes[i]) for i in va.order if i not in pairs]
    diff.added = [_ref(vb.nodes[i]) for i in vb.order if i not in b2a]
    scope = {**(outer or {}), **tensors}
    for a in va.order:
        b = pairs.get(a)
        if b is None:
            continue
        change = _node_change(va.nodes[a], vb.nodes[b], same, replaced)
        for attr, graphs_a in va.nodes[a].graphs.items():
            graphs_b = vb.nodes[b].graphs.get(attr)
            if graphs_b is None or len(graphs_b) != len(graphs_a):
                continue  # reported as an attribute change
            for k, (ga, gb) in enumerate(zip(graphs_a, graphs_b, strict=True)):
                where = f"{path}/{_node_label(va.nodes[a])}.{attr}" + (f"[{k}]" if len(graphs_a) > 1 else "")
                sub = diff_graph(
                    graph_view(ga, opsets=va.opsets, nested=True),
                    graph_view(gb, opsets=vb.opsets, nested=True),
                    path=where,
                    outer=scope,
                    owner=(change.a, change.b, attr),
                )
                diff.subgraphs.append(sub)
                if not sub.structurally_identical:
                    change.subgraphs.append(where)
        if change.subgraphs:
            change.fields.append("subgraphs")
        if change.fields:
            diff.changed.append(change)
    diff.renamed = _renames(va, vb, pairs, anchors, init_pairs)
    return diff


def _node_label(node: NodeRec) -> str:
    return node.name or f"{node.op}#{node.index}"


def _ref(node: NodeRec) -> NodeRef:
    return NodeRef(node.name, node.op, node.domain, node.index)


def pair_initializers(va: GraphView, vb: GraphView, pairs: Mapping[int, int], anchors: Anchors) -> dict[str, str]:
    """A initializer name -> B name: same name first, then the same input slot of matched
    nodes, then equal contents (dtype, shape and bytes) found once on each side."""
    found: dict[str, str] = {name: name for name in va.initializers if name in vb.initializers}
    taken = set(found.values())
    for a in va.order:
        b = pairs.get(a)
        if b is None:
            continue
        for ta, tb in zip(va.nodes[a].inputs, vb.nodes[b].inputs, strict=False):
            if ta in va.initializers and tb in vb.initializers and ta not in found and tb not in taken:
                found[ta] = tb
                taken.add(tb)
    rest_a = [n for n in va.initializers if n not in found]
    rest_b = [n for n in vb.initializers if n not in taken]
    if rest_a and rest_b:
        by_content: dict[tuple, list[str]] = defaultdict(list)
        for name in rest_b:
            by_content[_content_key(vb.initializers[name])].append(name)
        keys_a = Counter(_content_key(va.initializers[n]) for n in rest_a)
        for name in rest_a:
            key = _content_key(va.initializers[name])
            candidates = by_content.get(key, [])
            if keys_a[key] == 1 and len(candidates) == 1:
                found[name] = candidates[0]
    return found


def _content_key(init: Init) -> tuple:
    return (init.dtype, init.shape, hashlib.blake2b(init.data(), digest_size=16).digest())


def _tensor_pairs(
    va: GraphView, vb: GraphView, pairs: Mapping[int, int], anchors: Anchors, init_pairs: Mapping[str, str]
) -> dict[str, str]:
    """A tensor name -> B tensor name along the match (inputs, initializers, node outputs)."""
    tensors: dict[str, str] = {}
    for a, b in anchors.inputs.items():
        tensors[va.inputs[a].name] = vb.inputs[b].name
    tensors.update(init_pairs)
    for a in va.order:
        b = pairs.get(a)
        if b is None:
            continue
        for ta, tb in zip(va.nodes[a].outputs, vb.nodes[b].outputs, strict=False):
            if ta and tb:
                tensors.setdefault(ta, tb)
    return tensors


class _SameSource:
    """Whether input tensor ``ta`` of A and ``tb`` of B come from corresponding places."""

    def __init__(self, va: GraphView, vb: GraphView, pairs, anchors: Anchors, init_pairs):
        self.va, self.vb, self.pairs, self.anchors, self.init_pairs = va, vb, pairs, anchors, init_pairs

    def __call__(self, ta: str, tb: str) -> bool:
        sa, sb = self.va.source(ta), self.vb.source(tb)
        if sa[0] != sb[0]:
            return False
        kind = sa[0]
        if kind == "none":
            return True
        if kind == "node":
            return self.pairs.get(sa[1]) == sb[1] and sa[2] == sb[2]
        if kind == "input":
            return self.anchors.inputs.get(sa[1]) == sb[1]
        if kind == "init":
            return self.init_pairs.get(ta) == tb
        return self.anchors.outer.get(ta, ta) == tb  # outer: through the enclosing match

    def describe(self, view: GraphView, tensor: str) -> dict[str, Any]:
        source = view.source(tensor)
        kind = {"init": "initializer"}.get(source[0], source[0])
        if kind == "outer" and not view.nested:
            kind = "undefined"  # a main graph or a function body has no enclosing scope
        shown: dict[str, Any] = {"tensor": tensor, "from": kind}
        if source[0] == "node":
            shown["node"] = _ref(view.nodes[source[1]]).to_json()
            shown["output"] = source[2]
        return shown


def _replacements(groups: list[NodeGroup]) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
    """Node index -> the groups it belongs to (members and anchors), per side, for the groups
    that replace nodes by others (something on each side)."""
    in_a: dict[int, set[int]] = defaultdict(set)
    in_b: dict[int, set[int]] = defaultdict(set)
    for k, group in enumerate(groups):
        side_a = [*group.a, *([group.anchor_a] if group.anchor_a is not None else [])]
        side_b = [*group.b, *([group.anchor_b] if group.anchor_b is not None else [])]
        if side_a and side_b:
            for n in side_a:
                in_a[n.index].add(k)
            for n in side_b:
                in_b[n.index].add(k)
    return in_a, in_b


def _explained(source_a: dict[str, Any] | None, source_b: dict[str, Any] | None, replaced) -> bool:
    """A node now reads the replacement of what it read before (an output of an n:m group,
    or of the node a group copies): the group says so, the reader itself did not change."""
    if source_a is None or source_b is None or source_a["from"] != "node" or source_b["from"] != "node":
        return False
    groups_a = replaced[0].get(source_a["node"]["index"], ())
    groups_b = replaced[1].get(source_b["node"]["index"], ())
    return bool(set(groups_a) & set(groups_b))


def _node_change(na: NodeRec, nb: NodeRec, same: _SameSource, replaced) -> NodeChange:
    change = NodeChange(_ref(na), _ref(nb), [])
    if (na.domain, na.op) != (nb.domain, nb.op):
        change.fields.append("op_type")
    keys_a, keys_b = dict(na.attr_key), dict(nb.attr_key)
    for name in sorted(set(keys_a) | set(keys_b)):
        if name in na.graphs and name in nb.graphs and len(na.graphs[name]) == len(nb.graphs[name]):
            continue  # compared as subgraphs
        if keys_a.get(name) != keys_b.get(name):
            change.attributes.append(AttributeChange(name, na.attrs.get(name), nb.attrs.get(name)))
    if change.attributes:
        change.fields.append("attributes")
    for slot in range(max(len(na.inputs), len(nb.inputs))):
        ta = na.inputs[slot] if slot < len(na.inputs) else None
        tb = nb.inputs[slot] if slot < len(nb.inputs) else None
        if ta is not None and tb is not None and same(ta, tb):
            continue
        source_a = None if ta is None else same.describe(same.va, ta)
        source_b = None if tb is None else same.describe(same.vb, tb)
        if not _explained(source_a, source_b, replaced):
            change.inputs.append(WiringChange(slot, source_a, source_b))
    if change.inputs:
        change.fields.append("inputs")
    if len(na.outputs) != len(nb.outputs):
        change.outputs = (len(na.outputs), len(nb.outputs))
        change.fields.append("outputs")
    return change


def _value_changes(
    a: list[Value], b: list[Value], pairs: Mapping[int, int], same: _SameSource | None, replaced
) -> list[ValueChange]:
    changes = []
    paired_b = set(pairs.values())
    for va_ in a:
        k = pairs.get(va_.position)
        if k is None:
            changes.append(ValueChange("removed", va_.to_json(), None, []))
            continue
        vb_ = b[k]
        fields = [f for f in ("dtype", "shape") if getattr(va_, f) != getattr(vb_, f)]
        if (
            same is not None
            and not same(va_.name, vb_.name)
            and not _explained(same.describe(same.va, va_.name), same.describe(same.vb, vb_.name), replaced)
        ):
            fields.append("source")
        if fields:
            changes.append(ValueChange("changed", va_.to_json(), vb_.to_json(), fields))
    changes += [ValueChange("added", None, v.to_json(), []) for v in b if v.position not in paired_b]
    return changes


def _initializer_changes(va: GraphView, vb: GraphView, init_pairs: Mapping[str, str]) -> list[InitializerChange]:
    changes = []
    for name, init_a in va.initializers.items():
        other = init_pairs.get(name)
        if other is None:
            changes.append(InitializerChange("removed", init_a.to_json(), None, []))
            continue
        init_b = vb.initializers[other]
        fields = [f for f in ("dtype", "shape") if getattr(init_a, f) != getattr(init_b, f)]
        stats = None
        if not fields and not bytes_equal(init_a.data(), init_b.data()):
            fields.append("values")
            stats = initializer_stats(init_a, init_b)
        if fields:
            changes.append(InitializerChange("changed", init_a.to_json(), init_b.to_json(), fields, stats))
    paired = set(init_pairs.values())
    changes += [
        InitializerChange("added", None, i.to_json(), []) for n, i in vb.initializers.items() if n not in paired
    ]
    return changes


def initializer_stats(a: Init, b: Init) -> ValueStats | None:
    try:
        x = tensor_array(a.side, None if a.sparse else a.position, a.tensor)
        y = tensor_array(b.side, None if b.sparse else b.position, b.tensor)
    except Exception:  # types NumPy cannot hold: equality is all we know
        return None
    return value_stats(x, y)


def _renames(
    va: GraphView, vb: GraphView, pairs: Mapping[int, int], anchors: Anchors, init_pairs: Mapping[str, str]
) -> list[Rename]:
    renames = [
        Rename("node", va.nodes[a].name, vb.nodes[b].name)
        for a, b in sorted(pairs.items())
        if va.nodes[a].name != vb.nodes[b].name
    ]
    seen: set[str] = set()

    def add(kind: str, ta: str, tb: str) -> None:
        if ta != tb and ta not in seen:
            seen.add(ta)
            renames.append(Rename(kind, ta, tb))

    for a, b in anchors.inputs.items():
        add("input", va.inputs[a].name, vb.inputs[b].name)
    for a, b in anchors.outputs.items():
        add("output", va.outputs[a].name, vb.outputs[b].name)
    for ta, tb in init_pairs.items():
        add("initializer", ta, tb)
    for a, b in sorted(pairs.items()):
        for ta, tb in zip(va.nodes[a].outputs, vb.nodes[b].outputs, strict=False):
            if ta and tb:
                add("tensor", ta, tb)
    return renames


# --------------------------------------------------------------------------- n:m groups


def node_groups(va: GraphView, vb: GraphView, pairs: Mapping[int, int]) -> list[NodeGroup]:
    """Unmatched nodes that belong together (n:m matches), as the sets of one union-find:

    1. the nodes a pass generated for one origin node (named ``<role>::<origin>/...``), with
       that node itself where it is unmatched (fused away);
    2. unmatched nodes joined to their unmatched neighbours, and to the unmatched nodes of the
       other side that touch the same matched node at the same slot (a region replaced by
       another at the same place).

    A set holds at most one origin: the nodes of two origins that touch (the gradients of
    neighbouring nodes) stay apart, while an unmatched node without an origin joins the
    origin's set it touches. So a MatMul + Add fused into a Gemm named ``fuse::<MatMul>/...``
    is one group (-2 +1), and a node recomputed as ``recompute::<node>/...`` groups the copies
    with the node they copy (anchors matched on both sides: 1 -> n).
    """
    matched_b = set(pairs.values())
    removed = [i for i in va.order if i not in pairs]
    added = [i for i in vb.order if i not in matched_b]
    sets, anchors = _origin_sets(va, vb, pairs, removed, added)
    for u, v in _region_links(va, vb, pairs, removed, added):
        sets.union(u, v)
    by_key, regions = _set_members(sets, va, vb, removed, added)
    groups = []
    for key, (anchor_a, anchor_b) in anchors.items():
        if key not in by_key:
            continue  # its only node was an anchor found in another origin's set
        members_a, members_b = by_key[key]
        groups.append(
            NodeGroup(
                "origin",
                key[0],
                key[1],
                [_ref(va.nodes[i]) for i in members_a],
                [_ref(vb.nodes[i]) for i in members_b],
                None if anchor_a is None else _ref(va.nodes[anchor_a]),
                None if anchor_b is None else _ref(vb.nodes[anchor_b]),
            )
        )
    groups += [
        NodeGroup("region", None, None, [_ref(va.nodes[i]) for i in a], [_ref(vb.nodes[i]) for i in b])
        for a, b in regions
    ]
    return groups


#: an origin as node_groups labels its set: (the role of the pass that generated it, the node)
_Origin = tuple[str, str | None]


def _origin_sets(
    va: GraphView, vb: GraphView, pairs: Mapping[int, int], removed: list[int], added: list[int]
) -> tuple[_LabelledSets, dict[_Origin, tuple[int | None, int | None]]]:
    """Case 1 of ``node_groups``: the unmatched nodes (``removed`` from ``va``, ``added`` in
    ``vb``), each in a set of its own but for those of one origin, which share one, labelled
    with the origin; and each origin, in the order first met, with the node it names on each
    side (its anchor, None where there is none), which joins its set where it is unmatched."""
    matched_b = set(pairs.values())
    sets = _LabelledSets()
    first: dict[_Origin, tuple[str, int]] = {}  # origin -> its first node, in order
    for side, members, view in (("a", removed, va), ("b", added, vb)):
        for i in members:
            origin = node_origin(view.nodes[i].name)
            sets.add((side, i), origin)
            if origin is not None:
                sets.union(first.setdefault(origin, (side, i)), (side, i))
    names_a, names_b = _first_by_name(va), _first_by_name(vb)
    anchors: dict[_Origin, tuple[int | None, int | None]] = {}
    for key in first:
        origin = key[1]
        anchor_a = names_a.get(origin) if origin else None
        anchor_b = names_b.get(origin) if origin else None
        anchors[key] = (anchor_a, anchor_b)
        # an origin node that is gone (fused away) is part of the n:m group itself
        if anchor_a is not None and anchor_a not in pairs:
            sets.add(("a", anchor_a), key)
            sets.union(first[key], ("a", anchor_a))
        if anchor_b is not None and anchor_b not in matched_b:
            sets.add(("b", anchor_b), key)
            sets.union(first[key], ("b", anchor_b))
    return sets, anchors


def _set_members(
    sets: _LabelledSets, va: GraphView, vb: GraphView, removed: list[int], added: list[int]
) -> tuple[dict[_Origin, tuple[list[int], list[int]]], list[tuple[list[int], list[int]]]]:
    """The unmatched nodes of each set of ``sets``, each side's in file order: by origin for the
    labelled sets; and the unlabelled sets of two nodes or more (regions), in file order of
    their first node."""
    order_a = {i: k for k, i in enumerate(va.order)}
    order_b = {i: k for k, i in enumerate(vb.order)}
    members: dict[tuple, tuple[list[int], list[int]]] = {}
    for item in [*(("a", i) for i in removed), *(("b", i) for i in added)]:
        entry = members.setdefault(sets.find(item), ([], []))
        entry[0 if item[0] == "a" else 1].append(item[1])
    by_key: dict[_Origin, tuple[list[int], list[int]]] = {}
    regions = []
    for root, (members_a, members_b) in members.items():
        members_a.sort(key=order_a.__getitem__)
        members_b.sort(key=order_b.__getitem__)
        key = sets.labels.get(root)
        if key is not None:
            by_key[key] = (members_a, members_b)
        elif len(members_a) + len(members_b) >= 2:
            regions.append((members_a, members_b))
    regions.sort(key=lambda c: (order_a[c[0][0]] if c[0] else len(order_a), order_b[c[1][0]] if c[1] else 0))
    return by_key, regions


class _LabelledSets:
    """networkx's union-find whose sets carry at most one label: a union that would put two
    different labels in one set is refused."""

    def __init__(self) -> None:
        self.sets = nx.utils.UnionFind()
        self.labels: dict[tuple, object] = {}  # root -> label

    def add(self, item: tuple, label: object = None) -> None:
        """``item`` (in a set of its own if new); its set takes ``label`` unless it has one."""
        root = self.sets[item]
        if label is not None:
            self.labels.setdefault(root, label)

    def find(self, item: tuple) -> tuple:
        return self.sets[item]

    def union(self, u: tuple, v: tuple) -> None:
        ru, rv = self.sets[u], self.sets[v]
        lu, lv = self.labels.get(ru), self.labels.get(rv)
        if ru == rv or (lu is not None and lv is not None and lu != lv):
            return
        self.sets.union(ru, rv)
        self.labels.pop(ru, None)
        self.labels.pop(rv, None)
        if lu is not None or lv is not None:
            self.labels[self.sets[ru]] = lu if lu is not None else lv


def _first_by_name(view: GraphView) -> dict[str, int]:
    found: dict[str, int] = {}
    for node in view.nodes:
        if node.name:
            found.setdefault(node.name, node.index)
    return found


def _region_links(va, vb, pairs, removed: list[int], added: list[int]):
    """(item, item) links between unmatched nodes (("a", i), ("b", j)) and the places they
    touch: ("feeds", B node, output slot) for what they read from a matched node, ("reads",
    B node, input slot) for a matched node reading them; the same place on both sides joins
    the two sides' regions. In file order, so the union-find is deterministic."""
    for side, members, view, to_b in (("a", removed, va, pairs), ("b", added, vb, None)):
        member_set = set(members)
        for i in members:
            node = view.nodes[i]
            for t in node.inputs:
                produced = view.producer.get(t) if t else None
                if produced is None:
                    continue
                p, out_slot = produced
                if p in member_set:
                    yield (side, i), (side, p)
                else:
                    q = to_b.get(p) if to_b is not None else p
                    if q is not None:
                        yield (side, i), ("feeds", q, out_slot)
            for t in node.outputs:
                for c, c_slot in view.consumers.get(t, ()) if t else ():
                    if c not in member_set:
                        d = to_b.get(c) if to_b is not None else c
                        if d is not None:
                            yield (side, i), ("reads", d, c_slot)


# --------------------------------------------------------------------------- model level


def model_fields(a: onnx.ModelProto, b: onnx.ModelProto) -> list[ModelField]:
    changes = []
    for name in ("ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string"):
        if getattr(a, name) != getattr(b, name):
            changes.append(ModelField(name, None, getattr(a, name), getattr(b, name)))
    if a.graph.name != b.graph.name:
        changes.append(ModelField("graph_name", None, a.graph.name, b.graph.name))
    opsets_a = {o.domain or "ai.onnx": o.version for o in a.opset_import}
    opsets_b = {o.domain or "ai.onnx": o.version for o in b.opset_import}
    for domain in sorted(set(opsets_a) | set(opsets_b)):
        if opsets_a.get(domain) != opsets_b.get(domain):
            changes.append(ModelField("opset", domain, opsets_a.get(domain), opsets_b.get(domain)))
    meta_a, meta_b = metadata_of(a), metadata_of(b)
    for key in sorted(set(meta_a) | set(meta_b)):
        if meta_a.get(key) != meta_b.get(key):
            changes.append(ModelField("metadata", key, meta_a.get(key), meta_b.get(key)))
    return changes


def diff_functions(a: onnx.ModelProto, b: onnx.ModelProto) -> list[FunctionDiff]:
    def key(f: onnx.FunctionProto) -> tuple[str, str, str]:
        return (f.domain, f.name, getattr(f, "overload", ""))

    funcs_a = {key(f): f for f in a.functions}
    funcs_b = {key(f): f for f in b.functions}
    found = []
    for k in sorted(set(funcs_a) | set(funcs_b)):
        fa, fb = funcs_a.get(k), funcs_b.get(k)
        if fa is None or fb is None:
            found.append(FunctionDiff(*k, "added" if fa is None else "removed", []))
            continue
        fields, detail = [], {}
        for name, value_a, value_b in (
            ("inputs", len(fa.input), len(fb.input)),
            ("outputs", len(fa.output), len(fb.output)),
            ("attributes", list(fa.attribute), list(fb.attribute)),
            (
                "opset_import",
                {o.domain or "ai.onnx": o.version for o in fa.opset_import},
                {o.domain or "ai.onnx": o.version for o in fb.opset_import},
            ),
        ):
            if value_a != value_b:
                fields.append(name)
                detail[name] = {"a": value_a, "b": value_b}
        defaults_a = [x.SerializeToString(deterministic=True) for x in fa.attribute_proto]
        defaults_b = [x.SerializeToString(deterministic=True) for x in fb.attribute_proto]
        if defaults_a != defaults_b:
            fields.append("attribute_defaults")
        path = f"function {k[0]}::{k[1]}" if k[0] else f"function {k[1]}"
        graph = diff_graph(function_view(fa), function_view(fb), path=path)
        if not graph.structurally_identical:
            fields.append("body")
        found.append(FunctionDiff(*k, "changed", fields, graph, detail))
    return found


def histogram(a: onnx.ModelProto, b: onnx.ModelProto) -> list[OpCount]:
    """Node count per op type (subgraphs and functions included), for the ops whose count changed."""
    count_a, count_b = op_counts(a), op_counts(b)
    return [
        OpCount(op, count_a[op], count_b[op])
        for op in sorted(set(count_a) | set(count_b))
        if count_a[op] != count_b[op]
    ]


def op_counts(model: onnx.ModelProto) -> Counter[str]:
    counts: Counter[str] = Counter()
    stack = [model.graph.node, *[f.node for f in model.functions]]
    while stack:
        nodes = stack.pop()
        for n in nodes:
            counts[n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}"] += 1
            for attr in n.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    stack.append(attr.g.node)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    stack.extend(g.node for g in attr.graphs)
    return counts
