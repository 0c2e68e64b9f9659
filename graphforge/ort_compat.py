"""onnxruntime compatibility: which IR versions and opsets the installed onnxruntime reads,
converting a model down to them, and whether it builds a session for a model.

One module for what ``graph.save`` (every file written is one onnxruntime reads), the
runtime's sessions and the checker (``verify_model(with_ort=True)``) all need, so none
of them reaches into another for it. Everything is probed from onnxruntime itself, never
from a version table, so a newer or older onnxruntime is handled without an edit here.
"""

from __future__ import annotations

import functools

import onnx
import onnxruntime as ort
from onnx import helper, version_converter

from graphforge.errors import ModelSaveError, one_line
from graphforge.ir import model_nodes, nodes_of


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
