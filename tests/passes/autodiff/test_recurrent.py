"""The recurrent rules beyond the table rows (op_cases_recurrent.py): layout 1 (batch first),
which onnxruntime's CPU kernels refuse; the structure of what the rules emit; one compiled
graph for every batch and sequence length; and what they refuse, by name."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from gradcheck import numeric_gradients
from graphforge.passes import Autodiff
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import graphforge

T, N, F, H = 3, 2, 3, 2  # steps, batch, input features, hidden
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _model(op: str, attrs: dict, *, layout: int, opset: int = 14, lens: bool = False, dtype=np.float64, weighted=True):
    """One recurrent node (every input given, D directions) and loss = sum_k sum(out_k * R_k) with
    fixed random R_k (sum(out_k²) when not ``weighted``: any size); with its feeds."""
    rng = np.random.default_rng(7)
    d = 2 if attrs.get("direction") == "bidirectional" else 1
    g = GATES[op]
    state = (N, d, H) if layout else (d, N, H)
    shapes = {"X": (N, T, F) if layout else (T, N, F), "W": (d, g * H, F), "R": (d, g * H, H), "B": (d, 2 * g * H)}
    shapes |= {"initial_h": state} | ({"initial_c": state, "P": (d, 3 * H)} if op == "LSTM" else {})
    feeds = {name: rng.uniform(-1, 1, shape).astype(dtype) for name, shape in shapes.items()}
    if lens:
        feeds["sequence_lens"] = np.array([T, 1], np.int32)
    names = [n if n in feeds else "" for n in ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]]
    outputs = {"Y": (N, T, d, H) if layout else (T, d, N, H), "Y_h": state} | ({"Y_c": state} if op == "LSTM" else {})
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [helper.make_node(op, names[: len(shapes) + 1], list(outputs), hidden_size=H, layout=layout, **attrs)]
    weights = []
    for name, shape in outputs.items():
        weights.append(numpy_helper.from_array(rng.standard_normal(shape).astype(dtype), f"R_{name}"))
        nodes += [helper.make_node("Mul", [name, f"R_{name}" if weighted else name], [f"w_{name}"]),
                  helper.make_node("ReduceSum", [f"w_{name}"], [f"s_{name}"], keepdims=0)]  # fmt: skip
    nodes.append(helper.make_node("Sum", [f"s_{name}" for name in outputs], ["loss"]))
    inputs = [
        helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in feeds.items()
    ]
    graph = helper.make_graph(nodes, op, inputs, [helper.make_tensor_value_info("loss", elem, [])], weights * weighted)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    return model, feeds


def _wrt(feeds: dict) -> tuple[str, ...]:
    return tuple(k for k, v in feeds.items() if v.dtype.kind == "f")


class _Reference:
    """numeric_gradients' session interface over onnx's reference evaluator."""

    def __init__(self, model):
        self.evaluator = ReferenceEvaluator(model)

    def run(self, outputs, feeds):
        return self.evaluator.run(outputs, feeds)


def _as_layout_0(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with each layout-1 recurrent node written, as the ONNX spec defines it, as
    transposes around the layout-0 node, which onnxruntime runs; everything else untouched."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    nodes = []
    for node in model.graph.node:
        layout = next((a for a in node.attribute if a.name == "layout"), None)
        if node.op_type not in GATES or layout is None or layout.i == 0:
            nodes.append(node)
            continue
        layout.i = 0
        for k in (0, 5, 6):  # X, initial_h, initial_c: batch first -> sequence (directions) first
            if k < len(node.input) and node.input[k]:
                nodes.append(helper.make_node("Transpose", [node.input[k]], [f"{node.input[k]}_l0"], perm=[1, 0, 2]))
                node.input[k] = f"{node.input[k]}_l0"
        nodes.append(node)
        for k, name in enumerate(node.output):
            if name:
                perm = [2, 0, 1, 3] if k == 0 else [1, 0, 2]
                nodes.append(helper.make_node("Transpose", [f"{name}_l0"], [name], perm=perm))
                node.output[k] = f"{name}_l0"
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


@pytest.mark.parametrize(
    ("op", "attrs"),
    [
        ("LSTM", {"direction": "bidirectional"}),
        ("GRU", {"direction": "bidirectional", "linear_before_reset": 1}),
        ("GRU", {"direction": "reverse"}),
        ("RNN", {}),
    ],
    ids=["LSTM-bidirectional", "GRU-bidirectional-linear-before-reset", "GRU-reverse", "RNN"],
)
def test_layout_1_matches_central_differences(op, attrs, monkeypatch):
    # the gradient graph the rule emits for the layout-1 node runs on onnxruntime (float32) once
    # that node is re-expressed in layout 0; the oracle is float64 central differences of the
    # layout-1 model run by onnx's reference evaluator
    model, feeds = _model(op, attrs, layout=1, dtype=np.float32)
    wrt = _wrt(feeds)
    compiled = _as_layout_0(graphforge.compile(model, [Autodiff(inputs=wrt)]).model)
    session = graphforge.create_session(compiled, providers=["CPUExecutionProvider"])
    analytic = session.run([f"{n}_grad" for n in wrt], feeds)
    model64, feeds64 = _model(op, attrs, layout=1)
    monkeypatch.setattr(graphforge, "create_session", lambda m, providers=None: _Reference(m))
    numeric = numeric_gradients(model64, feeds64, wrt, eps=1e-6)
    for name, got in zip(wrt, analytic, strict=True):
        np.testing.assert_allclose(got, numeric[name], rtol=1e-4, atol=1e-5, err_msg=f"{op}: {name}")


@pytest.mark.parametrize("op", sorted(GATES))
def test_backward_is_scans_over_time_and_keeps_the_forward_node(op):
    # one Scan per direction for dh (and dc), one more for the LSTM's cell states; the rest is
    # outside any loop, so the batch and sequence dims stay whatever they are
    attrs = {"direction": "bidirectional"}
    model, feeds = _model(op, attrs, layout=0, dtype=np.float32)
    compiled = graphforge.compile(model, [Autodiff(inputs=_wrt(feeds))]).model
    ops = [n.op_type for n in compiled.graph.node]
    assert ops.count(op) == 1 and "Loop" not in ops
    assert ops.count("Scan") == (4 if op == "LSTM" else 2)
    assert {o.domain for o in compiled.opset_import} <= {"", "ai.onnx"}
    (node,) = [n for n in compiled.graph.node if n.op_type == op]
    assert helper.get_attribute_value(next(a for a in node.attribute if a.name == "direction")) == b"bidirectional"
    for scan in (n for n in compiled.graph.node if n.op_type == "Scan"):  # small bodies: elementwise and one MatMul
        body = helper.get_attribute_value(next(a for a in scan.attribute if a.name == "body"))
        assert len(body.node) <= 12, [n.op_type for n in body.node]
        assert sum(n.op_type == "MatMul" for n in body.node) <= 2


def test_compiled_once_for_every_batch_and_sequence_length():
    model, feeds = _model("LSTM", {"direction": "bidirectional"}, layout=0, dtype=np.float32, weighted=False)
    for value in model.graph.input:  # X [seq, batch, input], the states [2, batch, hidden]: symbolic
        dims = value.type.tensor_type.shape.dim
        if value.name == "X":
            dims[0].dim_param, dims[1].dim_param = "seq", "batch"
        elif value.name.startswith("initial_"):
            dims[1].dim_param = "batch"
    compiled = graphforge.compile(model, [Autodiff(inputs=_wrt(feeds))]).model
    session = graphforge.create_session(compiled, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for seq, batch in [(1, 1), (4, 3)]:
        sized = dict(feeds)
        sized["X"] = rng.standard_normal((seq, batch, F)).astype(np.float32)
        for name in ("initial_h", "initial_c"):
            sized[name] = rng.standard_normal((2, batch, H)).astype(np.float32)
        grads = session.run(["X_grad", "W_grad", "initial_c_grad"], sized)
        assert grads[0].shape == (seq, batch, F) and grads[2].shape == (2, batch, H)
        assert np.all(np.isfinite(grads[1]))


def _refusal(model) -> str:
    with pytest.raises(graphforge.GraphforgeError) as info:
        graphforge.compile(model, [Autodiff(inputs=("X", "W"))])
    return str(info.value)


def test_sequence_lens_below_opset_11_is_refused_by_name():
    model, _ = _model("GRU", {}, layout=0, opset=10, lens=True, dtype=np.float32)
    model.graph.node[0].name = "gru"
    for attr in [a for a in model.graph.node[0].attribute if a.name == "layout"]:
        model.graph.node[0].attribute.remove(attr)  # layout is an opset 14 attribute
    message = _refusal(model)
    assert "gru" in message and "GRU" in message and "sequence_lens needs opset 11+" in message


def test_an_activation_onnxruntime_does_not_read_is_refused():
    # onnxruntime's RNN reads names case-sensitively: "relu" would silently run as Tanh
    model, _ = _model("RNN", {"activations": ["relu"]}, layout=0, dtype=np.float32)
    model.graph.node[0].name = "rnn"
    message = _refusal(model)
    assert "rnn" in message and "activation 'relu' is not one of Affine, Relu" in message
    model, _ = _model("LSTM", {"activations": ["Sigmoid", "Gelu", "Tanh"]}, layout=0, dtype=np.float32)
    assert "activation 'Gelu' is not one of" in _refusal(model)


def test_reference_evaluator_is_an_independent_oracle():
    # the layout-1 oracle computes the same forward as onnxruntime where both run (layout 0)
    model, feeds = _model("GRU", {"direction": "bidirectional", "linear_before_reset": 1}, layout=0, dtype=np.float32)
    session = graphforge.create_session(model, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(
        ReferenceEvaluator(model).run(["loss"], feeds)[0], session.run(["loss"], feeds)[0], rtol=1e-5
    )


def test_model_fixture_is_valid():
    model, _ = _model("LSTM", {"direction": "bidirectional"}, layout=1)
    onnx.checker.check_model(model, full_check=True)
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.DOUBLE
