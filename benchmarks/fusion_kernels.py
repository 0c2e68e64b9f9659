"""The kernel-level A/Bs behind the fusion rules: each formulation alone in an onnxruntime CPU
session, at 1 and 2 threads, on a few layer shapes (median of 30 runs after 3 warm-ups).

    python benchmarks/fusion_kernels.py [relu|maxpool|conv|conv_forward|small_conv|optimizer ...]

- ReLU's gradient: Where(y > 0, dy, 0) against dy · Cast(y > 0) (rule relu_backward_mask).
- A 2×2/2 MaxPool's gradient: ScatterElements into flat zeros against MaxUnpool (rule
  maxpool_backward_unpool), and the forward MaxPool with and without its Indices output.
- A 3×3 stride-1 convolution's input gradient: ConvTranspose(dy, W) against Conv(dy, W
  transposed and flipped), plain (faster on some shapes, slower on others: not a rule) and on
  onnxruntime's NCHWc kernels with the weights blocked each run (rule conv_input_grad_nchwc,
  where the channels divide into the CPU's block).
- A forward convolution: Conv as it is (im2col + GEMM image by image) against onnxruntime's
  NCHWc Conv with the weights blocked each run and the input and output reordered (rule
  conv_nchwc), on ResNet-18's and the benchmark CNN's layers; the two run in turn, run by
  run, and each gets its median and its fastest run (the machine is shared: the fastest
  run is the one least disturbed).
- A 3×3 convolution over small images, forward and input gradient: Conv and ConvTranspose as
  they are against the batch stacked into one tall image (rules conv_stacked and
  conv_transpose_stacked, applied by the fuse pass itself, their position limit lifted so
  that the larger layers show why it is there); and the weight gradient as a GEMM per kernel
  offset over channels-first slices against one GEMM over channels-last columns (autodiff's
  Conv gradient, which picks the second up to 16 output positions).
- AdamW's update over a model's parameters (``optimizer_layouts``): the optimizer segment of
  graphforge's own program (its chain of elementwise ops once per parameter) against the same
  chain once over one flat buffer holding every parameter (the layout of a multi-tensor
  optimizer), with and without the Concat and Split that gather the parameters and gradients
  into it and hand the updated parameters back (the program's parameters are separate tensors).
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from graphforge.ort_compat import NCHWC_DOMAIN, NCHWC_WEIGHT_PERM, nchwc_block_size
from graphforge.stand_ins import is_stand_in

RUNS, WARMUP = 30, 3
ACTIVATIONS = ([32, 32, 32, 32], [16, 64, 56, 56])
#: batch, in channels, size, out channels: the benchmark CNN's second conv, two ImageNet-sized layers and
#: ResNet-18's four stages at 3×64×64 (the Fusion benchmark's)
CONVS = (
    (32, 32, 16, 64),
    (16, 64, 56, 64),
    (16, 128, 28, 128),
    (16, 64, 16, 64),
    (16, 128, 8, 128),
    (16, 256, 4, 256),
    (16, 512, 2, 512),
)


def median_ms(nodes, feeds: dict[str, np.ndarray], threads: int, inits=(), outputs=("out",)) -> tuple[float, list]:
    types = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64}
    graph = helper.make_graph(
        nodes,
        "ab",
        [helper.make_tensor_value_info(k, types[v.dtype], list(v.shape)) for k, v in feeds.items()],
        [helper.make_value_info(o, onnx.TypeProto()) for o in outputs],
        list(inits),
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(NCHWC_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=9)
    # no NCHWc transformer: a training program's weights are inputs, which it leaves alone anyway
    session = _cpu_session(model, threads, ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)
    result = session.run(None, feeds)
    return _median_ms(lambda: session.run(None, feeds)), result


def _cpu_session(model: onnx.ModelProto, threads: int, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads, options.log_severity_level = threads, 1, 3
    options.graph_optimization_level = level
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _median_ms(run) -> float:
    """Median ms of RUNS calls of ``run`` after WARMUP more."""
    for _ in range(WARMUP):
        run()
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1000


def relu(threads: int, rng) -> list[str]:
    zero = numpy_helper.from_array(np.array(0, np.float32), "zero")
    lines = []
    for shape in ACTIVATIONS:
        feeds = {"y": np.maximum(rng.standard_normal(shape), 0).astype(np.float32)}
        feeds["dy"] = rng.standard_normal(shape).astype(np.float32)
        mask = helper.make_node("Greater", ["y", "zero"], ["m"])
        where, a = median_ms([mask, helper.make_node("Where", ["m", "dy", "zero"], ["out"])], feeds, threads, [zero])
        cast = helper.make_node("Cast", ["m"], ["c"], to=TensorProto.FLOAT)
        mul, b = median_ms([mask, cast, helper.make_node("Mul", ["dy", "c"], ["out"])], feeds, threads, [zero])
        assert np.array_equal(a[0], b[0])
        lines.append(f"| ReLU gradient | {shape} | {threads} | Where {where:.2f} | Greater+Cast+Mul {mul:.2f} |")
    return lines


def maxpool(threads: int, rng) -> list[str]:
    lines = []
    for shape in ACTIVATIONS:
        x = rng.standard_normal(shape).astype(np.float32)
        pool = {"kernel_shape": [2, 2], "strides": [2, 2]}
        with_i, (y, indices) = median_ms(
            [helper.make_node("MaxPool", ["x"], ["out", "i"], **pool)], {"x": x}, threads, outputs=("out", "i")
        )
        without, _ = median_ms([helper.make_node("MaxPool", ["x"], ["out"], **pool)], {"x": x}, threads)
        lines.append(
            f"| MaxPool 2×2/2 forward | {shape} | {threads} | with Indices {with_i:.2f} | without {without:.2f} |"
        )
        feeds = {"dy": rng.standard_normal(y.shape).astype(np.float32), "i": indices}
        inits = [
            numpy_helper.from_array(np.array(shape, np.int64), "shape"),
            numpy_helper.from_array(np.array([-1]), "flat"),
        ]
        scatter_nodes = [
            helper.make_node("ConstantOfShape", ["shape"], ["z"]),
            helper.make_node("Reshape", ["z", "flat"], ["zf"]),
            helper.make_node("Reshape", ["i", "flat"], ["if"]),
            helper.make_node("Reshape", ["dy", "flat"], ["df"]),
            helper.make_node("ScatterElements", ["zf", "if", "df"], ["s"], axis=0),
            helper.make_node("Reshape", ["s", "shape"], ["out"]),
        ]
        scatter, a = median_ms(scatter_nodes, feeds, threads, inits)
        unpool, b = median_ms(
            [helper.make_node("MaxUnpool", ["dy", "i", "shape"], ["out"], **pool)], feeds, threads, inits
        )
        assert np.array_equal(a[0], b[0])
        lines.append(
            f"| MaxPool 2×2/2 gradient | {shape} | {threads} | ScatterElements {scatter:.2f} | MaxUnpool {unpool:.2f} |"
        )
    return lines


def conv_input_gradient(threads: int, rng) -> list[str]:
    flip = [
        numpy_helper.from_array(np.array(v, np.int64), name)
        for name, v in (("st", [-1, -1]), ("en", [-(2**62), -(2**62)]), ("ax", [2, 3]), ("sp", [-1, -1]))
    ]
    lines = []
    for n, c, size, o in CONVS:
        feeds = {
            "dy": rng.standard_normal((n, o, size, size)).astype(np.float32),
            "w": rng.standard_normal((o, c, 3, 3)).astype(np.float32),
        }
        transpose, a = median_ms(
            [helper.make_node("ConvTranspose", ["dy", "w"], ["out"], pads=[1] * 4)], feeds, threads
        )
        as_conv = [
            helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0, 2, 3]),
            helper.make_node("Slice", ["wt", "st", "en", "ax", "sp"], ["wf"]),
            helper.make_node("Conv", ["dy", "wf"], ["out"], pads=[1] * 4),
        ]
        conv, b = median_ms(as_conv, feeds, threads, flip)
        np.testing.assert_allclose(b[0], a[0], rtol=1e-4, atol=1e-3)
        line = f"| 3×3 conv input gradient | {[n, o, size, size]} → {c} | {threads} | ConvTranspose {transpose:.2f} | "
        line += f"Conv, flipped W {conv:.2f}"
        block = nchwc_block_size()
        if block and not (c % block or o % block):  # rule conv_input_grad_nchwc's form
            blocking = [
                numpy_helper.from_array(np.array(v, np.int64), name)
                for name, v in (("s6", [c // block, block, o // block, block, 3, 3]), ("s4", [c, o, 3, 3]))
            ]
            nchwc = [
                *as_conv[:2],
                helper.make_node("Reshape", ["wf", "s6"], ["w6"]),
                helper.make_node("Transpose", ["w6"], ["w6t"], perm=list(NCHWC_WEIGHT_PERM)),
                helper.make_node("Reshape", ["w6t", "s4"], ["wr"]),
                helper.make_node("ReorderInput", ["dy"], ["dyr"], domain=NCHWC_DOMAIN),
                helper.make_node("Conv", ["dyr", "wr"], ["yr"], domain=NCHWC_DOMAIN, pads=[1] * 4, kernel_shape=[3, 3]),
                helper.make_node("ReorderOutput", ["yr"], ["out"], domain=NCHWC_DOMAIN, channels=c),
            ]
            blocked, r = median_ms(nchwc, feeds, threads, [*flip, *blocking])
            np.testing.assert_allclose(r[0], a[0], rtol=1e-4, atol=1e-3)
            line += f"; NCHWc Conv, flipped W {blocked:.2f}"
        lines.append(line + " |")
    return lines


#: batch, in channels, size, out channels, kernel, stride: ResNet-18's layers at 3×64×64 (batch 16)
#: from 16×16 down, and the benchmark CNN's second conv (batch 32)
FORWARD_CONVS = (
    (16, 64, 16, 64, 3, 1),
    (32, 32, 16, 64, 3, 1),
    (16, 128, 8, 128, 3, 1),
    (16, 64, 16, 128, 3, 2),
    (16, 64, 16, 128, 1, 2),
    (16, 128, 8, 256, 3, 2),
    (16, 256, 4, 256, 3, 1),
)


def _interleaved_ms(runs: dict[str, Callable[[], object]]) -> dict[str, tuple[float, float]]:
    """Each run's (median, fastest) ms over RUNS rounds in which every run goes once, in turn."""
    for run in runs.values():
        for _ in range(WARMUP):
            run()
    times = {name: [] for name in runs}
    for _ in range(RUNS):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: (float(np.median(t)) * 1000, float(np.min(t)) * 1000) for name, t in times.items()}


def _nchwc_forward_nodes(o: int, c: int, k: int, stride: int, block: int) -> tuple[list, list]:
    """Rule conv_nchwc's form: W blocked ([O/B, B, C/B, B, k, k] permuted), x reordered, the
    NCHWc Conv, the result reordered back."""
    shapes = [
        numpy_helper.from_array(np.array(v, np.int64), name)
        for name, v in (("s6", [o // block, block, c // block, block, k, k]), ("s4", [o, c, k, k]))
    ]
    pads = [k // 2] * 4
    nodes = [
        helper.make_node("Reshape", ["w", "s6"], ["w6"]),
        helper.make_node("Transpose", ["w6"], ["w6t"], perm=list(NCHWC_WEIGHT_PERM)),
        helper.make_node("Reshape", ["w6t", "s4"], ["wr"]),
        helper.make_node("ReorderInput", ["x"], ["xr"], domain=NCHWC_DOMAIN),
        helper.make_node(
            "Conv", ["xr", "wr"], ["yr"], domain=NCHWC_DOMAIN, kernel_shape=[k, k], pads=pads, strides=[stride] * 2
        ),
        helper.make_node("ReorderOutput", ["yr"], ["out"], domain=NCHWC_DOMAIN, channels=o),
    ]
    return nodes, shapes


def _session_of(nodes, feeds: dict[str, np.ndarray], threads: int, inits=()):
    graph = helper.make_graph(
        nodes,
        "ab",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in feeds.items()],
        [helper.make_value_info("out", onnx.TypeProto())],
        list(inits),
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(NCHWC_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=9)
    return _cpu_session(model, threads, ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)


def conv_forward(threads: int, rng) -> list[str]:
    block = nchwc_block_size()
    if block is None:
        return [f"| conv forward | — | {threads} | no NCHWc kernels in this onnxruntime on this CPU | |"]
    lines = []
    for n, c, size, o, k, stride in FORWARD_CONVS:
        feeds = {
            "x": rng.standard_normal((n, c, size, size)).astype(np.float32),
            "w": (rng.standard_normal((o, c, k, k)) / np.sqrt(k * k * c)).astype(np.float32),
        }
        plain = _session_of(
            [helper.make_node("Conv", ["x", "w"], ["out"], pads=[k // 2] * 4, strides=[stride] * 2)], feeds, threads
        )
        nodes, shapes = _nchwc_forward_nodes(o, c, k, stride, block)
        blocked = _session_of(nodes, feeds, threads, shapes)
        np.testing.assert_allclose(blocked.run(None, feeds)[0], plain.run(None, feeds)[0], rtol=1e-4, atol=1e-4)
        ms = _interleaved_ms(
            {"plain": functools.partial(plain.run, None, feeds), "nchwc": functools.partial(blocked.run, None, feeds)}
        )
        out = (size - 1) // stride + 1
        lines.append(
            f"| {k}×{k} conv forward | {[n, c, size, size]} → {o}, stride {stride} ({out}×{out} out) | {threads} | "
            f"Conv {ms['plain'][0]:.2f} (fastest {ms['plain'][1]:.2f}) | "
            f"NCHWc Conv {ms['nchwc'][0]:.2f} (fastest {ms['nchwc'][1]:.2f}) |"
        )
    return lines


#: batch, in channels, size, out channels, stride: ResNet-18's 3×3 layers at 3×64×64, batch 16
SMALL_CONVS = (
    (16, 64, 16, 64, 1),
    (16, 128, 8, 128, 1),
    (16, 256, 4, 256, 1),
    (16, 512, 2, 512, 1),
    (16, 128, 8, 256, 2),
    (16, 256, 4, 512, 2),
)


def _one_node_model(node, feeds: dict[str, np.ndarray], out: tuple[int, ...]) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node],
        "conv",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in feeds.items()],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, list(out))],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _stacked_form(model: onnx.ModelProto, rule: str) -> onnx.ModelProto:
    from graphforge.passes.fusion.rules import stacked

    import graphforge

    saved, stacked.MAX_POSITIONS = stacked.MAX_POSITIONS, 1 << 30
    try:
        result = graphforge.compile(model, f"fuse(provider=cpu, rules=[{rule}])")
    finally:
        stacked.MAX_POSITIONS = saved
    assert result.records[-1].changed, result.records[-1].note
    return result.model


def _timed(model: onnx.ModelProto, feeds, threads: int):
    session = _cpu_session(model, threads, ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)
    return _median_ms(lambda: session.run(None, feeds)), session.run(None, feeds)[0]


def _weight_gradient_nodes(n, c, size, o, stride, channels_last: bool) -> list:
    """dW of a 3×3, pad-1 Conv from x and dy: per offset a GEMM over a channels-first slice
    (then stacked along a last axis), or one GEMM over the channels-last columns."""
    out = (size - 1) // stride + 1
    const = {}

    def ints(*v):
        name = f"k{len(const)}"
        const[name] = numpy_helper.from_array(np.array(v, np.int64), name)
        return name

    nodes = [helper.make_node("Transpose", ["dy"], ["dyt"], perm=[1, 0, 2, 3])]
    nodes.append(helper.make_node("Reshape", ["dyt", ints(o, -1)], ["g"]))
    perm, pads, axes = (
        ([0, 2, 3, 1], [0, 1, 1, 0] * 2, [1, 2]) if channels_last else ([1, 0, 2, 3], [0, 0, 1, 1] * 2, [2, 3])
    )
    nodes += [
        helper.make_node("Transpose", ["x"], ["xt"], perm=perm),
        helper.make_node("Pad", ["xt", ints(*pads)], ["xp"]),
    ]
    pieces = []
    for i in range(3):
        for j in range(3):
            end = [i + (out - 1) * stride + 1, j + (out - 1) * stride + 1]
            piece = f"s{i}{j}"
            nodes.append(
                helper.make_node("Slice", ["xp", ints(i, j), ints(*end), ints(*axes), ints(stride, stride)], [piece])
            )
            if not channels_last:
                nodes += [
                    helper.make_node("Reshape", [piece, ints(c, -1)], [piece + "f"]),
                    helper.make_node("Gemm", ["g", piece + "f"], [piece + "g"], transB=1),
                    helper.make_node("Unsqueeze", [piece + "g", ints(2)], [piece + "u"]),
                ]
                piece += "u"
            pieces.append(piece)
    if channels_last:
        nodes += [
            helper.make_node("Concat", pieces, ["cols"], axis=3),
            helper.make_node("Reshape", ["cols", ints(-1, 9 * c)], ["colm"]),
            helper.make_node("MatMul", ["g", "colm"], ["flat"]),
            helper.make_node("Reshape", ["flat", ints(o, 9, c)], ["f3"]),
            helper.make_node("Transpose", ["f3"], ["ft"], perm=[0, 2, 1]),
            helper.make_node("Reshape", ["ft", ints(o, c, 3, 3)], ["out"]),
        ]
    else:
        nodes += [
            helper.make_node("Concat", pieces, ["cat"], axis=2),
            helper.make_node("Reshape", ["cat", ints(o, c, 3, 3)], ["out"]),
        ]
    return nodes, list(const.values())


def small_convolutions(threads: int, rng) -> list[str]:
    lines = []
    for n, c, size, o, stride in SMALL_CONVS:
        out = (size - 1) // stride + 1
        x = rng.standard_normal((n, c, size, size)).astype(np.float32)
        w = (rng.standard_normal((o, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32)
        dy = rng.standard_normal((n, o, out, out)).astype(np.float32)
        conv = {"pads": [1] * 4, "strides": [stride] * 2}
        shape = f"{[n, c, size, size]} → {o}, stride {stride}"
        for what, node, feeds, rule, result in (
            ("forward", helper.make_node("Conv", ["x", "w"], ["out"], **conv), {"x": x, "w": w}, "conv_stacked", dy),
            (
                "input gradient",
                helper.make_node("ConvTranspose", ["dy", "w"], ["out"], **conv, output_padding=[stride - 1] * 2),
                {"dy": dy, "w": w},
                "conv_transpose_stacked",
                x,
            ),
        ):
            model = _one_node_model(node, feeds, result.shape)
            plain, a = _timed(model, feeds, threads)
            stacked, b = _timed(_stacked_form(model, rule), feeds, threads)
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-3)
            lines.append(
                f"| 3×3 conv {what} | {shape} | {threads} | {node.op_type} {plain:.2f} | stacked {stacked:.2f} |"
            )
        feeds = {"x": x, "dy": dy}
        times = []
        for channels_last in (False, True):
            nodes, inits = _weight_gradient_nodes(n, c, size, o, stride, channels_last)
            ms, result = median_ms(nodes, feeds, threads, inits)
            times.append((ms, result[0]))
        np.testing.assert_allclose(times[1][1], times[0][1], rtol=1e-3, atol=1e-2)
        lines.append(
            f"| 3×3 conv weight gradient | {shape} | {threads} | GEMM per offset {times[0][0]:.2f} | "
            f"one GEMM, channels last {times[1][0]:.2f} |"
        )
    return lines


#: parameter shapes: the Training step section's MLP, one GPT-2 small block, and 96 LayerNorm-sized
#: vectors (the optimizer's cost there is per op, not per byte)
PARAMETER_SETS = (
    ("MLP 784-1024-1024-10", [(1024, 784), (1024,), (1024, 1024), (1024,), (10, 1024), (10,)]),
    (
        "GPT-2 small block",
        [
            (768,),
            (768,),
            (768, 2304),
            (2304,),
            (768, 768),
            (768,),
            (768,),
            (768,),
            (768, 3072),
            (3072,),
            (3072, 768),
            (768,),
        ],
    ),
    ("96 × 768", [(768,)] * 96),
)


def _optimizer_segment(shapes) -> onnx.ModelProto:
    """The AdamW segment of graphforge's program for a model whose parameters have ``shapes``
    (loss = Σ ReduceSum(p · x): the update does not depend on what the forward is)."""
    import graphforge
    from graphforge.placement.step import split_program
    from graphforge.program import ProgramRoles

    params = [numpy_helper.from_array(np.full(s, 0.5, np.float32), f"p{i}") for i, s in enumerate(shapes)]
    nodes, sums = [], []
    for i in range(len(shapes)):
        nodes += [
            helper.make_node("Mul", [f"p{i}", "x"], [f"m{i}"]),
            helper.make_node("ReduceSum", [f"m{i}"], [f"s{i}"], keepdims=0),
        ]
        sums.append(f"s{i}")
    nodes.append(helper.make_node("Sum", sums, ["loss"]))
    graph = helper.make_graph(
        nodes,
        "params",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        params,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    program = graphforge.compile(model, "loss(output=loss), autodiff, adamw(lr=0.001, weight_decay=0.01)").model
    segment = split_program(program, ProgramRoles.read(program), norm_first=False).optim
    # the carried tensors are stand-ins there (the runtime binds them): inputs here, fed like the rest
    inputs = {v.name for v in segment.graph.input}
    for tensor in [t for t in segment.graph.initializer if is_stand_in(t)]:
        segment.graph.initializer.remove(tensor)
        if tensor.name not in inputs:
            segment.graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    return segment


def _bound_median_ms(model: onnx.ModelProto, feeds: dict[str, np.ndarray], threads: int) -> float:
    """Median ms of a run with inputs and outputs bound (the runtime's ping-pong buffers)."""
    session = _cpu_session(model, threads)
    binding = session.io_binding()
    for value in session.get_inputs():
        binding.bind_cpu_input(value.name, feeds[value.name])
    for value in session.get_outputs():
        binding.bind_output(value.name, "cpu")
    return _median_ms(lambda: session.run_with_iobinding(binding))


def _segment_feeds(segment: onnx.ModelProto, rng) -> dict[str, np.ndarray]:
    types = {TensorProto.FLOAT: np.float32, TensorProto.INT64: np.int64, TensorProto.BOOL: np.bool_}
    feeds = {}
    for value in segment.graph.input:
        tensor = value.type.tensor_type
        dims = [d.dim_value for d in tensor.shape.dim]
        dtype = types[tensor.elem_type]
        values = rng.random(dims) + 0.5 if dtype == np.float32 else np.ones(dims)
        feeds[value.name] = np.asarray(values, dtype)
    return feeds


def _gather_scatter(shapes) -> onnx.ModelProto:
    """What the flat layout adds to a step: the parameters and gradients flattened and
    concatenated into one buffer each, and the updated buffer split back into the parameters."""
    sizes = [math.prod(s) for s in shapes]
    nodes, inputs, outputs = [], [], []
    for kind in ("p", "g"):
        for i, s in enumerate(shapes):
            inputs.append(helper.make_tensor_value_info(f"{kind}{i}", TensorProto.FLOAT, list(s)))
            nodes.append(helper.make_node("Reshape", [f"{kind}{i}", "flat"], [f"{kind}{i}f"]))
        nodes.append(helper.make_node("Concat", [f"{kind}{i}f" for i in range(len(shapes))], [f"{kind}_all"], axis=0))
        outputs.append(f"{kind}_all")
    inputs.append(helper.make_tensor_value_info("new", TensorProto.FLOAT, [sum(sizes)]))
    nodes.append(helper.make_node("Split", ["new", "sizes"], [f"n{i}" for i in range(len(shapes))], axis=0))
    outputs += [f"n{i}" for i in range(len(shapes))]
    inits = [numpy_helper.from_array(np.array([-1]), "flat"), numpy_helper.from_array(np.array(sizes), "sizes")]
    graph = helper.make_graph(
        nodes, "gather", inputs, [helper.make_value_info(o, onnx.TypeProto()) for o in outputs], inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def optimizer_layouts(threads: int, rng) -> list[str]:
    lines = []
    for label, shapes in PARAMETER_SETS:
        total = sum(math.prod(s) for s in shapes)
        per_parameter = _optimizer_segment(shapes)
        flat = _optimizer_segment([(total,)])
        gather = _gather_scatter(shapes)
        ops = len(per_parameter.graph.node)
        each = _bound_median_ms(per_parameter, _segment_feeds(per_parameter, rng), threads)
        once = _bound_median_ms(flat, _segment_feeds(flat, rng), threads)
        moved = _bound_median_ms(gather, _segment_feeds(gather, rng), threads)
        lines.append(
            f"| AdamW update | {label}: {len(shapes)} tensors, {total:,} values | {threads} | "
            f"per parameter ({ops} nodes) {each:.2f} | one flat buffer ({len(flat.graph.node)} nodes) {once:.2f}, "
            f"with its Concat and Split {once + moved:.2f} |"
        )
    return lines


KERNELS = {
    "relu": relu,
    "maxpool": maxpool,
    "conv": conv_input_gradient,
    "conv_forward": conv_forward,
    "small_conv": small_convolutions,
    "optimizer": optimizer_layouts,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "what", nargs="*", choices=list(KERNELS), default=list(KERNELS), help="the A/Bs to run (default: all)"
    )
    chosen = parser.parse_args().what
    rng = np.random.default_rng(0)
    print("| what | shape | threads | today's ms | the other formulation's ms |")
    print("| --- | --- | ---: | --- | --- |")
    for threads in (1, 2):
        for name in chosen:
            print("\n".join(KERNELS[name](threads, rng)), flush=True)
    print(f"\nonnxruntime {ort.__version__}")


if __name__ == "__main__":
    main()
