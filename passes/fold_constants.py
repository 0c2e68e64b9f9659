"""Constant folding: evaluate nodes whose inputs are all known, with onnxruntime."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from graphforge.graph import Model, runtime_limits
from graphforge.ir import NONDETERMINISTIC_OPS, all_graphs, fingerprint, is_parameter
from graphforge.pipeline import Pass, PassResult


@dataclass(frozen=True)
class FoldConstants(Pass):
    """Replace nodes computable ahead of time by their values (onnx-graphsurgeon's folder,
    evaluated on onnxruntime).

    1. A node whose inputs are all constants (Constant nodes, non-parameter initializers,
       results of folded nodes) becomes a constant, and its dead producers go away.
    2. ``Shape`` of a tensor whose shape is fully static folds; symbolic dims never do,
       so dynamic batch and sequence dims stay dynamic.
    3. Floating-point initializers are parameters and are *not* folded into derived
       constants (folding ``Transpose(W)`` would make ``W`` vanish from training); set
       ``fold_parameters=true`` for an inference-only model.
    4. Results larger than ``size_limit_mb`` are left as computations, so folding never
       bloats the file.
    5. Random ops are never folded.
    6. Like ``dce``, it then removes every node no graph output needs (the producers
       folding left dead, and any that were dead already).
    """

    name = "fold_constants"
    fold_parameters: bool = False
    size_limit_mb: float = 16.0

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        before = fingerprint(graph)
        hidden = [] if self.fold_parameters else _hide_parameters(graph)
        saved_ir = graph.ir_version
        # gs evaluates with onnxruntime, which refuses files stamped with a newer IR version.
        if graph.ir_version is not None:
            graph.ir_version = min(graph.ir_version, runtime_limits()[0])
        level = gs.logger.G_LOGGER.severity
        gs.logger.G_LOGGER.severity = gs.logger.G_LOGGER.ERROR
        try:
            graph.fold_constants(
                size_threshold=int(self.size_limit_mb * 2**20),
                should_exclude_node=lambda node: node.op in NONDETERMINISTIC_OPS,
                error_ok=True,
            )
            graph.cleanup()
        finally:
            gs.logger.G_LOGGER.severity = level
            graph.ir_version = saved_ir
            for tensor, values in hidden:
                tensor.to_constant(values)
        return PassResult(model, fingerprint(graph) != before)


def _hide_parameters(graph: gs.Graph) -> list[tuple[gs.Tensor, np.ndarray]]:
    """Turn parameter initializers into variables for the duration of folding."""
    hidden = []
    seen: set[int] = set()
    for g in all_graphs(graph):
        for tensor in g.tensors().values():
            if id(tensor) in seen or not is_parameter(tensor):
                continue
            seen.add(id(tensor))
            values = tensor.values
            hidden.append((tensor, values))
            tensor.to_variable(dtype=values.dtype, shape=list(values.shape))
    return hidden
