"""Exporting an ``nn.Module`` for training, and compiling it into a graphforge program.

The rules of a training export (docs/guides/pytorch-export.md: training mode, no constant
folding, the TorchScript exporter where BatchNorm must stay in training mode) are applied here,
and two things the exporter does to a module are undone:

* **Tied values.** The TorchScript exporter merges initializers with equal values (fresh zero
  biases, unit norm scales, zero running means) into one, which would train two of torch's
  parameters as one. The export therefore runs with every floating parameter and buffer set
  to a placeholder value of its own (seeded, distinct), each exported initializer is
  recognised by its placeholder, given back torch's name and its real value; one
  ``nn.Parameter`` used in two places (a tied embedding) stays one initializer, as in torch.
* **Side effects.** Exporting runs the module's forward in training mode, which updates
  BatchNorm's running statistics and counters: every parameter and buffer is restored after.

What torch calls a parameter is recorded as a parameter, a buffer as a buffer, in the model
metadata autodiff reads (``graphforge.torch_input_kinds``, the kinds the dynamo exporter
writes), and what the export itself does not say is recorded beside: the parameters torch does
not train (``requires_grad=False``, ``graphforge.torch_frozen_parameters``) and the padding row
of each ``nn.Embedding(padding_idx=p)`` lookup (``graphforge.torch_padding_rows``). So autodiff
trains exactly what torch would, and gives a padding row what torch gives it.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from graphforge.errors import GraphforgeError
from graphforge.ir import TORCH_FROZEN, TORCH_KINDS, TORCH_PADDING_ROWS
from graphforge.pass_manager import compile
from graphforge.roles import metadata_of

#: the opset the export is written in (onnxruntime 1.31 reads up to 26; 17 is what the
#: TorchScript exporter handles best)
OPSET = 17
#: the lowest opset the dynamo exporter writes
DYNAMO_OPSET = 18
#: the exporters ``export_for_training`` runs; ``auto`` callers try them in this order
EXPORTERS = ("torchscript", "dynamo")


def export_for_training(
    module: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor] | torch.Tensor,
    *,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] = ("logits",),
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
    opset: int = OPSET,
    training: bool = True,
    exporter: str = "torchscript",
) -> onnx.ModelProto:
    """``module`` exported as a training graphforge can compile (see the module docstring).

    ``example_inputs``: one tensor or a sequence of them, as the forward takes them.
    ``input_names``: default ``x`` for one input, ``x0``, ``x1``, ... for several.
    ``dynamic_axes``: as ``torch.onnx.export`` takes them; default: dim 0 of every input and
    output is the dynamic ``batch``. ``training=False`` exports the module in eval mode
    (BatchNorm reads its running statistics, Dropout is gone). The module is left as it was
    (values and mode).

    ``exporter``: ``"torchscript"`` (``torch.onnx.export(dynamo=False)``) or ``"dynamo"``
    (``torch.export`` then torch's ONNX translation, at opset 18 or above, unoptimized: its
    optimizer folds constants, parameters among them). They export different sets of ops:
    TorchScript has no ``rms_norm`` or ``logcumsumexp``, for instance, and dynamo cannot trace
    some Python control flow that TorchScript's tracer unrolls. The dynamo exporter writes a
    training-mode BatchNorm in inference mode; it is put back in training mode here."""
    inputs, input_names, output_names, dynamic_axes = _export_arguments(
        exporter, example_inputs, input_names, output_names, dynamic_axes
    )
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
        model = _run_exporter(exporter, module, inputs, input_names, output_names, dynamic_axes, opset, training)
        # the TorchScript export ran the forward in training mode, which moved BatchNorm's
        # running statistics on from their placeholders: those moved values are what it wrote
        moved = {name: t.detach().clone() for name, t in tensors.items()}
    except GraphforgeError:
        raise
    except Exception as exc:
        raise _export_failure(exporter, exc) from exc
    finally:
        with torch.no_grad():
            for name, value in saved.items():
                every[name].copy_(value)
        module.train(was_training)
    _restore_values(model, [placeholders, moved], saved)
    if exporter == "dynamo" and training:
        _batch_norm_in_training_mode(model, {n for n, _ in module.named_buffers()})
    onnx.helper.set_model_props(model, _torch_metadata(model, module, placeholders))
    return model


def _export_arguments(
    exporter: str,
    example_inputs: Sequence[torch.Tensor] | torch.Tensor,
    input_names: Sequence[str] | None,
    output_names: Sequence[str],
    dynamic_axes: Mapping[str, Mapping[int, str]] | None,
) -> tuple[tuple[torch.Tensor, ...], list[str], list[str], Mapping[str, Mapping[int, str]]]:
    """``export_for_training``'s arguments checked, with their defaults filled in: the inputs
    as a tuple, the input and output names as lists, the dynamic axes."""
    if exporter not in EXPORTERS:
        raise GraphforgeError(f"exporter must be one of {', '.join(map(repr, EXPORTERS))}, got {exporter!r}")
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
    return inputs, input_names, output_names, dynamic_axes


def _run_exporter(
    exporter: str,
    module: torch.nn.Module,
    inputs: tuple[torch.Tensor, ...],
    input_names: list[str],
    output_names: list[str],
    dynamic_axes: Mapping[str, Mapping[int, str]],
    opset: int,
    training: bool,
) -> onnx.ModelProto:
    """``module`` put in training mode (or not) and exported by torch's ``exporter``, quietly."""
    axes = {k: dict(v) for k, v in dynamic_axes.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporters' deprecation and tracer warnings
        if exporter == "dynamo":
            return _export_dynamo(module.train(training), inputs, input_names, output_names, axes, opset)
        buffer = io.BytesIO()
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
            dynamic_axes=axes,
        )
        return onnx.load_from_string(buffer.getvalue())


def _export_failure(exporter: str, exc: Exception) -> GraphforgeError:
    """One line naming the export that failed and why (the dynamo exporter's innermost cause)."""
    cause = _root_cause(exc) if exporter == "dynamo" else exc
    text = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(cause)).split())
    text = text if len(text) <= 400 else text[:400] + " ..."
    how = "torch.onnx.export" if exporter == "torchscript" else "torch.onnx.export(dynamo=True)"
    return GraphforgeError(f"{how} failed: {type(cause).__name__}: {text}")


def _torch_metadata(
    model: onnx.ModelProto, module: torch.nn.Module, placeholders: Mapping[str, torch.Tensor]
) -> dict[str, str]:
    """``model``'s metadata with what torch says of its initializers: which are parameters and
    which buffers (of those given ``placeholders``), which parameters torch does not train, and
    the padding rows of its embeddings' lookups."""
    parameters = dict(module.named_parameters())
    present = {t.name for t in model.graph.initializer}
    kinds = {name: "PARAMETER" if name in parameters else "BUFFER" for name in placeholders if name in present}
    props = {**metadata_of(model), TORCH_KINDS: json.dumps(kinds, sort_keys=True)}
    frozen = sorted(name for name, p in parameters.items() if not p.requires_grad and name in kinds)
    if frozen:
        props[TORCH_FROZEN] = json.dumps(frozen)
    padding = _padding_rows(model, module)
    if padding:
        props[TORCH_PADDING_ROWS] = json.dumps(padding, sort_keys=True)
    return props


def _padding_rows(model: onnx.ModelProto, module: torch.nn.Module) -> dict[str, int]:
    """The lookups of each ``nn.Embedding(padding_idx=p)``'s weight (Gather on axis 0 of the
    initializer torch's name gives it) -> p, as ``graphforge.ir.TORCH_PADDING_ROWS`` records them."""
    rows = {id(m.weight): m.padding_idx for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    by_name = {name: rows[id(p)] for name, p in module.named_parameters() if rows.get(id(p)) is not None}
    found = {}
    for node in model.graph.node:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or node.input[0] not in by_name:
            continue
        if all(a.i == 0 for a in node.attribute if a.name == "axis"):
            found[node.output[0]] = int(by_name[node.input[0]])
    return found


def _export_dynamo(module, inputs, input_names, output_names, dynamic_axes, opset) -> onnx.ModelProto:
    # the exporter logs each op library it cannot load (torchvision's) as a warning
    quiet = logging.getLogger("torch.onnx")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        program = torch.onnx.export(
            module,
            inputs,
            dynamo=True,
            optimize=False,
            verbose=False,
            opset_version=max(opset, DYNAMO_OPSET),
            input_names=input_names,
            output_names=output_names,
            dynamic_axes=dynamic_axes,
        )
    finally:
        quiet.setLevel(level)
    return program.model_proto


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost exception: the dynamo exporter's own message is the same three steps of
    advice for every failure, and what failed (an op without an ONNX function, say) is below."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def _batch_norm_in_training_mode(model: onnx.ModelProto, buffers: set[str]) -> None:
    """The dynamo exporter writes a BatchNorm of a module in training mode as an inference
    BatchNormalization reading the running statistics (torch 2.13): each one that reads two
    of the module's buffers is made what torch computes, the batch's statistics, with the
    running statistics' new values as its outputs 1 and 2 (as the TorchScript export has them)."""
    taken = {o for node in model.graph.node for o in node.output}
    for node in model.graph.node:
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx") or len(node.input) < 5:
            continue
        if node.input[3] not in buffers or node.input[4] not in buffers:
            continue
        attributes = {a.name: a for a in node.attribute}
        if "training_mode" in attributes:
            attributes["training_mode"].i = 1
        else:
            node.attribute.append(onnx.helper.make_attribute("training_mode", 1))
        while len(node.output) < 3:
            name = f"{node.output[0]}/running_statistic{len(node.output)}"
            while name in taken:
                name += "_"
            taken.add(name)
            node.output.append(name)


def train_program(
    module: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor] | torch.Tensor,
    pipeline: str,
    *,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] = ("logits",),
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
    exporter: str = "auto",
    **compile_options: Any,
):
    """``module`` exported for training (``export_for_training``) and compiled by
    ``pipeline`` (``"loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-3)"``):
    the CompileResult, whose ``.model`` ``graphforge.Module`` trains and ``graphforge train``
    takes. Parameter and buffer names are torch's ``named_parameters``/``named_buffers``.
    ``exporter="auto"`` exports and compiles with each of ``EXPORTERS`` in turn until one
    works (the error names what each gave); or name one."""

    def attempt(name: str):
        model = export_for_training(
            module,
            example_inputs,
            input_names=input_names,
            output_names=output_names,
            dynamic_axes=dynamic_axes,
            exporter=name,
        )
        return compile(model, pipeline, **compile_options)

    return first_that_works(attempt, exporter)


def first_that_works(attempt, exporter: str = "auto"):
    """``attempt(name)`` for the exporter named, or with ``"auto"`` for each of ``EXPORTERS``
    in turn: the first result, or one GraphforgeError naming what each exporter gave."""
    if exporter != "auto":
        if exporter not in EXPORTERS:
            raise GraphforgeError(
                f"exporter must be 'auto' or one of {', '.join(map(repr, EXPORTERS))}, got {exporter!r}"
            )
        return attempt(exporter)
    failures = []
    for name in EXPORTERS:
        try:
            return attempt(name)
        except GraphforgeError as exc:
            failures.append(f"{name}: {exc}")
    raise GraphforgeError("no exporter gave a program it compiles; " + "; ".join(failures))


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
    by_value = {
        _fingerprint(value.detach().cpu().numpy()): name for values in placeholders for name, value in values.items()
    }
    renames: dict[str, str] = {}
    for initializer in model.graph.initializer:
        name = by_value.get(_fingerprint(numpy_helper.to_array(initializer)))
        if name is None:
            continue
        if name != initializer.name:
            renames[initializer.name] = name
        initializer.CopyFrom(numpy_helper.from_array(saved[name].detach().cpu().numpy(), name))
    renames.update(_read_baked_values(model, by_value, saved))
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


def _read_baked_values(
    model: onnx.ModelProto, by_value: Mapping[tuple, str], saved: Mapping[str, torch.Tensor]
) -> dict[str, str]:
    """Constant nodes into which the tracer baked a placeholder (it does so with a one-element
    buffer, GPT-NeoX's rotary inv_freq): in the main graph each goes, its readers reading the
    tensor's initializer (added, with torch's value, if the export has none), so a parameter
    still trains; in a subgraph the node keeps torch's value. Returns the renames to make."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    initializers = {t.name for t in graph.initializer}
    renames: dict[str, str] = {}
    kept = []
    for node in graph.node:
        found = _baked(node, by_value)
        if found is None or node.output[0] in outputs:
            kept.append(node)
            if found is not None:
                found[0].t.CopyFrom(numpy_helper.from_array(saved[found[1]].detach().cpu().numpy()))
            continue
        name = found[1]
        if name not in initializers:
            graph.initializer.append(numpy_helper.from_array(saved[name].detach().cpu().numpy(), name))
            initializers.add(name)
        renames[node.output[0]] = name
    if renames:
        del graph.node[:]
        graph.node.extend(kept)
    for node in _every_node(graph):
        found = _baked(node, by_value) if node.op_type == "Constant" else None
        if found is not None:  # one in a subgraph
            found[0].t.CopyFrom(numpy_helper.from_array(saved[found[1]].detach().cpu().numpy()))
    return renames


def _baked(node: onnx.NodeProto, by_value: Mapping[tuple, str]) -> tuple[onnx.AttributeProto, str] | None:
    """A Constant node's tensor attribute and the placeholder it holds, if it holds one."""
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
        return None
    value = next((a for a in node.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR), None)
    name = by_value.get(_fingerprint(numpy_helper.to_array(value.t))) if value is not None else None
    return None if name is None else (value, name)


def _every_node(graph: onnx.GraphProto):
    """The graph's nodes and those of every subgraph (an If's branches read the outer names)."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                yield from _every_node(sub)
