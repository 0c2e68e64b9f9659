"""The loss pass: append a standard loss on a model output, or adopt an existing scalar output."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnx_graphsurgeon as gs

from graphforge import roles
from graphforge.builder import Builder
from graphforge.errors import PassError
from graphforge.graph import Model
from graphforge.pass_infra import Fact, Pass, PassResult, check_number
from graphforge.shapes import infer_shapes

LossKind = Literal["cross_entropy", "mse", "l1", "bce_with_logits", "nll"]


@dataclass(frozen=True)
class Loss(Pass):
    """Make the graph output ``loss``.

    1. ``loss(kind=KIND, output=NAME)`` appends KIND on the model output NAME and adds the
       targets as a graph input ``labels`` (rename with ``labels=``) whose dims are all
       dynamic. Kinds, each equal to its ``torch.nn.functional`` namesake:
       cross_entropy (logits ``[N, C]`` or ``[N, C, d...]``, int64 class labels,
       ``ignore_index``, ``label_smoothing``), nll (log-probabilities, int64 labels,
       ``ignore_index``), mse, l1 and bce_with_logits (float targets shaped like NAME).
       ``reduction`` is mean or sum.
    4. ``axis=-1`` (cross_entropy and nll) reads the classes on the last axis, as
       transformers' causal LMs export their logits (``[batch, seq, vocab]``, labels
       ``[batch, seq]``); the default, 1, is torch's layout. The scores and labels are then
       flattened to ``[N, C]`` and ``[N]`` (free reshapes, no transpose of the logits).
    2. ``loss(output=NAME)`` without a kind adopts an existing one-element output as the
       loss, so a custom loss written into the model works.
    3. The model's other outputs stay (``keep_outputs=false`` drops them).
    """

    name = "loss"
    ensures = (Fact.LOSS,)
    output: str = ""
    kind: LossKind | None = None
    labels: str = "labels"
    reduction: Literal["mean", "sum"] = "mean"
    ignore_index: int = -100
    label_smoothing: float = 0.0
    keep_outputs: bool = True
    axis: Literal[1, -1] = 1

    def __post_init__(self):
        check_number(self, "label_smoothing", at_least=0, at_most=1)
        if self.label_smoothing and self.kind != "cross_entropy":
            raise ValueError("label_smoothing applies to kind=cross_entropy only")
        if self.axis != 1 and self.kind not in ("cross_entropy", "nll"):
            raise ValueError("axis applies to kind=cross_entropy and kind=nll only")

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        if any(t.name == "loss" for t in graph.outputs) and self.kind is not None:
            raise PassError("the model already has an output named 'loss'; use loss(output=loss) to adopt it")
        source = self._source(graph)
        if source.dtype is None or source.shape is None:
            # the loss reads only its source's type and rank, which an exporter usually declares
            # (inference costs about 0.1 s on GPT-2 small, and autodiff infers again anyway)
            model = infer_shapes(model, in_place=True)
            graph = model.graph
            source = self._source(graph)
        b = Builder(graph, prefix=roles.LOSS_PREFIX)
        with b.scope(self.kind or "adopted"):
            if self.kind is None:
                value = self._adopt(source)
            else:
                labels = self._labels_input(graph, source)
                value = _BUILDERS[self.kind](self, b, source, labels)
                model.metadata[roles.LABELS] = labels.name
                if self.axis != 1:
                    model.metadata[roles.LOSS_CLASS_AXIS] = str(self.axis)
        if value.name == "loss":  # an adopted output already named so: a second tensor "loss" would clash
            loss = value
        else:
            loss = gs.Variable("loss", dtype=source.dtype, shape=[])
            graph.nodes.append(gs.Node("Identity", name=f"{roles.LOSS_PREFIX}output", inputs=[value], outputs=[loss]))
        graph.outputs = [*(o for o in graph.outputs if self.keep_outputs and o is not loss), loss]
        model.metadata[roles.LOSS] = "loss"
        graph.cleanup()
        return PassResult(model, True)

    def _source(self, graph: gs.Graph) -> gs.Tensor:
        if not self.output:
            names = ", ".join(t.name for t in graph.outputs)
            raise PassError(f"name the model output to put the loss on with output=NAME (outputs: {names})")
        source = next((t for t in graph.outputs if t.name == self.output), None)
        if source is None:
            names = ", ".join(t.name for t in graph.outputs)
            raise PassError(f"the model has no output {self.output!r}; its outputs are: {names}")
        if source.dtype is not None and not np.issubdtype(np.dtype(source.dtype), np.floating):
            raise PassError(f"output {self.output!r} is {np.dtype(source.dtype)}, a loss needs a floating-point output")
        return source

    def _adopt(self, source: gs.Tensor) -> gs.Tensor:
        shape = source.shape
        if shape is None or not all(isinstance(d, int | np.integer) and d == 1 for d in shape):
            raise PassError(f"output {source.name!r} has shape {shape}; without kind= the loss must be one element")
        return source

    def _labels_input(self, graph: gs.Graph, source: gs.Tensor) -> gs.Tensor:
        if any(t.name == self.labels for t in graph.tensors().values()):
            raise PassError(f"the model already has a tensor named {self.labels!r}; choose another with labels=NAME")
        rank = len(source.shape) if source.shape is not None else None
        if rank is None:
            raise PassError(f"the rank of output {source.name!r} is unknown; the loss needs it")
        if self.kind in ("cross_entropy", "nll"):
            if rank < 2:
                raise PassError(
                    f"{self.kind} needs logits shaped [N, C] or [N, C, d...]; {source.name!r} has rank {rank}"
                )
            dims = [source.shape[0], *source.shape[2:]] if self.axis == 1 else list(source.shape[:-1])
            dtype = np.int64
        else:
            dims, dtype = list(source.shape), source.dtype
        shape = [d if isinstance(d, str) else f"{self.labels}_dim{i}" for i, d in enumerate(dims)]
        labels = gs.Variable(self.labels, dtype=dtype, shape=shape)
        graph.inputs.append(labels)
        return labels


def _reduce(loss: Loss, b: Builder, t: gs.Tensor) -> gs.Tensor:
    op = "ReduceMean" if loss.reduction == "mean" else "ReduceSum"
    return b.axes_op(op, t, None, keepdims=0)


def _classes_on_axis_1(loss: Loss, b: Builder, scores: gs.Tensor, labels: gs.Tensor) -> tuple[gs.Tensor, gs.Tensor]:
    """``scores`` and ``labels`` as the ONNX losses take them (classes on axis 1): as they are,
    or, with the classes last (``axis=-1``), flattened to ``[N, C]`` and ``[N]``."""
    rank = len(scores.shape)
    if loss.axis == 1 or rank == 2:
        return scores, labels
    return b.op("Flatten", scores, axis=rank - 1), b.op("Reshape", labels, b.constant(np.array([-1], np.int64)))


def _nll(loss: Loss, b: Builder, logp: gs.Tensor, labels: gs.Tensor) -> gs.Tensor:
    logp, labels = _classes_on_axis_1(loss, b, logp, labels)
    return _nll_of(loss, b, logp, labels)


def _nll_of(loss: Loss, b: Builder, logp: gs.Tensor, labels: gs.Tensor) -> gs.Tensor:
    return b.op("NegativeLogLikelihoodLoss", logp, labels, reduction=loss.reduction, ignore_index=loss.ignore_index)


def _cross_entropy(loss: Loss, b: Builder, logits: gs.Tensor, labels: gs.Tensor) -> gs.Tensor:
    if len(logits.shape) > 2 and b.opset < 13 and loss.axis == 1:
        raise PassError("cross_entropy over [N, C, d...] logits needs opset 13+ (LogSoftmax on one axis)")
    logits, labels = _classes_on_axis_1(loss, b, logits, labels)
    logp = b.op("LogSoftmax", logits, axis=1)
    nll = _nll_of(loss, b, logp, labels)
    eps = loss.label_smoothing
    if not eps:
        return nll
    # torch: (1 - eps) * nll + eps * mean over classes of -log p, over the labels not ignored
    smooth = b.neg(b.axes_op("ReduceMean", logp, [1], keepdims=0))
    keep = b.cast_like(b.op("Not", b.op("Equal", labels, b.constant(np.array(loss.ignore_index, np.int64)))), logits)
    smooth_total = b.axes_op("ReduceSum", b.mul(smooth, keep), None, keepdims=0)
    if loss.reduction == "mean":
        smooth_total = b.div(smooth_total, b.axes_op("ReduceSum", keep, None, keepdims=0))
    return b.add(b.mul(nll, b.scalar_like(1.0 - eps, logits)), b.mul(smooth_total, b.scalar_like(eps, logits)))


def _mse(loss: Loss, b: Builder, out: gs.Tensor, target: gs.Tensor) -> gs.Tensor:
    diff = b.sub(out, target)
    return _reduce(loss, b, b.mul(diff, diff))


def _l1(loss: Loss, b: Builder, out: gs.Tensor, target: gs.Tensor) -> gs.Tensor:
    return _reduce(loss, b, b.op("Abs", b.sub(out, target)))


def _bce_with_logits(loss: Loss, b: Builder, x: gs.Tensor, target: gs.Tensor) -> gs.Tensor:
    # the stable form torch uses: max(x, 0) - x * t + log(1 + exp(-|x|))
    per_element = b.add(b.sub(b.op("Relu", x), b.mul(x, target)), b.op("Softplus", b.neg(b.op("Abs", x))))
    return _reduce(loss, b, per_element)


_BUILDERS = {
    "cross_entropy": _cross_entropy,
    "nll": _nll,
    "mse": _mse,
    "l1": _l1,
    "bce_with_logits": _bce_with_logits,
}
