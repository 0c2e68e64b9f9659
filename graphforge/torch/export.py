"""Exporting an ``nn.Module`` for training, and compiling it into a graphforge program.

The README's rules for a training export (training mode, no constant folding, the TorchScript
exporter where BatchNorm must stay in training mode) are applied here, and two things the
exporter does to a module are undone:

* **Tied values.** The TorchScript exporter merges initializers with equal values (fresh zero
  biases, unit norm scales, zero running means) into one, which would train two of torch's
  parameters as one. The export therefore runs with every floating parameter and buffer set
  to a placeholder value of its own (seeded, distinct), each exported initializer is
  recognised by its placeholder, given back torch's name and its real value; one
  ``nn.Parameter`` used in two places (a tied embedding) stays one initializer, as in torch.
* **Side effects.** Exporting runs the module's forward in training mode, which updates
  BatchNorm's running statistics and counters: every parameter and buffer is restored after.

What torch calls a parameter with ``requires_grad`` is recorded as a parameter, everything
else (buffers, frozen parameters) as a buffer, in the model metadata autodiff reads
(``graphforge.torch_input_kinds``, the kinds the dynamo exporter writes): autodiff trains
exactly what torch would.
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from graphforge.errors import GraphforgeError
from graphforge.ir import TORCH_KINDS
from graphforge.pass_manager import compile

#: the opset the export is written in (onnxruntime 1.31 reads up to 26; 17 is what the
#: TorchScript exporter handles best)
OPSET = 17


def export_for_training(
    module: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor] | torch.Tensor,
    *,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] = ("logits",),
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
    opset: int = OPSET,
    training: bool = True,
) -> onnx.ModelProto:
    """``module`` exported as a training graphforge can compile (see the module docstring).

    ``example_inputs``: one tensor or a sequence of them, as the forward takes them.
    ``input_names``: default ``x`` for one input, ``x0``, ``x1``, ... for several.
    ``dynamic_axes``: as ``torch.onnx.export`` takes them; default: dim 0 of every input and
    output is the dynamic ``batch``. ``training=False`` exports the module in eval mode
    (BatchNorm reads its running statistics, Dropout is gone). The module is left as it was
    (values and mode)."""
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise GraphforgeError("example_inputs must be a tensor or a non-empty sequence of tensors")
    if input_names is None:
        input_names = ["x"] if len(inputs) == 1 else [f"x{i}" for i in range(len(inputs))]
    input_names, output_names = list(input_names), list(output_names)
    if len(input_names) != len(inputs):
        raise GraphforgeError(f"{len(inputs)} example input(s) but {len(input_names)} input name(s): {input_names}")
    if dynamic_axes is None:
        dynamic_axes = {name: {0: "batch"} for name in [*input_names, *output_names]}

    tensors = _named_tensors(module)
    # everything the forward may change comes back after: integer buffers too (BatchNorm's count)
    every = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    saved = {name: t.detach().clone() for name, t in every.items()}
    was_training = module.training
    placeholders = _placeholders(tensors)
    try:
        with torch.no_grad():
            for name, value in placeholders.items():
                tensors[name].copy_(value)
        buffer = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
            torch.onnx.export(
                module.train(training),
                inputs,
                buffer,
                dynamo=False,
                do_constant_folding=False,
                training=torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL,
                opset_version=opset,
                input_names=input_names,
                output_names=output_names,
                dynamic_axes={k: dict(v) for k, v in dynamic_axes.items()},
            )
        # the export ran the forward in training mode, which moved BatchNorm's running
        # statistics on from their placeholders: those moved values are what it wrote
        moved = {name: t.detach().clone() for name, t in tensors.items()}
    except GraphforgeError:
        raise
    except Exception as exc:
        text = " ".join(str(exc).split())
        text = text if len(text) <= 400 else text[:400] + " ..."
        raise GraphforgeError(f"torch.onnx.export failed: {type(exc).__name__}: {text}") from exc
    finally:
        with torch.no_grad():
            for name, value in saved.items():
                every[name].copy_(value)
        module.train(was_training)
    model = onnx.load_from_string(buffer.getvalue())
    _restore_values(model, [placeholders, moved], saved)
    trained = {name for name, p in module.named_parameters() if p.requires_grad}
    kinds = {name: "PARAMETER" if name in trained else "BUFFER" for name in placeholders}
    present = {t.name for t in model.graph.initializer}
    kinds = {name: kind for name, kind in kinds.items() if name in present}
    onnx.helper.set_model_props(model, {**_props(model), TORCH_KINDS: json.dumps(kinds, sort_keys=True)})
    return model


def train_program(
    module: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor] | torch.Tensor,
    pipeline: str,
    *,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] = ("logits",),
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
    **compile_options: Any,
):
    """``module`` exported for training (``export_for_training``) and compiled by
    ``pipeline`` (``"loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-3)"``):
    the CompileResult, whose ``.model`` ``graphforge.Module`` trains and ``graphforge train``
    takes. Parameter and buffer names are torch's ``named_parameters``/``named_buffers``."""
    model = export_for_training(
        module, example_inputs, input_names=input_names, output_names=output_names, dynamic_axes=dynamic_axes
    )
    return compile(model, pipeline, **compile_options)


def _named_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Floating parameters and buffers by their first name (a tied one once)."""
    named = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    odd = sorted(name for name, t in named.items() if t.dtype in (torch.bfloat16, torch.complex64, torch.complex128))
    if odd:
        raise GraphforgeError(
            f"cannot export {', '.join(odd)} ({named[odd[0]].dtype}): train in float32 (a mixed-precision pass "
            "lowers the compute, not the parameters)"
        )
    return {name: t for name, t in named.items() if t.is_floating_point()}


def _placeholders(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A distinct value for each tensor, in (0.5, 1.5): nothing the forward computes turns
    NaN on it (a variance, a square root), and no two tensors are equal."""
    generator = torch.Generator().manual_seed(0)
    return {
        name: (torch.rand(t.shape, generator=generator, dtype=torch.float64) + 0.5).to(t.dtype)
        for name, t in tensors.items()
    }


def _fingerprint(array: np.ndarray) -> tuple:
    return array.shape, array.dtype.str, hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def _restore_values(
    model: onnx.ModelProto, placeholders: Sequence[Mapping[str, torch.Tensor]], saved: Mapping[str, torch.Tensor]
) -> None:
    """Each initializer that holds a placeholder (any of the sets given) gets torch's name and
    real value back (the exporter may have renamed it); the graph reads the new name."""
    by_value = {_fingerprint(value.detach().cpu().numpy()): name for values in placeholders for name, value in values.items()}
    renames: dict[str, str] = {}
    for initializer in model.graph.initializer:
        name = by_value.get(_fingerprint(numpy_helper.to_array(initializer)))
        if name is None:
            continue
        if name != initializer.name:
            renames[initializer.name] = name
        initializer.CopyFrom(numpy_helper.from_array(saved[name].detach().cpu().numpy(), name))
    if not renames:
        return
    taken = {n for node in model.graph.node for n in node.output} | {i.name for i in model.graph.input}
    clash = sorted(set(renames.values()) & taken)
    if clash:
        raise GraphforgeError(
            f"the export names a tensor like the parameter(s) {clash}: cannot give them torch's names"
        )
    for node in _every_node(model.graph):
        node.input[:] = [renames.get(n, n) for n in node.input]


def _every_node(graph: onnx.GraphProto):
    """The graph's nodes and those of every subgraph (an If's branches read the outer names)."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                yield from _every_node(sub)


def _props(model: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}
