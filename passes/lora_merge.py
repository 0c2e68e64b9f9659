"""The lora_merge pass: a forward model's low-rank adapters folded into their base weights, as PEFT's merge_and_unload."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes  # onnx's own dependency: the types NumPy lacks (bfloat16)
import numpy as np
import onnx
import onnx_graphsurgeon as gs
from graphforge.passes.dce import DeadCodeElimination
from onnx import numpy_helper

from graphforge import roles
from graphforge.errors import PassError
from graphforge.graph import Model
from graphforge.ir import onnx_dtype
from graphforge.pass_infra import Fact, Pass, PassResult
from graphforge.program import LoraAdapter, ProgramRoles
from graphforge.stand_ins import store_values


@dataclass(frozen=True)
class LoraMerge(Pass):
    """Fold the lora pass's adapters into the weights they adapt: the plain model again.

    1. Each adapter's sums (the ``lora::<module>/Add`` nodes adding ``scale · (x Aᵀ) Bᵀ`` to its
       layers' products) go: each layer writes its product under the sum's name again, and
       the adapter's nodes, A and B go with nothing left to read them.
    2. The base weight W becomes W + scale · B A in its own layout: [out, in] as torch's
       Linear, its transpose (W + scale · (B A)ᵀ) where it is stored [in, out]
       (``fan_in_fan_out``). Computed in float64 and stored in W's type (float32, float16,
       bfloat16), so it equals PEFT's ``merge_and_unload`` within W's rounding.
    3. The roles: ``graphforge.lora`` goes, and so do the frozen roles the lora pass wrote.
    A weight read by a node other than its adapter's layers (a tied embedding), or a base
    that is no floating-point initializer, is refused naming the module, before anything
    changes. It works on forward models (after ``lora``, before the loss), and is what
    ``graphforge export`` runs on a pruned LoRA program unless it keeps the adapters apart.
    """

    name = "lora_merge"
    refuses = (Fact.GRADIENTS,)

    def run(self, model: Model) -> PassResult:
        adapters = ProgramRoles.of_model(model).lora
        if not adapters:
            return PassResult(model, False, "no adapters")
        graph = model.graph
        plans = [_plan(graph, a) for a in adapters]  # every check before any change
        for weight, sums, merged in plans:
            for add in sums:
                layer = add.inputs[0].inputs[0]
                layer.outputs[0] = add.outputs[0]
                add.outputs.clear()
            _store(weight, merged)
        DeadCodeElimination().run(model)
        del model.metadata[roles.LORA]
        frozen = {n: e for n, e in roles.get_json(model, roles.FROZEN, {}).items() if e.get("by") != "lora"}
        if frozen:
            roles.set_json(model, roles.FROZEN, frozen)
        else:
            model.metadata.pop(roles.FROZEN, None)
        return PassResult(model, True, f"{len(adapters)} adapters merged")


def _plan(graph: gs.Graph, adapter: LoraAdapter) -> tuple[gs.Constant, list[gs.Node], np.ndarray]:
    """Case 1 and 2 for one adapter, checked: its base weight, its sums, the merged weight."""
    tensors = graph.tensors()
    prefix = f"{roles.LORA_PREFIX}{adapter.module}/"
    sums = [n for n in graph.nodes if n.op == "Add" and (n.name or "").startswith(prefix) and _sum_of_layer(n)]
    weight, a, b = (tensors.get(name) for name in (adapter.weight, adapter.a, adapter.b))
    if not sums or not all(isinstance(t, gs.Constant) for t in (weight, a, b)):
        raise PassError(
            f"cannot merge the adapter of {adapter.module!r}: its base weight {adapter.weight!r}, A, B and sums are "
            "not all in the model as the lora pass wrote them (a quantized base keeps its adapters apart: "
            "export them with --adapters onnx or peft)"
        )
    layers = {id(add.inputs[0].inputs[0]) for add in sums}
    readers = [n for n in weight.outputs if id(n) not in layers and not _feeds_only(n, layers)]
    if readers:
        raise PassError(
            f"cannot merge the adapter of {adapter.module!r}: its base weight {adapter.weight!r} is also read by "
            f"{readers[0].op} {readers[0].name!r}, which merging would change too; keep the adapters apart "
            "(--adapters onnx or peft)"
        )
    delta = adapter.scale * (_float64(b) @ _float64(a))
    merged = _float64(weight) + (delta.T if adapter.fan_in_fan_out else delta)
    if merged.shape != tuple(weight.shape):
        raise PassError(f"cannot merge the adapter of {adapter.module!r}: B A is {list(delta.shape)}, "
                        f"its base weight {list(weight.shape)}")  # fmt: skip
    return weight, sums, merged


def _sum_of_layer(add: gs.Node) -> bool:
    base = add.inputs[0] if add.inputs else None
    return isinstance(base, gs.Variable) and len(base.inputs) == 1 and base.inputs[0].op in ("MatMul", "Gemm")


def _feeds_only(node: gs.Node, layers: set[int]) -> bool:
    """A Transpose of the weight (torch's Linear unfolded) read by the adapter's layers alone."""
    return node.op == "Transpose" and all(id(r) in layers for out in node.outputs for r in out.outputs)


def _float64(constant: gs.Constant) -> np.ndarray:
    return np.asarray(constant.values, dtype=np.float64)  # onnx-graphsurgeon reads bfloat16 as float32


def _store(weight: gs.Constant, merged: np.ndarray) -> None:
    code = onnx_dtype(weight.dtype)
    if code == onnx.TensorProto.BFLOAT16:
        store_values(weight, numpy_helper.from_array(merged.astype(np.float32).astype(ml_dtypes.bfloat16), weight.name))
    else:
        weight.values = merged.astype(onnx.helper.tensor_dtype_to_np_dtype(code))
    weight.data_location = None
