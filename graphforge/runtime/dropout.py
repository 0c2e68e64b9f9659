"""Reproducible dropout: masks that are a pure function of (seed, step, micro-batch, node, element).

onnxruntime's Dropout draws its mask from a generator inside the kernel that is seeded at
random (or from the node's ``seed`` attribute) and advances with every run; its state can be
neither set nor saved. So two runs of the same config train differently, and a run resumed
from a checkpoint cannot continue bit-identically.

``seeded_dropout(program)`` rewrites every training-mode Dropout of a training program into
standard ONNX ops computing the same function with a counter-based mask (the idea of JAX's
threefry and of Philox: hash a counter, keep no state):

    k1, k2 = fmix(key[0] + id), fmix(key[1] + id * G)    per node, on scalars
    h      = fmix(fmix(index * G + k1) + k2)             per element, uint32 arithmetic
    mask   = h < (1 - ratio) * 2^32,   y = Where(mask, x * 1/(1 - ratio), 0)

``index`` is the element's position in C order, ``id`` the CRC-32 of the node's output name
(a node keeps its stream when other nodes change) and ``key`` (input ``KEY_INPUT``, uint32
[2]) is what the runtime feeds each run: ``run_key(seed, step, micro_batch, replica)`` (each
data-parallel replica draws its own masks). ``fmix`` is
MurmurHash3's 32-bit finalizer with each xor-shift ``h ^= h >> s`` written as an add-shift
``h += h >> s`` (the Bitwise ops need opset 18; programs are usually older). The right
shift is a BitShift where the session runs on the CPU and a Div by 2^s on CUDA, whose
onnxruntime has no BitShift kernel; both are exact integer arithmetic, like the uint32 Mul,
Add and Less around them, so the masks are the same bits on every device. Div is several
times slower than BitShift on the CPU (onnxruntime divides element by element), hence the two.

The node's outputs keep their names: the mask output (which the Dropout gradient rule reads)
is the same mask, so the backward pass drops exactly the elements the forward pass dropped.
Nodes left as they are: Dropout in inference mode (no training_mode input, or a constant
false one), ratio a constant 0 (onnxruntime's Dropout is then the identity), and Dropout in
subgraphs or before opset 12 (ratio as an attribute).
"""

from __future__ import annotations

import zlib
from collections.abc import Collection

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphforge.payloads import copy_without_initializers

#: the program input the runtime feeds the per-run key to
KEY_INPUT = "graphforge.dropout_key"
#: the golden-ratio constant (odd): spreads consecutive counters over the 32-bit range
_GOLDEN = 0x9E3779B9
#: MurmurHash3 fmix32's multipliers and shifts
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35
_SHIFTS = (16, 13, 16)
_MASK64 = (1 << 64) - 1


def run_key(seed: int, step: int, micro_batch: int, replica: int = 0) -> np.ndarray:
    """The key of one run: two 32-bit words from (seed, step, micro-batch, data-parallel
    replica), by SplitMix64; replica 0 draws what a single process draws."""
    x = (
        int(seed) * 0x9E3779B97F4A7C15
        + int(step) * 0xD1B54A32D192ED03
        + int(micro_batch) * 0x8CB92BA72F3D8DD7
        + int(replica) * 0xA0761D6478BD642F
    ) & _MASK64
    x = _splitmix64(x)
    return np.array([x & 0xFFFFFFFF, x >> 32], np.uint32)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def fmix_reference(h: np.ndarray) -> np.ndarray:
    """``fmix`` in numpy (uint32, wrapping): what the emitted ops compute, for tests."""
    h = np.asarray(h, np.uint32)
    with np.errstate(over="ignore"):  # wrapping is the point
        for shift, multiplier in zip(_SHIFTS, (_M1, _M2, None), strict=True):
            h = h + (h >> np.uint32(shift))
            if multiplier is not None:
                h = h * np.uint32(multiplier)
    return h


#: how the emitted ops shift right: "bitshift" (the CPU) or "div" (CUDA); the same bits either way
SHIFTS = ("bitshift", "div")


def seeded_dropout(
    program: onnx.ModelProto, shift: str = "bitshift", *, bound: Collection[str] = ()
) -> tuple[onnx.ModelProto, int]:
    """A copy of ``program`` whose training-mode Dropout nodes use counter-based masks
    (and the input ``KEY_INPUT``), and how many nodes were rewritten (0: ``program`` itself
    is returned). ``shift``: one of ``SHIFTS``. ``bound``: inputs whose initializers the
    copy leaves out, as lean_model does (the caller always binds them: a Module's
    parameters and states, which would otherwise be held twice)."""
    if shift not in SHIFTS:
        raise ValueError(f"shift={shift!r}: use one of {SHIFTS}")
    opset = next((o.version for o in program.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 12:
        return program, 0
    constants = {t.name: t for t in program.graph.initializer}
    targets = {i for i, node in enumerate(program.graph.node) if _rewritable(node, constants)}
    if not targets:
        return program, 0
    result = copy_without_initializers(program)
    graph = result.graph
    graph.initializer.extend(t for t in program.graph.initializer if t.name not in bound)
    emitter = _Emitter(graph, opset, shift)
    key = helper.make_tensor_value_info(KEY_INPUT, TensorProto.UINT32, [2])
    graph.input.append(key)
    nodes = list(graph.node)
    rewritten: list[onnx.NodeProto] = []
    for i, node in enumerate(nodes):
        if i in targets:
            rewritten += emitter.dropout(node, constants)
        else:
            rewritten.append(node)
    del graph.node[:]
    graph.node.extend(rewritten)
    graph.initializer.extend(emitter.initializers)
    return result, len(targets)


def _rewritable(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto]) -> bool:
    if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx"):
        return False
    inputs = [*node.input, "", ""]
    ratio, training = inputs[1], inputs[2]
    if not training:
        return False  # inference mode: the identity
    if training in constants and not bool(numpy_helper.to_array(constants[training]).reshape(-1)[0]):
        return False
    return not (ratio in constants and float(numpy_helper.to_array(constants[ratio]).reshape(-1)[0]) == 0.0)


class _Emitter:
    """Emits the nodes of one rewritten Dropout, with unique names and constant initializers."""

    def __init__(self, graph: onnx.GraphProto, opset: int, shift: str):
        self.opset = opset
        self.shift = shift
        self.taken = {t.name for t in graph.initializer} | {i.name for i in graph.input}
        self.taken |= {o for n in graph.node for o in n.output}
        self.initializers: list[onnx.TensorProto] = []
        self.nodes: list[onnx.NodeProto] = []
        self.prefix = ""
        self._constants: dict[tuple, str] = {}

    def name(self, hint: str) -> str:
        base, n = f"{self.prefix}{hint}", 0
        name = base
        while name in self.taken:
            n += 1
            name = f"{base}_{n}"
        self.taken.add(name)
        return name

    def constant(self, value, dtype) -> str:
        array = np.array(value, dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            prefix, self.prefix = self.prefix, "dropout::"
            name = self.name("c")
            self.prefix = prefix
            self.initializers.append(numpy_helper.from_array(array, name))
            self._constants[key] = name
        return self._constants[key]

    def op(self, op_type: str, *inputs: str, output: str | None = None, **attrs) -> str:
        out = output or self.name(op_type)
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=self.name(op_type + "_node"), **attrs))
        return out

    def fmix(self, h: str) -> str:
        """MurmurHash3's fmix32 with add-shifts, on a uint32 tensor."""
        for shift, multiplier in zip(_SHIFTS, (_M1, _M2, None), strict=True):
            if self.shift == "bitshift":
                high = self.op("BitShift", h, self.constant(shift, np.uint32), direction="RIGHT")
            else:
                high = self.op("Div", h, self.constant(1 << shift, np.uint32))
            h = self.op("Add", h, high)
            if multiplier is not None:
                h = self.op("Mul", h, self.constant(multiplier, np.uint32))
        return h

    def dropout(self, node: onnx.NodeProto, constants: dict[str, onnx.TensorProto]) -> list[onnx.NodeProto]:
        inputs = [*node.input, "", ""]
        x, ratio, training = inputs[0], inputs[1], inputs[2]
        y = node.output[0]
        mask_out = node.output[1] if len(node.output) > 1 and node.output[1] else None
        self.nodes = []
        self.prefix = f"dropout::{node.name or y}/"
        node_id = zlib.crc32(y.encode())
        # per node: two 32-bit round keys from the run's key
        words = [self.op("Gather", KEY_INPUT, self.constant(i, np.int64), axis=0) for i in (0, 1)]
        k1 = self.fmix(self.op("Add", words[0], self.constant(node_id, np.uint32)))
        k2 = self.fmix(self.op("Add", words[1], self.constant((node_id * _GOLDEN) & 0xFFFFFFFF, np.uint32)))
        # per element: the C-order index, hashed with the round keys
        size = self.op("Size", x)
        size = self.op("Cast", size, to=TensorProto.INT32)  # 4-byte indices: tensors of up to 2^31 elements
        index = self.op("Cast", self.op("Range", self.constant(0, np.int32), size, self.constant(1, np.int32)),
                        to=TensorProto.UINT32)  # fmt: skip
        index = self.op("Reshape", index, self.op("Shape", x))
        h = self.fmix(self.op("Add", self.op("Mul", index, self.constant(_GOLDEN, np.uint32)), k1))
        h = self.fmix(self.op("Add", h, k2))
        # keep where h < (1 - ratio) * 2^32, computed in double on a scalar
        ratio = ratio or self.constant(0.5, np.float32)
        keep_fraction = self.op("Sub", self.constant(1.0, np.float64), self.op("Cast", ratio, to=TensorProto.DOUBLE))
        threshold = self.op("Mul", keep_fraction, self.constant(4294967296.0, np.float64))
        threshold = self.op("Min", threshold, self.constant(4294967295.0, np.float64))
        keep = self.op("Less", h, self.op("Cast", threshold, to=TensorProto.UINT32))
        # y = x * mask / (1 - ratio), as onnxruntime computes the scale: in float
        scale = self.op("Div", self.constant(1.0, np.float32),
                        self.op("Sub", self.constant(1.0, np.float32), self.op("Cast", ratio, to=TensorProto.FLOAT)))  # fmt: skip
        if training not in constants:  # training mode decided at run time: off means the identity
            off = self.op("Not", training)
            keep = self.op("Or", keep, off)
            scale = self.op("Where", training, scale, self.constant(1.0, np.float32))
        if self.opset >= 15:
            scale, zero = self.op("CastLike", scale, x), self.op("CastLike", self.constant(0.0, np.float32), x)
        else:  # no CastLike before opset 15: float data, as torch exports it
            zero = self.constant(0.0, np.float32)
        self.op("Where", keep, self.op("Mul", x, scale), zero, output=y)
        if mask_out is not None:
            self.op("Identity", keep, output=mask_out)
        return self.nodes
