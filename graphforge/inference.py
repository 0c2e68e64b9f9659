"""Inference models cut from a training program: the evaluation step a runtime runs, and the exported model.

Both are the ``prune`` pass (passes/prune.py) with the right options; the program is
never modified.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from graphforge import roles
from graphforge.errors import GraphforgeError
from graphforge.graph import Model, ModelSource, load
from graphforge.ir import onnx_dtype
from graphforge.verify import verify_model

#: name prefixes of the nodes the training passes add (loss, autodiff, optimizers)
TRAINING_NODE_PREFIXES = ("loss::", "grad::", "optim::")


def forward_outputs(program: ModelSource | Model) -> list[str]:
    """The program's outputs the forward model computes: not the loss, the gradients, the
    updated states or grad_norm (the outputs of the loss, autodiff and optimizer nodes)."""
    model = _as_model(program)
    producers = {id(t): node for node in model.graph.nodes for t in node.outputs}
    return [
        t.name
        for t in model.graph.outputs
        if id(t) not in producers or not producers[id(t)].name.startswith(TRAINING_NODE_PREFIXES)
    ]


def eval_model(program: ModelSource | Model, outputs: Sequence[str] | None = None) -> onnx.ModelProto:
    """The evaluation step of a training program: ``outputs`` (default: the forward
    outputs) and the loss, with Dropout off and BatchNorm on its running statistics.

    The labels input stays, and every parameter and buffer stays an overridable graph
    input of the same name (an initializer holding the program's value), so a runtime
    can bind the current training values without copying them into the model.
    """
    from graphforge.passes.prune import Prune

    model = _as_model(program)
    wanted = list(forward_outputs(model) if outputs is None else outputs)
    output_names = {t.name for t in model.graph.outputs}
    loss = model.metadata.get(roles.LOSS)
    if loss in output_names and loss not in wanted:
        wanted.append(loss)
    labels = model.metadata.get(roles.LABELS)
    keep = [labels] if labels in {t.name for t in model.graph.inputs} else []
    return _pruned(model, Prune(outputs=tuple(wanted), keep_inputs=tuple(keep), parameters_as_inputs=True))


def export_inference_model(
    program: ModelSource | Model,
    values: Mapping[str, np.ndarray] | None = None,
    outputs: Sequence[str] | None = None,
) -> onnx.ModelProto:
    """A plain ONNX inference model: ``outputs`` (default: the forward outputs) with
    Dropout off and BatchNorm on its running statistics, holding ``values`` as its
    parameters and buffers (None: the program's own values).

    ``values`` maps initializer names to arrays of the same shape and type; values for
    optimizer states, accumulators or the step (a runtime's whole state) are ignored, as
    an inference model has no place for them. Any other name is an error.
    """
    from graphforge.passes.prune import Prune

    model = _as_model(program)
    wanted = forward_outputs(model) if outputs is None else list(outputs)
    if values:
        _set_values(model, values)
    return _pruned(model, Prune(outputs=tuple(wanted)))


def _as_model(program: ModelSource | Model) -> Model:
    """A Model the caller's program does not share mutable state with."""
    if isinstance(program, Model):
        return program.copy()
    if isinstance(program, onnx.ModelProto):
        return Model.from_proto(program)  # onnx-graphsurgeon reads the proto, never writes it
    return Model.from_proto(load(program))


def _pruned(model: Model, prune) -> onnx.ModelProto:
    try:
        result = prune.run(model)
    except ValueError as exc:  # the pass's own parameter check
        raise GraphforgeError(f"prune: {exc}") from None
    proto = result.model.to_proto()
    verify_model(proto, where="the inference model")
    return proto


def _set_values(model: Model, values: Mapping[str, np.ndarray]) -> None:
    """Put ``values`` into the initializers of the same names, after checking them all."""
    tensors = model.graph.tensors()
    state = {spec["input"] for spec in roles.get_json(model, roles.STATE, []) if spec.get("init") != "initializer"}
    state |= {model.metadata[key] for key in (roles.STEP, roles.LR, roles.RESET_GRAD) if key in model.metadata}
    updates: list[tuple[gs.Constant, np.ndarray]] = []
    for name, value in values.items():
        tensor = tensors.get(name)
        if not isinstance(tensor, gs.Constant):
            if name in state:
                continue
            known = ", ".join(n for n, t in tensors.items() if isinstance(t, gs.Constant) and onnx_dtype(t.dtype))
            raise GraphforgeError(f"values: the program has no initializer {name!r}; its initializers are: {known}")
        array = np.asarray(value)
        if tuple(array.shape) != tuple(tensor.shape) or onnx_dtype(array.dtype) != onnx_dtype(tensor.dtype):
            raise GraphforgeError(
                f"values: {name!r} is {array.dtype}{list(array.shape)}, the program's initializer is "
                f"{_dtype_name(tensor.dtype)}{list(tensor.shape)}"
            )
        updates.append((tensor, array))
    for tensor, array in updates:
        tensor.values = array


def _dtype_name(dtype) -> str:
    code = onnx_dtype(dtype)
    return onnx.TensorProto.DataType.Name(code).lower() if code is not None else "?"
