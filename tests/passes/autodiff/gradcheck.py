"""Numeric gradient checking of one ONNX op: the machinery behind the per-op table.

A case is one node. Its model feeds every input from a graph input, and the loss is
sum(y_k * R_k) over the node's float outputs with fixed random R_k, so every element of
every output matters. The autodiff pass differentiates with respect to the inputs the
case marks; central differences on the forward model, run by onnxruntime, are the oracle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from graphforge.passes import Autodiff
from onnx import helper, numpy_helper

import graphforge

DOUBLE, FLOAT = np.float64, np.float32


def away_from_zero(rng: np.random.Generator, *shape, low=-2.0, high=2.0) -> np.ndarray:
    """Uniform values away from zero (|v| >= 0.1), so kinks at 0 are not straddled. Each table
    module binds its own seeded generator (``r = partial(away_from_zero, rng)``): adding rows to
    one module leaves the values of the others as they were tuned."""
    v = rng.uniform(low, high, size=shape)
    return np.where(np.abs(v) < 0.1, np.sign(v + 1e-12) * 0.1 + v, v)


def ints(*values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


@dataclass
class Case:
    """One row of the table.

    inputs: the node's inputs in order, each an ndarray (used as given; float arrays are cast
      to the case dtype) or None for an omitted optional input.
    grad: indices of the inputs to differentiate (default: every floating-point input).
    const: indices of inputs fed as initializers instead of graph inputs (axes, shapes, ...).
    outer: graph inputs ``outer0``, ``outer1``, ... that the node's subgraphs (If branches)
      read from the enclosing scope; the float ones are differentiated too.
    after: nodes ``(op, inputs, attrs)`` applied to the outputs before the loss (Dequantize
      after Quantize); the last one's output replaces them.
    reference: an oracle replacing central differences where those cannot see the gradient
      (a straight-through estimator, a random mask): ``reference(feeds, outputs, weights)``
      gets the feeds, the float outputs of the same run that computed the gradients and the
      loss weights R_k, and returns the expected gradient of each differentiated input.
    params: indices of differentiated inputs fed to autodiff as trainable initializers (a
      model's parameters) instead of graph inputs: small constant inputs take other paths
      (a function body is expanded with their values known).
    omit: indices of the node's outputs it does not produce (LSTM without Y).
    domain, functions: the node's op domain, and the model-local functions (FunctionProtos)
      that define its op there (graphforge's marker ops).
    """

    op: str
    inputs: list
    attrs: dict = field(default_factory=dict)
    grad: list[int] | None = None
    const: tuple[int, ...] = ()
    opset: int = 18
    outputs: int = 1
    rtol: float = 1e-5
    atol: float = 1e-6
    f32_rtol: float = 2e-2
    f32_atol: float = 2e-3
    eps: float | None = None
    id: str = ""
    symbolic: bool = True  # also check with every input dim symbolic
    outer: list = field(default_factory=list)
    after: tuple = ()
    reference: Callable | None = None
    params: tuple[int, ...] = ()
    omit: tuple[int, ...] = ()
    domain: str = ""
    functions: tuple = ()

    def label(self) -> str:
        return self.id or self.op


def _is_float(a) -> bool:
    return a is not None and np.issubdtype(np.asarray(a).dtype, np.floating)


def build_model(case: Case, dtype, *, symbolic: bool = False) -> tuple[onnx.ModelProto, dict, list[str]]:
    """The one-node model, its feeds, and the names of the inputs to differentiate."""
    rng = np.random.default_rng(1234)
    graph_inputs, initializers, names, feeds = [], [], [], {}
    grad = case.grad if case.grad is not None else [i for i, a in enumerate(case.inputs) if _is_float(a)]
    wrt = []
    for i, value in enumerate(case.inputs):
        if value is None:
            names.append("")
            continue
        name = f"in{i}"
        names.append(name)
        arr = np.asarray(value)
        if _is_float(arr):
            arr = arr.astype(dtype)
        if i in case.const:
            initializers.append(numpy_helper.from_array(arr, name))
            continue
        shape = [f"{name}_d{k}" for k in range(arr.ndim)] if symbolic else list(arr.shape)
        graph_inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), shape))
        feeds[name] = arr
        if i in grad:
            wrt.append(name)
    for k, value in enumerate(case.outer):
        arr = np.asarray(value)
        arr = arr.astype(dtype) if _is_float(arr) else arr
        name = f"outer{k}"
        shape = [f"{name}_d{j}" for j in range(arr.ndim)] if symbolic else list(arr.shape)
        graph_inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), shape))
        feeds[name] = arr
        if _is_float(arr):
            wrt.append(name)
    outs = [f"out{k}" for k in range(case.outputs)]
    outputs_named = ["" if k in case.omit else o for k, o in enumerate(outs)]
    nodes = [helper.make_node(case.op, names, outputs_named, domain=case.domain or None, **case.attrs)]
    outs = [o for k, o in enumerate(outs) if k not in case.omit]
    for k, (op, ins, attrs) in enumerate(case.after):
        outs = [f"after{k}"]
        nodes.append(helper.make_node(op, ins, outs, **attrs))
    # loss = sum_k sum(out_k * R_k): needs the outputs' shapes, found by running the node once
    probe = _run(_model(nodes, graph_inputs, initializers, [_vi(o) for o in outs], case.opset, case.functions), feeds)
    float_outs = [(o, v) for o, v in zip(outs, probe, strict=True) if _is_float(v)]
    terms = []
    loss_type = helper.np_dtype_to_tensor_dtype(np.dtype(float_outs[0][1].dtype))
    for o, v in float_outs:
        r = rng.standard_normal(v.shape).astype(v.dtype)
        initializers.append(numpy_helper.from_array(r, f"R_{o}"))
        nodes.append(helper.make_node("Mul", [o, f"R_{o}"], [f"w_{o}"]))
        nodes.append(helper.make_node("ReduceSum", [f"w_{o}"], [f"s_{o}"], keepdims=0))
        if helper.np_dtype_to_tensor_dtype(v.dtype) != loss_type:  # outputs of other types (LayerNorm's stash type)
            nodes.append(helper.make_node("Cast", [f"s_{o}"], [f"c_{o}"], to=loss_type))
            terms.append(f"c_{o}")
        else:
            terms.append(f"s_{o}")
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    outputs = [helper.make_tensor_value_info("loss", loss_type, [])]
    if case.reference is not None:  # the reference reads the outputs of the run it checks
        outputs += [
            helper.make_tensor_value_info(o, helper.np_dtype_to_tensor_dtype(v.dtype), [None] * v.ndim)
            for o, v in float_outs
        ]
    model = _model(nodes, graph_inputs, initializers, outputs, case.opset, case.functions)
    return model, feeds, wrt


def _vi(name):
    return helper.make_value_info(name, onnx.TypeProto())


def _model(nodes, inputs, initializers, outputs, opset, functions=()):
    graph = helper.make_graph(nodes, "case", inputs, outputs, initializers)
    imports = [
        helper.make_opsetid("", opset),
        *(helper.make_opsetid(d, 1) for d in sorted({f.domain for f in functions})),
    ]
    own = []
    for function in functions:  # at the model's opset: onnx requires the two to agree
        copy = onnx.FunctionProto()
        copy.CopyFrom(function)
        del copy.opset_import[:]
        copy.opset_import.append(helper.make_opsetid("", opset))
        own.append(copy)
    model = helper.make_model(graph, opset_imports=imports, functions=own)
    model.ir_version = 8 if opset <= 18 else 10  # what onnx expects of the opset; onnxruntime reads both
    return model


def _run(model, feeds, outputs=None):
    session = graphforge.create_session(model, providers=["CPUExecutionProvider"])
    return session.run(outputs, feeds)


def analytic_gradients(model, feeds, wrt, params=()) -> dict[str, np.ndarray]:
    """The autodiff gradients of the loss: ``params`` as trainable initializers holding their
    feeds, the other names of ``wrt`` as graph inputs."""
    if params:
        model = _as_initializers(model, {n: feeds[n] for n in params})
        feeds = {n: v for n, v in feeds.items() if n not in params}
    inputs = tuple(n for n in wrt if n not in params)
    result = graphforge.compile(model, [Autodiff(inputs=inputs, trainable=tuple(params) or ("*",))])
    names = [f"{n}_grad" for n in wrt]
    return dict(zip(wrt, _run(result.model, feeds, names), strict=True))


def _as_initializers(model, values: dict[str, np.ndarray]):
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = [v for v in out.graph.input if v.name not in values]
    del out.graph.input[:]
    out.graph.input.extend(kept)
    out.graph.initializer.extend(numpy_helper.from_array(v, n) for n, v in values.items())
    return out


def numeric_gradients(model, feeds, wrt, eps: float) -> dict[str, np.ndarray]:
    session = graphforge.create_session(model, providers=["CPUExecutionProvider"])
    grads = {}
    for name in wrt:
        base = feeds[name]
        g = np.zeros(base.shape, dtype=np.float64)
        for idx in np.ndindex(base.shape):
            values = []
            for sign in (1, -1):
                bumped = base.copy()
                bumped[idx] += sign * eps
                values.append(float(session.run(["loss"], {**feeds, name: bumped})[0]))
            g[idx] = (values[0] - values[1]) / (2 * eps)
        grads[name] = g
    return grads


def reference_gradients(case: Case, model, feeds, wrt) -> tuple[dict, dict]:
    """The gradients, and what ``case.reference`` expects of them given the same run's outputs."""
    result = graphforge.compile(model, [Autodiff(inputs=tuple(wrt))])
    outs = [o.name for o in model.graph.output if o.name != "loss"]
    values = _run(result.model, feeds, [f"{n}_grad" for n in wrt] + outs)
    analytic = dict(zip(wrt, values[: len(wrt)], strict=True))
    weights = {t.name[2:]: numpy_helper.to_array(t) for t in model.graph.initializer if t.name.startswith("R_")}
    expected = case.reference(feeds, dict(zip(outs, values[len(wrt) :], strict=True)), weights)
    return analytic, {name: expected[name] for name in wrt}


def supports_double(case: Case) -> bool:
    """Whether onnxruntime's CPU provider runs this op (and its gradient graph) in float64."""
    try:
        model, feeds, wrt = build_model(case, DOUBLE)
        analytic_gradients(model, feeds, wrt, _param_names(case))
    except Exception as exc:
        message = str(exc)
        # the last: onnxruntime expands function ops (MeanVarianceNormalization) with float constants
        unsupported = (
            "NOT_IMPLEMENTED",
            "Could not find an implementation",
            "Type 'tensor(double)'",
            "does not support double",
            "different types",
        )
        if any(m in message for m in unsupported):
            return False
        raise
    return True


def check(case: Case, *, symbolic: bool = False) -> str:
    """Compare analytic and numeric gradients; returns the dtype used."""
    dtype = DOUBLE if supports_double(case) else FLOAT
    model, feeds, wrt = build_model(case, dtype, symbolic=symbolic)
    assert wrt, f"{case.label()}: no input to differentiate"
    if case.reference is not None:
        analytic, numeric = reference_gradients(case, model, feeds, wrt)
    else:
        analytic = analytic_gradients(model, feeds, wrt, _param_names(case))
        eps = case.eps or (1e-6 if dtype is DOUBLE else 1e-2)
        numeric = numeric_gradients(model, feeds, wrt, eps)
    rtol, atol = (case.rtol, case.atol) if dtype is DOUBLE else (case.f32_rtol, case.f32_atol)
    for name in wrt:
        np.testing.assert_allclose(
            analytic[name], numeric[name], rtol=rtol, atol=atol,
            err_msg=f"{case.label()}: gradient of input {name} ({np.dtype(dtype).name}, symbolic={symbolic})",
        )  # fmt: skip
    return np.dtype(dtype).name


def _param_names(case: Case) -> tuple[str, ...]:
    return tuple(f"in{i}" for i in case.params)


def no_gradient_model(case: Case) -> tuple[onnx.ModelProto, list[str]]:
    """A model whose loss depends on the inputs only through the (non-differentiable) op."""
    graph_inputs, names, wrt = [], [], []
    for i, value in enumerate(case.inputs):
        name = f"in{i}"
        names.append(name)
        arr = np.asarray(value)
        graph_inputs.append(
            helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), list(arr.shape))
        )
        wrt.append(name)
    nodes = [
        helper.make_node(case.op, names, ["out0"], domain=case.domain or None, **case.attrs),
        helper.make_node("Cast", ["out0"], ["as_float"], to=onnx.TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["as_float"], ["loss"], keepdims=0),
    ]
    loss = helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])
    return _model(nodes, graph_inputs, [], [loss], case.opset, case.functions), wrt
