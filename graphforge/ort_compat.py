"""onnxruntime compatibility: which IR versions and opsets the installed onnxruntime reads,
converting a model down to them, and whether it builds a session for a model.

One module for what ``model_io.save`` (every file written is one onnxruntime reads), the
runtime's sessions and the checker (``verify_model(with_ort=True)``) all need, so none
of them reaches into another for it. Everything is probed from onnxruntime itself, never
from a version table, so a newer or older onnxruntime is handled without an edit here.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import tempfile
from collections.abc import Iterator

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper, version_converter

from graphforge.errors import ModelSaveError, one_line
from graphforge.ir import model_nodes, nodes_of

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"
#: providers that need a CUDA device: not even probed when the driver reports none
_NEED_CUDA_DEVICE = frozenset({CUDA, TENSORRT})


@functools.cache
def runtime_limits() -> tuple[int, int]:
    """(max IR version, max ai.onnx opset) that the installed onnxruntime loads.

    Probed once with tiny models instead of a version table, so a newer or older
    onnxruntime is handled without an edit here.
    """
    ir = next(v for v in range(onnx.IR_VERSION, 2, -1) if _runtime_loads(v, {"": 13}))
    opset = next(v for v in range(onnx.defs.onnx_opset_version(), 6, -1) if _runtime_loads(ir, {"": v}))
    return ir, opset


@functools.cache
def runtime_reads_opset(domain: str, version: int) -> bool:
    """Whether the installed onnxruntime loads a model that imports ``domain`` at ``version``.

    onnxruntime refuses versions above its own for the domains it knows (ai.onnx.ml,
    com.microsoft, ...), and accepts any version of a domain it does not know (a local
    function's). Probed once per pair, like ``runtime_limits``."""
    if domain in _DEFAULT_DOMAINS:
        return version <= runtime_limits()[1]
    return _runtime_loads(runtime_limits()[0], {"": 13, domain: version})


_DEFAULT_DOMAINS = ("", "ai.onnx")


def _runtime_loads(ir: int, opsets: dict[str, int]) -> bool:
    """Whether onnxruntime builds a session for an Identity model with this IR version and these opsets."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    model.ir_version = ir
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception:
        return False
    return True


def is_runtime_compatible(proto: onnx.ModelProto) -> bool:
    """Whether onnxruntime reads ``proto`` as it is (``make_runtime_compatible`` would leave it)."""
    return proto.ir_version <= runtime_limits()[0] and all(
        runtime_reads_opset(o.domain, o.version)
        for opsets in (proto.opset_import, *(f.opset_import for f in proto.functions))
        for o in opsets
    )


def make_runtime_compatible(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Lower the IR version, and the opsets if needed, to what onnxruntime reads.

    Mutates and returns ``proto``. Lowering the IR version only relabels the file (the
    newer IR versions add data types, which a model using them keeps). The ai.onnx opset
    goes through onnx's version converter, which fails loudly if that cannot be done; it
    drops local functions, so theirs is lowered here (see ``_lower_function_opset``).
    Other domains have no converter: an import onnxruntime does not read is dropped when
    no node uses that domain, and refused otherwise. Raises ModelSaveError.
    """
    max_ir, max_opset = runtime_limits()
    if proto.ir_version > max_ir:
        proto.ir_version = max_ir
    for owner in (proto, *proto.functions):
        _settle_other_domains(owner, proto)
        if owner is not proto:
            _lower_function_opset(owner, max_opset)
    opset = next((o.version for o in proto.opset_import if o.domain in _DEFAULT_DOMAINS), None)
    if opset is not None and opset > max_opset:
        try:
            converted = version_converter.convert_version(proto, max_opset)
        except Exception as exc:
            raise ModelSaveError(
                f"the model uses ai.onnx opset {opset}, onnxruntime reads at most {max_opset}, "
                f"and converting it failed: {one_line(exc)}"
            ) from None
        converted.ir_version = min(converted.ir_version, max_ir)
        del converted.functions[:]  # the converter drops them: put back the ones lowered above
        converted.functions.extend(proto.functions)
        proto.CopyFrom(converted)
    return proto


def _settle_other_domains(owner: onnx.ModelProto | onnx.FunctionProto, model: onnx.ModelProto) -> None:
    """Drop ``owner``'s imports of non-default domains that onnxruntime does not read and no
    node of ``owner`` uses; refuse one that a node uses (there is no converter for them)."""
    unreadable = [
        o
        for o in owner.opset_import
        if o.domain not in _DEFAULT_DOMAINS and not runtime_reads_opset(o.domain, o.version)
    ]
    if not unreadable:
        return
    nodes = model_nodes(model) if isinstance(owner, onnx.ModelProto) else nodes_of(owner.node)
    used = {node.domain for node in nodes}
    for entry in unreadable:
        if entry.domain in used:
            readable = next((v for v in range(entry.version - 1, 0, -1) if runtime_reads_opset(entry.domain, v)), None)
            where = "the model" if owner is model else f"local function {owner.domain}:{owner.name}"
            limit = f"at most {readable}" if readable else "no version of it"
            raise ModelSaveError(
                f"{where} uses {entry.domain} opset {entry.version}, onnxruntime reads {limit}, and onnx "
                f"converts only the ai.onnx domain; rewrite its {entry.domain} nodes for opset {readable or 1}"
            )
    kept = [o for o in owner.opset_import if o not in unreadable]
    del owner.opset_import[:]
    owner.opset_import.extend(kept)


def _lower_function_opset(function: onnx.FunctionProto, max_opset: int) -> None:
    """Lower a local function's ai.onnx import to ``max_opset``, in place.

    onnx's version converter drops functions, so:
    1. a function none of whose ai.onnx ops changed between the two versions is relabelled;
    2. otherwise its body is converted as a graph of its own, unless a node reads a function
       attribute (``ref_attr_name``), which the converter would replace with a default;
    3. anything else is refused."""
    entry = next((o for o in function.opset_import if o.domain in _DEFAULT_DOMAINS), None)
    if entry is None or entry.version <= max_opset:
        return
    nodes = list(nodes_of(function.node))
    changed = sorted(
        {
            n.op_type
            for n in nodes
            if n.domain in _DEFAULT_DOMAINS and _changed_since(n.op_type, max_opset, entry.version)
        }
    )
    if not changed:  # case 1
        entry.version = max_opset
        return
    where = (
        f"local function {function.domain}:{function.name} uses ai.onnx opset {entry.version} ({', '.join(changed)})"
    )
    if any(a.ref_attr_name for n in nodes for a in n.attribute):  # case 3
        raise ModelSaveError(
            f"{where}, onnxruntime reads at most opset {max_opset}, and onnx's version converter cannot convert "
            f"a function whose nodes read its attributes"
        )
    body = helper.make_graph(
        list(function.node),
        function.name,
        [onnx.ValueInfoProto(name=name) for name in function.input],
        [onnx.ValueInfoProto(name=name) for name in function.output],
    )
    wrapper = helper.make_model(body, opset_imports=list(function.opset_import))
    wrapper.ir_version = runtime_limits()[0]
    try:  # case 2
        converted = version_converter.convert_version(wrapper, max_opset)
    except Exception as exc:
        raise ModelSaveError(
            f"{where}, onnxruntime reads at most opset {max_opset}, and converting it failed: {one_line(exc)}"
        ) from None
    del function.node[:]
    function.node.extend(converted.graph.node)
    entry.version = max_opset


def _changed_since(op_type: str, old: int, new: int) -> bool:
    """Whether ai.onnx's ``op_type`` at opset ``new`` differs from (or is missing at) opset ``old``."""
    try:
        return onnx.defs.get_schema(op_type, new, "").since_version > old
    except onnx.defs.SchemaError:
        return True


def has_training_batch_norm(proto: onnx.ModelProto) -> bool:
    """Whether the main graph has a BatchNormalization in training mode (``expand_training_batch_norm``)."""
    return any(_is_training_batch_norm(n) for n in proto.graph.node)


def _is_training_batch_norm(node: onnx.NodeProto) -> bool:
    return (
        node.op_type == "BatchNormalization"
        and node.domain in _DEFAULT_DOMAINS
        and any(a.name == "training_mode" and a.i for a in node.attribute)
    )


def expand_training_batch_norm(proto: onnx.ModelProto) -> int:
    """Write each training-mode BatchNormalization of the main graph as the standard ops its
    definition gives, in place; returns how many were.

    onnxruntime's CUDA provider refuses a training-mode BatchNormalization from opset 14 on,
    when training mode became an attribute ("Training mode does not support BN opset 14 (or
    higher) yet", 1.31), and a model with one then gets no session at all. The expansion
    computes the same outputs: the batch's mean and population variance per channel (over
    every axis but 1, through a [N, C, -1] view, so the rank need not be known), Y
    standardized with them, and the running statistics mixed by ``momentum``.
    """
    opset = next((o.version for o in proto.opset_import if o.domain in _DEFAULT_DOMAINS), 0)
    graph = proto.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info, *graph.output)}
    types.update({t.name: t.data_type for t in graph.initializer})
    taken = {o for n in graph.node for o in n.output} | {i.name for i in graph.input} | set(types)
    expanded, count = [], 0
    for node in graph.node:
        if not _is_training_batch_norm(node):
            expanded.append(node)
            continue
        count += 1
        expanded.extend(_batch_norm_ops(node, opset, types, taken, count))
    del graph.node[:]
    graph.node.extend(expanded)
    return count


def has_dequantize(proto: onnx.ModelProto, prefix: str) -> bool:
    """Whether ``proto``'s main graph has a DequantizeLinear named with ``prefix``."""
    return any(n.op_type == "DequantizeLinear" and n.name.startswith(prefix) for n in proto.graph.node)


def own_dequantize_inputs(proto: onnx.ModelProto, prefix: str) -> int:
    """Give every DequantizeLinear of the main graph named with ``prefix`` one reader, and its
    own copy of the initializers it reads, in place; returns how many nodes were added.

    onnxruntime 1.31 fuses DequantizeLinear → MatMul into MatMulNBits only where the
    DequantizeLinear has one consumer and its weight and scale initializers have no other
    reader (measured: two DequantizeLinear of one initializer, one per MatMul, fuse neither).
    A program stores a quantized weight once and reads it in its forward and its backward;
    the session then holds the fused kernel's packed copy and the backward's, as it would
    anyway. The copies are new nodes at the start of the graph (they read initializers alone)."""
    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in nodes_of(graph.node):
        for i, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, i))
    outputs = {o.name for o in graph.output}
    taken = set(inits) | {n for node in nodes_of(graph.node) for n in (*node.input, *node.output)}
    added: list[onnx.NodeProto] = []
    used: set[str] = set()
    for dq in [n for n in graph.node if n.op_type == "DequantizeLinear" and n.name.startswith(prefix)]:
        consumers = [] if dq.output[0] in outputs else readers.get(dq.output[0], [])[1:]
        for k, (node, slot) in enumerate(consumers):
            copy = onnx.NodeProto()
            copy.CopyFrom(dq)
            copy.name = _fresh(f"{dq.name}/copy_{k}", taken)
            copy.output[0] = _fresh(f"{dq.output[0]}/copy_{k}", taken)
            node.input[slot] = copy.output[0]
            added.append(copy)
    for dq in [*(n for n in graph.node if n.op_type == "DequantizeLinear" and n.name.startswith(prefix)), *added]:
        for i, name in enumerate(dq.input):
            if name not in inits:
                continue
            if name in used:
                tensor = onnx.TensorProto()
                tensor.CopyFrom(inits[name])
                tensor.name = _fresh(f"{name}/copy", taken)
                graph.initializer.append(tensor)
                dq.input[i] = tensor.name
            used.add(name)
    for node in reversed(added):
        graph.node.insert(0, node)
    return len(added)


def _fresh(name: str, taken: set[str]) -> str:
    n, fresh = 0, name
    while fresh in taken:
        n += 1
        fresh = f"{name}_{n}"
    taken.add(fresh)
    return fresh


def _batch_norm_ops(node: onnx.NodeProto, opset: int, types: dict, taken: set, index: int) -> list[onnx.NodeProto]:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    eps, momentum = attrs.get("epsilon", 1e-5), attrs.get("momentum", 0.9)
    x, scale, bias, mean_in, var_in = node.input[:5]
    prefix = f"{node.name or f'BatchNormalization{index}'}/expanded"
    nodes: list[onnx.NodeProto] = []

    def name(what: str) -> str:
        out, n = f"{prefix}/{what}", 1
        while out in taken:
            out, n = f"{prefix}/{what}{n}", n + 1
        taken.add(out)
        return out

    def op(op_type: str, *inputs: str, output: str | None = None, **attributes) -> str:
        out = output or name(op_type)
        nodes.append(helper.make_node(op_type, list(inputs), [out], name=name(f"{op_type}_node"), **attributes))
        return out

    def ints(what: str, values) -> str:
        return op("Constant", value=numpy_helper.from_array(np.array(values, np.int64), name(what)))

    def scalar(what: str, value: float) -> str:
        constant = op("Constant", value=numpy_helper.from_array(np.array(value, np.float32), name(what)))
        if opset >= 15:
            return op("CastLike", constant, x)
        elem = next((types[v] for v in (x, scale, bias, mean_in, var_in) if types.get(v)), onnx.TensorProto.FLOAT)
        return constant if elem == onnx.TensorProto.FLOAT else op("Cast", constant, to=elem)

    def mean_over_batch(v: str) -> str:  # over axes 0 and 2 of a [N, C, M] view, kept as [1, C, 1]
        if opset >= 18:
            return op("ReduceMean", v, ints("axes", [0, 2]), keepdims=1)
        return op("ReduceMean", v, axes=[0, 2], keepdims=1)

    per_channel = ints("per_channel", [1, -1, 1])
    x3 = op("Reshape", x, ints("view", [0, 0, -1]))
    mean = mean_over_batch(x3)
    centered = op("Sub", x3, mean)
    var = mean_over_batch(op("Mul", centered, centered))
    std = op("Sqrt", op("Add", var, scalar("epsilon", eps)))
    y3 = op("Div", centered, std)
    y3 = op("Add", op("Mul", y3, op("Reshape", scale, per_channel)), op("Reshape", bias, per_channel))
    op("Reshape", y3, op("Shape", x), output=node.output[0])
    flat = ints("flat", [-1])
    for position, statistic, given in ((1, mean, mean_in), (2, var, var_in)):
        if len(node.output) > position and node.output[position]:
            kept = op("Mul", given, scalar("momentum", momentum))
            new = op("Mul", op("Reshape", statistic, flat), scalar("one_minus_momentum", 1.0 - momentum))
            op("Add", kept, new, output=node.output[position])
    return nodes


def cuda_driver_has_device() -> bool:
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    if libcuda.cuInit(0) != 0 or libcuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return False
    return count.value > 0


@contextlib.contextmanager
def output_silenced() -> Iterator[None]:
    """Send file descriptors 1 and 2 to /dev/null: a failing provider library logs from C++,
    past Python's sys.stdout/sys.stderr. Used only around the one-time provider probe."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        saved = [os.dup(1), os.dup(2)]
    except OSError:  # no fd 1 or 2 to silence (a daemon): nothing can be printed anyway
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


@functools.cache
def provider_works(name: str) -> bool:
    """Whether a session on ``name`` really runs on it here (cached: probed once per process)."""
    if name == CPU:
        return True
    if name not in ort.get_available_providers():
        return False
    if name in _NEED_CUDA_DEVICE and not cuda_driver_has_device():
        return False
    from onnx import helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    model = make_runtime_compatible(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        with output_silenced():
            session = ort.InferenceSession(model.SerializeToString(), options, providers=[name, CPU], enable_fallback=0)
    except Exception:
        return False
    return session.get_providers()[0] == name


#: Kernels onnxruntime's CPU provider registers for a type but refuses when run, by an
#: attribute: op -> {reduction: element types} (measured on onnxruntime 1.31 by running each
#: op, reduction and type: "MLFloat16 data type is not supported with ScatterElements opset 16
#: when reduction is 'add'"). A session loads them, so node_kernel's probe alone passes them.
_CPU_REFUSED_REDUCTIONS = {
    "ScatterElements": {
        "add": {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16},
        "mul": {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16},
        "max": {onnx.TensorProto.BFLOAT16},
        "min": {onnx.TensorProto.BFLOAT16},
    },
    "ScatterND": {
        reduction: {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16} for reduction in ("add", "mul", "max", "min")
    },
}


def _refused_when_run(proto: onnx.NodeProto, input_types: tuple[int, ...]) -> bool:
    refused = _CPU_REFUSED_REDUCTIONS.get(proto.op_type) if proto.domain in ("", "ai.onnx") else None
    if not refused:
        return False
    reduction = next((a.s.decode() for a in proto.attribute if a.name == "reduction"), "none")
    return bool(refused.get(reduction, set()) & set(input_types))


#: node_kernel's answers: a kernel of the provider computes the node in the types it has, or
#: onnxruntime runs it by casting to float32 and back (its InsertCastTransformer, on the CPU)
NATIVE, EMULATED = "native", "emulated"


@functools.cache
def node_kernel(
    provider: str, node: bytes, input_types: tuple[int, ...], opsets: tuple[tuple[str, int], ...]
) -> str | None:
    """How onnxruntime runs one node (a serialized NodeProto) on ``provider`` with inputs of
    these element types (0: an omitted optional input): NATIVE, EMULATED (the session loads,
    but onnxruntime computes the node in float32 between casts it inserts, as its CPU provider
    does for float16 arithmetic it has no kernel for), or None when no session can be made
    (without falling back to another provider). Shapes are left unknown, so only what the
    kernel registry decides counts; cached per node and types."""
    proto = onnx.NodeProto.FromString(node)
    if provider == CPU and _refused_when_run(proto, input_types):
        return None
    outputs = [f"y{i}" if name else "" for i, name in enumerate(proto.output)]
    names = [f"x{i}" if code else "" for i, code in enumerate(input_types)]
    del proto.input[:], proto.output[:]
    proto.input.extend(names)
    proto.output.extend(outputs)
    inputs = [helper.make_tensor_value_info(n, code, None) for n, code in zip(names, input_types, strict=True) if n]
    graph = helper.make_graph(
        [proto], "probe", inputs, [helper.make_value_info(o, onnx.TypeProto()) for o in outputs if o]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    with tempfile.TemporaryDirectory() as folder:
        optimized = os.path.join(folder, "optimized.onnx")
        try:
            model = onnx.shape_inference.infer_shapes(make_runtime_compatible(model))
            typed = {v.name: v for v in model.graph.value_info}
            for out in model.graph.output:
                if out.name in typed:
                    out.type.CopyFrom(typed[out.name].type)
            options = ort.SessionOptions()
            options.log_severity_level = 4
            # no fusions: what is left beside the node is what onnxruntime had to insert
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            options.optimized_model_filepath = optimized
            if provider != CPU:  # else onnxruntime runs what the provider lacks on the CPU
                options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
            with output_silenced() if provider != CPU else contextlib.nullcontext():
                ort.InferenceSession(model.SerializeToString(), options, providers=[provider])
        except Exception:
            return None
        ran = [n.op_type for n in onnx.load(optimized, load_external_data=False).graph.node]
    return NATIVE if ran == [proto.op_type] else EMULATED


def resolve_provider(name: str) -> str:
    """``"cpu"``, ``"cuda"`` or ``"auto"`` (CUDA where it works here, else the CPU) as
    onnxruntime's provider name; "cuda" where CUDA does not work is a ValueError."""
    if name == "auto":
        return CUDA if provider_works(CUDA) else CPU
    full = {"cpu": CPU, "cuda": CUDA}.get(name, name)
    if not provider_works(full):
        raise ValueError(
            f"provider {name!r} does not work on this machine (onnxruntime offers: {', '.join(ort.get_available_providers())})"
        )
    return full


#: onnxruntime's blocked-channel CPU kernels (ReorderInput, Conv, ReorderOutput of this domain)
NCHWC_DOMAIN = "com.microsoft.nchwc"


@functools.cache
def nchwc_block_size() -> int | None:
    """The channel block of onnxruntime's NCHWc CPU kernels on this machine (16 with AVX-512, 8
    with AVX2), or None where this build and CPU have none. A program whose Conv weights are
    laid out for one block computes garbage with another, so it is asked of onnxruntime itself:
    its own NCHWc transformer reorders a probe Conv's constant weights, and the layout it wrote
    (NCHWC_WEIGHT_PERM) says B."""
    channels = 64
    weights = (np.arange(channels * channels, dtype=np.float32) % 251).reshape(channels, channels, 1, 1)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"])],
        "nchwc_probe",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, channels, 8, 8])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weights, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7)
    with tempfile.TemporaryDirectory() as folder:
        optimized = os.path.join(folder, "optimized.onnx")
        options = ort.SessionOptions()
        options.log_severity_level = 4
        options.optimized_model_filepath = optimized
        try:
            ort.InferenceSession(model.SerializeToString(), options, providers=[CPU])
            done = onnx.load(optimized)
        except Exception:
            return None
    if not any(n.domain == NCHWC_DOMAIN and n.op_type == "Conv" for n in done.graph.node):
        return None
    written = {t.name: numpy_helper.to_array(t) for t in done.graph.initializer}
    conv = next(n for n in done.graph.node if n.domain == NCHWC_DOMAIN and n.op_type == "Conv")
    reordered = written.get(conv.input[1])
    for block in (4, 8, 16, 32, 64):
        if reordered is not None and np.array_equal(reordered, _nchwc_weights(weights, block)):
            return block
    return None


#: the NCHWc Conv's weight layout: [O, C, kh, kw] split into [O/B, B(out), C/B, B(in), kh, kw]
#: and transposed by this to [O/B, C/B, kh, kw, B(in), B(out)]
NCHWC_WEIGHT_PERM = (0, 2, 4, 5, 3, 1)


def _nchwc_weights(w: np.ndarray, block: int) -> np.ndarray:
    """``w`` [O, C, kh, kw] in the layout onnxruntime's NCHWc Conv reads (channels divisible by
    ``block``), flattened back to w's shape."""
    o, c, *kernel = w.shape
    return w.reshape(o // block, block, c // block, block, *kernel).transpose(NCHWC_WEIGHT_PERM).reshape(w.shape)
