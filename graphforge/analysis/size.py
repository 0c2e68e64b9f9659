"""Sizes: bytes of a tensor from its shape and type, what a model holds, and bytes for people."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs
from onnx import helper

from graphforge.graph import Model
from graphforge.ir import every_graph, onnx_dtype


def nbytes(shape, dtype) -> int | None:
    """Bytes of a tensor of ``shape`` (static dims) and ``dtype`` (NumPy or ONNX enum), without
    reading any values; None when a dim is dynamic or the type's size is unknown."""
    if shape is None or not all(isinstance(d, int | np.integer) and d >= 0 for d in shape):
        return None
    code = onnx_dtype(dtype)
    if code is None:
        return None
    try:
        itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(code)).itemsize
    except (KeyError, TypeError, ValueError):
        return None
    return math.prod(int(d) for d in shape) * itemsize


def human_bytes(size: float) -> str:
    """``1536`` → ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


@dataclass(frozen=True)
class ModelSize:
    """What a model holds: nodes (subgraphs and functions included), graph inputs
    (overridable initializers included), outputs, and bytes of stored tensors
    (initializers and Constant node values)."""

    nodes: int
    inputs: int
    outputs: int
    tensor_bytes: int

    @classmethod
    def of(cls, model: Model) -> ModelSize:
        graph = model.graph
        constants: dict[int, gs.Constant] = {}
        nodes = 0
        for g in every_graph(graph):
            nodes += len(g.nodes)
            for node in g.nodes:
                value = node.attrs.get("value") if node.op == "Constant" else None
                for t in [*node.inputs, *([value] if isinstance(value, gs.Constant) else [])]:
                    if isinstance(t, gs.Constant):
                        constants[id(t)] = t
        inputs = len(graph.inputs) + len(model.initializer_inputs)
        stored = sum(nbytes(t.shape or (), t.dtype) or 0 for t in constants.values())
        return cls(nodes, inputs, len(graph.outputs), stored)

    def compared_with(self, before: ModelSize) -> str:
        """One line: each count before → after, and the stored bytes saved."""
        saved = before.tensor_bytes - self.tensor_bytes
        share = f" ({saved / before.tensor_bytes:.0%} less)" if before.tensor_bytes and saved > 0 else ""
        return (
            f"nodes {before.nodes} → {self.nodes}, inputs {before.inputs} → {self.inputs}, "
            f"outputs {before.outputs} → {self.outputs}, stored tensors "
            f"{human_bytes(before.tensor_bytes)} → {human_bytes(self.tensor_bytes)}{share}"
        )
