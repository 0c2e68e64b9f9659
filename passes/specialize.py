"""The specialize pass: a model at fixed dims, every value that depends only on shapes folded."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import onnx
import onnx_graphsurgeon as gs
from graphforge.passes.fold_constants import FoldConstants, may_fold

from graphforge.analysis.cost import parse_dims
from graphforge.analysis.host_sync import host_syncs, summary
from graphforge.errors import PassError
from graphforge.graph import Model
from graphforge.ir import fingerprint, gc_paused, recorded_json
from graphforge.pass_infra import Pass, PassResult
from graphforge.shapes import infer_shapes

#: metadata key: the dims a model was specialized to, JSON object name -> size
SPECIALIZED = "graphforge.specialized"
#: rounds of inference and folding: a fold makes shapes static that the next round folds
#: (a NonZero's axes, then the Shape of the ReduceSum over them); three suffice for every
#: program graphforge builds, the fourth is a margin
MAX_ROUNDS = 4
#: shape computations are small; a larger result (a [seq, seq] mask from a Range at a long
#: sequence, zeros of an activation's shape) stays a computation on the device: its shape
#: inputs are constants by then, so it does not sync with the host
FOLD_LIMIT_MB = 1.0
#: specializations kept per process (``specialized``), by the model's bytes and the dims: a
#: runner's profiled twin, a Module made again on the same program (a resume, an eval copy)
#: and a second runner over the same segments find theirs made (GPT-2 small's forward/backward
#: at 8 × 64: 3.7 s to make, 6 ms to find; what is kept has no weights, about 1 MiB each)
CACHED_SPECIALIZATIONS = 16
#: a model larger than this (one that holds its weights) is specialized each time, not kept
CACHED_MAX_BYTES = 64 * 2**20
_cache: OrderedDict[tuple[str, tuple[str, ...]], bytes] = OrderedDict()
_cache_lock = threading.Lock()


@dataclass(frozen=True)
class Specialize(Pass):
    """Bind the inputs' symbolic dims to sizes and fold what then depends only on shapes.

    1. Each graph input's dim named in ``dims`` ("batch=8") takes that size; a name no input
       has is an error (a misspelt dim would specialize nothing). The graph outputs' dims of
       those names do too; other symbolic dims stay.
    2. Every other tensor's shape is inferred again from the inputs (what was inferred for
       symbolic dims is dropped first, so no stale name survives).
    3. Values that depend only on shapes are folded into constants (``fold_constants``, up to
       FOLD_LIMIT_MB a value): Shape and Size, the Range, ConstantOfShape and Reshape targets
       exporters compute from them, and the Equal/Not/And/NonZero chains of a run-time
       unbroadcast. 2 and 3 repeat until nothing more folds (at most MAX_ROUNDS).
    4. The dims are recorded (``graphforge.specialized``), and the note names the nodes that
       still sync with the host (``graphforge.analysis.host_sync``; a transformer's program
       has none left).
    The model computes what it computed for inputs of those dims, in fewer nodes. This is the
    one pass that bakes symbolic dims, by request: the runner applies it to the sessions it
    makes for a batch's dims, and keeps the general model for others.
    """

    name = "specialize"
    dims: tuple[str, ...] = ()

    def run(self, model: Model) -> PassResult:
        with gc_paused():
            return self._run(model)

    def _run(self, model: Model) -> PassResult:
        sizes = parse_dims(self.dims)
        graph = model.graph
        named = {d for t in graph.inputs for d in (t.shape or ()) if isinstance(d, str)}
        unknown = sorted(set(sizes) - named)
        if unknown:
            raise PassError(
                f"dims {', '.join(unknown)}: no graph input has such a dim; the inputs' symbolic dims: "
                f"{', '.join(sorted(named)) or 'none'}"
            )
        before = fingerprint(graph)
        _bind(graph, sizes)
        fold = FoldConstants(size_limit_mb=FOLD_LIMIT_MB)
        for round_ in range(MAX_ROUNDS):
            model = infer_shapes(model, in_place=True)
            if round_ and not may_fold(model, FOLD_LIMIT_MB):  # what the last round's shapes left to fold
                break
            result = fold.run(model)
            model = result.model
            if not result.changed:
                break
        graph = model.graph
        recorded = {**recorded_json(model.metadata, SPECIALIZED, dict, {}), **sizes}
        if recorded:
            model.metadata[SPECIALIZED] = json.dumps(recorded, sort_keys=True)
        return PassResult(model, fingerprint(graph) != before or bool(sizes), summary(host_syncs(graph)))


def _bind(graph: gs.Graph, sizes: dict[str, int]) -> None:
    """Case 1 and the first half of case 2: the sizes on the inputs and outputs, every other
    tensor's shape forgotten where a dim of it is symbolic."""
    boundary = {id(t) for t in (*graph.inputs, *graph.outputs)}
    for tensor in graph.tensors().values():
        if not isinstance(tensor, gs.Variable) or tensor.shape is None:
            continue
        if id(tensor) in boundary:
            tensor.shape = [sizes.get(d, d) if isinstance(d, str) else d for d in tensor.shape]
        elif any(not isinstance(d, int) for d in tensor.shape):
            tensor.shape = None


def input_dims(proto: onnx.ModelProto) -> set[str]:
    """The names of ``proto``'s symbolic input dims: what ``specialize`` may bind."""
    return {
        d.dim_param
        for value in proto.graph.input
        if value.type.HasField("tensor_type")
        for d in value.type.tensor_type.shape.dim
        if d.dim_param
    }


def specialized(proto: onnx.ModelProto, dims: Mapping[str, int]) -> onnx.ModelProto:
    """``proto`` specialized to those of ``dims`` its inputs have (a batch's ``batch_dims`` may
    name more: a segment reads some of the inputs only); ``proto`` itself when none."""
    named = input_dims(proto)
    chosen = tuple(f"{name}={int(size)}" for name, size in sorted(dims.items()) if name in named)
    if not chosen:
        return proto
    if proto.ByteSize() > CACHED_MAX_BYTES:
        return Specialize(dims=chosen).run(Model.from_proto(proto)).model.to_proto()
    key = (hashlib.sha256(proto.SerializeToString(deterministic=True)).hexdigest(), chosen)
    with _cache_lock:
        made = _cache.get(key)
        if made is not None:
            _cache.move_to_end(key)
    if made is None:
        own = onnx.ModelProto()
        own.CopyFrom(proto)  # the import renames constants' tensors in the proto it reads: not the caller's
        made = Specialize(dims=chosen).run(Model.from_proto(own)).model.to_proto().SerializeToString()
        with _cache_lock:
            _cache[key] = made
            while len(_cache) > CACHED_SPECIALIZATIONS:
                _cache.popitem(last=False)
    result = onnx.ModelProto()
    result.ParseFromString(made)  # the caller's own copy
    return result
