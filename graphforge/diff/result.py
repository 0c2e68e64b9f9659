"""What a diff finds, as plain data: every class here turns into the JSON of docs/diff-json.md.

Two verdicts: ``structurally_identical`` ignores names, initializer values and model-level
fields (opsets, IR version, metadata); ``identical`` ignores nothing the diff reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from graphforge.diff.text import render_text

#: the JSON schema's version: bumped whenever a field changes meaning or goes away
SCHEMA_VERSION = 1
SCHEMA = "graphforge.diff"


def number(value: float | None) -> float | str | None:
    """A float as JSON allows it: NaN and infinities become strings."""
    if value is None:
        return None
    value = float(value)
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


@dataclass
class NodeRef:
    name: str
    op_type: str
    domain: str
    index: int

    @property
    def label(self) -> str:
        op = f"{self.domain}::{self.op_type}" if self.domain and self.domain != "ai.onnx" else self.op_type
        return f"{op} {self.name!r}" if self.name else f"{op} #{self.index}"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "op_type": self.op_type, "domain": self.domain, "index": self.index}


@dataclass
class AttributeChange:
    name: str
    a: Any  # None: absent on that side
    b: Any

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "a": self.a, "b": self.b}


@dataclass
class WiringChange:
    """An input slot that reads something else: each side as a description of its source."""

    slot: int
    a: dict[str, Any] | None
    b: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        return {"slot": self.slot, "a": self.a, "b": self.b}


@dataclass
class NodeChange:
    a: NodeRef
    b: NodeRef
    fields: list[str]  # of: op_type, attributes, inputs, outputs, subgraphs
    attributes: list[AttributeChange] = field(default_factory=list)
    inputs: list[WiringChange] = field(default_factory=list)
    outputs: tuple[int, int] | None = None  # output counts, when they differ
    subgraphs: list[str] = field(default_factory=list)  # paths of the subgraph diffs that differ

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a.to_json(),
            "b": self.b.to_json(),
            "fields": list(self.fields),
            "attributes": [c.to_json() for c in self.attributes],
            "inputs": [c.to_json() for c in self.inputs],
            "outputs": None if self.outputs is None else {"a": self.outputs[0], "b": self.outputs[1]},
            "subgraphs": list(self.subgraphs),
        }


@dataclass
class ValueChange:
    """A graph input or output added, removed, or changed (dtype, shape, or what produces it)."""

    status: str  # added, removed, changed
    a: dict[str, Any] | None
    b: dict[str, Any] | None
    fields: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "a": self.a, "b": self.b, "fields": list(self.fields)}


@dataclass
class ValueStats:
    """How two tensors of one shape differ: max |a - b|, max |a - b| / max(|a|, |b|), and
    how many elements differ (the maxima are None for non-numeric types: strings)."""

    max_abs: float | None
    max_rel: float | None
    differing: int
    elements: int

    def to_json(self) -> dict[str, Any]:
        return {
            "max_abs": number(self.max_abs),
            "max_rel": number(self.max_rel),
            "differing": self.differing,
            "elements": self.elements,
        }


@dataclass
class InitializerChange:
    status: str  # added, removed, changed
    a: dict[str, Any] | None
    b: dict[str, Any] | None
    fields: list[str]  # of: dtype, shape, values
    values: ValueStats | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "a": self.a,
            "b": self.b,
            "fields": list(self.fields),
            "values": None if self.values is None else self.values.to_json(),
        }


@dataclass
class NodeGroup:
    """Nodes that belong together across the two sides (an n:m match).

    kind "origin": nodes a pass generated for one node (named ``<role>::<origin>/...``,
    e.g. ``grad::`` for autodiff), with the node itself when it exists (``anchor_a``/``anchor_b``).
    kind "region": connected unmatched nodes replaced by others at the same place."""

    kind: str
    role: str | None
    origin: str | None
    a: list[NodeRef]
    b: list[NodeRef]
    anchor_a: NodeRef | None = None
    anchor_b: NodeRef | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "role": self.role,
            "origin": self.origin,
            "anchor": {
                "a": None if self.anchor_a is None else self.anchor_a.to_json(),
                "b": None if self.anchor_b is None else self.anchor_b.to_json(),
            },
            "a": [n.to_json() for n in self.a],
            "b": [n.to_json() for n in self.b],
        }


@dataclass
class Rename:
    kind: str  # node, input, output, initializer, tensor
    a: str
    b: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "a": self.a, "b": self.b}


@dataclass
class GraphDiff:
    """One graph level: the main graph, a subgraph (``path`` names where it sits) or a function body."""

    path: str
    a_name: str
    b_name: str
    matched: int
    nodes_a: int
    nodes_b: int
    inputs: list[ValueChange] = field(default_factory=list)
    outputs: list[ValueChange] = field(default_factory=list)
    initializers: list[InitializerChange] = field(default_factory=list)
    added: list[NodeRef] = field(default_factory=list)
    removed: list[NodeRef] = field(default_factory=list)
    changed: list[NodeChange] = field(default_factory=list)
    groups: list[NodeGroup] = field(default_factory=list)
    renamed: list[Rename] = field(default_factory=list)
    #: diffs of the subgraphs of matched nodes (If branches, Loop and Scan bodies)
    subgraphs: list[GraphDiff] = field(default_factory=list)
    #: for a subgraph: the node pair that owns it and the attribute
    owner: tuple[NodeRef, NodeRef, str] | None = None
    #: the match itself, kept for the HTML renderer and numeric mode (not serialized)
    node_pairs: dict[int, int] = field(default_factory=dict, repr=False)
    tensor_pairs: dict[str, str] = field(default_factory=dict, repr=False)
    views: tuple[Any, Any] | None = field(default=None, repr=False)

    @property
    def structurally_identical(self) -> bool:
        return not (
            self.added
            or self.removed
            or self.changed
            or self.inputs
            or self.outputs
            or any(c.status != "changed" or c.fields != ["values"] for c in self.initializers)
            or not all(g.structurally_identical for g in self.subgraphs)
        )

    @property
    def identical(self) -> bool:
        return (
            self.structurally_identical
            and not self.initializers
            and not self.renamed
            and self.a_name == self.b_name
            and all(g.identical for g in self.subgraphs)
        )

    def to_json(self) -> dict[str, Any]:
        owner = None
        if self.owner is not None:
            owner = {"a": self.owner[0].to_json(), "b": self.owner[1].to_json(), "attribute": self.owner[2]}
        return {
            "path": self.path,
            "owner": owner,
            "name": {"a": self.a_name, "b": self.b_name},
            "nodes": {"a": self.nodes_a, "b": self.nodes_b, "matched": self.matched},
            "structurally_identical": self.structurally_identical,
            "identical": self.identical,
            "inputs": [c.to_json() for c in self.inputs],
            "outputs": [c.to_json() for c in self.outputs],
            "initializers": [c.to_json() for c in self.initializers],
            "added": [n.to_json() for n in self.added],
            "removed": [n.to_json() for n in self.removed],
            "changed": [c.to_json() for c in self.changed],
            "groups": [g.to_json() for g in self.groups],
            "renamed": [r.to_json() for r in self.renamed],
            "subgraphs": [g.to_json() for g in self.subgraphs],
        }


@dataclass
class ModelField:
    """A model-level field that differs: ir_version, opset (per domain), producer_name,
    producer_version, domain, model_version, doc_string, graph_name, metadata (per key)."""

    field: str
    key: str | None
    a: Any
    b: Any

    def to_json(self) -> dict[str, Any]:
        return {"field": self.field, "key": self.key, "a": self.a, "b": self.b}


@dataclass
class FunctionDiff:
    domain: str
    name: str
    overload: str
    status: str  # added, removed, changed
    fields: list[str]  # of: inputs, outputs, attributes, opset_import, body
    graph: GraphDiff | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def structurally_identical(self) -> bool:
        return (
            self.status == "changed" and self.fields == [] and (self.graph is None or self.graph.structurally_identical)
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "domain": self.domain,
            "name": self.name,
            "overload": self.overload,
            "status": self.status,
            "fields": list(self.fields),
            "detail": self.detail,
            "graph": None if self.graph is None else self.graph.to_json(),
        }


@dataclass
class OpCount:
    op: str
    a: int
    b: int

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "a": self.a, "b": self.b, "delta": self.b - self.a}


@dataclass
class TensorNumeric:
    """One matched tensor pair as both models computed it on the same inputs."""

    a: str
    b: str
    node: NodeRef  # the A node that produces it
    status: str  # same, close, differs, shape, dtype, missing
    shape_a: list[int] | None = None
    shape_b: list[int] | None = None
    stats: ValueStats | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "node": self.node.to_json(),
            "status": self.status,
            "shape": {"a": self.shape_a, "b": self.shape_b},
            "stats": None if self.stats is None else self.stats.to_json(),
        }

    @property
    def diverges(self) -> bool:
        return self.status not in ("same", "close")


@dataclass
class NumericReport:
    inputs: dict[str, dict[str, Any]]  # A input name -> {"dtype", "shape", "generated"}
    seed: int
    rtol: float
    atol: float
    tensors: list[TensorNumeric]  # in A's topological order
    #: symbolic dim name -> the size generated inputs gave it
    dims: dict[str, int] = field(default_factory=dict)
    #: changes these inputs did not show (an initializer differs, no compared tensor does)
    warnings: list[str] = field(default_factory=list)

    @property
    def first_divergence(self) -> TensorNumeric | None:
        return next((t for t in self.tensors if t.diverges), None)

    def to_json(self) -> dict[str, Any]:
        first = self.first_divergence
        return {
            "inputs": self.inputs,
            "seed": self.seed,
            "dims": dict(self.dims),
            "rtol": self.rtol,
            "atol": self.atol,
            "compared": len(self.tensors),
            "diverging": sum(t.diverges for t in self.tensors),
            "first_divergence": None if first is None else first.to_json(),
            "warnings": list(self.warnings),
            "tensors": [t.to_json() for t in self.tensors],
        }


@dataclass
class ModelDiff:
    """The diff of two models. ``to_text()`` for people, ``to_json()`` for programs."""

    a_label: str
    b_label: str
    model: list[ModelField]
    graph: GraphDiff
    functions: list[FunctionDiff]
    histogram: list[OpCount]
    numeric: NumericReport | None = None
    #: "a"/"b" -> the ONNX checker's first problem with that model, None where it passes
    problems: dict[str, str | None] = field(default_factory=lambda: {"a": None, "b": None})

    @property
    def valid(self) -> bool:
        """Both models pass the ONNX checker (an invalid one is diffed only when allowed)."""
        return all(p is None for p in self.problems.values())

    @property
    def structurally_identical(self) -> bool:
        return self.graph.structurally_identical and all(f.structurally_identical for f in self.functions)

    @property
    def identical(self) -> bool:
        return (
            self.structurally_identical
            and self.graph.identical
            and not self.model
            and all(f.graph is None or f.graph.identical for f in self.functions)
        )

    def summary(self) -> dict[str, int]:
        """Counts over the main graph, its subgraphs and the function bodies."""
        counts = dict.fromkeys(
            (
                "nodes_added",
                "nodes_removed",
                "nodes_changed",
                "nodes_matched",
                "renamed",
                "inputs_changed",
                "outputs_changed",
                "initializers_changed",
                "functions_changed",
                "model_fields_changed",
            ),
            0,
        )
        for g in self.all_graphs():
            counts["nodes_added"] += len(g.added)
            counts["nodes_removed"] += len(g.removed)
            counts["nodes_changed"] += len(g.changed)
            counts["nodes_matched"] += g.matched
            counts["renamed"] += len(g.renamed)
            counts["inputs_changed"] += len(g.inputs)
            counts["outputs_changed"] += len(g.outputs)
            counts["initializers_changed"] += len(g.initializers)
        counts["functions_changed"] = sum(
            not (f.graph is not None and f.graph.identical and not f.fields) for f in self.functions
        )
        counts["model_fields_changed"] = len(self.model)
        return counts

    def all_graphs(self) -> list[GraphDiff]:
        """Every graph diff: the main graph, nested subgraphs (depth first), function bodies."""
        found: list[GraphDiff] = []
        stack = [self.graph, *[f.graph for f in reversed(self.functions) if f.graph is not None]]
        stack.reverse()
        while stack:
            g = stack.pop()
            found.append(g)
            stack.extend(reversed(g.subgraphs))
        return found

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "version": SCHEMA_VERSION,
            "a": self.a_label,
            "b": self.b_label,
            "identical": self.identical,
            "structurally_identical": self.structurally_identical,
            "valid": self.valid,
            "problems": dict(self.problems),
            "summary": self.summary(),
            "model": [f.to_json() for f in self.model],
            "histogram": [c.to_json() for c in self.histogram],
            "graph": self.graph.to_json(),
            "functions": [f.to_json() for f in self.functions],
            "numeric": None if self.numeric is None else self.numeric.to_json(),
        }

    def to_text(self, color: bool = False, *, brief: bool = False) -> str:
        return render_text(self, color=color, brief=brief)
