"""Gradient conformance on onnx's own backend node test cases (``onnx.backend.test.case.node``).

Each case is a small model written by the onnx project (one op, or an ``*_expanded`` function
body inlined), with its inputs. For each case:

1. every floating-point input becomes a trainable initializer, every other input a constant
   initializer; the loss is ``sum_k sum(y_k * R_k)`` over the float outputs (those no rule
   detaches) with fixed random ``R_k``, so every element of every output matters; ``autodiff``
   builds the gradients, which onnxruntime computes in the model's own type;
2. the oracle is central differences in float64: a float64 copy of the forward model (every
   float type, initializer, type attribute and constant made double), run by onnxruntime where
   it runs the copy, else by onnx's reference evaluator; an evaluator must reproduce the
   model's outputs and pass a float64 probe (``_sees_float64``). Where none does, the model as
   it is, with wider steps and tolerance;
3. the step and the kink rule: at each sampled coordinate the numeric gradient is the central
   difference at the smallest of ``STEPS`` where the left and right difference quotients
   agree, and the central difference at the next step agrees with it (within ``KINK_RTOL``:
   a larger step gets past an oracle's rounding noise). Where no step passes, the coordinate
   is within a step of a point where the loss is not differentiable (ReLU at 0, a tie in Max
   or ArgMax, a step of Floor, the edge of an op's domain) and is skipped and counted, never
   compared; every other coordinate sampled must match, within ``TOLERANCE`` of the largest
   gradient of the case (a gradient near zero is judged on the scale of the others). An input
   a rule calls a setting and gives no gradient (BatchNormalization's running mean) is
   reported, not compared.

The outcome of a case is one of ``STATUSES``: matched; refused (the autodiff's GraphforgeError,
naming the op and why); skipped, for one of these reasons only: the ``SKIP`` list (a random
forward), inputs of types numpy lacks or sequence inputs, a forward onnxruntime cannot run,
outputs holding inf or nan, no evaluator reproducing the forward, float16 without a float64
evaluator, every sampled coordinate at a kink; no rule (an op on the way has none); nothing to
differentiate. A mismatch or an error (anything escaping the autodiff that is not a
GraphforgeError, or a gradient graph onnxruntime refuses) fails the test.

``python tests/passes/autodiff/conformance.py`` (``make conformance``) runs every case and writes
docs/ops-conformance.json, which ``python -m graphforge.passes.autodiff.opsdoc`` renders into
docs/ops.md.
"""

from __future__ import annotations

import json
import re
import sys
import warnings
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from graphforge.passes.autodiff import RULES, Autodiff, MissingGradientRule
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import graphforge
from graphforge.errors import GraphforgeError, one_line
from graphforge.ir import NONDETERMINISTIC_OPS, model_nodes

REPO = Path(__file__).resolve().parents[3]
RESULTS = REPO / "docs" / "ops-conformance.json"
#: how to record the outcomes anew
COMMAND = "python tests/passes/autodiff/conformance.py"
#: coordinates compared per differentiated input (sampled, the same ones every run)
COORDINATES = 12
#: the reference evaluator runs ops in Python loops: where it is the oracle and an input has
#: more elements than this (the 3-D pooling cases, [1, 3, 32, 32, 32]: 2.5 s a run, 90 s a
#: case at 12 coordinates, 35 s at 3), that input samples LARGE_REFERENCE_COORDINATES instead
#: (their smaller 3-D and 2-D cases, with ONNX Runtime or the reference as the oracle, sample 12)
LARGE_REFERENCE_ELEMENTS, LARGE_REFERENCE_COORDINATES = 32_768, 1
#: central-difference steps tried, smallest first, relative to the coordinate's size: in float64,
#: and in the model's own type
STEPS_64, STEPS_32 = (1e-7, 1e-6, 1e-5, 1e-4, 1e-3), (1e-3, 3e-3, 1e-2, 3e-2)
#: left and right difference quotients further apart than this (relative) mean a kink within the step
KINK_RTOL = 1e-3
#: |analytic - numeric| <= rtol * max(|numeric|, the case's largest gradient) + atol, by the
#: analytic's type; atol is where float32 rounding of the intermediates dominates (a saturated
#: tanh's 1 - y^2 keeps two digits of a 1e-5 derivative, in torch as here)
TOLERANCE = {
    np.dtype(np.float64): (1e-6, 1e-12),
    np.dtype(np.float32): (2e-3, 1e-5),
    np.dtype(np.float16): (5e-2, 1e-3),
}

#: cases left out, and why (each reason is one the report names)
SKIP = {
    # the forward draws random numbers: central differences see noise, not a derivative
    "random": ("test_dropout_default_mask", "test_dropout_default_mask_ratio", "test_dropout_default",
               "test_dropout_default_ratio", "test_training_dropout", "test_training_dropout_default",
               "test_training_dropout_default_mask", "test_training_dropout_mask"),
}  # fmt: skip

STATUSES = ("matched", "refused", "skipped", "no rule", "nothing to differentiate", "mismatch", "error")


@dataclass
class Outcome:
    """What one case gave: a status of STATUSES, why (refused, skipped, no rule, mismatch,
    error), and how many coordinates were compared and skipped as kinks."""

    case: str
    ops: list[str]
    status: str
    reason: str = ""
    checked: int = 0
    kinks: int = 0
    oracle: str = ""
    details: list[str] = field(default_factory=list)
    #: inputs and outputs left out by design: a rule's settings that get no gradient, and the
    #: outputs a rule detaches (see graphforge.passes.autodiff.registry.Rule)
    by_design: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status not in ("mismatch", "error")


_collected: tuple[frozenset[str], dict[str, object]] | None = None


def cases(without: Iterable[str] = ()) -> dict[str, object]:
    """onnx's backend node test cases by name (collected once; onnx prints warnings making them).

    ``without``: cases whose data is not made. onnx makes every case's expected outputs as it
    imports its modules, with its reference evaluator: the 3-D pooling cases take seconds each,
    paid again by every test process that collects them. Their modules are imported once, so
    the first call decides; a later one cannot bring back a case the first left out."""
    global _collected
    without = frozenset(without)
    if _collected is None:
        from onnx.backend.test.case import base
        from onnx.backend.test.case.node import collect_testcases

        exporter = base._Exporter.__init__  # runs each export_* of a case class as it is made
        unmade = {"export_" + name.removeprefix("test_") for name in without}

        def made_without(cls, name, bases, namespace):
            exporter(cls, name, bases, {k: v for k, v in namespace.items() if k not in unmade})

        base._Exporter.__init__ = made_without
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                _collected = (without, {case.name: case for case in collect_testcases(None)})
        finally:
            base._Exporter.__init__ = exporter
    left_out, collected = _collected
    unknown = sorted(n for n in left_out if not defines(n))
    if unknown:
        raise ValueError(f"onnx has no export function named for {unknown}: they cannot be left out")
    if not left_out <= without:
        raise RuntimeError(f"the cases were collected without {sorted(left_out - without)}")
    return {name: case for name, case in collected.items() if name not in without}


def _collected_cases() -> dict[str, object]:
    """The cases collected so far (every case, where none were yet)."""
    return _collected[1] if _collected is not None else cases()


def defines(name: str) -> bool:
    """Whether onnx defines the case ``name``, made or not, by an export function named for it
    (``export_averagepool_3d_default`` makes ``test_averagepool_3d_default``): what ``cases``
    can leave out. (A class's plain ``export`` names its case after the op: not seen here.)"""
    from onnx.backend.test.case.base import Base

    export = "export_" + name.removeprefix("test_")
    return any(export in vars(cls) for cls in Base.__subclasses__())


def op_label(node: onnx.NodeProto) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


def case_ops(model: onnx.ModelProto) -> list[str]:
    return sorted({op_label(n) for n in model_nodes(model)})


# --------------------------------------------------------------------------- the training model


def _inputs(case) -> list[np.ndarray] | str:
    """The case's first data set's inputs as arrays, or why they cannot be used."""
    values = []
    for value in case.data_sets[0][0]:
        if isinstance(value, list) or value is None:
            return "sequence or optional inputs"
        if isinstance(value, TensorProto):
            if value.data_type not in _NUMPY_TYPES:
                return f"an input of type {TensorProto.DataType.Name(value.data_type).lower()}, which numpy lacks"
            value = numpy_helper.to_array(value)
        values.append(np.asarray(value))
    return values


#: element types numpy holds as they are (bfloat16 and float8 come back as other types)
_NUMPY_TYPES = {
    TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.INT8, TensorProto.INT16,
    TensorProto.INT32, TensorProto.INT64, TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32,
    TensorProto.UINT64, TensorProto.BOOL,
}  # fmt: skip
#: the name of the loss output (no case uses it)
LOSS = "conformance_loss"


def _weights(case_name: str, outputs: list[tuple[str, np.ndarray]]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(zlib.crc32(case_name.encode()))
    return {name: rng.standard_normal(value.shape).astype(value.dtype) for name, value in outputs}


def loss_model(model: onnx.ModelProto, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """``model`` with the float32 scalar output ``loss = sum_k sum(y_k * R_k)`` first, then its
    own outputs (the oracle is checked on all of them)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    terms = []
    for k, (name, r) in enumerate(weights.items()):
        graph.initializer.append(numpy_helper.from_array(r, f"conformance_R{k}"))
        graph.node.extend([
            helper.make_node("Mul", [name, f"conformance_R{k}"], [f"conformance_w{k}"]),
            helper.make_node("ReduceSum", [f"conformance_w{k}"], [f"conformance_s{k}"], keepdims=0),
            helper.make_node("Cast", [f"conformance_s{k}"], [f"conformance_t{k}"], to=TensorProto.FLOAT),
        ])  # fmt: skip
        terms.append(f"conformance_t{k}")
    graph.node.append(helper.make_node("Sum", terms, [LOSS]))
    graph.output.insert(0, helper.make_tensor_value_info(LOSS, TensorProto.FLOAT, []))
    if not any(o.domain in ("", "ai.onnx") for o in out.opset_import):  # the loss's own ops need one
        out.opset_import.append(helper.make_opsetid("", 13))
    out.ir_version = max(out.ir_version, 4)  # initializers that are not graph inputs
    return out


def with_initializers(model: onnx.ModelProto, values: dict[str, np.ndarray], names) -> onnx.ModelProto:
    """``model`` with the graph inputs ``names`` turned into initializers holding ``values``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = [v for v in out.graph.input if v.name not in names]
    del out.graph.input[:]
    out.graph.input.extend(kept)
    out.graph.initializer.extend(numpy_helper.from_array(values[n], n) for n in names)
    return out


# --------------------------------------------------------------------------- the float64 copy

_TO_DOUBLE = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16}
#: attributes naming an element type the node produces
_TYPE_ATTRIBUTES = ("to", "dtype", "output_dtype", "softmax_precision", "stash_type")


def as_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` computing in float64: float types of inputs, outputs, value infos,
    initializers, Cast/RandomX targets and constant attributes, in every graph and subgraph."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graphs = [out.graph]
    while graphs:
        graph = graphs.pop()
        for value in [*graph.input, *graph.output, *graph.value_info]:
            if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type in _TO_DOUBLE:
                value.type.tensor_type.elem_type = TensorProto.DOUBLE
        for i, tensor in enumerate(graph.initializer):
            if tensor.data_type in _TO_DOUBLE:
                graph.initializer[i].CopyFrom(_double_tensor(tensor))
        for node in graph.node:
            for attr in node.attribute:
                if attr.name in _TYPE_ATTRIBUTES and attr.type == onnx.AttributeProto.INT and attr.i in _TO_DOUBLE:
                    attr.i = TensorProto.DOUBLE
                elif attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in _TO_DOUBLE:
                    attr.t.CopyFrom(_double_tensor(attr.t))
                elif attr.type == onnx.AttributeProto.GRAPH:
                    graphs.append(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    graphs.extend(attr.graphs)
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                _constant_lists_as_double(node)
    return out


def _double_tensor(tensor: TensorProto) -> TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float64), tensor.name)


def _constant_lists_as_double(node: onnx.NodeProto) -> None:
    """A Constant's ``value_float(s)`` (always float32) becomes a float64 ``value``."""
    for attr in list(node.attribute):
        if attr.name in ("value_float", "value_floats"):
            values = np.array(attr.f if attr.name == "value_float" else list(attr.floats), np.float64)
            node.attribute.remove(attr)
            node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(values)))


# --------------------------------------------------------------------------- evaluators


def _ort(model: onnx.ModelProto):
    options = ort.SessionOptions()
    options.log_severity_level = 4  # a kernel refusing float64 at run time is an answer here, not news
    session = graphforge.create_session(model, providers=["CPUExecutionProvider"], options=options)
    return lambda feeds, outputs=(LOSS,): session.run(list(outputs), feeds)


def _reference(model: onnx.ModelProto):
    evaluator = ReferenceEvaluator(model)
    return lambda feeds, outputs=(LOSS,): evaluator.run(list(outputs), feeds)


def oracle(model: onnx.ModelProto, feeds: dict[str, np.ndarray], expected: dict[str, np.ndarray]):
    """(loss function of the feeds, its name, whether it computes in float64): the first of
    onnxruntime on the float64 copy, the reference evaluator on it, onnxruntime on the model as
    it is, that reproduces ``expected`` (the float outputs onnxruntime gives for the model as
    it is): an evaluator whose op differs (the reference RNN ignores sequence_lens) is passed over."""
    double = as_float64(model)
    double_feeds = {n: v.astype(np.float64) if v.dtype.kind == "f" else v for n, v in feeds.items()}
    for name, make, candidate, in64 in (
        ("onnxruntime float64", _ort, double, True),
        ("reference float64", _reference, double, True),
        ("onnxruntime", _ort, model, False),
    ):
        try:
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run = make(candidate)
                values = run(double_feeds if in64 else feeds, list(expected))
        except Exception:
            continue
        same = all(_close(np.asarray(v, np.float64), e) for v, e in zip(values, expected.values(), strict=True))
        if same and (not in64 or _sees_float64(run, double_feeds, list(expected), values)):
            return (lambda f, run=run: float(np.asarray(run(f)[0]))), name, in64
    return None, "", False


#: how far the float64 probe nudges the inputs: multiples of 1e-6 of themselves, not in
#: simple ratio, so that rounding to float32 cannot scale along by chance
_PROBE_STEPS = (1, 3, 7)


def _sees_float64(run, feeds: dict[str, np.ndarray], outputs: list[str], values) -> bool:
    """Whether an evaluator of a float64 copy computes in float64 all the way: nudging every
    float input by k random 1e-6 of itself (k in _PROBE_STEPS) must move the outputs k times as
    far (to 1e-4), as smooth float64 arithmetic does; a float32 computation inside (onnx's
    reference Erf, and so its Gelu) rounds the small moves to steps of 6e-8 and breaks that."""
    rng = np.random.default_rng(0)
    direction = {n: rng.choice([-1.0, 1.0], v.shape) for n, v in feeds.items() if v.dtype.kind == "f"}
    try:
        moved = [
            run({n: v * (1 + k * 1e-6 * direction[n]) if n in direction else v for n, v in feeds.items()}, outputs)
            for k in _PROBE_STEPS
        ]
    except Exception:
        return False
    ratios = []
    for before, *after in zip(values, *moved, strict=True):
        before = np.asarray(before, np.float64)
        first = np.asarray(after[0], np.float64) - before
        floor = 1e-14 * max(float(np.max(np.abs(before), initial=0.0)), 1.0)
        for k, value in zip(_PROBE_STEPS[1:], after[1:], strict=True):
            delta = np.asarray(value, np.float64) - before
            moving = np.abs(delta) > floor
            ratios.append((np.abs(delta - k * first) / np.maximum(np.abs(delta), 1e-300))[moving])
    ratios = np.concatenate(ratios) if ratios else np.zeros(0)
    return ratios.size == 0 or float(np.mean(ratios <= 1e-4)) >= 0.95


#: how close an oracle's forward must be to onnxruntime's in the model's own type, relative to
#: the output's largest element: about a hundred roundings of that type
_FORWARD_RTOL = {np.dtype(np.float64): 1e-9, np.dtype(np.float32): 1e-4, np.dtype(np.float16): 2e-2}


def _close(value: np.ndarray, expected: np.ndarray) -> bool:
    """Equal in shape, and in value to the rounding of ``expected``'s type."""
    if value.shape != expected.shape:
        return False
    if not expected.size:
        return True
    rtol = _FORWARD_RTOL.get(expected.dtype, 2e-2)
    wide = np.asarray(expected, np.float64)
    scale = max(float(np.max(np.abs(wide[np.isfinite(wide)]), initial=0.0)), 1e-30)
    same_inf = np.isfinite(value) == np.isfinite(wide)
    return bool(same_inf.all() and np.all(np.abs(value - wide)[np.isfinite(wide)] <= rtol * scale))


# --------------------------------------------------------------------------- one case


def check_case(name: str, *, coordinates: int = COORDINATES) -> Outcome:
    """Run one backend case through autodiff and the oracle; never raises."""
    case = _collected_cases()[name]
    ops = case_ops(case.model)
    outcome = Outcome(name, ops, "error")
    try:
        with np.errstate(all="ignore"):
            _check(case, outcome, coordinates)
    except Exception as exc:  # an escaping exception is a bug somewhere: say which
        outcome.status, outcome.reason = "error", f"{type(exc).__name__}: {one_line(exc)}"[:300]
    return outcome


class _Stop(Exception):
    """Ends a case early with an outcome (skipped, refused, no rule, nothing to differentiate)."""

    def __init__(self, status: str, reason: str):
        super().__init__(status, reason)
        self.status, self.reason = status, reason


def _check(case, outcome: Outcome, coordinates: int) -> None:
    try:
        feeds, wrt = _feeds(case, outcome)
        forward_model, floats = _forward(case, outcome, feeds)
        analytic = _analytic(forward_model, feeds, wrt)
        _compare(case, outcome, forward_model, floats, feeds, wrt, analytic, coordinates)
    except _Stop as stop:
        outcome.status, outcome.reason = stop.status, stop.reason


def _feeds(case, outcome: Outcome) -> tuple[dict[str, np.ndarray], list[str]]:
    """The case's inputs by name, and the floating-point ones (differentiated)."""
    for reason, names in SKIP.items():
        if case.name in names:
            raise _Stop("skipped", reason)
    if any(op in NONDETERMINISTIC_OPS and op != "Dropout" for op in outcome.ops):
        raise _Stop("nothing to differentiate", "a random op")
    values = _inputs(case)
    if isinstance(values, str):
        raise _Stop("skipped", values)
    feeds = dict(zip([v.name for v in case.model.graph.input], values, strict=True))
    wrt = [n for n, v in feeds.items() if v.dtype.kind == "f"]
    if not wrt:
        raise _Stop("nothing to differentiate", "no floating-point input")
    if not any(feeds[n].size for n in wrt):
        raise _Stop("nothing to differentiate", "every floating-point input is empty")
    return feeds, wrt


def _forward(case, outcome: Outcome, feeds) -> tuple[onnx.ModelProto, list[tuple[str, np.ndarray]]]:
    """The model with its loss (over the float outputs no rule detaches), and those outputs
    as onnxruntime computes them."""
    model = case.model
    try:
        results = graphforge.create_session(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    except Exception as exc:
        raise _Stop("skipped", f"onnxruntime cannot run the forward ({one_line(exc)})") from None
    floats = [
        (o.name, np.asarray(v))
        for o, v in zip(model.graph.output, results, strict=True)
        if o.name and o.type.HasField("tensor_type") and isinstance(v, np.ndarray) and v.dtype.kind == "f"
    ]
    detached = {name: why for name, why in _detached_outputs(model).items() if name in dict(floats)}
    outcome.by_design += [f"output {name}: {why}" for name, why in detached.items()]
    floats = [(n, v) for n, v in floats if n not in detached]
    if not floats:
        raise _Stop("nothing to differentiate", "no floating-point output")
    if not all(np.isfinite(v).all() for _, v in floats):
        raise _Stop("skipped", "the outputs hold inf or nan at the case's inputs")
    return loss_model(model, _weights(case.name, floats)), floats


def _analytic(forward_model: onnx.ModelProto, feeds, wrt: list[str]) -> dict[str, np.ndarray]:
    """autodiff's gradients with every input an initializer (the float ones trainable), run by
    onnxruntime in the model's own type; the inputs a rule gives none are missing."""
    program = with_initializers(forward_model, feeds, list(feeds))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = graphforge.compile(program, [Autodiff(loss=LOSS, trainable=tuple(wrt))]).model
    except GraphforgeError as exc:  # the PassManager's error; what the pass raised is its cause
        cause = exc.__cause__
        if isinstance(cause, MissingGradientRule):  # "cannot differentiate op X (...) in node 'n': why; ..."
            why = re.sub(r"^.*? in node '[^']*': ", "", str(cause)).split(";")[0].split(". ")[0]
            op = re.search(r"op (\S+) \(", str(cause))
            raise _Stop("no rule", f"{op.group(1)}: {why}" if op else why) from None
        if "depends on none of" in str(exc):  # every op on the way has a rule that gives none
            raise _Stop("nothing to differentiate", "no gradient flows through its ops") from None
        if cause is not None and not isinstance(cause, GraphforgeError):
            raise _Stop("error", one_line(exc)) from None  # an internal error escaped the pass: a bug
        raise _Stop("refused", one_line(exc)) from None
    gradients = json.loads(graphforge.roles.metadata_of(compiled)[graphforge.roles.GRADIENTS])
    session = graphforge.create_session(compiled, providers=["CPUExecutionProvider"])  # failing: a bug
    names = [n for n in wrt if n in gradients]
    return dict(zip(names, session.run([gradients[n] for n in names], {}), strict=True))


def _compare(case, outcome: Outcome, forward_model, floats, feeds, wrt, analytic, coordinates: int) -> None:
    """Central differences at sampled coordinates of each differentiated input, against ``analytic``."""
    constants = [n for n in feeds if n not in wrt]
    evaluate, outcome.oracle, in64 = oracle(
        with_initializers(forward_model, feeds, constants), {n: feeds[n] for n in wrt}, dict(floats)
    )
    if evaluate is None:
        raise _Stop("skipped", "no evaluator reproduces the forward")
    if not in64 and any(feeds[n].dtype.itemsize < 4 for n in wrt):
        raise _Stop(
            "skipped", "no evaluator runs a float64 copy, and differences in float16 are too coarse to judge by"
        )
    base = {n: feeds[n].astype(np.float64) if in64 else feeds[n] for n in wrt}
    steps = STEPS_64 if in64 else STEPS_32
    f0 = evaluate(base)
    scale = max([float(np.max(np.abs(g))) for g in analytic.values() if np.size(g)] + [1e-6])
    rng = np.random.default_rng(zlib.crc32(case.name.encode()) + 1)
    for name in wrt:
        value, grad = base[name], analytic.get(name)
        setting = _setting(case.model, name) if grad is None else None
        if setting is not None:  # the rule gives this input no gradient, and says why
            outcome.by_design.append(f"input {name}: {setting}")
            continue
        expected = np.zeros(value.shape) if grad is None else np.asarray(grad, np.float64)
        rtol, atol = TOLERANCE.get(np.dtype(grad.dtype) if grad is not None else np.dtype(np.float32), (2e-3, 1e-5))
        if not in64:  # the oracle itself rounds like the model: wider steps, wider tolerance
            rtol = max(rtol, 2e-2)
        sampled = coordinates
        if outcome.oracle.startswith("reference") and value.size > LARGE_REFERENCE_ELEMENTS:
            sampled = min(coordinates, LARGE_REFERENCE_COORDINATES)
        for index in rng.choice(value.size, size=min(value.size, sampled), replace=False) if value.size else []:
            idx = np.unravel_index(int(index), value.shape)
            found = central_difference(evaluate, base, f0, name, idx, steps)
            if found is None:
                outcome.kinks += 1
                continue
            numeric, h = found
            # the oracle's own rounding: a loss rounded to its type, differenced over 2h
            rounding = 4 * np.finfo(np.float64 if in64 else np.float32).eps * max(1.0, abs(f0)) / h
            outcome.checked += 1
            if abs(expected[idx] - numeric) > rtol * max(abs(numeric), scale) + atol + rounding:
                which = "no gradient (the rule gives none)" if grad is None else f"{expected[idx]:.6g}"
                outcome.details.append(f"{name}{[int(i) for i in idx]}: analytic {which}, numeric {numeric:.6g}")
    if outcome.details:
        outcome.status = "mismatch"
        outcome.reason = f"{len(outcome.details)} of {outcome.checked} coordinates differ; " + outcome.details[0]
    elif outcome.checked == 0:
        outcome.status, outcome.reason = "skipped", "every sampled coordinate is at a kink"
    else:
        outcome.status = "matched"


def central_difference(evaluate, base: dict, f0: float, name: str, idx, steps) -> tuple[float, float] | None:
    """d loss / d base[name][idx]: the central difference at the smallest of ``steps`` where the
    left and right quotients agree and the next step's central difference agrees with it (an
    oracle's rounding noise fails that), and that step; None where no step passes (a kink, or
    a step that leaves the op's domain)."""
    value = base[name]
    quotients: dict[int, tuple[float, float, float] | None] = {}

    def at(k: int):
        if k not in quotients:
            h = steps[k] * max(1.0, abs(float(value[idx])))
            try:
                fp = evaluate({**base, name: _bumped(value, idx, h)})
                fm = evaluate({**base, name: _bumped(value, idx, -h)})
            except Exception:  # the op refuses the bumped value (a ratio below 0, a scale it cannot take)
                quotients[k] = None
            else:
                quotients[k] = ((fp - f0) / h, (f0 - fm) / h, (fp - fm) / (2 * h), h)
        return quotients[k]

    for k in range(len(steps) - 1):
        here, wider = at(k), at(k + 1)
        if here is None or wider is None:
            return None
        right, left, central, h = here
        if not all(np.isfinite(v) for v in (right, left, central, wider[2])):
            continue
        sides_agree = abs(right - left) <= KINK_RTOL * (1.0 + abs(right) + abs(left))
        if sides_agree and abs(central - wider[2]) <= KINK_RTOL * (1.0 + abs(central)):
            return central, h
    return None


def _rule(node: onnx.NodeProto):
    return RULES.get(node.op_type, node.domain if node.domain != "ai.onnx" else "")


def _detached_outputs(model: onnx.ModelProto) -> dict[str, str]:
    """Graph outputs a top-level node makes at an output its rule detaches, with why."""
    found = {}
    for node in model.graph.node:
        rule = _rule(node)
        for i, name in enumerate(node.output):
            why = dict(rule.detached).get(i) if rule is not None else None
            if name and why is not None:
                found[name] = f"{node.op_type} output {i}, {why}"
    return found


def _setting(model: onnx.ModelProto, name: str) -> str | None:
    """Why ``name`` gets no gradient, when every top-level node reading it reads it at an input
    its rule calls a setting; else None."""
    reasons = []
    for node in model.graph.node:
        for i, x in enumerate(node.input):
            if x != name:
                continue
            rule = _rule(node)
            what = rule.setting(i) if rule is not None else None
            if what is None:
                return None
            reasons.append(f"{node.op_type} input {i}, {what}")
    return "; ".join(dict.fromkeys(reasons)) or None


def _bumped(value: np.ndarray, idx, h: float) -> np.ndarray:
    out = value.copy()
    out[idx] = out[idx] + h
    return out


# --------------------------------------------------------------------------- the full run


def run_all(names=None, *, coordinates: int = COORDINATES, progress=None) -> list[Outcome]:
    outcomes = []
    for name in sorted(names or cases()):
        outcomes.append(check_case(name, coordinates=coordinates))
        if progress is not None:
            progress(outcomes[-1])
    return outcomes


def op_of(name: str) -> str:
    """The op type a case checks: its one node's, or for ``*_expanded`` (the function body
    inlined) the unexpanded case's; the ops of a case of several nodes joined by "+" (the
    nodes of the main graph: If, Loop and Scan stand for their bodies)."""
    base = _collected_cases().get(name.split("_expanded")[0]) or _collected_cases()[name]  # also *_expanded_ver18
    return "+".join(sorted({op_label(n) for n in base.model.graph.node}))  # not its bodies' ops


def short(reason: str) -> str:
    """A reason as the report shows it: without the PassManager's and the rule's prefixes, the
    node, onnxruntime's status codes and long tensor names, cut to about a hundred characters."""
    reason = re.sub(r"^pass \d+ \(autodiff\(.*?\)\) failed: ", "", reason)
    reason = reason.removeprefix("cannot differentiate: ")
    reason = re.sub(r" \(node '[^']*', op [^)]*\)$", "", reason)
    reason = reason.replace("onnxruntime cannot load the model: ", "")
    reason = re.sub(r"\[ONNXRuntimeError\] : \d+ : \w+ : ", "", reason)
    reason = re.sub(r"'[^' ]{30,}'", "'...'", reason)
    return reason if len(reason) <= 110 else reason[:107].rsplit(" ", 1)[0] + " ..."


def record(outcomes: list[Outcome]) -> dict:
    """What docs/ops-conformance.json holds: the versions, and per case its op, outcome, why,
    and the coordinates compared and skipped as kinks."""
    entries = {}
    for o in outcomes:
        entry = {"op": op_of(o.case), "status": o.status}
        if o.reason and o.status != "matched":
            entry["reason"] = short(o.reason)
        for key in ("checked", "kinks", "oracle", "by_design"):
            if getattr(o, key):
                entry[key] = getattr(o, key)
        entries[o.case] = entry
    return {"onnx": onnx.__version__, "onnxruntime": ort.__version__, "coordinates": COORDINATES, "cases": entries}


def write(results: dict) -> None:
    """docs/ops-conformance.json, one case a line (reviewable diffs), then docs/ops.md."""
    from graphforge.passes.autodiff import opsdoc

    head = {k: v for k, v in results.items() if k != "cases"}
    lines = [json.dumps(head)[:-1] + ', "cases": {']
    cases_ = list(results["cases"].items())
    for i, (name, entry) in enumerate(cases_):
        lines.append(f"{json.dumps(name)}: {json.dumps(entry)}" + ("," if i < len(cases_) - 1 else ""))
    lines.append("}}")
    RESULTS.write_text("\n".join(lines) + "\n")
    opsdoc.main([])


def main() -> int:
    outcomes = run_all(progress=lambda o: print(f"{o.status:<24} {o.case} {o.reason}"[:200], flush=True))
    bad = [o for o in outcomes if not o.ok]
    for o in bad:
        print(f"{o.status}: {o.case}: {o.reason}", file=sys.stderr)
    if bad:
        print(f"{len(bad)} of {len(outcomes)} cases mismatched or failed; nothing written", file=sys.stderr)
        return 1
    write(record(outcomes))
    print(f"{len(outcomes)} cases; written to {RESULTS} and docs/ops.md")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
