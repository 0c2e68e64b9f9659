"""Matching the nodes of two graph levels by structure, then by name.

Names are the weakest evidence (passes and exporters rename), so they come last:

1. Anchors: graph inputs and outputs pair by name, the rest by position; initializers
   that keep their name, dtype and shape are anchors too; tensors read from an enclosing
   scope are anchored through the enclosing graph's match.
2. Cone hashes: a node's forward hash covers its op, attributes and everything upstream
   of it (its ancestors, down to the anchors); its backward hash everything downstream. A
   hash found once in each graph pairs its two nodes. One edit changes only the forward
   hashes below it and the backward hashes above it, so each node away from an edit is
   still matched by one of the two.
3. Neighbourhood hashing: Weisfeiler-Lehman refinement over the nodes still unmatched,
   seeded with op type + attributes (then op type alone, to find changed nodes), where a
   matched neighbour counts by its pair: a few rounds, matching unique labels, restarted
   whenever a match is made.
4. Structurally indistinguishable nodes (the same cones) pair by name, then by file order.
5. Names: an unmatched node pairs with the unmatched node of the same name and op type.
6. Greedy extension, in topological order: an unmatched node pairs with the candidate
   (same op, or same name) that agrees with it on the most matched neighbours.
7. Replacement in place: two unmatched nodes of different op types that are each other's
   only candidate by position, with the same arity, pair (an op type change).

Every step iterates in file or topological order, and labels are interned as integers in
the order they are met, so the result never depends on Python's hash seed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from graphforge.diff.view import GraphView, Value

#: Weisfeiler-Lehman rounds before giving up on a label set (each round widens the
#: neighbourhood by one hop; matched neighbours already carry the cones' information)
WL_ROUNDS = 3


class Interner:
    """Hashable keys -> small integers, in the order first seen (exact: no hash collisions)."""

    def __init__(self) -> None:
        self.ids: dict[object, int] = {}

    def __call__(self, key: object) -> int:
        found = self.ids.get(key)
        if found is None:
            found = self.ids[key] = len(self.ids)
        return found


@dataclass
class Anchors:
    """What both sides are known to share before any node is matched."""

    inputs: dict[int, int]  # A input position -> B input position
    outputs: dict[int, int]  # A output position -> B output position
    initializers: set[str]  # initializer names both sides have with the same dtype and shape
    outer: dict[str, str] = field(default_factory=dict)  # A enclosing-scope name -> B name


def pair_values(a: Sequence[Value], b: Sequence[Value]) -> dict[int, int]:
    """Inputs (or outputs) by name, then the rest by position, in order."""
    b_by_name = {v.name: v.position for v in reversed(b)}
    pairs: dict[int, int] = {}
    taken: set[int] = set()
    for v in a:
        k = b_by_name.get(v.name)
        if k is not None and k not in taken:
            pairs[v.position] = k
            taken.add(k)
    rest_a = [v.position for v in a if v.position not in pairs]
    rest_b = [v.position for v in b if v.position not in taken]
    pairs.update(zip(rest_a, rest_b, strict=False))
    return dict(sorted(pairs.items()))


def make_anchors(va: GraphView, vb: GraphView, outer: dict[str, str] | None = None) -> Anchors:
    shared = {
        name
        for name, init in va.initializers.items()
        if (other := vb.initializers.get(name)) is not None and (other.dtype, other.shape) == (init.dtype, init.shape)
    }
    return Anchors(pair_values(va.inputs, vb.inputs), pair_values(va.outputs, vb.outputs), shared, dict(outer or {}))


class Matcher:
    """The state of one match: the pairs so far and each side's anchor labels."""

    def __init__(self, va: GraphView, vb: GraphView, anchors: Anchors):
        self.va, self.vb, self.anchors = va, vb, anchors
        self.intern = Interner()
        self.a2b: dict[int, int] = {}
        self.b2a: dict[int, int] = {}
        inputs_b = {k: a for a, k in anchors.inputs.items()}
        outputs_b = {k: a for a, k in anchors.outputs.items()}
        outer_b = set(anchors.outer.values())
        self.anchor_a = self._anchor_labels(va, "A", anchors.inputs, lambda t: anchors.outer.get(t))
        self.anchor_b = self._anchor_labels(vb, "B", inputs_b, lambda t: t if t in outer_b else None)
        self.out_a = self._output_labels(va, anchors.outputs)
        self.out_b = self._output_labels(vb, outputs_b)

    def _anchor_labels(self, view: GraphView, side: str, inputs: dict[int, int], outer) -> dict[str, int]:
        """A label for every tensor no node of this level produces, equal across sides when anchored."""
        labels: dict[str, int] = {}
        for v in view.inputs:
            paired = inputs.get(v.position)
            labels.setdefault(v.name, self.intern(("in", paired) if paired is not None else ("in" + side, v.position)))
        for name, init in view.initializers.items():
            key = ("init", name) if name in self.anchors.initializers else ("initT", init.dtype, init.shape)
            labels.setdefault(name, self.intern(key))
        for node in view.nodes:
            for t in (*node.inputs, *node.implicit):
                if t and t not in labels and t not in view.producer:
                    mapped = outer(t)
                    labels[t] = self.intern(("outer", mapped) if mapped is not None else ("outer" + side, t))
        labels[""] = self.intern(("none",))
        return labels

    def _output_labels(self, view: GraphView, outputs: dict[int, int]) -> dict[str, list[int]]:
        labels: dict[str, list[int]] = {}
        for v in view.outputs:
            paired = outputs.get(v.position)
            labels.setdefault(v.name, []).append(
                self.intern(("out", paired) if paired is not None else ("out?", v.position))
            )
        return labels

    def pair(self, a: int, b: int) -> None:
        assert a not in self.a2b and b not in self.b2a
        self.a2b[a] = b
        self.b2a[b] = a

    def unmatched_a(self) -> list[int]:
        return [i for i in self.va.order if i not in self.a2b]

    def unmatched_b(self) -> list[int]:
        return [i for i in self.vb.order if i not in self.b2a]


# --------------------------------------------------------------------------- labels and hashes


def base_labels(view: GraphView, intern: Interner, *, strict: bool) -> list[int]:
    """Op type + domain (+ attributes and arity when strict) of every node."""
    if strict:
        return [intern((n.domain, n.op, n.attr_key, len(n.inputs), len(n.outputs))) for n in view.nodes]
    return [intern((n.domain, n.op)) for n in view.nodes]


def forward_hashes(view: GraphView, base: list[int], anchor: dict[str, int], intern: Interner) -> list[int]:
    """Each node's label combined with its inputs' hashes: equal hashes mean equal upstream cones."""
    hashes: list[int | None] = [None] * len(view.nodes)
    for i in view.order:
        node = view.nodes[i]
        sig = []
        for t in (*node.inputs, -1, *node.implicit):
            if t == -1:
                sig.append(-1)
                continue
            produced = view.producer.get(t) if t else None
            if produced is None:
                sig.append(anchor[t])
            else:
                p, slot = produced
                upstream = hashes[p]
                sig.append(intern(("n", upstream if upstream is not None else ("cycle", base[p]), slot)))
        hashes[i] = intern((base[i], tuple(sig)))
    return hashes  # type: ignore[return-value]


def backward_hashes(view: GraphView, base: list[int], outputs: dict[str, list[int]], intern: Interner) -> list[int]:
    """Each node's label combined with its consumers' hashes (per output, as a multiset)."""
    hashes: list[int | None] = [None] * len(view.nodes)
    for i in reversed(view.order):
        node = view.nodes[i]
        sig = []
        for t in node.outputs:
            entries = list(outputs.get(t, ())) if t else []
            for c, slot in view.consumers.get(t, ()) if t else ():
                downstream = hashes[c]
                entries.append(intern(("c", downstream if downstream is not None else ("cycle", base[c]), slot)))
            sig.append(tuple(sorted(entries)))
        hashes[i] = intern((base[i], tuple(sig)))
    return hashes  # type: ignore[return-value]


# --------------------------------------------------------------------------- phases


def match_unique(m: Matcher, keys_a: Sequence, keys_b: Sequence) -> int:
    """Pair the unmatched nodes whose key occurs exactly once among the unmatched of each side."""
    groups_a = _groups(m.unmatched_a(), keys_a)
    groups_b = _groups(m.unmatched_b(), keys_b)
    made = 0
    for key, members in groups_a.items():
        others = groups_b.get(key)
        if others is not None and len(members) == 1 and len(others) == 1:
            m.pair(members[0], others[0])
            made += 1
    return made


def match_groups(m: Matcher, keys_a: Sequence, keys_b: Sequence, *, unequal: bool) -> int:
    """Pair nodes that share a key but are not alone with it: by name first, then in order.

    ``unequal``: also pair groups of different sizes (right only for keys that make nodes
    interchangeable, such as both cone hashes)."""
    groups_a = _groups(m.unmatched_a(), keys_a)
    groups_b = _groups(m.unmatched_b(), keys_b)
    made = 0
    for key, members in groups_a.items():
        others = groups_b.get(key)
        if not others or (len(members) != len(others) and not unequal):
            continue
        made += _pair_by_name_then_order(m, members, others)
    return made


def _pair_by_name_then_order(m: Matcher, members: list[int], others: list[int]) -> int:
    made = 0
    by_name: dict[str, list[int]] = defaultdict(list)
    for b in others:
        by_name[m.vb.nodes[b].name].append(b)
    left = []
    for a in members:
        name = m.va.nodes[a].name
        candidates = [b for b in by_name.get(name, ()) if b not in m.b2a] if name else []
        if candidates:
            m.pair(a, candidates[0])
            made += 1
        else:
            left.append(a)
    for a, b in zip(left, [b for b in others if b not in m.b2a], strict=False):
        m.pair(a, b)
        made += 1
    return made


def match_wl(m: Matcher, *, strict: bool, rounds: int = WL_ROUNDS) -> int:
    """Weisfeiler-Lehman refinement over the unmatched nodes; a matched neighbour is labelled
    by its pair. Returns the number of pairs made (stops at the first round that makes any)."""
    todo_a, todo_b = m.unmatched_a(), m.unmatched_b()
    if not todo_a or not todo_b:
        return 0
    base_a = base_labels(m.va, m.intern, strict=strict)
    base_b = base_labels(m.vb, m.intern, strict=strict)
    labels_a = {i: base_a[i] for i in todo_a}
    labels_b = {i: base_b[i] for i in todo_b}
    for _ in range(rounds):
        labels_a = {i: _refine(m, m.va, i, labels_a, m.a2b, m.anchor_a, m.out_a, "A") for i in todo_a}
        labels_b = {i: _refine(m, m.vb, i, labels_b, m.b2a, m.anchor_b, m.out_b, "B") for i in todo_b}
        keys_a = _sparse_keys(len(m.va.nodes), labels_a)
        keys_b = _sparse_keys(len(m.vb.nodes), labels_b)
        made = match_unique(m, keys_a, keys_b)
        if made:
            return made
    return 0


def _refine(m: Matcher, view: GraphView, i: int, labels: dict[int, int], pairs, anchor, outputs, side: str) -> int:
    node = view.nodes[i]
    intern = m.intern
    ins = []
    for slot, t in enumerate(node.inputs):
        produced = view.producer.get(t) if t else None
        if produced is None:
            ins.append(anchor[t])
            continue
        p, out_slot = produced
        ins.append(intern((*_neighbour(p, pairs, labels, side, view), out_slot, slot)))
    outs = []
    for t in node.outputs:
        entries = list(outputs.get(t, ())) if t else []
        for c, slot in view.consumers.get(t, ()) if t else ():
            entries.append(intern((*_neighbour(c, pairs, labels, side, view), slot)))
        outs.append(tuple(sorted(entries)))
    return intern((labels[i], tuple(ins), tuple(outs)))


def _neighbour(j: int, pairs: dict[int, int], labels: dict[int, int], side: str, view: GraphView) -> tuple:
    if j in pairs:
        # the pair's A index names it on both sides
        return ("m", j if side == "A" else pairs[j])
    label = labels.get(j)
    return ("u", label if label is not None else view.nodes[j].op)


def _sparse_keys(n: int, labels: dict[int, int]) -> list[int | None]:
    keys: list[int | None] = [None] * n
    for i, label in labels.items():
        keys[i] = label
    return keys


def match_names(m: Matcher) -> int:
    """Pair unmatched nodes with the same non-empty name and op type (names unique per side)."""
    names_b: dict[tuple[str, str, str], list[int]] = defaultdict(list)
    for b in m.unmatched_b():
        node = m.vb.nodes[b]
        if node.name:
            names_b[(node.name, node.domain, node.op)].append(b)
    made = 0
    for a in m.unmatched_a():
        node = m.va.nodes[a]
        found = names_b.get((node.name, node.domain, node.op)) if node.name else None
        if found and len(found) == 1 and found[0] not in m.b2a:
            m.pair(a, found[0])
            made += 1
    return made


def match_greedy(m: Matcher) -> int:
    """In topological order, pair each unmatched node with the unmatched candidate that agrees
    with it on the most matched neighbours (same op type, or same name and at least one
    agreeing neighbour; ties go to equal attributes, then equal names, then file order)."""
    made = 0
    names_b: dict[str, list[int]] = defaultdict(list)
    for b in m.unmatched_b():
        if m.vb.nodes[b].name:
            names_b[m.vb.nodes[b].name].append(b)
    tensor_map = _anchor_tensor_map(m)
    for a in m.unmatched_a():
        votes = _neighbour_votes(m, a, tensor_map)
        node = m.va.nodes[a]
        best: tuple | None = None
        for b in {*votes, *(names_b.get(node.name, ()) if node.name else ())}:
            if b in m.b2a:
                continue
            other = m.vb.nodes[b]
            same_op = (other.domain, other.op) == (node.domain, node.op)
            same_name = bool(node.name) and other.name == node.name
            score = votes.get(b, 0)
            if not (same_op and (score or same_name)) and not (same_name and score):
                continue
            rank = (score, same_op, other.attr_key == node.attr_key, same_name, -b)
            if best is None or rank > best:
                best = rank
        if best is not None:
            m.pair(a, -best[-1])
            made += 1
    return made


def match_positions(m: Matcher) -> int:
    """Pair an unmatched node with one of another op type when each is the only unmatched
    node where the other sits (by matched neighbours) and their arities agree: an op that was
    replaced in place (Relu -> LeakyRelu), reported as an op type change."""
    tensor_map = _anchor_tensor_map(m)
    proposals: dict[int, int] = {}
    for a in m.unmatched_a():
        candidates = [b for b, votes in _neighbour_votes(m, a, tensor_map).items() if votes and b not in m.b2a]
        if len(candidates) == 1:
            proposals[a] = candidates[0]
    wanted = defaultdict(list)
    for a, b in proposals.items():
        wanted[b].append(a)
    made = 0
    for a, b in proposals.items():
        na, nb = m.va.nodes[a], m.vb.nodes[b]
        if len(wanted[b]) == 1 and (len(na.inputs), len(na.outputs)) == (len(nb.inputs), len(nb.outputs)):
            m.pair(a, b)
            made += 1
    return made


def _anchor_tensor_map(m: Matcher) -> dict[str, str]:
    """A tensor name -> B tensor name for what is anchored outside the nodes."""
    mapping = {m.va.inputs[a].name: m.vb.inputs[b].name for a, b in m.anchors.inputs.items()}
    mapping.update({name: name for name in m.anchors.initializers})
    mapping.update(m.anchors.outer)
    return mapping


def _neighbour_votes(m: Matcher, a: int, tensor_map: dict[str, str]) -> dict[int, int]:
    """B nodes sitting where ``a`` sits relative to its matched neighbours, with their vote counts."""
    va, vb = m.va, m.vb
    node = va.nodes[a]
    votes: dict[int, int] = defaultdict(int)
    for slot, t in enumerate(node.inputs):
        if not t:
            continue
        tb = _mapped_tensor(m, t, tensor_map)
        if tb is None:
            continue
        for c, c_slot in vb.consumers.get(tb, ()):
            if c_slot == slot and c not in m.b2a:
                votes[c] += 1
    for out_slot, t in enumerate(node.outputs):
        if not t:
            continue
        for c, c_slot in va.consumers.get(t, ()):
            d = m.a2b.get(c)
            if d is None or c_slot < 0 or c_slot >= len(vb.nodes[d].inputs):
                continue
            produced = vb.producer.get(vb.nodes[d].inputs[c_slot])
            if produced is not None and produced[1] == out_slot and produced[0] not in m.b2a:
                votes[produced[0]] += 1
        for position in va.output_names.get(t, ()):
            k = m.anchors.outputs.get(position)
            produced = vb.producer.get(vb.outputs[k].name) if k is not None else None
            if produced is not None and produced[1] == out_slot and produced[0] not in m.b2a:
                votes[produced[0]] += 1
    return votes


def _mapped_tensor(m: Matcher, t: str, tensor_map: dict[str, str]) -> str | None:
    produced = m.va.producer.get(t)
    if produced is None:
        return tensor_map.get(t)
    p, slot = produced
    q = m.a2b.get(p)
    if q is None:
        return None
    outputs = m.vb.nodes[q].outputs
    return outputs[slot] if slot < len(outputs) and outputs[slot] else None


def _groups(members: Iterable[int], keys: Sequence) -> dict[object, list[int]]:
    groups: dict[object, list[int]] = defaultdict(list)
    for i in members:
        key = keys[i]
        if key is not None:
            groups[key].append(i)
    return groups


# --------------------------------------------------------------------------- driver


def match_nodes(va: GraphView, vb: GraphView, anchors: Anchors) -> dict[int, int]:
    """A node index -> B node index for every node matched (see the module docstring)."""
    m = Matcher(va, vb, anchors)
    if not va.nodes or not vb.nodes:
        return {}
    base_a = base_labels(va, m.intern, strict=True)
    base_b = base_labels(vb, m.intern, strict=True)
    fa = forward_hashes(va, base_a, m.anchor_a, m.intern)
    fb = forward_hashes(vb, base_b, m.anchor_b, m.intern)
    ba = backward_hashes(va, base_a, m.out_a, m.intern)
    bb = backward_hashes(vb, base_b, m.out_b, m.intern)
    both_a, both_b = list(zip(fa, ba, strict=True)), list(zip(fb, bb, strict=True))
    match_unique(m, both_a, both_b)
    match_unique(m, fa, fb)
    match_unique(m, ba, bb)
    match_groups(m, both_a, both_b, unequal=True)
    _refine_until_stable(m)
    if match_groups(m, fa, fb, unequal=False) + match_groups(m, ba, bb, unequal=False):
        _refine_until_stable(m)
    if match_names(m):
        _refine_until_stable(m)
    while match_greedy(m):
        _refine_until_stable(m)
    while match_positions(m):
        _refine_until_stable(m)
    return dict(sorted(m.a2b.items()))


def _refine_until_stable(m: Matcher) -> None:
    while match_wl(m, strict=True) or match_wl(m, strict=False):
        pass
