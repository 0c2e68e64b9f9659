"""Numeric mode: run both models on the same inputs and compare every matched tensor.

Each model gets every node output the match pairs as an extra graph output; onnxruntime
runs them with graph optimizations off (a fused kernel would hide the tensors, and the
values must be the ones the graph describes). The pairs are compared in A's topological
order, so the first pair beyond tolerance is the place where the two models part ways.
Only main-graph tensors are exposed: what a subgraph (If branch, Loop or Scan body) or a
function body computes inside shows only through the node that holds it.

Agreement holds only at the inputs used: when initializers differ and no compared tensor
does, the report says so (``warnings``) rather than let "all tensors agree" stand alone.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from graphforge.diff.result import GraphDiff, ModelDiff, NodeRef, NumericReport, TensorNumeric
from graphforge.diff.source import Side
from graphforge.diff.stats import value_stats
from graphforge.diff.view import GraphView, Value
from graphforge.errors import GraphforgeError, one_line
from graphforge.runtime import create_session
from graphforge.runtime.sessions import session_options

#: the size given to a symbolic or unknown dimension of a generated input (``--dim NAME=N``
#: sets one): large enough that a batch or a sequence is not one or two elements a ReLU may
#: zero out, small enough for GPT-2's attention at every layer
DEFAULT_DIM = 8
#: integer inputs are drawn from [0, this) unless they index an initializer (then its size)
DEFAULT_INT_HIGH = 2
#: ops whose input at the given slot indexes the data at slot 0 along ``axis``
_INDEX_INPUTS = {"Gather": 1, "GatherElements": 1}


def numeric_report(
    side_a: Side,
    side_b: Side,
    diff: ModelDiff,
    *,
    inputs: Mapping[str, np.ndarray] | str | os.PathLike | None,
    seed: int,
    rtol: float,
    atol: float,
    dims: Mapping[str, int] | None = None,
) -> NumericReport:
    graph = diff.graph
    assert graph.views is not None
    va, vb = graph.views
    given = load_inputs(inputs)
    unknown = sorted(set(given) - {v.name for v in (*va.inputs, *vb.inputs)})
    if unknown:
        names = ", ".join(v.name for v in va.inputs) or "none"
        raise GraphforgeError(
            f"numeric inputs name {', '.join(map(repr, unknown))}, which neither model reads (A's inputs: {names})"
        )
    sizes = dim_sizes(va, vb, dims or {})
    rng = np.random.default_rng(seed)
    feeds_a: dict[str, np.ndarray] = {}
    described: dict[str, dict[str, Any]] = {}
    for v in va.inputs:
        feeds_a[v.name] = given[v.name] if v.name in given else generate_input(v, va, rng, sizes)
        described[v.name] = {
            "dtype": str(feeds_a[v.name].dtype),
            "shape": list(feeds_a[v.name].shape),
            "generated": v.name not in given,
        }
    paired = {vb.inputs[k].name: va.inputs[a].name for a, k in _input_pairs(graph).items()}
    feeds_b: dict[str, np.ndarray] = {}
    for v in vb.inputs:
        if v.name in given:
            feeds_b[v.name] = given[v.name]
        elif v.name in paired:
            feeds_b[v.name] = feeds_a[paired[v.name]]
        else:
            feeds_b[v.name] = generate_input(v, vb, rng, sizes)
    pairs = _tensor_pairs(graph, va, vb)
    values_a = _run(side_a, [a for a, _, _ in pairs], feeds_a, "A")
    values_b = _run(side_b, [b for _, b, _ in pairs], feeds_b, "B")
    tensors = [
        compare_tensor(ta, tb, node, values_a.get(ta), values_b.get(tb), rtol=rtol, atol=atol) for ta, tb, node in pairs
    ]
    report = NumericReport(described, seed, rtol, atol, tensors, dims=sizes)
    report.warnings = unseen_changes(diff, report)
    return report


def dim_sizes(va: GraphView, vb: GraphView, dims: Mapping[str, int]) -> dict[str, int]:
    """Symbolic dim name -> the size generated inputs give it: ``dims`` where named, else
    DEFAULT_DIM. A name no input of either model uses is refused (a typo would go unnoticed)."""
    symbolic: dict[str, None] = {}
    for v in (*va.inputs, *vb.inputs):
        for d in v.shape or ():
            if isinstance(d, str):
                symbolic.setdefault(d, None)
    unknown = [name for name in dims if name not in symbolic]
    if unknown:
        known = ", ".join(symbolic) or "none"
        raise GraphforgeError(
            f"--dim {unknown[0]}: no input of either model has a dimension named {unknown[0]!r} "
            f"(symbolic dimensions: {known})"
        )
    bad = [f"{name}={size}" for name, size in dims.items() if not isinstance(size, int) or size < 1]
    if bad:
        raise GraphforgeError(f"--dim {bad[0]}: a dimension's size must be a whole number of at least 1")
    return {name: int(dims.get(name, DEFAULT_DIM)) for name in symbolic}


def unseen_changes(diff: ModelDiff, report: NumericReport) -> list[str]:
    """Changes the inputs never showed: initializers whose values differ while no compared
    tensor does (a weight masked by a ReLU at these inputs, or read by a branch not taken)."""
    if report.first_divergence is not None:
        return []
    return [
        f"initializer {c.a['name']!r} differs but no compared tensor does at these inputs; try other --seed/--inputs"
        for g in diff.all_graphs()
        for c in g.initializers
        if c.status == "changed" and c.a is not None
    ]


def load_inputs(inputs: Mapping[str, np.ndarray] | str | os.PathLike | None) -> dict[str, np.ndarray]:
    if inputs is None:
        return {}
    if isinstance(inputs, Mapping):
        return {name: np.asarray(value) for name, value in inputs.items()}
    path = Path(inputs)
    expected = "expected an .npz of input name -> array, as numpy.savez writes"
    if not path.is_file():
        raise GraphforgeError(f"{path}: no such inputs file ({expected})")
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
    except OSError as exc:
        raise GraphforgeError(f"{path}: cannot read inputs ({exc.strerror or exc})") from None
    if magic == b"\x93NUMPY":
        raise GraphforgeError(f"{path}: a single .npy array has no input name; {expected}")
    if not magic.startswith(b"PK"):
        raise GraphforgeError(f"{path}: not an .npz file (no zip header); {expected}")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise GraphforgeError(f"{path}: cannot read inputs ({one_line(exc)}); {expected}") from None


def generate_input(
    value: Value, view: GraphView, rng: np.random.Generator, sizes: Mapping[str, int] | None = None
) -> np.ndarray:
    """Random data for a declared input: a symbolic dim gets its size from ``sizes`` (else
    DEFAULT_DIM), an unknown one DEFAULT_DIM; floats are standard normal, integers stay below
    the size of what they index (Gather), booleans are fair coins."""
    if value.shape is None or not value.dtype or value.dtype.startswith(("sequence", "map", "optional", "sparse")):
        raise GraphforgeError(
            f"numeric: cannot generate input {value.name!r} (type {value.dtype or 'unknown'}, shape "
            f"{'unknown' if value.shape is None else list(value.shape)}); pass it with --inputs FILE.npz"
        )
    sizes = sizes or {}
    shape = [d if isinstance(d, int) else sizes.get(d, DEFAULT_DIM) if d else DEFAULT_DIM for d in value.shape]
    dtype = onnx.helper.tensor_dtype_to_np_dtype(onnx.TensorProto.DataType.Value(value.dtype.upper()))
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, _int_high(value.name, view), shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _int_high(name: str, view: GraphView) -> int:
    highs = []
    for c, slot in view.consumers.get(name, ()):
        node = view.nodes[c]
        if _INDEX_INPUTS.get(node.op) != slot or not node.inputs:
            continue
        data = view.initializers.get(node.inputs[0])
        axis = node.attrs.get("axis", 0)
        if data is not None and isinstance(axis, int) and -len(data.shape) <= axis < len(data.shape):
            highs.append(data.shape[axis])
    return max(1, min(highs)) if highs else DEFAULT_INT_HIGH


def _input_pairs(graph: GraphDiff) -> dict[int, int]:
    va, vb = graph.views  # type: ignore[misc]
    names = {v.name: v.position for v in vb.inputs}
    return {v.position: names[graph.tensor_pairs[v.name]] for v in va.inputs if graph.tensor_pairs.get(v.name) in names}


def _tensor_pairs(graph: GraphDiff, va: GraphView, vb: GraphView) -> list[tuple[str, str, NodeRef]]:
    """(A tensor, B tensor, A producer) for every output of every matched node, in A's order."""
    found = []
    seen: set[str] = set()
    for a in va.order:
        b = graph.node_pairs.get(a)
        if b is None:
            continue
        node = va.nodes[a]
        for ta, tb in zip(node.outputs, vb.nodes[b].outputs, strict=False):
            if ta and tb and ta not in seen:
                seen.add(ta)
                found.append((ta, tb, NodeRef(node.name, node.op, node.domain, node.index)))
    return found


def _run(side: Side, names: list[str], feeds: dict[str, np.ndarray], which: str) -> dict[str, Any]:
    model = onnx.ModelProto()
    model.CopyFrom(side.full_proto())
    present = {o.name for o in model.graph.output}
    for name in names:
        if name not in present:
            model.graph.output.append(onnx.ValueInfoProto(name=name))
            present.add(name)
    options = session_options()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = create_session(model, options=options, where=f"model {which} ({side.label})")
    wanted = [o.name for o in session.get_outputs()]
    try:
        results = session.run(wanted, {name: feeds[name] for name in (i.name for i in session.get_inputs())})
    except Exception as exc:  # onnxruntime's run errors are plain RuntimeErrors
        raise GraphforgeError(
            f"numeric: onnxruntime failed to run model {which} ({side.label}): {one_line(exc)}"
        ) from None
    return dict(zip(wanted, results, strict=True))


def compare_tensor(ta: str, tb: str, node: NodeRef, x: Any, y: Any, *, rtol: float, atol: float) -> TensorNumeric:
    if not isinstance(x, np.ndarray) or not isinstance(y, np.ndarray):
        return TensorNumeric(ta, tb, node, "missing")
    shapes = (list(x.shape), list(y.shape))
    if x.shape != y.shape:
        return TensorNumeric(ta, tb, node, "shape", *shapes)
    numeric = x.dtype.kind in "biufc" and y.dtype.kind in "biufc"
    if not numeric and x.dtype != y.dtype:
        return TensorNumeric(ta, tb, node, "dtype", *shapes)
    stats = value_stats(x, y)
    if stats.differing == 0:
        status = "same"
    elif numeric and np.allclose(y.astype(np.float64), x.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True):
        status = "close"
    else:
        status = "differs"
    return TensorNumeric(ta, tb, node, status, *shapes, stats)
