"""The fuse pass and its engine.

Oracle: the same program compiled without ``fuse``, run by onnxruntime on the same inputs;
every output (the loss and each gradient) must agree within 1e-6 relative: element by element
for the rules that change kernels, not arithmetic (both come out bit for bit equal here), and
relative to the output's largest magnitude for the NCHWc convolution, which sums the same
products in another order. Each rule is also counted: how often it fires where it
must, and that it refuses, with its reason, where it must not.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from graphforge.passes.fusion import Fuse
from graphforge.passes.fusion.engine import Context, Pattern, Rule, apply
from graphforge.passes.fusion.rules import RULES
from onnx import TensorProto, helper, numpy_helper

import graphforge
from graphforge import roles
from graphforge.errors import InvalidModelError
from graphforge.graph import Model
from graphforge.ort_compat import NCHWC_DOMAIN, nchwc_block_size
from graphforge.placement.cut import cut
from tests.models import random_inputs, run, tanh_mlp

CLASSES = 5
GRADIENTS = "loss(kind=cross_entropy, output=logits), autodiff"
RTOL = 1e-6


def cnn(*pools: dict | None, seed: int = 0, width: int = 4, size: int = 12, stride: int = 1) -> onnx.ModelProto:
    """x [N, 3, size, size] → (Conv 3×3 with ``width`` channels → Relu → MaxPool(**pool), or
    no pool for None) per pool → global average → Gemm → logits [N, 5]. The convs after the
    first have ``stride``."""
    rng = np.random.default_rng(seed)
    nodes, inits, x, channels = [], [], "x", 3
    for i, pool in enumerate(pools):
        w = (rng.standard_normal((width, channels, 3, 3)) / np.sqrt(9 * channels)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        conv = {"pads": [1, 1, 1, 1], "strides": [stride if i else 1] * 2}
        nodes += [
            helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], name=f"/conv{i}", **conv),
            helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"/relu{i}"),
        ]
        x, channels = f"r{i}", width
        if pool is not None:
            nodes.append(helper.make_node("MaxPool", [x], [f"p{i}"], name=f"/pool{i}", **pool))
            x = f"p{i}"
    inits.append(numpy_helper.from_array(rng.standard_normal((CLASSES, width)).astype(np.float32), "fc"))
    nodes += [
        helper.make_node("GlobalAveragePool", [x], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "fc"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


POOL = {"kernel_shape": [2, 2], "strides": [2, 2]}


def compiled(model: onnx.ModelProto, pipeline: str):
    return graphforge.compile(model, pipeline)


def fused(model: onnx.ModelProto, pipeline: str = GRADIENTS, fuse: str = "fuse(provider=cpu)"):
    """(program without fuse, program with it, fuse's report from the model's metadata)."""
    plain = compiled(model, pipeline).model
    done = compiled(model, f"{pipeline}, {fuse}").model
    report = {p.key: p.value for p in done.metadata_props}[roles.FUSION]
    return plain, done, json.loads(report)


def assert_same_values(
    plain: onnx.ModelProto, done: onnx.ModelProto, seed: int = 0, *, reordered: bool = False
) -> None:
    """Every output within RTOL of the unfused program's, element by element; or, where a rule
    sums in another order (``reordered``), each output's largest difference within RTOL of its
    largest magnitude (an element that cancels to near 0 has no relative precision to keep)."""
    feeds = random_inputs(plain, seed=seed, dims={"N": 4}, int_high=CLASSES)
    expected, actual = run(plain, feeds), run(done, feeds)
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        if reordered:
            assert np.abs(actual[name] - value).max() <= RTOL * np.abs(value).max(), name
        else:
            np.testing.assert_allclose(actual[name], value, rtol=RTOL, atol=0, err_msg=name)


def ops(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


# --------------------------------------------------------------------------- the rules


def test_relu_and_maxpool_rules_fire_once_per_layer_and_keep_every_gradient():
    plain, done, report = fused(cnn(POOL, POOL))
    assert report["fired"] == {"relu_backward_mask": 2, "maxpool_backward_unpool": 2}
    assert ops(done)["MaxUnpool"] == 2
    assert ops(done)["ScatterElements"] == ops(plain)["ScatterElements"] - 2
    assert ops(done)["Where"] == ops(plain)["Where"] - 2
    assert_same_values(plain, done)
    assert_same_values(plain, done, seed=1)


def test_overlapping_windows_keep_the_summing_scatter():
    overlapping = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    plain, done, report = fused(cnn(overlapping))
    assert report["fired"] == {"relu_backward_mask": 1}
    assert report["refused"]["maxpool_backward_unpool"] == {"windows overlap (the gradient is summed)": 1}
    assert_same_values(plain, done)


@pytest.mark.parametrize(
    "pool",
    [
        {"kernel_shape": [2, 2], "strides": [3, 3], "dilations": [2, 2]},  # spread, yet disjoint
        {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 1, 1]},
        {"kernel_shape": [5, 5], "strides": [5, 5], "ceil_mode": 1},  # windows at 0, 5, 10: the last clipped
        {"kernel_shape": [2, 3], "strides": [2, 3]},
    ],
    ids=["dilated", "padded", "ceil_mode", "rectangular"],
)
def test_maxpool_rule_on_disjoint_windows_of_every_shape(pool):
    plain, done, report = fused(cnn(pool, seed=3))
    assert report["fired"]["maxpool_backward_unpool"] == 1
    assert_same_values(plain, done)


def test_column_major_indices_are_left_alone():
    plain, done, report = fused(cnn({**POOL, "storage_order": 1}))
    assert "maxpool_backward_unpool" not in report["fired"]
    assert_same_values(plain, done)


def test_where_on_something_other_than_a_relu_is_left_alone():
    """A forward ``Where(x > 0, x, 0)`` (a user's clamp, not a ReLU) is not the rule's pattern
    of use, whatever its shape: refused, and the forward keeps computing exactly as before."""
    model = onnx.parser.parse_model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        clamp (float[N, 4] x) => (float[N, 4] y) <float zero = {0.0}> {
            m = Greater(x, zero)
            y = Where(m, x, zero)
        }
        """
    )
    result = graphforge.compile(model, "fuse(provider=cpu)")
    assert ops(result.model)["Where"] == 1
    assert "the mask is not of a ReLU's output" in result.records[-1].note


def test_no_rule_fires_on_a_model_without_relu_or_maxpool():
    plain, done, report = fused(tanh_mlp(), pipeline="loss(kind=mse, output=y), autodiff")
    assert report["fired"] == {}
    assert ops(done) == ops(plain)


def test_fused_recomputed_program_keeps_its_values():
    """After recompute, the backward's ReLU masks read recomputed ReLUs: still ReLUs."""
    plain, done, report = fused(cnn(POOL, POOL), pipeline=f"{GRADIENTS}, sgd(lr=0.1), recompute(budget=0)")
    assert report["fired"]["relu_backward_mask"] == 2
    assert_same_values(plain, done)


def test_training_steps_with_fuse_equal_those_without():
    from graphforge.runtime import Module

    pipeline = f"{GRADIENTS}, adamw(lr=1e-2)"
    plain, done, _ = fused(cnn(POOL, POOL), pipeline=pipeline)
    rng = np.random.default_rng(0)
    a, b = Module(plain, device="cpu"), Module(done, device="cpu")
    for _ in range(3):
        x = rng.standard_normal((4, 3, 12, 12)).astype(np.float32)
        y = rng.integers(0, CLASSES, 4)
        np.testing.assert_allclose(b.train_step(x, y), a.train_step(x, y), rtol=RTOL)
    for name, value in a.parameters.items():
        np.testing.assert_allclose(b.parameters[name], value, rtol=RTOL, atol=0, err_msg=name)


needs_nchwc = pytest.mark.skipif(nchwc_block_size() is None, reason="no NCHWc kernels in this onnxruntime on this CPU")


@needs_nchwc
def test_conv_input_gradient_on_nchwc_kernels_where_the_image_is_large_enough():
    """Three convs of 16 channels over 16×16 images: the second and third need input
    gradients (the first's input is the data), and both have 256 positions."""
    plain, done, report = fused(cnn(None, None, None, width=16, size=16))
    assert report["fired"]["conv_input_grad_nchwc"] == 2
    assert report["nchwc_block"] == nchwc_block_size()
    assert ops(done)["ConvTranspose"] == ops(plain)["ConvTranspose"] - 2
    assert_same_values(plain, done, reordered=True)
    assert_same_values(plain, done, seed=1, reordered=True)


@needs_nchwc
@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (cnn(None, None, width=16, size=8), "fewer than 256 positions per image"),
        (cnn(None, None, width=12, size=16), "channels not a multiple of the block"),
        (cnn(None, None, width=16, size=32, stride=2), "strides or dilations other than 1"),
    ],
    ids=["small_image", "odd_channels", "strided"],
)
def test_conv_input_gradient_stays_a_conv_transpose(model, reason):
    plain, done, report = fused(model, fuse="fuse(provider=cpu, rules=[conv_input_grad_nchwc])")
    assert "conv_input_grad_nchwc" not in report["fired"]
    assert any(r.startswith(reason) for r in report["refused"]["conv_input_grad_nchwc"])
    assert_same_values(plain, done)


def _torch_gradients(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The loss and each weight's gradient of a ``cnn`` model without pools, by torch's autograd
    (the oracle the program's ONNX gradients are held to)."""
    import torch

    weights = {t.name: torch.tensor(numpy_helper.to_array(t), requires_grad=True) for t in model.graph.initializer}
    h = torch.from_numpy(feeds["x"])
    for node in model.graph.node:
        if node.op_type == "Conv":
            strides = next(a.ints for a in node.attribute if a.name == "strides")
            h = torch.relu(torch.nn.functional.conv2d(h, weights[node.input[1]], stride=list(strides), padding=1))
    logits = h.mean(dim=(2, 3)) @ weights["fc"].T
    loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(feeds["labels"]))
    loss.backward()
    return {"loss": loss.detach().numpy(), **{f"{k}_grad": w.grad.numpy() for k, w in weights.items()}}


@needs_nchwc
def test_forward_convs_on_nchwc_kernels_keep_every_gradient_and_export_as_they_were():
    """Three 3×3 convs over 8×8 images (64 output positions), 16 channels after the first: the
    second and third run on NCHWc kernels (the first reads 3 channels, which no block divides).
    The loss and every gradient equal the program's without fuse, run by onnxruntime, and torch
    autograd's; the export has the user's Convs again, byte for byte."""
    model = cnn(None, None, None, width=16, size=8)
    plain, done, report = fused(model, fuse="fuse(provider=cpu, rules=[conv_nchwc])")
    assert report["fired"] == {"conv_nchwc": 2}
    assert list(report["refused"]["conv_nchwc"]) == [f"channels not a multiple of the block ({nchwc_block_size()})"]
    assert report["nchwc_block"] == nchwc_block_size()
    assert sorted(report["restore"]) == ["c1", "c2"]
    assert sum(n.op_type == "Conv" and n.domain == NCHWC_DOMAIN for n in done.graph.node) == 2
    assert_same_values(plain, done, reordered=True)
    assert_same_values(plain, done, seed=1, reordered=True)
    feeds = random_inputs(plain, seed=2, dims={"N": 4}, int_high=CLASSES)
    actual, expected = run(done, feeds), _torch_gradients(model, feeds)
    for name, value in expected.items():
        assert np.abs(actual[name] - value).max() <= 1e-5 * np.abs(value).max(), name
    assert exported(done).SerializeToString() == exported(plain).SerializeToString()


@needs_nchwc
@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (cnn(None, None, width=16, size=4), "fewer than 64 positions per image"),
        (cnn(None, None, width=12, size=8), "channels not a multiple of the block"),
    ],
    ids=["small_image", "odd_channels"],
)
def test_forward_conv_stays_a_conv(model, reason):
    _, done, report = fused(model, fuse="fuse(provider=cpu, rules=[conv_nchwc])")
    assert "conv_nchwc" not in report["fired"]
    assert any(r.startswith(reason) for r in report["refused"]["conv_nchwc"])
    assert NCHWC_DOMAIN not in {n.domain for n in done.graph.node}


@needs_nchwc
def test_a_program_fused_for_another_nchwc_block_is_refused_by_the_runtime():
    """Whole, and as the segments a data-parallel or PyTorch-front-end runtime cuts it into."""
    _, done, _ = fused(cnn(None, None, width=16, size=16))
    record = next(p for p in done.metadata_props if p.key == roles.FUSION)
    record.value = json.dumps({**json.loads(record.value), "nchwc_block": 2 * nchwc_block_size()})
    backward = cut(done, [[o.name for o in done.graph.output if o.name.endswith("_grad")]])[0].model
    for model in (done, backward):
        with pytest.raises(InvalidModelError, match=r"NCHWc kernels with \d+-channel blocks"):
            graphforge.create_session(model)


STACKED = ("conv_stacked", "conv_transpose_stacked")


def exported(program: onnx.ModelProto) -> onnx.ModelProto:
    return compiled(program, "prune(outputs=[logits])").model


@pytest.mark.parametrize(
    ("size", "stride", "forward", "backward"),
    [(4, 1, 3, 2), (2, 1, 3, 2), (1, 1, 3, 2), (3, 1, 3, 2), (5, 2, 2, 2), (8, 2, 2, 2), (16, 2, 1, 1)],
    ids=["4x4", "2x2", "1x1", "3x3_odd", "5x5_strided_odd", "8x8_strided", "16x16_strided"],
)
def test_small_image_convolutions_run_stacked_and_export_as_they_were(size, stride, forward, backward):
    """Three 3×3 convs (the later ones with ``stride``); each with at most 16 output positions
    per image is stacked, and so is each input gradient whose dY has at most 16. The exported
    model is byte for byte the one exported without fuse: prune puts the Conv back."""
    model = cnn(None, None, None, width=8, size=size, stride=stride)
    plain, done, report = fused(
        model,
        pipeline=f"{GRADIENTS}, sgd(lr=0.1)",
        fuse="fuse(provider=cpu, rules=[conv_stacked, conv_transpose_stacked])",
    )
    assert report["fired"] == {"conv_stacked": forward, "conv_transpose_stacked": backward}
    assert sorted(report["restore"]) == sorted(f"c{i}" for i in range(3 - forward, 3))
    assert ops(done)["Conv"] == ops(plain)["Conv"]  # each rewritten as one stacked Conv
    if forward < 3:
        assert report["refused"]["conv_stacked"] == {"more than 16 positions per image": 3 - forward}
    assert_same_values(plain, done, reordered=True)
    assert_same_values(plain, done, seed=1, reordered=True)
    assert exported(done).SerializeToString() == exported(plain).SerializeToString()


@pytest.mark.parametrize(
    ("op", "x", "w", "attrs"),
    [
        ("Conv", [4, 3, 5], [6, 3, 3], {"pads": [1, 1]}),
        ("Conv", [4, 2, 3, 2, 2], [3, 2, 2, 2, 2], {"pads": [1, 0, 1, 0, 1, 0], "strides": [2, 1, 1]}),
        ("Conv", [3, 2, 4, 4], [3, 2, 3, 3], {"pads": [2, 0, 0, 2], "dilations": [2, 1]}),
        ("Conv", [3, 2, 4, 3], [3, 2, 2, 3], {"pads": [0, 1, 1, 1], "strides": [3, 1]}),
        ("Conv", [3, 4, 3, 3], [4, 2, 3, 3], {"pads": [1, 1, 1, 1], "group": 2}),
        ("Conv", [3, 2, 5, 5], [3, 2, 3, 3], {"auto_pad": "VALID"}),
        (
            "ConvTranspose",
            [3, 4, 2, 2],
            [4, 3, 3, 3],
            {"strides": [2, 2], "pads": [0, 1, 2, 0], "output_padding": [1, 1]},
        ),
        ("ConvTranspose", [3, 2, 3], [2, 2, 3], {"dilations": [2], "pads": [1, 0]}),
        ("ConvTranspose", [3, 4, 2, 3], [4, 1, 2, 2], {"group": 2, "strides": [1, 2]}),
    ],
    ids=[
        "1d",
        "3d_strided",
        "dilated_uneven_pads",
        "stride_3",
        "grouped",
        "valid",
        "transpose_strided",
        "transpose_1d_dilated",
        "transpose_grouped",
    ],
)
def test_stacking_keeps_every_geometry(op, x, w, attrs):
    """A forward Conv or ConvTranspose of each geometry, stacked: the same output as
    onnxruntime's on the node as written (the batch dim symbolic, as exporters write it)."""
    rng = np.random.default_rng(2)
    weights = numpy_helper.from_array(rng.standard_normal(w).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "w"], ["y"], name="/node", **attrs)],
        "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *x[1:]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [weights],
    )
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    result = compiled(model, f"fuse(provider=cpu, rules={list(STACKED)})")
    assert result.records[-1].changed, result.records[-1].note
    feeds = {"x": rng.standard_normal(x).astype(np.float32)}
    expected, actual = run(model, feeds)["y"], run(result.model, feeds)["y"]
    assert actual.shape == expected.shape
    assert np.abs(actual - expected).max() <= RTOL * np.abs(expected).max()


def _decoder(bias: bool) -> onnx.ModelProto:
    """x [N, 4, 3, 3] → Conv 3×3 (8) → Relu → ConvTranspose 3×3/2 (5 channels, pads 1,
    output_padding 1) [N, 5, 6, 6] → global average → logits [N, 5]: a forward ConvTranspose,
    with biases or not."""
    rng = np.random.default_rng(5)
    inits = [
        numpy_helper.from_array((rng.standard_normal((8, 4, 3, 3)) / 6).astype(np.float32), "w0"),
        numpy_helper.from_array((rng.standard_normal((8, CLASSES, 3, 3)) / 8).astype(np.float32), "w1"),
    ]
    extra = ([], [])
    if bias:
        inits += [
            numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), f"b{i}")
            for i, n in enumerate((8, CLASSES))
        ]
        extra = (["b0"], ["b1"])
    nodes = [
        helper.make_node("Conv", ["x", "w0", *extra[0]], ["c"], name="/conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="/relu"),
        helper.make_node(
            "ConvTranspose",
            ["r", "w1", *extra[1]],
            ["up"],
            name="/up",
            strides=[2, 2],
            pads=[1, 1, 1, 1],
            output_padding=[1, 1],
        ),
        helper.make_node("GlobalAveragePool", ["up"], ["g"]),
        helper.make_node("Flatten", ["g"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "decoder",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 3, 3])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_a_forward_conv_transpose_is_stacked_and_put_back_on_export(bias):
    """The decoder's forward Conv and ConvTranspose (the biases a third input), and the
    ConvTranspose's input gradient, a Conv with 3×3 outputs; only the forward two are put back."""
    plain, done, report = fused(_decoder(bias), fuse=f"fuse(provider=cpu, rules={list(STACKED)})")
    assert report["fired"] == {"conv_stacked": 2, "conv_transpose_stacked": 1}
    assert sorted(report["restore"]) == ["c", "up"]
    assert_same_values(plain, done, reordered=True)
    assert exported(done).SerializeToString() == exported(plain).SerializeToString()


@needs_nchwc
def test_a_forward_conv_transpose_on_nchwc_kernels_is_put_back_on_export():
    """Any rule that rewrites a user's node is recorded by the engine, not only the stacked ones:
    a forward 16×16 ConvTranspose goes onto the CPU's blocked kernels, and the export, which must
    not depend on the CPU's vector width, has the ConvTranspose again."""
    block = nchwc_block_size()
    rng = np.random.default_rng(4)
    graph = helper.make_graph(
        [helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="/up", pads=[1, 1, 1, 1])],
        "up",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", block, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", block, 16, 16])],
        [numpy_helper.from_array(rng.standard_normal((block, block, 3, 3)).astype(np.float32), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    done = compiled(model, "fuse(provider=cpu, rules=[conv_input_grad_nchwc])").model
    assert {n.domain for n in done.graph.node} >= {NCHWC_DOMAIN}
    assert list(json.loads(roles.metadata_of(done)[roles.FUSION])["restore"]) == ["y"]
    prune = "prune(outputs=[y])"
    fused_export, plain_export = compiled(done, prune).model, compiled(model, prune).model
    assert fused_export.graph == plain_export.graph  # (the raw model has no producer: its bytes differ there)
    assert list(fused_export.opset_import) == list(plain_export.opset_import)


def test_a_program_edited_after_fuse_is_a_clear_prune_error():
    _, done, _ = fused(cnn(None, None, width=8, size=4))
    record = next(p for p in done.metadata_props if p.key == roles.FUSION)
    value = json.loads(record.value)
    value["restore"]["c1"][-1]["inputs"][1] = "w_gone"
    record.value = json.dumps(value)
    with pytest.raises(graphforge.GraphforgeError, match=r"Conv '/conv1', whose inputs 'w_gone' the model no longer"):
        exported(done)


def test_stacking_is_a_cpu_rule():
    graph = Model.from_proto(cnn(None, width=8, size=4)).graph
    report = apply(graph, [r for r in RULES if r.name in STACKED], Context("CUDAExecutionProvider", 17))
    assert report.fired == {}
    assert report.refused["conv_stacked"] == {
        "a CPU kernel's per-image loop; the program is for CUDAExecutionProvider": 1
    }


def test_new_nodes_keep_the_origin_and_the_output_names():
    plain, done, _ = fused(cnn(POOL))
    unpool = next(n for n in done.graph.node if n.op_type == "MaxUnpool")
    assert roles.node_origin(unpool.name) == ("grad", "/pool0")
    assert {o.name for o in plain.graph.output} == {o.name for o in done.graph.output}
    onnx.checker.check_model(done)


def test_unknown_rule_names_the_rules():
    with pytest.raises(ValueError, match="relu_backward_mask, maxpool_backward_unpool, conv_input_grad_nchwc"):
        Fuse(rules=("relu_fusion",))


def test_one_rule_chosen_applies_only_that_rule():
    _, _, report = fused(cnn(POOL), fuse="fuse(provider=cpu, rules=[maxpool_backward_unpool])")
    assert report["fired"] == {"maxpool_backward_unpool": 1}


# --------------------------------------------------------------------------- the engine

SQUARE_AND_PRODUCT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[4] a, float[4] b) => (float[4] y, float[4] z) {
    sq = Mul(a, a)
    y = Neg(sq)
    prod = Mul(a, b)
    z = Neg(prod)
    dead = Abs(a)
}
"""


def _square_rule(calls: list) -> Rule:
    """Neg(Mul(x, x)) → Neg(Pow(x, 2)); refuses when x is the input named ``b``."""

    def check(m, _):
        calls.append(m.root.outputs[0].name)
        return "x is b" if m.vars["x"].name == "b" else None

    def replace(b, m, _):
        return [b.op("Neg", b.op("Pow", m.vars["x"], b.constant(np.array(2.0, np.float32))))]

    return Rule("square", Pattern.of(lambda p: p.op("Neg", p.op("Mul", p.var("x"), p.var("x")))), check, replace, "")


def _graph(text: str) -> gs.Graph:
    return Model.from_proto(onnx.parser.parse_model(text)).graph


def test_a_variable_named_twice_binds_one_tensor():
    graph = _graph(SQUARE_AND_PRODUCT)
    calls: list[str] = []
    report = apply(graph, [_square_rule(calls)], Context("CPUExecutionProvider", 17))
    assert calls == ["y"]  # Neg(Mul(a, b)) is no match
    assert report.fired == {"square": 1}
    ops_now = [n.op for n in graph.nodes]
    assert ops_now.count("Pow") == 1 and ops_now.count("Mul") == 1  # a·a gone, a·b kept
    assert "Abs" in ops_now  # dead before: dce's, not this pass's
    y = next(t for t in graph.outputs if t.name == "y")
    assert y.inputs[0].op == "Neg" and y.inputs[0].inputs[0].inputs[0].op == "Pow"


def test_refusals_are_counted_by_reason():
    text = SQUARE_AND_PRODUCT.replace("sq = Mul(a, a)", "sq = Mul(b, b)")
    report = apply(_graph(text), [_square_rule([])], Context("CPUExecutionProvider", 17))
    assert report.fired == {} and report.refused == {"square": {"x is b": 1}}
    assert report.note() == "no rule fired; square refused 1: x is b ×1"


def test_replacement_is_placed_where_the_root_was():
    graph = _graph(SQUARE_AND_PRODUCT)
    apply(graph, [_square_rule([])], Context("CPUExecutionProvider", 17))
    names = [n.op for n in graph.nodes]
    assert names.index("Pow") < names.index("Mul")  # the a·a root's place, before a·b


def test_a_disconnected_pattern_is_an_error():
    def two(p):
        p.op("Abs", p.var("x"))
        return p.op("Neg", p.var("y"))

    with pytest.raises(ValueError, match="not connected"):
        Pattern.of(two)


def test_every_forward_node_of_a_match_is_put_back_on_export():
    """A pattern over several forward nodes: prune writes each of them again (the Mul whose
    output only the matched Neg read, then the Neg), and the export is the model as given."""
    source = onnx.parser.parse_model(SQUARE_AND_PRODUCT.replace("    dead = Abs(a)\n", ""))
    model = Model.from_proto(source)
    context = Context("CPUExecutionProvider", 17)
    apply(model.graph, [_square_rule([])], context)
    assert [r["op"] for r in context.restore["y"]] == ["Mul", "Neg"]
    roles.set_json(model, roles.FUSION, {"restore": context.restore})
    fused_proto = model.to_proto()
    assert "Pow" in ops(fused_proto)
    exported = compiled(fused_proto, "prune(outputs=[y, z])").model
    assert exported.graph == compiled(source, "prune(outputs=[y, z])").model.graph


def test_a_rule_that_leaves_a_forward_input_unread_is_an_error():
    """prune puts a forward node back onto its own inputs: a replacement that reads around one
    (here the source of the Abs the Neg read) would leave it to be removed, so apply refuses."""
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4] x) => (float[4] y) {
        a = Abs(x)
        y = Neg(a)
    }
    """

    def replace(b, m, _):
        return [b.op("Neg", b.op("Abs", m.vars["a"].inputs[0].inputs[0]))]

    rule = Rule("around", Pattern.of(lambda p: p.op("Neg", p.var("a"))), lambda m, c: None, replace, "")
    with pytest.raises(RuntimeError, match=r"rule around rewrote Neg .* left its input\(s\) 'a' unread"):
        apply(_graph(text), [rule], Context("CPUExecutionProvider", 17))


def _channels_last_conv() -> onnx.ModelProto:
    """[N, 4, 4, 8] channels last, made NCHW by a Transpose, then a 2×2 stride-2 Conv (as
    ConvNeXt writes its downsampling), its attributes in the order torch's dynamo exporter
    writes them (not sorted by name)."""
    rng = np.random.default_rng(0)
    conv = helper.make_node("Conv", ["nchw", "w", "bias"], ["c"], name="/down/Conv")
    for name, value in (("strides", [2, 2]), ("pads", [0, 0, 0, 0]), ("kernel_shape", [2, 2]), ("group", 1)):
        conv.attribute.append(helper.make_attribute(name, value))
    nodes = [
        helper.make_node("Transpose", ["x"], ["nchw"], name="/down/Transpose", perm=[0, 3, 1, 2]),
        conv,
        helper.make_node("Flatten", ["c"], ["f"], name="/Flatten"),
        helper.make_node("Gemm", ["f", "fc"], ["logits"], name="/Gemm", transB=1),
    ]
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (6, 8, 2, 2)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.normal(0, 0.1, 6).astype(np.float32), "bias"),
        numpy_helper.from_array(rng.normal(0, 0.3, (CLASSES, 24)).astype(np.float32), "fc"),
    ]
    graph = helper.make_graph(
        nodes,
        "channels_last",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 4, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_conv_reading_a_transpose_is_stacked_and_put_back_as_written():
    plain, done, report = fused(_channels_last_conv(), fuse=f"fuse(provider=cpu, rules={list(STACKED)})")
    assert report["fired"] == {"conv_stacked": 1}  # the first layer: no input gradient
    assert_same_values(plain, done, reordered=True)
    fused_export, plain_export = exported(done), exported(plain)
    assert fused_export.graph == plain_export.graph
    (conv,) = [n for n in fused_export.graph.node if n.op_type == "Conv"]
    assert [a.name for a in conv.attribute] == ["strides", "pads", "kernel_shape", "group"]
