"""Which nodes of a model make a GPU session wait for the host: what keeps a step from being
one stream of kernels (and from capture as a CUDA graph).

A node syncs with the host when

1. its output's shape depends on its input's values (NonZero, Unique, Compress, ...): the
   kernel's result is copied to the host to size the output before anything after it runs;
2. it reads, at an input the provider reads on the host (a Reshape's shape, a ReduceSum's
   axes, a Slice's bounds, a ConstantOfShape's shape, ...), a value computed at run time:
   that value is copied to the host first (onnxruntime inserts a MemcpyToHost);
3. it is control flow (If's condition, Loop's trip count and condition are read on the host);
4. it is a ``Shape`` or ``Size`` left at run time: onnxruntime computes it on the host, where
   its output lives, and so is shape arithmetic whose every computed input is such a value;
5. it reads a value case 4 computed on the host at any input: the value is copied to the
   device first (a copy of a host value a CUDA graph cannot replay), or the node runs on the host.

A value is known ahead of time when it is an initializer or a Constant node's output;
``specialize`` folds the shape computations of a program at fixed dims into such constants,
after which a transformer's step should have none of these nodes. The input slots are those
onnxruntime's CUDA provider declares as CPU inputs for the standard ops (and the CPU provider
reads anyway), listed here by op: a static table, as kernel registrations cannot be queried
from Python.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import onnx_graphsurgeon as gs

from graphforge.constants import is_constant

#: ops whose output shape depends on their inputs' values
DATA_DEPENDENT = frozenset({"NonZero", "Unique", "Compress", "NonMaxSuppression", "StringSplit", "RegexFullMatch"})
#: control flow: its condition or trip count is read on the host
CONTROL_FLOW = frozenset({"If", "Loop"})
#: op -> the input slots read on the host (shapes, axes, bounds, counts)
HOST_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,),
    "Expand": (1,),
    "Tile": (1,),
    "ConstantOfShape": (0,),
    "Range": (0, 1, 2),
    "Slice": (1, 2, 3, 4),
    "Squeeze": (1,),
    "Unsqueeze": (1,),
    "Split": (1,),
    "Pad": (1, 2, 3),
    "TopK": (1,),
    "OneHot": (1,),
    "Resize": (1, 2, 3),
    "Upsample": (1,),
    "CumSum": (1,),
    "Trilu": (1,),
    "ReduceSum": (1,),
    "ReduceMean": (1,),
    "ReduceMax": (1,),
    "ReduceMin": (1,),
    "ReduceProd": (1,),
    "ReduceL1": (1,),
    "ReduceL2": (1,),
    "ReduceLogSum": (1,),
    "ReduceLogSumExp": (1,),
    "ReduceSumSquare": (1,),
    "CenterCropPad": (1,),
    "Col2Im": (1, 2),
}


@dataclass(frozen=True)
class HostSync:
    """One node that syncs with the host, and why (one of the module docstring's cases)."""

    node: str
    op: str
    reason: str

    def describe(self) -> str:
        return f"{self.op} {self.node!r}: {self.reason}"


#: ops onnxruntime computes on the host: their output is a shape, read from the input's metadata
ON_HOST = frozenset({"Shape", "Size"})


def host_syncs(graph: gs.Graph) -> list[HostSync]:
    """The nodes of ``graph`` (main graph; a node with subgraphs counts as one) that sync with
    the host, in graph order (a topological one: what case 4 computes on the host is known
    before its readers are met)."""
    found = []
    on_host: set[int] = set()  # ids of the tensors case 4 computes on the host
    for node in graph.nodes:
        reason = _reason(node, on_host)
        if reason is not None:
            found.append(HostSync(node.name or "", node.op, reason))
    return found


def _reason(node: gs.Node, on_host: set[int]) -> str | None:
    if node.domain not in (None, "", "ai.onnx"):
        return None
    if node.op in ON_HOST:
        on_host.update(id(t) for t in node.outputs)
        return "a shape computed on the host at run time"
    host_slots = HOST_INPUTS.get(node.op, ())
    # the inputs a kernel reads on the device; a shape op's result stays on the host when all
    # of these are host values (a Gather of a Shape, a Concat of dims): ConstantOfShape and
    # Range, which read shapes only, write theirs on the device
    data = [t for i, t in enumerate(node.inputs) if i not in host_slots and not t.is_empty() and not _known(t)]
    from_host = [t.name for t in data if id(t) in on_host]
    if data and len(from_host) == len(data) and node.op not in DATA_DEPENDENT | CONTROL_FLOW:
        on_host.update(id(t) for t in node.outputs)
        return f"shape arithmetic on the host, over {', '.join(from_host)}"
    if from_host:
        return f"reads {', '.join(from_host)}, computed on the host"
    if node.op in DATA_DEPENDENT:
        return "its output's shape depends on its input's values"
    if node.op in CONTROL_FLOW:
        return "control flow: its condition is read on the host"
    computed = [
        node.inputs[i].name
        for i in host_slots
        if i < len(node.inputs) and not node.inputs[i].is_empty() and not _known(node.inputs[i])
    ]
    if computed:
        return f"reads {', '.join(computed)} on the host, computed at run time"
    return None


def _known(tensor: gs.Tensor) -> bool:
    """Whether ``tensor``'s value is known ahead of time: an initializer or a Constant's output."""
    return is_constant(tensor)


def summary(syncs: Iterable[HostSync], limit: int = 5) -> str:
    """``3 nodes sync with the host: NonZero 'a': ...; ...``, or that none does."""
    syncs = list(syncs)
    if not syncs:
        return "no node syncs with the host"
    shown = "; ".join(s.describe() for s in syncs[:limit])
    more = f"; and {len(syncs) - limit} more" if len(syncs) > limit else ""
    return f"{len(syncs)} node(s) sync with the host: {shown}{more}"
