"""Mixed precision: which nodes of a graph compute in a low-precision float type
(float16 or bfloat16), and the casts that make it so.

Shared by the mixed_precision pass (a training program's forward and backward) and prune
(an inference model exported in float16). Every node gets one of four policies:

- ``LOW``: compute in the low type (GEMMs and convolutions: ``LOW_OPS``);
- ``FP32``: compute in float32 (what loses too much in 16 bits: ``FP32_OPS``);
- ``FOLLOW``: compute in the type of the activations it reads: float32 if any of them is
  float32 (as torch promotes), else the low type; parameters and constants do not vote,
  they are cast to the activations' type (torch.autocast casts a Linear's weight and bias
  into its GEMM the same way);
- ``OUTSIDE``: not converted; what it reads is cast back to its original type.

Which inputs and outputs must share one type comes from the op's ONNX schema (its type
variable), never from a table per op; whether a node may run in the low type is asked of
the session's execution provider (``runs``), and a node whose kernel is missing computes
in float32 instead. A tensor cast is made once and shared by all its readers (a weight is
cast once per step, not once per reader), a cast back to the type a cast came from reuses
its source, and every cast is named ``<prefix><tensor>/Cast_<type>`` so it can be found
and removed (``remove_casts``).
"""

from __future__ import annotations

import enum
import functools
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper, numpy_helper

from graphforge import roles
from graphforge.dag import outer_inputs, placed_early, topological_order
from graphforge.ir import onnx_dtype
from graphforge.ort_compat import EMULATED, node_kernel

#: the low-precision types, by the names the passes take
LOW_TYPES = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
FLOAT = TensorProto.FLOAT
#: how ONNX schemas write these types
_TYPE_STRINGS = {
    FLOAT: "tensor(float)",
    TensorProto.FLOAT16: "tensor(float16)",
    TensorProto.BFLOAT16: "tensor(bfloat16)",
}

#: ops computed in the low type: torch.autocast's "ops that can autocast to float16" on CUDA
#: (its op reference), by the ONNX op each exports to
LOW_OPS = {
    "MatMul": "matmul, mm, bmm",
    "Gemm": "addmm, linear",
    "Conv": "conv1d, conv2d, conv3d",
    "ConvTranspose": "conv_transpose1d/2d/3d",
    "Einsum": "einsum (lowers to bmm)",
    "Attention": "scaled_dot_product_attention",
    "PRelu": "prelu",
    "LSTM": "cudnn_rnn",
    "GRU": "cudnn_rnn",
    "RNN": "cudnn_rnn",
}
#: ops computed in float32 and why: torch.autocast's "ops that can autocast to float32" on
#: CUDA (exp, log, pow, reciprocal/rsqrt, softmax, log_softmax, the losses, the norms,
#: sum, prod, cumsum, logsumexp), and the sums over many values a backward makes (a bias
#: gradient sums over the batch)
FP32_OPS = {
    "Exp": "exp overflows float16 above 11",
    "Log": "log of small values loses its digits",
    "Pow": "pow overflows easily",
    "Reciprocal": "reciprocal of small values overflows",
    "Softplus": "softplus (exp inside)",
    "Softmax": "softmax sums exponentials",
    "LogSoftmax": "log_softmax sums exponentials",
    "SoftmaxCrossEntropyLoss": "a loss",
    "NegativeLogLikelihoodLoss": "a loss",
    "ReduceSum": "sums many values",
    "ReduceMean": "sums many values",
    "ReduceSumSquare": "sums many squares",
    "ReduceProd": "multiplies many values",
    "ReduceL1": "a norm",
    "ReduceL2": "a norm",
    "ReduceLogSum": "log of a sum",
    "ReduceLogSumExp": "logsumexp",
    "CumSum": "cumsum",
    "LayerNormalization": "normalization statistics",
    "GroupNormalization": "normalization statistics",
    "InstanceNormalization": "normalization statistics",
    "BatchNormalization": "normalization statistics (and its running statistics)",
    "RMSNormalization": "normalization statistics",
    "LpNormalization": "a norm",
    "MeanVarianceNormalization": "normalization statistics",
    "Acos": "acos",
    "Asin": "asin",
    "Cosh": "cosh overflows",
    "Sinh": "sinh overflows",
    "Tan": "tan",
}


#: ops whose output depends on their input's shape only
_SHAPE_OPS = frozenset({"Shape", "Size"})


class Policy(enum.Enum):
    LOW = "low"
    FP32 = "float32"
    FOLLOW = "follow"
    OUTSIDE = "outside"


def op_policy(node: gs.Node) -> Policy:
    """The policy of an op by its type alone: LOW_OPS, FP32_OPS, else FOLLOW."""
    if (node.domain or "") not in ("", "ai.onnx"):
        return Policy.OUTSIDE
    if node.op in LOW_OPS:
        return Policy.LOW
    if node.op in FP32_OPS:
        return Policy.FP32
    return Policy.FOLLOW


def program_policy(keep_fp32: Iterable[str] = ()) -> Callable[[gs.Node], Policy]:
    """The policy for a graphforge program (or the model pruned from one): the optimizer,
    allreduce and pipeline nodes OUTSIDE, the loss and the first steps of its gradient in
    float32, ``keep_fp32`` (op types, node names, or forward nodes whose gradients too)
    in float32, the rest by ``op_policy``."""
    keep = frozenset(keep_fp32)

    def policy(node: gs.Node) -> Policy:
        name = node.name or ""
        if name.startswith((roles.OPTIM_PREFIX, roles.ALLREDUCE_PREFIX, roles.STAGES_PREFIX)):
            return Policy.OUTSIDE
        if name.startswith((roles.LOSS_PREFIX, roles.GRAD_PREFIX + roles.LOSS_PREFIX)):
            return Policy.FP32
        if keep:
            origin = roles.node_origin(name)
            if node.op in keep or name in keep or (origin is not None and origin[1] in keep):
                return Policy.FP32
        return op_policy(node)

    return policy


@dataclass
class Conversion:
    """What ``convert`` did: nodes computing in the low type (by op), those of them that
    onnxruntime computes in float32 between casts of its own (EMULATED), nodes that would
    have but whose kernel the provider lacks (by op), and the casts it added."""

    low: Counter = field(default_factory=Counter)
    emulated: Counter = field(default_factory=Counter)
    fallback: Counter = field(default_factory=Counter)
    casts: int = 0

    def note(self, low_name: str) -> str:
        text = f"{sum(self.low.values())} nodes in {low_name}, {self.casts} casts"
        if self.emulated:
            text += (
                f"; {sum(self.emulated.values())} of them ({_listed(self.emulated)}) onnxruntime computes in float32 "
                f"between casts it inserts (no {low_name} kernel: {low_name} storage, float32 arithmetic)"
            )
        if self.fallback:
            text += f"; in float32 for want of a {low_name} kernel: {_listed(self.fallback)}"
        return text


def _listed(counts: Counter) -> str:
    return ", ".join(f"{op} ×{n}" for op, n in sorted(counts.items()))


#: runs(node, input element types) -> how the provider runs it: NATIVE, EMULATED, or None
#: (it cannot); True counts as NATIVE and False as None
KernelCheck = Callable[[gs.Node, tuple[int, ...]], "str | bool | None"]


def kernel_check(provider: str, opset: int) -> KernelCheck:
    """How onnxruntime's ``provider`` runs a node of an ai.onnx ``opset`` graph with these
    input types (ort_compat.node_kernel: probed once per op, attributes and types)."""
    opsets = (("", opset),)

    def runs(node: gs.Node, types: tuple[int, ...]) -> str | None:
        return node_kernel(provider, node_key(node), types, opsets)

    return runs


def convert(
    graph: gs.Graph,
    low: int,
    policy: Callable[[gs.Node], Policy],
    runs: KernelCheck,
    *,
    parameters: Iterable[str] = (),
    prefix: str = "amp::",
) -> Conversion:
    """Make ``graph`` compute in ``low`` where ``policy`` says, in place. The graph's float
    types must be known (run shape inference first). ``parameters``: initializers a runtime
    overrides (cast by a node each run); other float constants are converted once, their
    values clipped to the low type's finite range (a mask's -1e9 stays finite)."""
    order = [graph.nodes[i] for i in topological_order(graph)]
    casts = _Casts(low, frozenset(parameters), prefix)
    done = Conversion()
    # tensors a subgraph reads from this scope keep their type: the subgraph is not converted
    pinned = {id(t) for node in order for t in outer_inputs(node) if _has_subgraph(node)}
    # what a batch feeds, and everything computed from it except shapes (ConstantOfShape's
    # zeros are a constant whatever the batch): the tensors whose type a FOLLOW node takes
    activations = {id(t) for t in graph.inputs}
    opset = graph.opset or 13
    placed: list[gs.Node] = []
    for node in order:
        before = len(casts.made)
        reads_activation = node.op not in _SHAPE_OPS and any(id(t) in activations for t in node.inputs)
        _convert_node(node, policy(node), _signature(node, opset), casts, runs, pinned, activations, done)
        if reads_activation:
            activations.update(id(t) for t in node.outputs)
        placed += casts.made[before:]
        placed.append(node)
    outputs = []
    for t in graph.outputs:
        original = casts.original.get(id(t))
        if original is None:
            outputs.append(t)
            continue
        back = casts.cast(t, original)
        back.name, t.name = t.name, f"{prefix}{t.name}"  # the output keeps its name and type
        outputs.append(back)
    placed += casts.made[len(placed) - len(order) :]
    # a cast back to float32 goes right after what it casts: the low-precision tensor (a
    # gradient on its way to the optimizer) then dies there instead of living beside its copy
    ups = {id(n) for n in casts.made if n.attrs["to"] == FLOAT}
    graph.nodes = placed_early(placed, {id(n) for n in placed} - ups)
    graph.outputs = outputs
    done.casts = len(casts.made) + casts.constants
    return done


def _convert_node(node, policy, sig, casts, runs, pinned, activations, done: Conversion) -> None:
    if policy is Policy.OUTSIDE or sig is None or _has_subgraph(node):
        casts.restore_inputs(node, range(len(node.inputs)))
        return
    tied_in, tied_out, allowed, per_input, variables = sig
    original = {onnx_dtype(node.outputs[j].dtype) for j in tied_out if not node.outputs[j].is_empty()}
    target = FLOAT
    if original == {FLOAT} and not any(id(node.outputs[j]) in pinned for j in tied_out):
        target = _target(node, policy, tied_in, casts, activations)
    if target != FLOAT and _TYPE_STRINGS[target] not in allowed:
        target = FLOAT
    wanted = {i: _code(t) for i, t in enumerate(node.inputs)}
    for i in tied_in:
        if wanted[i] in (FLOAT, casts.low):
            wanted[i] = target
    # inputs of another type variable (Greater's A and B): one type, the low one only if all have it
    groups: dict[str, list[int]] = {}
    for i in range(len(node.inputs)):
        if i not in tied_in:
            groups.setdefault(variables.get(i, f"fixed {i}"), []).append(i)
    for slots in groups.values():
        floats = [i for i in slots if wanted[i] in (FLOAT, casts.low)]
        mixed = len({wanted[i] for i in floats}) > 1
        for i in floats:
            if wanted[i] == casts.low and (mixed or _TYPE_STRINGS[casts.low] not in per_input.get(i, ())):
                wanted[i] = FLOAT
    kernel = runs(node, tuple(wanted[i] for i in range(len(node.inputs)))) if casts.low in wanted.values() else True
    if kernel is None or kernel is False:
        if target != FLOAT:
            done.fallback[node.op] += 1
        wanted = {i: FLOAT if code == casts.low else code for i, code in wanted.items()}
        target = FLOAT
    elif kernel == EMULATED and target != FLOAT:
        done.emulated[node.op] += 1
    for i, code in wanted.items():
        t = node.inputs[i]
        if code != _code(t):
            node.inputs[i] = casts.cast(t, code)
    if target != FLOAT:
        done.low[node.op] += 1
        for j in tied_out:
            out = node.outputs[j]
            if not out.is_empty():
                casts.original[id(out)] = FLOAT
                out.dtype = _np_type(target)


def _target(node: gs.Node, policy: Policy, tied_in, casts: _Casts, activations: set[int]) -> int:
    if policy is Policy.LOW:
        return casts.low
    if policy is Policy.FP32:
        return FLOAT
    voters = {_code(node.inputs[i]) for i in tied_in if id(node.inputs[i]) in activations}
    return casts.low if voters == {casts.low} else FLOAT


class _Casts:
    """The casts made so far (one per tensor and type), and the tensors whose type changed."""

    def __init__(self, low: int, parameters: frozenset[str], prefix: str):
        self.low, self.parameters, self.prefix = low, parameters, prefix
        self.made: list[gs.Node] = []
        self.constants = 0
        self._cache: dict[tuple[int, int], gs.Tensor] = {}
        self._source: dict[int, gs.Tensor] = {}  # a cast's output -> what it cast
        #: id(tensor) -> the type it had before it became low
        self.original: dict[int, int] = {}

    def cast(self, t: gs.Tensor, to: int) -> gs.Tensor:
        key = (id(t), to)
        if key in self._cache:
            return self._cache[key]
        source = self._source.get(id(t))
        if source is not None and _code(source) == to:
            return source
        if isinstance(t, gs.Constant) and t.name not in self.parameters and to == TensorProto.FLOAT16:
            out = gs.Constant(f"{self.prefix}{t.name}/{_short(to)}", _clipped(t.values, np.float16))
            self.constants += 1
        else:
            out = gs.Variable(f"{self.prefix}{t.name}/{_short(to)}", dtype=_np_type(to), shape=t.shape)
            self.made.append(
                gs.Node(
                    "Cast", name=f"{self.prefix}{t.name}/Cast_{_short(to)}", attrs={"to": to}, inputs=[t], outputs=[out]
                )
            )
        self._cache[key] = out
        self._source[id(out)] = t
        return out

    def restore_inputs(self, node: gs.Node, slots: Iterable[int]) -> None:
        """Inputs at ``slots`` whose type this conversion changed go back to the original type."""
        for i in slots:
            t = node.inputs[i]
            original = self.original.get(id(t))
            if original is not None:
                node.inputs[i] = self.cast(t, original)


def remove_casts(graph: gs.Graph, prefix: str = "amp::") -> int:
    """Undo ``convert``: its casts go (readers and graph outputs take the cast's source again,
    a graph output its name back) and the tensors computed in the low type lose their type
    (shape inference gives it again, float32). Returns how many casts went."""
    casts = [n for n in graph.nodes if n.op == "Cast" and n.name.startswith(prefix)]
    if not casts:
        return 0
    replaced = {}
    for node in casts:
        replaced[id(node.outputs[0])] = node.inputs[0]
    for node in graph.nodes:
        node.inputs = [replaced.get(id(t), t) for t in node.inputs]
    outputs = []
    for t in graph.outputs:
        source = replaced.get(id(t))
        if source is None:
            outputs.append(t)
            continue
        source.name, source.dtype = t.name, t.dtype
        outputs.append(source)
    graph.outputs = outputs
    graph.nodes = [n for n in graph.nodes if id(n) not in {id(c) for c in casts}]
    low = {np.dtype(np.float16), _np_type(TensorProto.BFLOAT16)}
    kept_outputs = {id(t) for t in graph.outputs}
    for node in graph.nodes:
        for t in node.outputs:
            if id(t) not in kept_outputs and t.dtype is not None and np.dtype(t.dtype) in low:
                t.dtype = None
    graph.cleanup()
    return len(casts)


# ---------------------------------------------------------------------- schemas and types


def _signature(node: gs.Node, opset: int):
    if (node.domain or "") not in ("", "ai.onnx"):
        return None
    return _schema_signature(node.op, "", opset, len(node.inputs), len(node.outputs))


@functools.cache
def _schema_signature(op: str, domain: str, opset: int, n_in: int, n_out: int):
    """(inputs of the output's type variable, outputs of it, the types it allows, per input
    the types its own variable allows, per input its type variable), from the op's schema;
    None without a schema. An output of a fixed type ties no inputs."""
    try:
        schema = onnx.defs.get_schema(op, opset, domain)
    except onnx.defs.SchemaError:
        return None
    if not schema.outputs:
        return None
    constraints = {c.type_param_str: frozenset(c.allowed_type_strs) for c in schema.type_constraints}
    var = schema.outputs[0].type_str

    def formal(params, i):
        if i < len(params):
            return params[i]
        last = params[-1] if params else None
        return last if last is not None and last.option == onnx.defs.OpSchema.FormalParameterOption.Variadic else None

    tied = var in constraints
    tied_in = tuple(
        i for i in range(n_in) if tied and (f := formal(schema.inputs, i)) is not None and f.type_str == var
    )
    tied_out = tuple(
        j for j in range(n_out) if tied and (f := formal(schema.outputs, j)) is not None and f.type_str == var
    )
    formals = {i: f for i in range(n_in) if (f := formal(schema.inputs, i)) is not None}
    per_input = {i: constraints.get(f.type_str, frozenset({f.type_str})) for i, f in formals.items()}
    variables = {i: f.type_str for i, f in formals.items() if f.type_str in constraints}
    return tied_in, tied_out, constraints.get(var, frozenset()), per_input, variables


def _has_subgraph(node: gs.Node) -> bool:
    return any(True for _ in node.subgraphs())


def _code(t: gs.Tensor) -> int:
    return 0 if t.is_empty() else (onnx_dtype(t.dtype) or 0)


def _np_type(code: int):
    return helper.tensor_dtype_to_np_dtype(code)


def _short(code: int) -> str:
    return {FLOAT: "fp32", TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16"}.get(code, str(code))


def _clipped(values: np.ndarray, dtype) -> np.ndarray:
    """``values`` in ``dtype``, finite values beyond its range clipped to it (not made inf)."""
    values = np.asarray(values)
    limit = np.finfo(dtype).max
    finite = np.isfinite(values)
    return np.where(finite, np.clip(values, -limit, limit), values).astype(dtype)


def node_key(node: gs.Node) -> bytes:
    """``node`` as a NodeProto without names (its op, domain and attributes): equal for nodes
    a kernel check cannot tell apart."""
    attrs = {}
    for name, value in node.attrs.items():
        if isinstance(value, gs.Constant):
            value = numpy_helper.from_array(np.asarray(value.values))
        elif isinstance(value, gs.Tensor):
            continue
        attrs[name] = value
    proto = helper.make_node(
        node.op,
        ["" if t.is_empty() else "x" for t in node.inputs],
        ["" if t.is_empty() else "y" for t in node.outputs],
        domain=node.domain or None,
        **attrs,
    )
    return proto.SerializeToString()
