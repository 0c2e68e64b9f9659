"""Inference models cut from a training program: the evaluation step a runtime runs, and the exported model.

Both are the ``prune`` pass (passes/prune.py) with the right options; the program is
never modified.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from graphforge.errors import GraphforgeError
from graphforge.graph import Model, names_kept
from graphforge.ir import onnx_dtype
from graphforge.model_io import ModelSource, load
from graphforge.passes.lora_merge import LoraMerge
from graphforge.passes.prune import Prune
from graphforge.program import ProgramRoles
from graphforge.verify import verify_model


def eval_model(
    program: ModelSource | Model,
    outputs: Sequence[str] | None = None,
    *,
    verify: bool = True,
    keep_markers: bool = False,
) -> onnx.ModelProto:
    """The evaluation step of a training program: ``outputs`` (default: the forward
    outputs) and the loss, with Dropout off and BatchNorm on its running statistics.

    The labels input stays, and every parameter and buffer stays an overridable graph
    input of the same name (an initializer holding the program's value), so a runtime
    can bind the current training values without copying them into the model.
    ``verify=False``: no check of the result, for a runtime that binds values the program
    leaves out (``stand_ins.without_values``): onnxruntime checks the model it loads.
    ``keep_markers``: graphforge's marker calls stay (prune's option), for a runtime that
    runs the collectives they stand for.
    """
    with _read(program) as model:
        program_roles = ProgramRoles.of_model(model)
        wanted = list(program_roles.forward_outputs if outputs is None else outputs)
        loss = program_roles.loss
        if loss is not None and loss not in wanted:
            wanted.append(loss)
        labels = program_roles.labels
        keep = [labels] if labels in {t.name for t in model.graph.inputs} else []
        prune = Prune(
            outputs=tuple(wanted), keep_inputs=tuple(keep), parameters_as_inputs=True, keep_markers=keep_markers
        )
        return _pruned(model, prune, verify=verify)


def export_inference_model(
    program: ModelSource | Model,
    values: Mapping[str, np.ndarray] | None = None,
    outputs: Sequence[str] | None = None,
    *,
    dtype: str = "float32",
    merge_adapters: bool = True,
) -> onnx.ModelProto:
    """A plain ONNX inference model: ``outputs`` (default: the forward outputs) with
    Dropout off and BatchNorm on its running statistics, holding ``values`` as its
    parameters and buffers (None: the program's own values). ``dtype`` "float16" or
    "bfloat16": computing in that type where mixed_precision would, weights stored in it
    (prune's ``dtype``). The lora pass's adapters are folded into their base weights
    (``lora_merge``) unless ``merge_adapters`` is false or the base is quantized
    (``quantize_frozen``: merging would undo it): then they stay in the model, and so does its
    ``graphforge.lora`` role (``adapters_merged`` says which).

    ``values`` maps initializer names to arrays of the same shape and type; values for
    optimizer states, accumulators or the step (a runtime's whole state) are ignored, as
    an inference model has no place for them. Any other name is an error.
    """
    with _read(program) as model:
        wanted = list(ProgramRoles.of_model(model).forward_outputs) if outputs is None else list(outputs)
        if values:
            _set_values(model, values)
        if merge_adapters and adapters_merged(ProgramRoles.of_model(model)):
            model = _prune_run(model, Prune(outputs=tuple(wanted)))
            LoraMerge().run(model)
            if dtype == "float32":
                return _verified(model.to_proto())
        return _pruned(model, Prune(outputs=tuple(wanted), dtype=dtype))


def adapters_merged(roles: ProgramRoles) -> bool:
    """Whether an export merges the program's adapters: it has some, and no quantized base weight."""
    return bool(roles.lora) and not any(a.weight in roles.quantized for a in roles.lora)


@contextlib.contextmanager
def _read(program: ModelSource | Model) -> Iterator[Model]:
    """A Model the caller's program does not share mutable state with. A caller's ModelProto
    is read in place (``Model.reading``: its Constant nodes copied, its weights not), its
    weights' names kept: onnx-graphsurgeon's exports rename the tensors they export from, and
    an import of the proto itself had let prune rename its Constant nodes' values."""
    if isinstance(program, Model):
        yield program.copy()
    elif isinstance(program, onnx.ModelProto):
        with names_kept(program):
            yield Model.reading(program)
    else:
        yield Model.from_proto(load(program))


def _pruned(model: Model, prune, *, verify: bool = True) -> onnx.ModelProto:
    proto = _prune_run(model, prune).to_proto()
    return _verified(proto) if verify else proto


def _verified(proto: onnx.ModelProto) -> onnx.ModelProto:
    verify_model(proto, where="the inference model")
    return proto


def _prune_run(model: Model, prune) -> Model:
    try:
        return prune.run(model).model
    except ValueError as exc:  # the pass's own parameter check
        raise GraphforgeError(f"prune: {exc}") from None


def _set_values(model: Model, values: Mapping[str, np.ndarray]) -> None:
    """Put ``values`` into the initializers of the same names, after checking them all."""
    tensors = model.graph.tensors()
    program_roles = ProgramRoles.of_model(model)
    state = {spec.input for spec in program_roles.carried if spec.init != "initializer"}
    state |= set(program_roles.scalar_inputs)
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
        tensor.data_location = None  # it may have been a stand-in (stand_ins.without_values): the values are here now


def _dtype_name(dtype) -> str:
    code = onnx_dtype(dtype)
    return onnx.TensorProto.DataType.Name(code).lower() if code is not None else "?"
