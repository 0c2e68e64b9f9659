"""The quantize_frozen pass: a frozen base's linear weights stored as int4 or int8 in blocks, read through DequantizeLinear."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import ml_dtypes  # onnx's own dependency: NumPy's int4
import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import numpy_helper, version_converter

from graphforge import roles
from graphforge.errors import PassError, one_line
from graphforge.graph import Model
from graphforge.ir import onnx_dtype
from graphforge.pass_infra import Fact, Pass, PassResult
from graphforge.pass_spec import ParameterValueError
from graphforge.program import ProgramRoles, QuantizedWeight
from graphforge.stand_ins import is_left_out, store_values

#: the ai.onnx opset of DequantizeLinear's block_size and of int4
OPSET = 21
#: the IR version opset 21 comes with (int4 is an IR 10 type)
IR_VERSION = 10
#: bits -> (the smallest, the largest integer), as QuantizeLinear saturates
RANGES = {4: (-8, 7), 8: (-128, 127)}
_INT_TYPES = {4: ml_dtypes.int4, 8: np.int8}
_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16}
_STANDARD = (None, "", "ai.onnx")


def quantize_blocks(w: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """``w`` [K, N] as integers q [K, N] (int8 values within ``bits``' range) and scales
    [K / block, N] of ``w``'s type: symmetric (no zero point), each column's blocks of
    ``block`` rows scaled by max|w| / qmax (1 for a block of zeros), and q = w / scale rounded
    half to even and saturated, as ONNX's QuantizeLinear computes it (in float32)."""
    low, high = RANGES[bits]
    k, n = w.shape
    blocks = np.asarray(w, np.float32).reshape(k // block, block, n)
    largest = np.abs(blocks).max(axis=1)
    scale = np.where(largest > 0, largest / high, 1.0).astype(w.dtype)
    q = np.clip(np.rint(blocks / scale.astype(np.float32)[:, None, :]), low, high)
    return q.reshape(k, n).astype(np.int8), scale


def dequantize_blocks(q: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    """DequantizeLinear of ``q`` [K, N] with blocked ``scale`` [K / block, N] along axis 0, in float32."""
    return q.astype(np.float32) * np.repeat(scale.astype(np.float32), block, axis=0)


@dataclass(frozen=True)
class _Reader:
    """A linear product reading a frozen weight: ``node`` reads it at input 1, as it is
    (``through`` None) or through the 2-D Transpose ``through``; ``transposed``: the product
    multiplies by the weight's transpose (a Transpose between, or a Gemm's transB)."""

    node: gs.Node
    through: gs.Node | None
    transposed: bool


@dataclass(frozen=True)
class QuantizeFrozen(Pass):
    """Store a model's frozen linear weights as int4 or int8 with a float scale per block of
    ``block`` input features, read through standard DequantizeLinear (ai.onnx opset 21), so
    that the frozen base takes about an eighth (int4) or a quarter (int8) of its float bytes,
    and onnxruntime fuses each forward product into its n-bit kernel (MatMulNBits).

    1. Weights: the frozen ones (``graphforge.frozen``: the lora pass's base), 2-D float32 or
       float16 initializers that linear products alone read: MatMul's B, as it is or through a
       2-D Transpose (torch's Linear [out, in], exported unfolded), and Gemm's B (either
       transB). A weight any other node reads (an embedding's Gather, an output head tied to
       it) stays float, as do the weights ``exclude`` names (fnmatch patterns) and 1-D ones
       (biases, norms).
    2. Layout: stored [in, out] (MatMul's B, [K, N]) with blocks along axis 0, the layout
       onnxruntime's fusion takes: a weight its products read transposed is stored as its
       transpose, the Transpose is dropped and a Gemm reads it with transB 0.
    3. Values: symmetric (no zero point): per column and block, scale = max|w| / qmax (qmax 7
       for int4, 127 for int8; 1 for a block of zeros) and q = w / scale rounded half to even
       and saturated, as ONNX's QuantizeLinear computes it; a dequantized value is within half a
       scale of the float one.
    4. One DequantizeLinear per product that reads the weight (onnxruntime fuses only a
       DequantizeLinear with one consumer), all of the one integer initializer; a session
       gives each its own copy of the initializers, which the fusion also needs
       (graphforge/runtime/sessions.py). The backward's input gradient (dX = dY · Wᵀ) reads
       the same dequantized weight, unfused: its blocks lie along the product's output.
    5. The model's ai.onnx opset is raised to 21 (onnx's version converter) where it is lower;
       a model the converter cannot convert, or one with local functions (which it drops), is
       refused.
    6. Roles: the weights leave ``graphforge.frozen``; ``graphforge.quantized`` records each:
       its integer and scale initializers, bits, block, float shape and layout.
    Names: ``quant::<weight>/data`` and ``quant::<weight>/scale`` (never parameters), nodes
    ``quant::<weight>/DequantizeLinear_<n>``. A block that does not divide a weight's input
    features, bits other than 4 or 8, and a model without a frozen weight to quantize are
    refused by name, and the model is left as it was.
    """

    name = "quantize_frozen"
    refuses = (Fact.GRADIENTS,)
    bits: int = 4
    block: int = 32
    exclude: tuple[str, ...] = field(default=())

    def __post_init__(self):
        if self.bits not in RANGES or isinstance(self.bits, bool):
            raise ParameterValueError(f"pass 'quantize_frozen' parameter 'bits': expected 4 or 8, got {self.bits!r}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 16:
            raise ParameterValueError(
                f"pass 'quantize_frozen' parameter 'block': expected a power of two ≥ 16, got {self.block!r}"
            )
        if self.block & (self.block - 1):
            raise ParameterValueError(
                f"pass 'quantize_frozen' parameter 'block': expected a power of two ≥ 16 (onnxruntime's "
                f"n-bit kernel's blocks), got {self.block}"
            )

    def run(self, model: Model) -> PassResult:
        existing = ProgramRoles.of_model(model)
        chosen = self._chosen(model.graph, existing.frozen)
        model = _at_opset(model, OPSET)  # case 5, the readers found again in the converted graph
        graph = model.graph
        graph.ir_version = max(graph.ir_version or 0, IR_VERSION)  # int4's
        chosen = {name: readers for name, readers in self._chosen(graph, existing.frozen).items() if name in chosen}
        tensors = graph.tensors()
        made = {}
        before = after = 0
        for name, readers in chosen.items():
            weight = tensors[name]
            made[name], size = self._quantize(graph, weight, readers)
            before += weight.values.nbytes
            after += size
        _in_order(graph)
        frozen = {n: f.to_json() for n, f in existing.frozen.items() if n not in made}
        roles.set_json(model, roles.FROZEN, frozen)
        recorded = {n: q.to_json() for n, q in existing.quantized.items()}
        recorded.update({n: q.to_json() for n, q in made.items()})
        roles.set_json(model, roles.QUANTIZED, recorded)
        note = f"{len(made)} weights to int{self.bits} in blocks of {self.block}: {_mib(before)} → {_mib(after)}"
        return PassResult(model, True, note)

    def _chosen(self, graph: gs.Graph, frozen) -> dict[str, list[_Reader]]:
        """Case 1: the frozen weights to quantize and their readers, each weight checked (case 2's block)."""
        if not frozen:
            raise PassError(
                "the model has no frozen weight (graphforge.frozen) to quantize: put quantize_frozen after "
                "the pass that freezes the base, e.g. lora(r=8), quantize_frozen(bits=4, block=32)"
            )
        chosen = {}
        for name, t in graph.tensors().items():
            if name not in frozen or not _is_float_matrix(t) or any(fnmatch.fnmatchcase(name, p) for p in self.exclude):
                continue
            readers = _linear_readers(t)
            if readers is None:
                continue
            if is_left_out(t):
                raise PassError(f"weight {name!r} has no values (a model of stand-ins): quantize_frozen reads them")
            rows = int(t.shape[1] if readers[0].transposed else t.shape[0])
            if rows % self.block:
                raise PassError(
                    f"block {self.block} does not divide weight {name!r}'s {rows} input features (shape "
                    f"{list(t.shape)}): choose a block that divides them, or exclude=[{name}]"
                )
            chosen[name] = readers
        if not chosen:
            raise PassError(
                f"none of the {len(frozen)} frozen weights is a 2-D float weight that linear products alone "
                "read (MatMul's or Gemm's B): nothing to quantize"
            )
        return chosen

    def _quantize(self, graph: gs.Graph, weight: gs.Constant, readers: list[_Reader]) -> tuple[QuantizedWeight, int]:
        """Cases 2-4 for one weight: its integers and scales, and a DequantizeLinear per product."""
        values = np.asarray(weight.values)
        stored = values.T if readers[0].transposed else values
        q, scale = quantize_blocks(np.ascontiguousarray(stored), self.bits, self.block)
        prefix = f"{roles.QUANT_PREFIX}{weight.name}/"
        data = gs.Constant(prefix + "data", np.zeros(q.shape, np.int8))
        tensor = numpy_helper.from_array(q.astype(_INT_TYPES[self.bits]), data.name)
        store_values(data, tensor)
        scales = gs.Constant(prefix + "scale", scale)
        for i, reader in enumerate(readers):
            w = gs.Variable(f"{prefix}weight_{i}", dtype=values.dtype, shape=list(stored.shape))
            dq = gs.Node(
                "DequantizeLinear",
                name=f"{prefix}DequantizeLinear_{i}",
                inputs=[data, scales],
                outputs=[w],
                attrs={"axis": 0, "block_size": self.block},
            )
            graph.nodes.append(dq)
            reader.node.inputs[1] = w
            if reader.node.op == "Gemm":
                reader.node.attrs["transB"] = 0
            if reader.through is not None:
                reader.through.inputs.clear()
        for reader in readers:
            if reader.through is not None and not reader.through.outputs[0].outputs:
                reader.through.outputs.clear()
        quantized = QuantizedWeight(
            weight.name,
            data.name,
            scales.name,
            self.bits,
            self.block,
            tuple(int(d) for d in values.shape),
            readers[0].transposed,
        )
        return quantized, len(tensor.raw_data) + scale.nbytes


def _is_float_matrix(t: gs.Tensor) -> bool:
    return isinstance(t, gs.Constant) and onnx_dtype(t.dtype) in _FLOAT_TYPES and len(t.shape or ()) == 2


def _linear_readers(weight: gs.Constant) -> list[_Reader] | None:
    """Every product reading ``weight`` as its B, in one layout (case 1); None where another node
    reads it, or products read it in both layouts."""
    readers: list[_Reader] = []
    for node in list(weight.outputs):
        if node.domain not in _STANDARD:
            return None
        if node.op == "Transpose" and [int(p) for p in node.attrs.get("perm", [1, 0])] == [1, 0]:
            through = _through_transpose(node)
            if through is None:
                return None
            readers += through
        elif node.op in ("MatMul", "Gemm") and [i for i, x in enumerate(node.inputs) if x is weight] == [1]:
            readers.append(_Reader(node, None, node.op == "Gemm" and bool(node.attrs.get("transB", 0))))
        else:
            return None
    if not readers or len({r.transposed for r in readers}) != 1:
        return None
    return readers


def _through_transpose(transpose: gs.Node) -> list[_Reader] | None:
    """The MatMuls reading a weight's Transpose as their B, or None where anything else reads it."""
    out = transpose.outputs[0]
    readers = list(out.outputs)
    if not readers or any(
        r.op != "MatMul" or r.domain not in _STANDARD or r.inputs[1] is not out or r.inputs[0] is out for r in readers
    ):
        return None
    return [_Reader(r, transpose, True) for r in readers]


def _in_order(graph: gs.Graph) -> None:
    """The new DequantizeLinear nodes right before their readers, the Transposes they replace
    dropped (a node with no inputs and outputs left)."""
    made = [n for n in graph.nodes if n.op == "DequantizeLinear" and (n.name or "").startswith(roles.QUANT_PREFIX)]
    before = {}
    for dq in made:
        for reader in dq.outputs[0].outputs:
            before.setdefault(id(reader), []).append(dq)
    placed = {id(dq) for dqs in before.values() for dq in dqs}
    order = []
    for node in graph.nodes:
        if id(node) in placed or (not node.inputs and not node.outputs):
            continue
        order.extend(before.get(id(node), ()))
        order.append(node)
    graph.nodes = order


def _at_opset(model: Model, opset: int) -> Model:
    """``model`` at ai.onnx ``opset`` at least (case 5): itself where it is, else converted by onnx's
    version converter (its weights not copied: converted as stand-ins, their values taken back)."""
    old = model.graph.opset or 1
    if old >= opset:
        return model
    if model.graph.functions:
        names = ", ".join(f.name for f in model.graph.functions)
        raise PassError(
            f"quantize_frozen needs ai.onnx opset {opset} (DequantizeLinear's block_size, int4) and the model "
            f"has opset {old} and local functions ({names}), which onnx's version converter drops"
        )
    proto = model.to_proto(values=False)
    try:
        converted = version_converter.convert_version(proto, opset)
    except Exception as exc:
        raise PassError(
            f"quantize_frozen needs ai.onnx opset {opset} (DequantizeLinear's block_size, int4), and converting "
            f"the model from opset {old} failed: {one_line(exc)}"
        ) from None
    converted.ir_version = max(converted.ir_version, IR_VERSION)
    result = Model.from_proto(converted, values_from=model)
    result.metadata = dict(model.metadata)
    return result


def _mib(size: int) -> str:
    return f"{size / 2**20:.2f} MiB"
