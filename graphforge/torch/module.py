"""GraphforgeModule: an ``nn.Module`` whose forward and backward run as graphforge programs on
onnxruntime, inside an unchanged PyTorch training loop.

On the first call with a new input signature (each input's dtype and rank, whether it needs a
gradient, and the module's train/eval mode) the wrapped module is exported in that mode
(``export_for_training``), its parameters and buffers become graph inputs, and the ``vjp`` pass
builds the backward from the outputs' gradients (the ``<output>_seed`` inputs: what torch hands
the backward) to the parameters that require a gradient and the inputs that do. The result is cut (``graphforge.placement.cut``) into a forward
segment, which computes the outputs and BatchNorm's new running statistics, and a backward
segment, which receives what the forward stashed and computes the gradients. Both run in a
``torch.autograd.Function``: ``loss.backward()`` fills each parameter's ``.grad``, so any
``torch.optim`` optimizer, scheduler or clipping works as before; the parameters stay the
module's, read at every call. Under ``torch.no_grad()`` only the forward segment runs.

Dims are symbolic in the export, so another batch size or sequence length reuses the compiled
program. Tensors cross without copies, through the one bridge (graphforge.runtime.dlpack):
inputs, parameters and buffers bound to the sessions as they are (on CUDA the sessions run on
onnxruntime's CUDA provider on the tensors' GPU); outputs, gradients and the forward's stash as
the OrtValues onnxruntime wrote on that device, the stash bound as they are to the backward, the
rest handed to torch. The sessions are a Runner's (with no carried tensors: the parameters are
the module's), as every client's are. On CUDA a run first waits for torch's current stream (its
kernels may still be writing an input), and onnxruntime's own stream is done when a run returns.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import onnx_graphsurgeon as gs
import onnxruntime as ort
import torch

from graphforge.builder import Builder
from graphforge.errors import GraphforgeError
from graphforge.graph import Model
from graphforge.ir import FLOAT_TYPES, TORCH_FROZEN, recorded_json, recorded_torch_kinds, replace_uses
from graphforge.model_io import save
from graphforge.pass_manager import PassManager
from graphforge.passes.autodiff import VectorJacobian
from graphforge.passes.optimizers import torch_running_variance
from graphforge.placement.cut import cut
from graphforge.roles import grad_name, metadata_of
from graphforge.runtime.devices import Device, resolve_device
from graphforge.runtime.dlpack import ortvalue_of, tensor_of
from graphforge.runtime.runner import BoundSession, Runner
from graphforge.torch.export import EXPORTERS, export_for_training, first_that_works

#: the prefix of the nodes this wrapper adds to the export (running statistics)
_PREFIX = "torch::"


@dataclass
class _Compiled:
    """One input signature's programs: the forward and backward sessions and what they exchange."""

    inputs: list[str]
    outputs: list[str]
    trained: list[str]  # parameters that get a gradient, in the order the Function takes them
    differentiated: list[str]  # inputs that get a gradient
    fed: list[str]  # parameters and buffers the programs read, by torch name
    statistics: dict[str, str]  # buffer -> the forward output holding its new value
    counters: list[str]  # BatchNorm's num_batches_tracked buffers, one more each training forward
    previous: dict[str, str]  # an input fed a copy of a running variance -> its buffer
    runner: Runner  # no carried tensors: the parameters are the module's, fed at each call
    forward: BoundSession
    forward_outputs: list[str]
    backward: BoundSession | None
    exporter: str  # which of export.EXPORTERS made it
    backward_inputs: list[str] = field(default_factory=list)

    @property
    def device(self) -> Device:
        return self.runner.device


class GraphforgeModule(torch.nn.Module):
    """Run ``module``'s forward and backward as graphforge programs (see the module docstring).

    ``fallback``: when the module cannot be exported or compiled, or gets inputs this wrapper
    does not take (keyword or non-tensor arguments, tensors on two devices, CUDA tensors where
    onnxruntime's CUDA provider does not work): ``"warn"`` runs the plain module with one
    warning naming the reason, ``"error"`` raises it.
    ``debug_dir``: a folder where each signature's exported, compiled and cut models are saved.
    ``exporter``: ``"auto"`` exports and compiles with TorchScript's exporter, and where that
    fails with the dynamo exporter (``export_for_training``); or ``"torchscript"``/``"dynamo"``.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        fallback: Literal["warn", "error"] = "warn",
        debug_dir=None,
        exporter: Literal["auto", "torchscript", "dynamo"] = "auto",
    ):
        super().__init__()
        if fallback not in ("warn", "error"):
            raise GraphforgeError(f"fallback must be 'warn' or 'error', got {fallback!r}")
        self.module = module
        self.fallback = fallback
        self.debug_dir = Path(debug_dir) if debug_dir is not None else None
        if exporter != "auto" and exporter not in EXPORTERS:
            raise GraphforgeError(f"exporter must be 'auto', 'torchscript' or 'dynamo', got {exporter!r}")
        self.exporter = exporter
        self._compiled: dict[tuple, _Compiled] = {}
        #: per (dtype, rank, needs a gradient) of the inputs: which dims of each are symbolic.
        #: The batch (dim 0) starts so; a dim seen with a second size becomes so too, when the
        #: export with it symbolic compiles (some exports, such as TorchScript's attention
        #: with a symbolic embedding width, do not: those dims stay fixed, one program a size)
        self._dynamic: dict[tuple, tuple[frozenset[int], ...]] = {}
        self._fixed: dict[tuple, tuple[frozenset[int], ...]] = {}
        self._fallen_back: str | None = None
        #: how many times a signature was compiled (a test and a user can see re-exports)
        self.compiles = 0

    def forward(self, *args, **kwargs):
        if self._fallen_back is not None:
            return self.module(*args, **kwargs)
        why = _unsupported(args, kwargs, self.module)
        if why is not None:
            return self._fall_back(why, args, kwargs)
        kind = _signature(args, self.module.training)
        dynamic = self._dynamic.setdefault(kind, tuple(frozenset({0}) if a.dim() else frozenset() for a in args))
        key = (kind, _sizes(args, dynamic))
        compiled = self._compiled.get(key)
        if compiled is None:
            try:
                compiled, key = self._compile_for(args, kind, key)
            except GraphforgeError as exc:
                return self._fall_back(str(exc), args, kwargs)
        tensors = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}
        trained = [tensors[name] for name in compiled.trained]
        grad_wanted = torch.is_grad_enabled() and (
            any(t.requires_grad for t in trained) or any(args[i].requires_grad for i in _indices(compiled, args))
        )
        if grad_wanted:
            outputs = _Run.apply(compiled, tensors, len(args), *args, *trained)
        else:
            outputs = _run_forward(compiled, tensors, args)[0]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _fall_back(self, why: str, args, kwargs):
        if self.fallback == "error":
            raise GraphforgeError(f"GraphforgeModule cannot run {type(self.module).__name__}: {why}")
        warnings.warn(
            f"GraphforgeModule runs {type(self.module).__name__} in plain PyTorch from now on: {why}", stacklevel=3
        )
        self._fallen_back = why
        return self.module(*args, **kwargs)

    def _compile_for(self, args, kind, key) -> tuple[_Compiled, tuple]:
        """Compile for a signature seen for the first time: where programs of the same dtypes
        and ranks exist, the dims whose sizes differ from theirs become symbolic (when that
        compiles; else they stay fixed)."""
        dynamic = self._dynamic[kind]
        fixed = self._fixed.setdefault(kind, tuple(frozenset() for _ in args))
        seen = [sizes for (k, sizes) in self._compiled if k == kind]
        if seen:
            changed = tuple(
                frozenset(d for d in range(a.dim()) if any(s[i][d] not in (None, a.shape[d]) for s in seen)) - fixed[i]
                for i, a in enumerate(args)
            )
            if any(changed):
                wider = tuple(d | c for d, c in zip(dynamic, changed, strict=True))
                try:
                    compiled = self._compile(args, wider)
                except GraphforgeError:
                    self._fixed[kind] = tuple(f | c for f, c in zip(fixed, changed, strict=True))
                else:
                    self._dynamic[kind] = wider
                    key = (kind, _sizes(args, wider))
                    self._compiled = {k: v for k, v in self._compiled.items() if k[0] != kind}
                    self._compiled[key] = compiled
                    return compiled, key
        compiled = self._compile(args, dynamic)
        self._compiled[key] = compiled
        return compiled, key

    def _compile(self, args, dynamic) -> _Compiled:
        self.compiles += 1
        folder = None
        if self.debug_dir is not None:
            folder = self.debug_dir / f"signature{self.compiles - 1}"
            folder.mkdir(parents=True, exist_ok=True)
            shapes = [
                [None if d in dims else n for d, n in enumerate(a.shape)] for a, dims in zip(args, dynamic, strict=True)
            ]
            (folder / "signature.json").write_text(
                json.dumps({"shapes": shapes, "dtypes": [str(a.dtype) for a in args]}) + "\n"
            )
        # first, so that CUDA tensors where onnxruntime cannot run CUDA fall back before an export
        device = resolve_device(str(args[0].device))
        return first_that_works(
            lambda exporter: _compile(self.module, args, dynamic, folder, device, exporter), self.exporter
        )


def _unsupported(args, kwargs, module: torch.nn.Module) -> str | None:
    if kwargs:
        return f"keyword arguments ({', '.join(kwargs)}) are not taken; pass them positionally"
    if not args:
        return "a forward without inputs"
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            return f"input {i} is a {type(a).__name__}, not a tensor"
        if a.device.type not in ("cpu", "cuda"):
            return f"input {i} is on {a.device}; GraphforgeModule runs CPU and CUDA tensors"
        if a.device != args[0].device:
            return f"input {i} is on {a.device} and input 0 on {args[0].device}"
    device = args[0].device
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        if t.device != device:
            return f"{name} is on {t.device} and the inputs on {device}; move the module there first"
    return None


def _signature(args, training: bool) -> tuple:
    """What a compiled program is made for: each input's dtype, rank and whether it needs a
    gradient, the mode, and the device its sessions run on."""
    inputs = tuple((a.dtype, a.dim(), a.requires_grad and a.is_floating_point()) for a in args)
    return inputs, training, str(args[0].device)


def _sizes(args, dynamic) -> tuple:
    """Each input's dims, None where symbolic."""
    return tuple(
        tuple(None if d in dims else n for d, n in enumerate(a.shape)) for a, dims in zip(args, dynamic, strict=True)
    )


def _indices(compiled: _Compiled, args) -> list[int]:
    return [compiled.inputs.index(name) for name in compiled.differentiated]


def _compile(module: torch.nn.Module, args, dynamic, folder: Path | None, device: Device, exporter: str) -> _Compiled:
    names = [f"input{i}" for i in range(len(args))]
    exported = export_for_training(
        module,
        tuple(a.detach() for a in args),
        input_names=names,
        output_names=["output"],  # the export names any further outputs
        dynamic_axes={
            name: {d: f"{name}_dim{d}" for d in sorted(dims)} for name, dims in zip(names, dynamic, strict=True)
        },
        training=module.training,
        exporter=exporter,
    )
    for i, value in enumerate(exported.graph.output):  # symbolic: another batch gives other output dims
        for d, dim in enumerate(value.type.tensor_type.shape.dim):
            dim.Clear()
            dim.dim_param = f"output{i}_dim{d}"
    outputs = [o.name for o in exported.graph.output]
    floating = [o.name for o in exported.graph.output if o.type.tensor_type.elem_type in FLOAT_TYPES]
    metadata = metadata_of(exported)
    kinds = recorded_torch_kinds(metadata)
    frozen = set(recorded_json(metadata, TORCH_FROZEN, list, []))  # requires_grad=False: torch wants no gradient
    trained = sorted(name for name, kind in kinds.items() if kind == "PARAMETER" and name not in frozen)
    differentiated = [n for n, a in zip(names, args, strict=True) if a.requires_grad and a.is_floating_point()]
    if folder is not None:
        save(exported, folder / "exported.onnx")
    model = Model.from_proto(exported)
    b = Builder(model.graph, prefix=_PREFIX)
    _parameters_as_inputs(model.graph, kinds)
    statistics, previous = _running_statistics(b, kinds)
    if not floating:
        trained, differentiated = [], []
    if not trained and not differentiated:
        segments = cut(model, [])
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # parameters the outputs do not depend on get no gradient
            vjp = VectorJacobian(outputs=tuple(floating), trainable=(), inputs=(*trained, *differentiated))
            model = Model.from_proto(PassManager([vjp], verify=False).run(model).model)
        gradients = {t.name for t in model.graph.outputs}
        trained = [n for n in trained if grad_name(n) in gradients]
        differentiated = [n for n in differentiated if grad_name(n) in gradients]
        segments = cut(model, [[*outputs, *statistics.values()]])
        if folder is not None:
            save(model, folder / "compiled.onnx")
    if folder is not None:
        for segment in segments:
            save(segment.model, folder / f"segment{segment.index}.onnx")
    first, second = segments[0], segments[-1] if len(segments) > 1 else None
    # torch's loss and optimizer run next, on the same cores: the sessions' threads do not spin
    runner = Runner([], device, spin=False)
    forward = runner.segment(first).session
    backward = runner.segment(second).session if second is not None else None
    return _Compiled(
        inputs=names,
        outputs=outputs,
        trained=trained,
        differentiated=differentiated,
        fed=sorted(kinds),
        statistics=statistics,
        previous=previous,
        counters=sorted({f"{b.rsplit('.', 1)[0]}.num_batches_tracked" for b in statistics}),
        runner=runner,
        forward=forward,
        exporter=exporter,
        forward_outputs=[o.name for o in first.model.graph.output],
        backward=backward,
        backward_inputs=backward.inputs if backward is not None else [],
    )


def _parameters_as_inputs(graph: gs.Graph, kinds: dict[str, str]) -> None:
    """Every parameter and buffer initializer becomes a graph input: the module's tensors are
    fed at each call."""
    for name, tensor in graph.tensors().items():
        if name in kinds and isinstance(tensor, gs.Constant):
            fed = gs.Variable(name, dtype=tensor.dtype, shape=list(tensor.shape))
            tensor.name = f"{name}/initial"  # read by nothing from here on
            replace_uses(tensor, fed)
            graph.inputs.append(fed)


def _running_statistics(b: Builder, kinds: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Each training-mode BatchNormalization's running statistics become outputs, the variance
    made unbiased as torch keeps it (``torch_running_variance``, as the optimizer passes do).
    The correction reads the previous variance from an input of its own, fed a copy:
    onnxruntime's BatchNormalization writes its new statistics into the buffer it read them
    from (seen: a Mul of that input run after it read the new value). Returns (buffer -> output
    name, that input -> buffer)."""
    statistics: dict[str, str] = {}
    previous: dict[str, str] = {}
    for node in list(b.graph.nodes):
        if node.op != "BatchNormalization" or not node.attrs.get("training_mode") or len(node.outputs) < 3:
            continue
        mean, var = node.inputs[3], node.inputs[4]
        if mean.name not in kinds or var.name not in kinds:
            continue
        before = gs.Variable(f"{var.name}.previous", dtype=var.dtype, shape=var.shape)
        b.graph.inputs.append(before)
        previous[before.name] = var.name
        with b.scope(var.name):
            new_var = torch_running_variance(b, node, before, node.outputs[2])
        for buffer, value in ((mean, node.outputs[1]), (var, new_var)):
            value.dtype, value.shape = buffer.dtype, buffer.shape
            b.graph.outputs.append(value)
            statistics[buffer.name] = value.name
    return statistics, previous


def _feed(t: torch.Tensor) -> ort.OrtValue:
    """A tensor as a session reads it, on its memory (the one bridge, graphforge.runtime.dlpack)."""
    return ortvalue_of(t.detach().contiguous())


def _run(compiled: _Compiled, session: BoundSession, feeds: dict[str, Any], outputs: list[str]) -> dict:
    """Run ``session`` through the signature's runner on ``feeds`` (``_feed``'s values, or
    OrtValues a previous run made) and return its ``outputs`` as the OrtValues onnxruntime wrote
    them into, on the device: bound, not copied out as ``session.run`` would copy them (the
    forward's stash, a GPT-2's logits)."""
    device = compiled.device
    if device.type == "cuda":
        # torch's kernels that write the inputs run on torch's stream, onnxruntime's on its own
        torch.cuda.current_stream(device.id).synchronize()
    return compiled.runner.run(session, feeds, fetch_device=outputs)[1]


def _run_forward(compiled: _Compiled, tensors: dict[str, torch.Tensor], args) -> tuple[list[torch.Tensor], dict]:
    feeds = {name: _feed(a) for name, a in zip(compiled.inputs, args, strict=True)}
    feeds.update({name: _feed(tensors[name]) for name in compiled.fed})
    # a copy: onnxruntime's BatchNormalization writes the new variance where it read the old one
    feeds.update({previous: _feed(tensors[name].detach().clone()) for previous, name in compiled.previous.items()})
    done = _run(compiled, compiled.forward, feeds, compiled.forward_outputs)
    with torch.no_grad():
        for buffer, name in compiled.statistics.items():
            tensors[buffer].copy_(tensor_of(done[name]))
        for buffer in compiled.counters:
            if buffer in tensors:
                tensors[buffer].add_(1)
    outputs = [tensor_of(done[name]) for name in compiled.outputs]
    return outputs, {**{k: v for k, v in feeds.items() if k not in compiled.inputs}, **done}


class _Run(torch.autograd.Function):
    """The forward segment in ``forward``, the backward segment in ``backward``."""

    @staticmethod
    def forward(ctx, compiled: _Compiled, tensors: dict, count: int, *values):
        args = values[:count]
        outputs, known = _run_forward(compiled, tensors, args)
        ctx.compiled = compiled
        ctx.known = {k: known[k] for k in compiled.backward_inputs if k in known}
        ctx.known.update({n: _feed(a) for n, a in zip(compiled.inputs, args, strict=True)})
        ctx.outputs = [(o.shape, o.dtype, o.device) for o in outputs]
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        compiled = ctx.compiled
        feeds = dict(ctx.known)
        for name, grad, (shape, dtype, device) in zip(compiled.outputs, grads, ctx.outputs, strict=True):
            if f"{name}_seed" in compiled.backward_inputs:
                feeds[f"{name}_seed"] = _feed(
                    grad if grad is not None else torch.zeros(shape, dtype=dtype, device=device)
                )
        wanted = [grad_name(n) for n in (*compiled.differentiated, *compiled.trained)]
        done = _run(compiled, compiled.backward, feeds, wanted)
        input_grads = [
            tensor_of(done[grad_name(name)]) if name in compiled.differentiated else None for name in compiled.inputs
        ]
        param_grads = [tensor_of(done[grad_name(name)]) for name in compiled.trained]
        return (None, None, None, *input_grads, *param_grads)
