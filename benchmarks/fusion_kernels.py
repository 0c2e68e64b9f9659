"""The kernel-level A/Bs behind the fusion rules: each formulation alone in an onnxruntime CPU
session, at 1 and 2 threads, on a few layer shapes (median of 30 runs after 3 warm-ups).

    python benchmarks/fusion_kernels.py

- ReLU's gradient: Where(y > 0, dy, 0) against dy · Cast(y > 0) (rule relu_backward_mask).
- A 2×2/2 MaxPool's gradient: ScatterElements into flat zeros against MaxUnpool (rule
  maxpool_backward_unpool), and the forward MaxPool with and without its Indices output.
- A 3×3 stride-1 convolution's input gradient: ConvTranspose(dy, W) against Conv(dy, W
  transposed and flipped), plain (faster on some shapes, slower on others: not a rule) and on
  onnxruntime's NCHWc kernels with the weights blocked each run (rule conv_input_grad_nchwc,
  where the channels divide into the CPU's block).
"""

from __future__ import annotations

import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from graphforge.ort_compat import NCHWC_DOMAIN, NCHWC_WEIGHT_PERM, nchwc_block_size

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
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads, options.log_severity_level = threads, 1, 3
    # no NCHWc transformer: a training program's weights are inputs, which it leaves alone anyway
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    for _ in range(WARMUP):
        result = session.run(None, feeds)
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1000, result


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


def main() -> None:
    rng = np.random.default_rng(0)
    print("| what | shape | threads | today's ms | the other formulation's ms |")
    print("| --- | --- | ---: | --- | --- |")
    for threads in (1, 2):
        for lines in (relu(threads, rng), maxpool(threads, rng), conv_input_gradient(threads, rng)):
            print("\n".join(lines), flush=True)
    print(f"\nonnxruntime {ort.__version__}")


if __name__ == "__main__":
    main()
