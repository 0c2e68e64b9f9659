"""The expand_gradient pass: ONNX's Gradient operator (ai.onnx.preview.training) expanded into
standard ops, checked against analytic values and central differences run by onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from gradcheck import numeric_gradients
from graphforge.passes import REGISTRY, ExpandGradient
from graphforge.passes.autodiff.gradient_op import PREVIEW_TRAINING

import graphforge

HEADER = '<ir_version: 8, opset_import: ["" : 18, "ai.onnx.preview.training" : 1]>'


def parse(body: str) -> onnx.ModelProto:
    model = onnx.parser.parse_model(HEADER + body)
    onnx.checker.check_model(model, full_check=True)
    return model


def expand(model: onnx.ModelProto) -> onnx.ModelProto:
    return graphforge.compile(model, "expand_gradient").model


def run(model: onnx.ModelProto, feeds: dict, names: list[str]) -> dict[str, np.ndarray]:
    session = graphforge.create_session(model, providers=["CPUExecutionProvider"])
    return dict(zip(names, session.run(names, feeds), strict=True))


def forward_only(model: onnx.ModelProto, y: str = "loss") -> onnx.ModelProto:
    """The model without its Gradient nodes, with y as its only output: the numeric oracle."""
    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    nodes = [n for n in proto.graph.node if n.op_type != "Gradient"]
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    outputs = [o for o in proto.graph.output if o.name == y]
    del proto.graph.output[:]
    proto.graph.output.extend(outputs)
    return proto


def scalars(**values: float) -> dict[str, np.ndarray]:
    return {k: np.array(v, np.float32) for k, v in values.items()}


# --------------------------------------------------------------------------- the spec's examples

SPEC_ADD = """
add (float a, float b) => (float c, float dc_da, float dc_db) {
    c = Add(a, b)
    dc_da, dc_db = ai.onnx.preview.training.Gradient <xs = ["a", "b"], y = "c"> (a, b)
}"""

SPEC_ADD_MUL = """
add_mul (float a, float b) => (float d, float dd_da, float dd_db) {
    c = Add(a, b)
    d = Mul(a, c)
    dd_da, dd_db = ai.onnx.preview.training.Gradient <xs = ["a", "b"], y = "d"> (a, b)
}"""


def test_spec_example_add():
    out = run(expand(parse(SPEC_ADD)), scalars(a=1.0, b=2.0), ["c", "dc_da", "dc_db"])
    assert out == {"c": 3.0, "dc_da": 1.0, "dc_db": 1.0}


def test_spec_example_add_mul():
    # d = a * (a + b): dd/da = 2a + b, dd/db = a
    out = run(expand(parse(SPEC_ADD_MUL)), scalars(a=1.0, b=2.0), ["d", "dd_da", "dd_db"])
    assert out == {"d": 3.0, "dd_da": 4.0, "dd_db": 1.0}


def test_expanded_model_is_standard_onnx():
    expanded = expand(parse(SPEC_ADD_MUL))
    assert all(n.domain in ("", "ai.onnx") for n in expanded.graph.node)
    assert [o.domain for o in expanded.opset_import] == [""]
    assert [o.name for o in expanded.graph.output] == ["d", "dd_da", "dd_db"]


def test_model_without_gradient_nodes_is_unchanged():
    model = onnx.parser.parse_model('<ir_version: 8, opset_import: ["" : 18]> g (float a) => (float b) { b = Neg(a) }')
    result = graphforge.compile(model, "expand_gradient")
    assert not result.records[0].changed
    assert "expand_gradient" in REGISTRY


def test_other_preview_training_ops_keep_the_import():
    model = parse("""
    g (float a, float b, float r, int64 t) => (float dc_da, float a_new, float h_new) {
        c = Mul(a, b)
        dc_da = ai.onnx.preview.training.Gradient <xs = ["a"], zs = ["b"], y = "c"> (a, b)
        a_new, h_new = ai.onnx.preview.training.Adagrad <decay_factor = 0.0> (r, t, a, dc_da, b)
    }""")
    expanded = expand(model)
    assert PREVIEW_TRAINING in [o.domain for o in expanded.opset_import]
    assert [n.op_type for n in expanded.graph.node if n.domain == PREVIEW_TRAINING] == ["Adagrad"]


# --------------------------------------------------------------------------- tensors, against central differences

MLP = """
mlp (double[3, 4] x, double[4, 5] w, double[5] bias, double[3, 5] t) => (double loss, double[4, 5] dw, double[5] db) {
    h = MatMul(x, w)
    z = Add(h, bias)
    a = Tanh(z)
    e = Sub(a, t)
    sq = Mul(e, e)
    loss = ReduceMean <keepdims = 0> (sq)
    dw, db = ai.onnx.preview.training.Gradient <xs = ["w", "bias"], zs = ["x", "t"], y = "loss"> (w, bias, x, t)
}"""


def _mlp_feeds(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((3, 4)),
        "w": rng.standard_normal((4, 5)) * 0.5,
        "bias": rng.standard_normal(5) * 0.1,
        "t": rng.standard_normal((3, 5)),
    }


def test_mlp_gradients_match_central_differences():
    model = parse(MLP)
    feeds = _mlp_feeds()
    got = run(expand(model), feeds, ["dw", "db"])
    numeric = numeric_gradients(forward_only(model), feeds, ["w", "bias"], eps=1e-6)
    np.testing.assert_allclose(got["dw"], numeric["w"], rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(got["db"], numeric["bias"], rtol=1e-6, atol=1e-8)


def test_gradient_with_respect_to_an_intermediate_tensor():
    # the spec's "dY/dH": loss = mean((tanh(h) - t)^2) with h = x @ w, so dloss/dh is elementwise
    model = parse(MLP.replace('xs = ["w", "bias"], zs = ["x", "t"]', 'xs = ["h", "bias"], zs = ["t"]')
                  .replace("(w, bias, x, t)", "(h, bias, t)").replace("double[4, 5] dw", "double[3, 5] dw"))  # fmt: skip
    feeds = _mlp_feeds()
    got = run(expand(model), feeds, ["dw", "db"])
    z = feeds["x"] @ feeds["w"] + feeds["bias"]
    expected_dh = 2 * (np.tanh(z) - feeds["t"]) * (1 - np.tanh(z) ** 2) / z.size
    np.testing.assert_allclose(got["dw"], expected_dh, rtol=1e-10)
    np.testing.assert_allclose(got["db"], expected_dh.sum(axis=0), rtol=1e-10)


def test_a_tensor_and_one_computed_from_it():
    # xs = [w, h] with h = x @ w: dloss/dw is the total derivative, dloss/dh is not lost on the way
    model = parse(MLP.replace('xs = ["w", "bias"], zs = ["x", "t"]', 'xs = ["w", "h"], zs = ["x", "t"]')
                  .replace("(w, bias, x, t)", "(w, h, x, t)").replace("double[5] db", "double[3, 5] db"))  # fmt: skip
    feeds = _mlp_feeds()
    got = run(expand(model), feeds, ["dw", "db"])
    z = feeds["x"] @ feeds["w"] + feeds["bias"]
    expected_dh = 2 * (np.tanh(z) - feeds["t"]) * (1 - np.tanh(z) ** 2) / z.size
    np.testing.assert_allclose(got["db"], expected_dh, rtol=1e-10)
    np.testing.assert_allclose(got["dw"], feeds["x"].T @ expected_dh, rtol=1e-10)


def test_gradient_at_other_inputs():
    # the spec's "dY/dH when H = H_1": the node reads h1, not h, so the graph between h and y is copied
    model = parse("""
    g (double[2, 3] x, double[3, 3] w, double[2, 3] h1) => (double y, double[2, 3] dy_dh) {
        h = MatMul(x, w)
        s = Sin(h)
        y = ReduceSum <keepdims = 0> (s)
        dy_dh = ai.onnx.preview.training.Gradient <xs = ["h"], y = "y"> (h1)
    }""")
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((2, 3)), "w": rng.standard_normal((3, 3)), "h1": rng.standard_normal((2, 3))}
    got = run(expand(model), feeds, ["y", "dy_dh"])
    np.testing.assert_allclose(got["y"], np.sin(feeds["x"] @ feeds["w"]).sum(), rtol=1e-12)
    np.testing.assert_allclose(got["dy_dh"], np.cos(feeds["h1"]), rtol=1e-12)


def test_second_order_derivative():
    # the spec's higher-order example: a Gradient of a Gradient's output; y = w^3 + w*b
    model = parse("""
    g (float w, float b) => (float dy_dw, float d2y_dw2, float d2y_dwdb) {
        w2 = Mul(w, w)
        w3 = Mul(w2, w)
        wb = Mul(w, b)
        y = Add(w3, wb)
        dy_dw = ai.onnx.preview.training.Gradient <xs = ["w"], zs = ["b"], y = "y"> (w, b)
        d2y_dw2, d2y_dwdb = ai.onnx.preview.training.Gradient <xs = ["w", "b"], y = "dy_dw"> (w, b)
    }""")
    got = run(expand(model), scalars(w=2.0, b=5.0), ["dy_dw", "d2y_dw2", "d2y_dwdb"])
    assert got == {"dy_dw": 3 * 4.0 + 5.0, "d2y_dw2": 6 * 2.0, "d2y_dwdb": 1.0}


def test_second_order_node_listed_first_still_expands_after_the_first():
    model = parse("""
    g (float w) => (float d2y, float dy) {
        d2y = ai.onnx.preview.training.Gradient <xs = ["w"], y = "dy"> (w)
        w2 = Mul(w, w)
        y = Mul(w2, w)
        dy = ai.onnx.preview.training.Gradient <xs = ["w"], y = "y"> (w)
    }""")
    got = run(expand(model), scalars(w=3.0), ["d2y", "dy"])
    assert got == {"dy": 27.0, "d2y": 18.0}


def test_omitted_output_and_an_unused_x():
    model = parse("""
    g (float a, float b, float[2] u) => (float dc_db, float[2] dc_du) {
        c = Mul(a, b)
        dc_da_skipped, dc_db, dc_du = ai.onnx.preview.training.Gradient <xs = ["a", "b", "u"], y = "c"> (a, b, u)
    }""")
    model.graph.node[1].output[0] = ""  # an empty first output: dc/da is not computed
    got = run(expand(model), {**scalars(a=3.0, b=4.0), "u": np.ones(2, np.float32)}, ["dc_db", "dc_du"])
    assert got["dc_db"] == 3.0
    np.testing.assert_array_equal(got["dc_du"], np.zeros(2, np.float32))


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (('xs = ["a", "b"]', 'xs = ["a", "nope"]'), "'nope' named in xs/zs/y is not a tensor of the graph"),
        (('y = "d"', 'y = "missing"'), "'missing' named in xs/zs/y is not a tensor of the graph"),
        (("> (a, b)", "> (a)"), "it has 1 input(s), but xs and zs name 2 tensor(s)"),
        (('xs = ["a", "b"]', 'xs = ["a"], zs = ["b"]'), "it has 2 outputs, but xs names only 1 tensor(s)"),
    ],
    ids=["x-not-in-graph", "y-not-in-graph", "input-count", "output-count"],
)
def test_malformed_gradient_nodes_are_refused(edit, message):
    text = SPEC_ADD_MUL.replace(*edit)
    model = onnx.parser.parse_model(HEADER + text)
    with pytest.raises(graphforge.PipelineError, match="cannot expand Gradient") as info:
        graphforge.compile(model, [ExpandGradient()], verify=False)
    assert message in str(info.value)


def test_non_scalar_y_is_refused():
    model = parse("""
    g (float[3] a) => (float[3] c, float[3] dc_da) {
        c = Mul(a, a)
        dc_da = ai.onnx.preview.training.Gradient <xs = ["a"], y = "c"> (a)
    }""")
    with pytest.raises(
        graphforge.PipelineError, match=r"y 'c' must be a scalar \(one element\), but its shape is \[3\]"
    ):
        expand(model)


def test_integer_x_is_refused():
    model = parse("""
    g (float a, int64 k) => (float c, float dc_dk) {
        kf = Cast <to = 1> (k)
        c = Mul(a, kf)
        dc_dk = ai.onnx.preview.training.Gradient <xs = ["k"], y = "c"> (k)
    }""")
    with pytest.raises(graphforge.PipelineError, match="x 'k' is int64, not floating-point"):
        expand(model)


def test_gradient_of_its_own_output_is_refused():
    # y depends on the Gradient's output and the Gradient on y: a cycle the loader refuses
    # before any expansion starts, naming the model as invalid.
    model = onnx.parser.parse_model(
        HEADER
        + """
    g (float w) => (float y) {
        dy = ai.onnx.preview.training.Gradient <xs = ["w"], y = "y"> (w)
        y = Mul(dy, w)
    }"""
    )
    with pytest.raises(graphforge.InvalidModelError, match="not a valid ONNX model"):
        expand(model)
