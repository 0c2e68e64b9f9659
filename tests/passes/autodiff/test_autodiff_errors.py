"""What the autodiff and loss passes refuse, and how they say it: exact message fragments,
nothing written on failure (the CLI exits 2 with one stderr line and no traceback). Also the
trainable/frozen globs and gradients with respect to graph inputs, checked numerically."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from _tracebacks import assert_no_traceback
from gradcheck import numeric_gradients
from graphforge.passes.autodiff import RULES
from models import run

import graphforge
from graphforge import roles

#: the console script installed beside the interpreter running the tests
GRAPHFORGE = Path(sys.executable).parent / "graphforge"

W12 = "{1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0}"


def parse(body: str, *, opsets: str = '"" : 17') -> onnx.ModelProto:
    model = onnx.parser.parse_model(f"<ir_version: 8, opset_import: [{opsets}]>" + body)
    onnx.checker.check_model(model, full_check=True)
    return model


def compile_error(model: onnx.ModelProto, pipeline: str) -> str:
    with pytest.raises(graphforge.GraphforgeError) as info:
        graphforge.compile(model, pipeline)
    return str(info.value)


def cli_compile(model: onnx.ModelProto, pipeline: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path]:
    source, output = tmp_path / "model.onnx", tmp_path / "out.onnx"
    onnx.save(model, source)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [str(GRAPHFORGE), "compile", str(source), "-p", pipeline, "-o", str(output)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    return proc, output


def assert_cli_refused(proc: subprocess.CompletedProcess, output: Path, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    assert_no_traceback(proc.stderr)
    for fragment in fragments:
        assert fragment in lines[0]
    assert not output.exists()


# --------------------------------------------------------------------------- ops without a rule

#: x -> MatMul(w) -> a custom op -> Relu -> ReduceSum -> loss; every node named
CUSTOM_ON_PATH = f"""
g (float[2, 3] x) => (float loss)
<float[3, 4] w = {W12}>
{{
    [proj] h = MatMul(x, w)
    [gelu] f = com.example.FastGelu (h)
    [act] s = Relu(f)
    [total] loss = ReduceSum <keepdims = 0> (s)
}}"""


def custom_on_path() -> onnx.ModelProto:
    return parse(CUSTOM_ON_PATH, opsets='"" : 17, "com.example" : 1')


def test_custom_op_on_the_path_names_op_domain_opset_node_path_and_near_ops():
    message = compile_error(custom_on_path(), "autodiff")
    assert "cannot differentiate op FastGelu (domain com.example, opset 17) in node 'gelu'" in message
    assert "no gradient rule is registered; ops of domain 'com.example' are a runtime's fusions" in message
    assert "ai.onnx ops named like it: Gelu" in message
    assert "Path from the loss: loss 'loss' <- ReduceSum 'total' <- Relu 'act' <- FastGelu 'gelu'" in message


def test_cli_refuses_a_custom_op_on_the_path(tmp_path):
    proc, output = cli_compile(custom_on_path(), "autodiff", tmp_path)
    assert_cli_refused(
        proc, output, "cannot differentiate op FastGelu (domain com.example, opset 17)", "<- FastGelu 'gelu'"
    )


#: x -> MatMul(w) -> a standard op (node 'gelu', fed by h: float[2, 4]) -> Relu -> ReduceSum -> loss
ONNX_OP_ON_PATH = """
g (float[2, 3] x) => (float loss)
<float[3, 4] w = {w}, int64[4] nchw = {{1, 2, 2, 2}}{initializers}>
{{
    [proj] h = MatMul(x, w)
    [to_nchw] h4 = Reshape(h, nchw)
    {node}
    [act] s = Relu(f)
    [total] loss = ReduceSum <keepdims = 0> (s)
}}"""

#: ai.onnx ops that have no gradient rule today, each as node 'gelu' reading h4 (h as
#: float[1, 2, 2, 2]) or h, with the initializers it needs, and the op family the error lists
#: (None: none). The test takes those that still have no rule, so it keeps testing as rules
#: are added; should all of them get one, it fails (it never skips): add another op that has none.
_NO_RULE_CANDIDATES = {
    "RoiAlign": (
        ", float[1, 4] rois = {0.0, 0.0, 1.0, 1.0}, int64[1] image = {0}",
        "[gelu] f = RoiAlign <output_height = 1, output_width = 1> (h4, rois, image)",
        "pool",
    ),
    "Unique": ("", "[gelu] f = Unique (h)", None),
}


def onnx_ops_on_the_path() -> list[tuple[str, onnx.ModelProto]]:
    """Each candidate op that has no gradient rule, in ONNX_OP_ON_PATH (parse() checks it)."""
    missing = [op for op in _NO_RULE_CANDIDATES if RULES.get(op) is None]
    assert missing, f"every candidate op has a gradient rule now: add one that has none to {list(_NO_RULE_CANDIDATES)}"
    return [(op, candidate_model(op)) for op in missing]


def candidate_model(op: str) -> onnx.ModelProto:
    initializers, node, _ = _NO_RULE_CANDIDATES[op]
    return parse(ONNX_OP_ON_PATH.format(w=W12, initializers=initializers, node=node))


@pytest.mark.parametrize("op", list(_NO_RULE_CANDIDATES))
def test_no_rule_candidates_are_valid_models(op):
    assert [n.op_type for n in candidate_model(op).graph.node if n.name == "gelu"] == [op]


def listed(message: str, label: str) -> list[str]:
    """The ops the message lists after ``label`` (up to the next ';' or '.')."""
    _, _, rest = message.partition(label)
    return rest.split(";")[0].split(". ")[0].split(", ") if rest else []


def test_onnx_op_without_a_rule_on_the_path():
    for op, model in onnx_ops_on_the_path():
        message = compile_error(model, "autodiff")
        assert f"cannot differentiate op {op} (domain ai.onnx, opset 17) in node 'gelu'" in message
        assert "no gradient rule is registered" in message
        family = _NO_RULE_CANDIDATES[op][2]
        kin = listed(message, f"supported {family} ops: ")
        assert (family is None) == (not kin), message
        assert all(RULES.get(k) is not None for k in kin)
        if family == "pool":
            assert "MaxPool" in kin and "MaxUnpool" in kin
        # its neighbours: Reshape (or MatMul) before it, Relu after it
        neighbours = listed(message, "its neighbours' ops, which have rules: ")
        assert "Relu" in neighbours and ({"Reshape", "MatMul"} & set(neighbours)), message
        assert f"Path from the loss: loss 'loss' <- ReduceSum 'total' <- Relu 'act' <- {op} 'gelu'" in message


def test_loop_error_names_the_node_and_says_if_is_supported():
    # a parameter read inside a Loop body (from the enclosing scope) is on the loss's path
    model = parse(
        f"""
        g (float[2, 3] x) => (float loss)
        <float[3, 4] w = {W12}, int64 n = {{2}}, bool go = {{1}}>
        {{
            [loop] y = Loop (n, go, x) <body = body (int64 i, bool c, float[2, 3] acc) => (bool c_out, float[2, 3] next)
            {{
                c_out = Identity (c)
                h = MatMul (acc, w)
                s = ReduceSum <keepdims = 1> (h)
                next = Add (acc, s)
            }}>
            [total] loss = ReduceSum <keepdims = 0> (y)
        }}"""
    )
    message = compile_error(model, "autodiff")
    assert "cannot differentiate op Loop (domain ai.onnx, opset 17) in node 'loop'" in message
    assert "gradients through Loop bodies are not supported yet (If and Scan are)" in message
    assert "supported control_flow ops: If, Scan" in message


def test_cli_refuses_an_onnx_op_without_a_rule_on_the_path(tmp_path):
    op, model = onnx_ops_on_the_path()[0]
    proc, output = cli_compile(model, "autodiff", tmp_path)
    assert_cli_refused(
        proc,
        output,
        f"cannot differentiate op {op} (domain ai.onnx, opset 17) in node 'gelu'",
        "no gradient rule is registered; ",
        f"<- Relu 'act' <- {op} 'gelu'",
    )


def test_op_without_a_rule_off_the_path_is_fine():
    # the custom op only feeds a side output: the loss never reaches it
    model = parse(
        f"""
        g (float[2, 3] x) => (float loss, float[2, 4] side)
        <float[3, 4] w = {W12}>
        {{
            [proj] h = MatMul(x, w)
            [gelu] side = com.example.FastGelu (h)
            [total] loss = ReduceSum <keepdims = 0> (h)
        }}""",
        opsets='"" : 17, "com.example" : 1',
    )
    result = graphforge.compile(model, "autodiff")
    assert [o.name for o in result.model.graph.output] == ["loss", "side", "w_grad"]


# --------------------------------------------------------------------------- autodiff refusals

#: two parameter groups, enc_* and dec_*, each a weight and a bias
TWO_LAYERS = """
g (double[2, 3] x) => (double loss, double[2, 2] y)
<double[3, 4] enc_w = {0.1, -0.2, 0.3, 0.4, -0.5, 0.6, 0.7, -0.8, 0.9, 0.1, 0.2, -0.3},
 double[4] enc_b = {0.1, 0.2, -0.1, 0.05},
 double[4, 2] dec_w = {0.5, -0.4, 0.3, 0.2, -0.1, 0.6, 0.7, -0.2},
 double[2] dec_b = {0.3, -0.3},
 double[3] unused_v = {1.0, 2.0, 3.0}>
{
    h = MatMul(x, enc_w)
    hb = Add(h, enc_b)
    a = Tanh(hb)
    o = MatMul(a, dec_w)
    y = Add(o, dec_b)
    sq = Mul(y, y)
    loss = ReduceSum <keepdims = 0> (sq)
    side = Mul(x, unused_v)
}"""


def two_layers() -> onnx.ModelProto:
    return parse(TWO_LAYERS)


def test_non_scalar_loss():
    model = parse(f"g (float[2, 3] x) => (float[2, 4] loss) <float[3, 4] w = {W12}> {{ loss = MatMul(x, w) }}")
    assert "the loss 'loss' must be a scalar (one element), but its shape is [2, 4]" in compile_error(model, "autodiff")


def test_cli_refuses_a_non_scalar_loss(tmp_path):
    model = parse(f"g (float[2, 3] x) => (float[2, 4] loss) <float[3, 4] w = {W12}> {{ loss = MatMul(x, w) }}")
    proc, output = cli_compile(model, "autodiff", tmp_path)
    assert_cli_refused(proc, output, "pass 1 (autodiff) failed", "must be a scalar (one element)")


def test_missing_loss_output_suggests_the_loss_pass():
    message = compile_error(two_layers(), "autodiff(loss=nope)")
    assert "the model has no output 'nope' to use as the loss (outputs: loss, y)" in message
    assert "add one with the loss pass" in message


def test_loss_that_depends_on_no_trainable_parameter():
    model = parse(
        f"""g (float[2, 3] x) => (float loss, float[2, 4] y) <float[3, 4] w = {W12}>
        {{ y = MatMul(x, w)
           loss = ReduceSum <keepdims = 0> (x) }}"""
    )
    assert "the loss 'loss' depends on none of the 1 trainable tensors" in compile_error(model, "autodiff")


@pytest.mark.parametrize(
    ("pipeline", "fragment"),
    [
        ("autodiff(frozen=['*'])", "no trainable parameters match trainable=['*'] frozen=['*']"),
        ("autodiff(frozen=['enc_*', 'dec_*', 'unused_*'])", "frozen=['enc_*', 'dec_*', 'unused_*']"),
        ("autodiff(trainable=['nomatch*'])", "no trainable parameters match trainable=['nomatch*'] frozen=[]"),
        ("autodiff(trainable=['enc_*'], frozen=['enc_*'])", "trainable=['enc_*'] frozen=['enc_*']"),
    ],
)
def test_globs_that_leave_nothing_trainable(pipeline, fragment):
    assert fragment in compile_error(two_layers(), pipeline)


def test_cli_refuses_globs_that_leave_nothing_trainable(tmp_path):
    proc, output = cli_compile(two_layers(), "autodiff(frozen=['*'])", tmp_path)
    assert_cli_refused(proc, output, "no trainable parameters match")


def test_parameters_without_a_gradient_are_listed_in_a_warning():
    with pytest.warns(UserWarning, match=r"does not depend on 1 parameter\(s\), which get no gradient: unused_v$"):
        result = graphforge.compile(two_layers(), "autodiff")
    outputs = [o.name for o in result.model.graph.output]
    assert "unused_v_grad" not in outputs
    assert {"enc_w_grad", "enc_b_grad", "dec_w_grad", "dec_b_grad"} <= set(outputs)


def test_unknown_input_name():
    assert "inputs=['nope'] are not graph inputs; the graph inputs are: x" in compile_error(
        two_layers(), "autodiff(inputs=[nope])"
    )


# --------------------------------------------------------------------------- trainable / frozen globs, inputs=


def _gradient_outputs(pipeline: str) -> tuple[onnx.ModelProto, list[str]]:
    result = graphforge.compile(two_layers(), pipeline)
    return result.model, sorted(o.name for o in result.model.graph.output if o.name.endswith("_grad"))


@pytest.mark.parametrize(
    ("pipeline", "expected"),
    [
        ("autodiff(trainable=['enc_*'])", ["enc_b_grad", "enc_w_grad"]),
        ("autodiff(frozen=['*_b'], trainable=['enc_*', 'dec_*'])", ["dec_w_grad", "enc_w_grad"]),
        ("autodiff(trainable=['*_w'], frozen=['dec_*'])", ["enc_w_grad"]),
        ("autodiff(trainable=['*c_[wb]'], frozen=['enc_b'])", ["dec_b_grad", "dec_w_grad", "enc_w_grad"]),
    ],
)
def test_trainable_and_frozen_globs(pipeline, expected):
    model, grads = _gradient_outputs(pipeline)
    assert grads == expected
    meta = {p.key: p.value for p in model.metadata_props}
    assert sorted(json.loads(meta[roles.PARAMETERS])) == sorted(g.removesuffix("_grad") for g in expected)


def test_gradients_of_parameters_and_of_a_graph_input_match_central_differences():
    model = two_layers()
    result = graphforge.compile(model, "autodiff(inputs=[x], trainable=['enc_*'])")
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3))}
    session = graphforge.create_session(result.model, providers=["CPUExecutionProvider"])
    (x_grad,) = session.run(["x_grad"], feeds)
    numeric = numeric_gradients(model, feeds, ["x"], eps=1e-6)
    np.testing.assert_allclose(x_grad, numeric["x"], rtol=1e-6, atol=1e-9)
    assert x_grad.shape == (2, 3)

    # the parameter gradients: turn enc_w into a graph input of the forward model and bump it
    enc_w = onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "enc_w"))
    as_input = _initializer_as_input(model, "enc_w")
    numeric_w = numeric_gradients(as_input, {**feeds, "enc_w": enc_w}, ["enc_w"], eps=1e-6)
    (w_grad,) = session.run(["enc_w_grad"], feeds)
    np.testing.assert_allclose(w_grad, numeric_w["enc_w"], rtol=1e-6, atol=1e-9)


def _initializer_as_input(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    init = next(t for t in proto.graph.initializer if t.name == name)
    proto.graph.input.append(onnx.helper.make_tensor_value_info(name, init.data_type, list(init.dims)))
    proto.graph.initializer.remove(init)
    return proto


# --------------------------------------------------------------------------- loss pass refusals

#: logits [N, 4] (float), an int64 output, a rank-1 float output and a one-element one
OUTPUTS = f"""
g (float[N, 3] x, int64[N] k) => (float[N, 4] logits, int64[N] idx, float[4] vec, float one)
<float[3, 4] w = {W12}>
{{
    logits = MatMul(x, w)
    idx = Identity(k)
    zero = Constant <value_ints = [0]> ()
    vec = ReduceSum <keepdims = 0> (logits, zero)
    one = ReduceSum <keepdims = 0> (vec)
}}"""


@pytest.mark.parametrize(
    ("pipeline", "fragment"),
    [
        ("loss(kind=cross_entropy, output=nope)", "the model has no output 'nope'; its outputs are: logits, idx, vec, one"),
        ("loss(kind=cross_entropy, output=idx)", "output 'idx' is int64, a loss needs a floating-point output"),
        ("loss(kind=cross_entropy, output=vec)", "cross_entropy needs logits shaped [N, C] or [N, C, d...]; 'vec' has rank 1"),
        ("loss(kind=nll, output=vec)", "nll needs logits shaped [N, C] or [N, C, d...]; 'vec' has rank 1"),
        ("loss(kind=cross_entropy, output=logits, labels=k)", "the model already has a tensor named 'k'; choose another with labels=NAME"),
        ("loss(output=vec)", "output 'vec' has shape [4]; without kind= the loss must be one element"),
        ("loss(output=logits)", "output 'logits' has shape ['N', 4]; without kind= the loss must be one element"),
        ("loss", "name the model output to put the loss on with output=NAME (outputs: logits, idx, vec, one)"),
    ],
)  # fmt: skip
def test_loss_pass_refusals(pipeline, fragment):
    assert fragment in compile_error(parse(OUTPUTS), pipeline)


def test_loss_pass_infers_the_rank_an_output_does_not_declare():
    """The loss reads its output's declared type and shape; where the shape is not declared (the
    checker wants it declared: unchecked), shape inference finds it (the labels get logits'
    rank less one)."""
    model = parse(OUTPUTS)
    logits = next(o for o in model.graph.output if o.name == "logits")
    logits.type.tensor_type.ClearField("shape")
    program = graphforge.compile(model, "loss(kind=cross_entropy, output=logits), autodiff", verify=False).model
    labels = next(i for i in program.graph.input if i.name == "labels")
    assert [d.dim_param or d.dim_value for d in labels.type.tensor_type.shape.dim] == ["N"]
    out = run(program, {"x": np.ones((2, 3), np.float32), "k": np.zeros(2, np.int64), "labels": np.array([1, 3])})
    assert np.isfinite(out["loss"]) and out["w_grad"].shape == (3, 4)


def test_loss_pass_refuses_an_existing_labels_tensor():
    model = parse(OUTPUTS.replace("int64[N] k", "int64[N] labels").replace("Identity(k)", "Identity(labels)"))
    message = compile_error(model, "loss(kind=cross_entropy, output=logits)")
    assert "the model already has a tensor named 'labels'; choose another with labels=NAME" in message


def test_loss_pass_refuses_a_second_loss_output():
    model = parse(OUTPUTS.replace("float one", "float loss").replace("one = ", "loss = "))
    message = compile_error(model, "loss(kind=mse, output=logits)")
    assert "the model already has an output named 'loss'; use loss(output=loss) to adopt it" in message


@pytest.mark.parametrize("value", ["1.5", "-0.1"])
def test_label_smoothing_out_of_range(value):
    message = compile_error(parse(OUTPUTS), f"loss(kind=cross_entropy, output=logits, label_smoothing={value})")
    assert "pass 'loss' parameter 'label_smoothing': expected a number in [0, 1], got" in message


def test_label_smoothing_needs_cross_entropy():
    message = compile_error(parse(OUTPUTS), "loss(kind=mse, output=logits, label_smoothing=0.1)")
    assert "label_smoothing applies to kind=cross_entropy only" in message


def test_cli_refuses_a_loss_on_a_non_scalar_output(tmp_path):
    proc, output = cli_compile(parse(OUTPUTS), "loss(output=vec), autodiff", tmp_path)
    assert_cli_refused(proc, output, "pass 1 (loss(output=vec)) failed", "without kind= the loss must be one element")


def test_adopting_a_one_element_output_works():
    result = graphforge.compile(parse(OUTPUTS), "loss(output=one), autodiff")
    assert [o.name for o in result.model.graph.output][-2:] == ["loss", "w_grad"]


def test_adopting_an_output_named_loss_keeps_one_tensor_of_that_name():
    """loss(output=loss), as the refusal above advises: the output is the loss itself (a second
    tensor named 'loss' would make the graph's names ambiguous for every later pass)."""
    model = parse(OUTPUTS.replace("float one", "float loss").replace("one = ", "loss = "))
    adopted = graphforge.compile(model, "loss(output=loss)").model
    assert [o.name for o in adopted.graph.output] == ["logits", "idx", "vec", "loss"]
    program = graphforge.compile(model, "loss(output=loss), autodiff").model
    producers = [n.op_type for n in program.graph.node if "loss" in n.output]
    assert producers == ["ReduceSum"]
    assert [o.name for o in program.graph.output].count("loss") == 1
    reference = graphforge.compile(parse(OUTPUTS), "loss(output=one), autodiff").model
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    feeds = {"x": x, "k": np.zeros(2, np.int64)}
    got, want = run(program, feeds), run(reference, feeds)
    np.testing.assert_allclose(got["w_grad"], want["w_grad"], rtol=1e-6)  # d(sum of x·w)/dw: every row the sum of x
    np.testing.assert_allclose(got["w_grad"], np.repeat(x.sum(0)[:, None], 4, axis=1), rtol=1e-5)


def test_constants_the_loss_pass_creates_are_not_parameters(mlp_path):
    """label_smoothing adds float constants; they must not become trainable parameters."""
    plain = graphforge.compile(mlp_path, "loss(kind=cross_entropy, output=y), autodiff").model
    smoothed = graphforge.compile(mlp_path, "loss(kind=cross_entropy, output=y, label_smoothing=0.1), autodiff").model
    grads = sorted(o.name for o in smoothed.graph.output if o.name.endswith("_grad"))
    assert grads == sorted(o.name for o in plain.graph.output if o.name.endswith("_grad"))
    assert not any(g.startswith("loss::") for g in grads)
