"""On-device training artifacts: a training program written as the files a runtime on a
device trains with, as onnxruntime-training's ``artifacts.generate_artifacts`` wrote them.

``generate_artifacts(model, requires_grad=..., loss=LossType..., optimizer=OptimType..., ...)``
takes onnxruntime-training's arguments, compiles the forward model with the pipeline they mean
(``pipeline_for``) and writes, into ``artifact_directory`` (each name after ``prefix``):

- ``training_model.onnx``: forward and backward, the gradients accumulated into carried
  buffers (unless the lazy-reset input is true), the loss first among its outputs;
- ``eval_model.onnx``: forward and loss, Dropout off and BatchNorm on its running statistics;
- ``optimizer_model.onnx``: the update, from the accumulated gradients;
- ``checkpoint``: every carried tensor, and the frozen parameters (graphforge's checkpoint:
  safetensors, per-tensor CRC-32);
- ``train_step.onnx``: the whole step in one model, the fast path where nothing accumulates;
- ``train_steps.onnx``: that step k times in one run (the steps pass, passes/steps.py): each
  input but the carried tensors and frozen parameters stacked on a leading dim ``steps`` of
  k (the batch, the labels, lr, step, reset, dropout key), the loss and reports [k], k left to
  each run;
- ``inference.onnx``: the forward outputs, the checkpoint's weights in it;
- ``manifest.json`` (graphforge/ondevice/manifest.py), written last: a set whose manifest does
  not match its files is refused by every reader.

``write_artifacts(program, folder, state=...)`` writes the same from a compiled program (a
trained run's, with its checkpoint): the training and optimizer models are the program cut
after its accumulated gradients, each model's carried tensors are plain graph inputs (no
initializer shares a name with an input: onnxruntime's C API, and so onnxruntime-node and
onnxruntime-web, would leave such an input out of the session and drop its feed), and their
values are the checkpoint's. The frozen parameters (the program's frozen role, or those named
``frozen``) are plain inputs too, read and never replaced, with the role ``frozen`` in the
manifest and the checkpoint, as onnxruntime-training's artifacts hold them: a runtime reads and
sets them with the trainable ones where asked (``getContiguousParameters(false)``), and a step
leaves them as they are.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from enum import Enum
from pathlib import Path

import onnx
from onnx import numpy_helper

from graphforge.digests import sha256_file
from graphforge.errors import GraphforgeError
from graphforge.graph import Model
from graphforge.model_io import ModelSource, load, save
from graphforge.ondevice.manifest import CHECKPOINT, FILES, FROZEN, Manifest, ModelEntry, StateEntry, ports
from graphforge.pass_manager import PassManager, parse_pipeline, pipeline_text
from graphforge.pass_spec import format_value
from graphforge.passes.steps import steps_model
from graphforge.placement.cut import cut
from graphforge.placement.lean import lean_model
from graphforge.program import ProgramRoles
from graphforge.runtime.checkpoint import CheckpointState, TensorSpec
from graphforge.runtime.dropout import KEY_INPUT, seeded_dropout
from graphforge.runtime.inference import eval_model, export_inference_model
from graphforge.runtime.sessions import backward_constants
from graphforge.tempfiles import move_into_place, temp_folder_beside


class LossType(Enum):
    """The losses onnxruntime-training's artifacts offer (the model's output against targets)."""

    MSELoss = 1
    CrossEntropyLoss = 2
    BCEWithLogitsLoss = 3
    L1Loss = 4


class OptimType(Enum):
    """The optimizers onnxruntime-training's artifacts offer, with its defaults: AdamW as its
    AdamWOptimizer computes it (betas 0.9, 0.999, eps 1e-6, no weight decay, the bias
    correction in the rate: ``adamw(mode=hf)``), SGD without momentum."""

    AdamW = 1
    SGD = 2


#: each loss as the loss pass writes it, and the name onnxruntime-training gives its targets
_LOSSES = {
    LossType.MSELoss: ("mse", "target"),
    LossType.CrossEntropyLoss: ("cross_entropy", "labels"),
    LossType.BCEWithLogitsLoss: ("bce_with_logits", "target"),
    LossType.L1Loss: ("l1", "target"),
}
#: onnxruntime-training's default learning rate (its Optimizer's, until one is set)
DEFAULT_LR = 1e-3
_OPTIMIZERS = {
    OptimType.AdamW: f"adamw(lr={DEFAULT_LR}, weight_decay=0.0, eps=1e-6, mode=hf, accumulate=true)",
    OptimType.SGD: f"sgd(lr={DEFAULT_LR}, accumulate=true)",
}


def generate_artifacts(
    model: onnx.ModelProto | str | os.PathLike,
    requires_grad: Sequence[str] | None = None,
    frozen_params: Sequence[str] | None = None,
    loss: LossType | None = None,
    optimizer: OptimType | None = None,
    artifact_directory: str | os.PathLike | None = None,
    prefix: str = "",
    ort_format: bool = False,
    custom_op_library: str | os.PathLike | None = None,
    additional_output_names: Sequence[str] | None = None,
    nominal_checkpoint: bool = False,
    loss_input_names: Sequence[str] | None = None,
) -> None:
    """Write the training artifacts of ``model`` (a forward model) into ``artifact_directory``
    (default: the current folder), as onnxruntime-training's ``generate_artifacts`` does.

    ``requires_grad``: the parameters that train (default: every floating-point
    initializer); ``frozen_params``: parameters that do not. ``loss``: a LossType appended on
    the model's first output (``loss_input_names``' first, where given), or None: that
    output is the loss. ``optimizer``: an OptimType (default AdamW: graphforge's artifacts
    always include the update). ``additional_output_names``: outputs the training and eval
    models return after the loss. ``ort_format``, ``custom_op_library`` and
    ``nominal_checkpoint`` are refused by name: graphforge writes standard ONNX that every
    onnxruntime package reads, with its complete checkpoint."""
    if ort_format:
        raise GraphforgeError("ort_format=True: graphforge writes ONNX models, which every onnxruntime package reads")
    if custom_op_library is not None:
        raise GraphforgeError("custom_op_library: graphforge's artifacts hold standard ONNX operators only")
    if nominal_checkpoint:
        raise GraphforgeError("nominal_checkpoint=True is not supported: the artifacts hold the complete checkpoint")
    source = load(model) if not isinstance(model, onnx.ModelProto) else model
    pipeline = pipeline_for(source, requires_grad, frozen_params, loss, optimizer, loss_input_names)
    program = PassManager(parse_pipeline(pipeline)).run(source).model
    folder = Path(artifact_directory) if artifact_directory is not None else Path.cwd()
    write_artifacts(program, folder, prefix=prefix, outputs=additional_output_names or (), frozen=frozen_params or ())


def pipeline_for(
    model: onnx.ModelProto,
    requires_grad: Sequence[str] | None = None,
    frozen_params: Sequence[str] | None = None,
    loss: LossType | None = None,
    optimizer: OptimType | None = None,
    loss_input_names: Sequence[str] | None = None,
) -> str:
    """The graphforge pipeline that onnxruntime-training's ``generate_artifacts`` arguments mean."""
    both = sorted(set(requires_grad or ()) & set(frozen_params or ()))
    if both:
        raise GraphforgeError(f"parameter(s) both frozen and requiring gradients: {', '.join(both)}")
    outputs = [o.name for o in model.graph.output]
    source = loss_input_names[0] if loss_input_names else (outputs[0] if outputs else None)
    if source is None or source not in outputs:
        raise GraphforgeError(
            f"the loss reads {source!r}, which is no output of the model (it has: {', '.join(outputs)})"
        )
    if loss is None:
        loss_pass = f"loss(output={format_value(source)})"
    elif isinstance(loss, LossType):
        kind, target = _LOSSES[loss]
        loss_pass = f"loss(kind={kind}, output={format_value(source)}, labels={target})"
    else:
        raise GraphforgeError(f"loss {loss!r}: use one of {', '.join(t.name for t in LossType)}, or None")
    trainable = [_exact(name) for name in requires_grad] if requires_grad is not None else ["*"]
    frozen = [_exact(name) for name in frozen_params or ()]
    autodiff = f"autodiff(trainable={format_value(trainable)}, frozen={format_value(frozen)})"
    chosen = OptimType.AdamW if optimizer is None else optimizer
    if not isinstance(chosen, OptimType):
        raise GraphforgeError(f"optimizer {optimizer!r}: use one of {', '.join(t.name for t in OptimType)}")
    return f"{loss_pass}, {autodiff}, {_OPTIMIZERS[chosen]}"


def _exact(name: str) -> str:
    """A parameter name as a glob that matches it alone (autodiff reads globs)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def accumulating(pipeline: str) -> tuple[list, str]:
    """``pipeline``'s passes with the optimizer accumulating (what a training model needs
    for lazy_reset_grad), and the text that says so in the user's spelling."""
    passes = parse_pipeline(pipeline)
    changed = [
        dataclasses.replace(p, accumulate=True) if getattr(p, "accumulate", True) is False else p for p in passes
    ]
    return changed, pipeline_text(changed, pipeline, full=False)


# --------------------------------------------------------------------------- from a program


def artifacts_from(
    model: str | os.PathLike,
    folder: str | os.PathLike,
    *,
    pipeline: str | None = None,
    checkpoint: str | os.PathLike | None = None,
    outputs: Sequence[str] | None = None,
    loss_only: bool = False,
    prefix: str = "",
    freeze: Sequence[str] = (),
    frozen_constants: bool = False,
) -> tuple[Manifest, str]:
    """What ``graphforge artifacts`` writes into ``folder``: the artifacts of ``model``, a
    training program, or a forward model compiled with ``pipeline`` (its optimizer made to
    accumulate; ``freeze``: globs of the weights to freeze, the freeze pass put first, as
    onnxruntime-training's ``frozen_params``), starting from the checkpoint file ``checkpoint``
    (the command finds a run folder's latest).
    The training and eval models return ``outputs`` after the loss (default: the forward
    outputs; none with ``loss_only``). The frozen weights are inputs of the models, their values
    in the checkpoint, or with ``frozen_constants`` constants of the models (onnxruntime folds
    and prepacks them; the checkpoint leaves them out). Returns the manifest and a line saying
    what it was made from."""
    proto = load(model)
    if ProgramRoles.of_proto(proto).is_training_program:
        if pipeline is not None or freeze:
            given = "a pipeline (-p)" if pipeline is not None else "weights to freeze (--freeze)"
            raise GraphforgeError(
                f"{model} is a training program already: give it no {given}, or give its forward model"
            )
        program, how = proto, f"the training program {model}"
    else:
        if pipeline is None:
            raise GraphforgeError(f"{model} is a forward model: give it a pipeline (-p, e.g. \"loss(kind=cross_entropy, "
                                  "output=logits), autodiff, adamw(lr=1e-3)\"), or a training program")  # fmt: skip
        if freeze:
            pipeline = f"freeze(names={format_value(list(freeze))}), {pipeline}"
        passes, text = accumulating(pipeline)
        program = PassManager(passes).run(proto).model
        how = f'{model} compiled with "{text}"'
    state = None
    if checkpoint is not None:
        state = CheckpointState.load(checkpoint, program)
        how += f", from {checkpoint} (step {state.step})"
    extras = [] if loss_only else list(outputs) if outputs else list(ProgramRoles.of_proto(program).forward_outputs)
    frozen = None
    if frozen_constants:
        # the JavaScript runtime cannot turn off onnxruntime's NchwcTransformer, which Python's
        # sessions leave out where a backward kernel reads a constant weight (runtime/sessions.py,
        # nchwc_safe): a frozen convolution after a trained one stays an input
        frozen = sorted(backward_constants(program))
        how += ", the frozen weights constants of the models"
        if frozen:
            how += f" but the {len(frozen)} that the backward reads (inputs, from the checkpoint)"
    return write_artifacts(program, folder, state=state, prefix=prefix, outputs=extras, frozen=frozen), how


def write_artifacts(
    program: ModelSource | Model,
    folder: str | os.PathLike,
    *,
    state: CheckpointState | None = None,
    prefix: str = "",
    outputs: Sequence[str] | None = None,
    frozen: Sequence[str] | None = None,
) -> Manifest:
    """Write the artifacts of a training ``program`` into ``folder`` (made if missing), its
    carried tensors ``state``'s (default: the program's own), the training and eval models
    returning the loss and ``outputs`` (default: none; the forward outputs are ``inference.onnx``'s).
    ``frozen``: initializers of the program that are parameters it does not train: the models
    read them as inputs, from the checkpoint. Default: the program's frozen weights (its
    ``graphforge.frozen`` role: what ``autodiff``'s patterns, torch's ``requires_grad=False``,
    the lora pass or the freeze pass froze); ``generate_artifacts`` gives its ``frozen_params``
    alone, as onnxruntime-training keeps a parameter it names in neither list a constant of the
    models; ``[]`` keeps every frozen weight a constant of the models (``--frozen-constants``)."""
    if Path(folder).exists() and not Path(folder).is_dir():
        raise GraphforgeError(f"{folder} is a file, not a folder: artifacts are written into a folder")
    proto = (
        program.to_proto()
        if isinstance(program, Model)
        else (load(program) if not isinstance(program, onnx.ModelProto) else program)
    )
    roles = ProgramRoles.of_proto(proto).require_training_program()
    _refuse_distributed(roles)
    extra = list(outputs or ())
    unknown = [o for o in extra if o not in roles.outputs]
    if unknown:
        raise GraphforgeError(
            f"additional output {unknown[0]!r} is no output of the program (it has: {', '.join(roles.forward_outputs)})"
        )
    state = state if state is not None else CheckpointState.from_program(proto)
    state.check(roles.carried)
    fixed = _frozen_values(proto, roles, list(roles.frozen) if frozen is None else frozen)
    models = _models(proto, roles, extra, fixed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # written beside the folder first, then moved in, the manifest last: a failure leaves the
    # folder as it was, and a reader never meets a manifest naming files not yet in place
    with temp_folder_beside(folder) as tmp:
        entries = {}
        for key, (model, role_of) in models.items():
            entries[key] = _written(model, tmp / f"{prefix}{FILES[key]}", role_of, role_of)
        inference = export_inference_model(
            proto, {n: v for n, v in state.tensors.items() if n in _inference_values(roles)}
        )
        entries["inference"] = _written(
            inference, tmp / f"{prefix}{FILES['inference']}", _batch_roles(roles), _output_roles
        )
        checkpoint = _with_frozen(state, fixed).save(tmp / f"{prefix}{CHECKPOINT}")
        dropout = None
        if any(i.name == KEY_INPUT for i in models["training"][0].graph.input):
            dropout = {"input": KEY_INPUT, "seed": int(state.seeds.get("dropout", 0)), "key": "splitmix64"}
        manifest = Manifest(
            models=entries,
            state=[
                *(StateEntry(c.input, c.role, c.dtype, tuple(c.shape), c.like) for c in roles.carried),
                *(StateEntry(name, FROZEN, value.dtype.name, tuple(value.shape)) for name, value in fixed.items()),
            ],
            checkpoint=checkpoint.name,
            checkpoint_sha256=sha256_file(checkpoint),
            optimizer=roles.optimizer,
            hyperparameters=dict(roles.hyperparameters),
            default_lr=roles.default_lr,
            accumulates=roles.accumulates,
            loss=roles.loss or "loss",
            labels=roles.labels,
            outputs=extra,
            dropout=dropout,
            graphforge=_version(),
        )
        written = manifest.write(tmp, prefix)
        for path in [*sorted(p for p in tmp.iterdir() if p != written), written]:
            move_into_place(path, folder / path.name)
    return manifest


def _written(model: onnx.ModelProto, path: Path, inputs_role, outputs_role) -> ModelEntry:
    save(model, path)
    return ModelEntry(
        path.name, sha256_file(path), ports(model.graph.input, inputs_role), ports(model.graph.output, outputs_role)
    )


def _refuse_distributed(roles: ProgramRoles) -> None:
    for what, present in (
        ("the allreduce or zero pass", roles.allreduce is not None),
        ("pipeline stages", roles.stages is not None),
        ("tensor_parallel", roles.tensor_parallel is not None),
    ):
        if present:
            raise GraphforgeError(
                f"the program was compiled with {what}: on-device artifacts train on one process; compile it without"
            )


def _frozen_values(proto: onnx.ModelProto, roles: ProgramRoles, frozen: Sequence[str]) -> dict:
    """The values of the ``frozen`` parameters (program initializers), in the program's order."""
    initializers = {t.name: t for t in proto.graph.initializer}
    carried = {c.input for c in roles.carried}
    for name in frozen:
        if name in carried:
            raise GraphforgeError(f"frozen parameter {name!r} is trained by the program (it carries an update of it)")
        if name not in initializers:
            raise GraphforgeError(f"frozen parameter {name!r} is no initializer of the program")
    wanted = set(frozen)
    return {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer if t.name in wanted}


def _with_frozen(state: CheckpointState, fixed: dict) -> CheckpointState:
    """``state`` with the frozen parameters' values besides its carried tensors."""
    if not fixed:
        return state
    specs = [TensorSpec(n, FROZEN, v.dtype.name, tuple(v.shape)) for n, v in fixed.items()]
    return state.with_tensors({**state.tensors, **fixed}, [*state.specs, *specs])


def _frozen_as_inputs(model: onnx.ModelProto, fixed: dict) -> onnx.ModelProto:
    """``model`` reading the frozen parameters it holds as initializers from graph inputs."""
    held = [t for t in model.graph.initializer if t.name in fixed]
    if not held:
        return model
    kept = [t for t in model.graph.initializer if t.name not in fixed]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    for tensor in held:
        model.graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
    return model


def _models(proto: onnx.ModelProto, roles: ProgramRoles, extra: list[str], fixed: dict) -> dict:
    """The training, optimizer, eval and whole-step models, each with its carried tensors and
    frozen parameters as plain inputs, and how to name each input's and output's role."""
    keyed, _ = seeded_dropout(proto)  # (masks a runtime in any language draws the same)
    carried = {c.input: c for c in roles.carried}
    by_output = {c.output: c for c in roles.carried}
    loss = roles.loss or "loss"
    accumulators = [c for c in roles.carried if c.role == "accumulator"]
    written_first = [c.output for c in roles.carried if c.role in ("accumulator", "buffer")]
    handed = (
        [c.output for c in accumulators] if roles.accumulates else list(dict.fromkeys(roles.gradient_boundary.values()))
    )
    if roles.accumulates:  # the update reads the accumulators, as a runtime holds them between the two
        keyed = _read_through(keyed, set(handed))
    training, update = cut(keyed, [list(dict.fromkeys([loss, *extra, *written_first, *handed]))])
    stray = [n for n in update.receives if n not in handed]
    if stray:
        raise GraphforgeError(
            f"the program's update reads {stray[0]!r} of its forward/backward, which no artifact carries"
        )
    gradients = set() if roles.accumulates else set(handed)
    optimizer = _reading_state(update.model, {c.output: c.input for c in accumulators})
    reports = [n for n in [*roles.step_reports, roles.step_output] if n is not None]

    def role_of(name: str) -> tuple[str, str | None]:
        if name in carried or name in fixed:
            return "state", name
        if name in by_output:
            return "state", by_output[name].input
        if name == loss:
            return "loss", None
        if name in gradients:
            return "gradient", None
        if name in reports:
            return "report", None
        return _scalar_role(roles, name)

    all_carried = [c.output for c in roles.carried if c.output in roles.outputs]
    updated = [c.output for c in roles.carried if c.role not in ("accumulator", "buffer")]
    models = {
        "training": _plain(training.model, [loss, *extra, *written_first, *sorted(gradients)]),
        "optimizer": _plain(optimizer, _present(optimizer, [*updated, *reports])),
        "eval": _plain(eval_model(proto, extra, verify=False), None),
        "train_step": _plain(keyed, [loss, *extra, *all_carried, *reports]),
    }
    whole = _frozen_as_inputs(models["train_step"], fixed)
    scans = [n for n in [loss, *roles.step_reports] if n in {o.name for o in whole.graph.output}]
    steps = steps_model(
        _plain(whole, [*scans, *all_carried]), None, carried={c.input: c.output for c in roles.carried},
        fixed=list(fixed), scans=scans,
    )  # fmt: skip
    models["train_step"] = whole
    models["train_steps"] = steps
    return {key: (_frozen_as_inputs(model, fixed), role_of) for key, model in models.items()}


def _scalar_role(roles: ProgramRoles, name: str) -> tuple[str, None]:
    scalars = {roles.lr_input: "lr", roles.step_input: "step", roles.reset_input: "reset", KEY_INPUT: "dropout_key"}
    if name in scalars:
        return scalars[name], None
    if name == roles.labels:
        return "labels", None
    if name in {b.name for b in roles.batch_inputs}:
        return "batch", None
    if name in roles.forward_outputs:
        return "output", None
    raise GraphforgeError(f"the artifacts have a tensor {name!r} whose role graphforge does not know")


def _batch_roles(roles: ProgramRoles):
    return lambda name: ("labels" if name == roles.labels else "batch", None)


def _output_roles(name: str) -> tuple[str, None]:
    return "output", None


def _inference_values(roles: ProgramRoles) -> set[str]:
    """The carried tensors an inference model holds: parameters and buffers."""
    return {c.input for c in roles.carried if c.role in ("parameter", "buffer")}


def _present(model: onnx.ModelProto, names: list[str]) -> list[str]:
    produced = {o.name for o in model.graph.output}
    return [n for n in dict.fromkeys(names) if n in produced]


def _read_through(model: onnx.ModelProto, outputs: set[str]) -> onnx.ModelProto:
    """A copy of ``model`` in which whatever reads ``x`` of ``out = Identity(x)``, ``out`` one of
    ``outputs``, reads ``out`` instead (the same value): the optimizer's accumulated gradients
    are the accumulators' new values, not the tensor an Identity names so."""
    named = {n.input[0]: n.output[0] for n in model.graph.node if n.op_type == "Identity" and n.output[0] in outputs}
    if not named:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in out.graph.node:
        if node.op_type == "Identity" and node.output[0] in outputs:
            continue
        for i, name in enumerate(node.input):
            if name in named:
                node.input[i] = named[name]
    return out


def _reading_state(model: onnx.ModelProto, renames: dict[str, str]) -> onnx.ModelProto:
    """``model`` (the update) reading each accumulated gradient from the carried tensor that
    holds it between the training model's run and its own (``renames``: output -> input)."""
    taken = {i.name for i in model.graph.input} - set(renames)
    clash = [new for old, new in renames.items() if new in taken]
    if clash:
        raise GraphforgeError(f"the update reads {clash[0]!r} both before and after the gradients accumulate")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    for value in graph.input:
        if value.name in renames:
            value.name = renames[value.name]
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
    return out


def _plain(model: onnx.ModelProto, outputs: list[str] | None) -> onnx.ModelProto:
    """``model`` computing ``outputs`` (None: all it has) with every input a plain graph input:
    the initializers of inputs (overridable defaults) go, their values are the checkpoint's."""
    inputs = {i.name for i in model.graph.input}
    lean = lean_model(
        model, [o for o in outputs if o in {p.name for p in model.graph.output}] if outputs else None, bound=inputs
    )
    shared = sorted({t.name for t in lean.graph.initializer} & {i.name for i in lean.graph.input})
    if shared:
        raise GraphforgeError(f"an artifact would hold an initializer that is also an input: {shared[0]!r}")
    if outputs:  # in the order asked for: the loss first, as onnxruntime-training's models have it
        order = {name: i for i, name in enumerate(outputs)}
        ordered = sorted(lean.graph.output, key=lambda o: order.get(o.name, len(order)))
        del lean.graph.output[:]
        lean.graph.output.extend(ordered)
    return lean


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("graphforge")
    except PackageNotFoundError:
        return "unknown"
