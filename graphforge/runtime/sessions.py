"""Sessions in one place: which execution providers work here, and a session factory.

``onnxruntime-gpu`` lists CUDAExecutionProvider (and TensorRT) even on a machine without a
GPU, and asking for one there prints errors and silently falls back to the CPU. So a
provider other than the CPU is offered only when a probe session really runs on it (for
CUDA, only after the CUDA driver answers with at least one device), and sessions are
created without onnxruntime's fallback: a provider that fails is an error, not a surprise.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
from onnx import external_data_helper

from graphforge import roles
from graphforge.errors import GraphforgeError, InvalidModelError, ModelSaveError, one_line
from graphforge.model_io import ModelSource, load, refuse_unresolved_external_data, save
from graphforge.ort_compat import (
    CPU,
    CUDA,
    TENSORRT,
    expand_training_batch_norm,
    has_dequantize,
    has_training_batch_norm,
    is_runtime_compatible,
    make_runtime_compatible,
    nchwc_block_size,
    own_dequantize_inputs,
    provider_works,
)
from graphforge.payloads import exceeds_protobuf_limit
from graphforge.program import ProgramRoles

_SHORT_NAMES = {"cuda": CUDA, "cpu": CPU, "tensorrt": TENSORRT}
ENV_PROVIDERS = "GRAPHFORGE_PROVIDERS"
ENV_THREADS = "GRAPHFORGE_THREADS"
#: "1" lets onnxruntime's CUDA provider use TF32 for float32 MatMul/Gemm/Conv (see cuda_defaults)
ENV_TF32 = "GRAPHFORGE_TF32"
#: options given to the CUDA provider where a session's provider entry does not set them (see cuda_defaults)
CUDA_DEFAULT_OPTIONS: dict[str, str] = {"use_tf32": "0", "arena_extend_strategy": "kSameAsRequested"}
#: the accuracy level of onnxruntime's MatMulNBits for a program with quantized weights (the
#: quantize_frozen pass): 0 to 4, onnxruntime's session.qdq_matmulnbits_accuracy_level (see quantized_options)
ENV_NBITS_ACCURACY = "GRAPHFORGE_NBITS_ACCURACY"
#: the level a program with quantized weights runs at unless $GRAPHFORGE_NBITS_ACCURACY says another
NBITS_ACCURACY_DEFAULT = "1"
_NBITS_ACCURACY = "session.qdq_matmulnbits_accuracy_level"
#: onnxruntime's session option for the folder of external data when the model comes as bytes
_EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"


def _cuda_works() -> bool:
    return provider_works(CUDA)


def available_providers() -> list[str]:
    """Providers to use, best first: ``$GRAPHFORGE_PROVIDERS`` if set, else CUDA (if it works) then CPU."""
    override = os.environ.get(ENV_PROVIDERS, "").strip()
    if override:
        return [_provider_name(p) for p in resolve_providers(override.split(","), source=f"${ENV_PROVIDERS}")]
    return [CUDA, CPU] if _cuda_works() else [CPU]


def resolve_providers(providers: Sequence[Any], *, source: str = "providers") -> list[Any]:
    """Check a provider list (names, short names ``cpu``/``cuda``/``tensorrt``, or
    ``(name, options)`` pairs as onnxruntime takes them): every one must exist in this
    onnxruntime build and work on this machine. Duplicates are dropped, order is kept."""
    known = ort.get_available_providers()
    resolved: list[Any] = []
    seen: set[str] = set()
    for entry in providers:
        name, provider_options = (entry[0], entry[1]) if isinstance(entry, tuple) else (entry, None)
        name = str(name).strip()
        name = _SHORT_NAMES.get(name.lower(), name)
        if not name or name in seen:
            continue
        seen.add(name)
        resolved.append((name, provider_options) if provider_options is not None else name)
    if not resolved:
        raise GraphforgeError(f"{source} names no execution provider; this onnxruntime has: {', '.join(known)}")
    unknown = [n for n in map(_provider_name, resolved) if n not in known]
    if unknown:
        raise GraphforgeError(
            f"{source} names {', '.join(unknown)}, which this onnxruntime does not have; it has: {', '.join(known)}"
        )
    for name in map(_provider_name, resolved):
        if provider_works(name):
            continue
        if name == CUDA:
            raise GraphforgeError(f"{source} asks for CUDA, but no CUDA device is usable on this machine")
        raise GraphforgeError(f"{source} asks for {name}, which this onnxruntime lists but which does not work here")
    return resolved


def _provider_name(entry: Any) -> str:
    return entry[0] if isinstance(entry, tuple) else entry


#: (device type, id) -> whether one arena for it is registered in onnxruntime's environment
_shared_arenas: dict[tuple[str, int], bool] = {}


def share_arena(options: ort.SessionOptions, device_type: str = "cpu", device_id: int = 0) -> bool:
    """Make ``options``' session allocate its tensors on the device from one arena that every
    session of this process sharing it uses (onnxruntime's environment allocator, one per
    device), instead of an arena of its own. A training step of two or more sessions
    (forward/backward, then the update; data-parallel or pipeline segments) then reuses one
    peak's worth of memory, where each arena of its own would keep its session's peak for
    good. On CUDA the arena grows by what is asked (CUDA_DEFAULT_OPTIONS' strategy). Returns
    False where this onnxruntime cannot register one (the session keeps its own arena).

    A session captured as a CUDA graph must not share it: the graph replays into the blocks
    its capture used, which the arena has since handed to values other sessions still hold."""
    key = (device_type, device_id)
    if key not in _shared_arenas:
        try:
            if device_type == "cpu":
                info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
                ort.create_and_register_allocator(info, ort.OrtArenaCfg({}))
            else:
                info = ort.OrtMemoryInfo(
                    "Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, device_id, ort.OrtMemType.DEFAULT
                )
                # kSameAsRequested, as each session's own CUDA arena (cuda_defaults)
                ort.create_and_register_allocator_v2(
                    CUDA, info, {"device_id": str(device_id)}, ort.OrtArenaCfg({"arena_extend_strategy": 1})
                )
            _shared_arenas[key] = True
        except (AttributeError, RuntimeError, ort.capi.onnxruntime_pybind11_state.Fail):
            _shared_arenas[key] = False
    if _shared_arenas[key]:
        options.add_session_config_entry("session.use_env_allocators", "1")
    return _shared_arenas[key]


def session_options(
    *, intra_op_threads: int | None = None, inter_op_threads: int | None = None, spin: bool = True
) -> ort.SessionOptions:
    """Session options with thread counts (``$GRAPHFORGE_THREADS`` sets the intra-op default).

    A thread count is a whole number ≥ 0; 0 lets onnxruntime choose. ``spin=False``: the
    session's threads do not spin for work after a run (onnxruntime's default is to spin),
    for a session whose runs alternate with other work on the same cores: another session's,
    or torch's.
    """
    options = ort.SessionOptions()
    options.log_severity_level = 3
    env_threads = os.environ.get(ENV_THREADS, "").strip()
    if intra_op_threads is None and env_threads:
        try:
            intra_op_threads = int(env_threads)
        except ValueError:
            intra_op_threads = -1
        if intra_op_threads < 0:
            raise GraphforgeError(
                f"${ENV_THREADS} must be a whole number ≥ 0 (0 lets onnxruntime choose), got {env_threads!r}"
            )
    for what, value in (("intra_op_threads", intra_op_threads), ("inter_op_threads", inter_op_threads)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise GraphforgeError(f"{what} must be a whole number ≥ 0 (0 lets onnxruntime choose), got {value!r}")
    if intra_op_threads is not None:
        options.intra_op_num_threads = intra_op_threads
    if inter_op_threads is not None:
        options.inter_op_num_threads = inter_op_threads
    if not spin:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return options


def create_session(
    model: ModelSource,
    *,
    providers: Sequence[Any] | None = None,
    options: ort.SessionOptions | None = None,
    intra_op_threads: int | None = None,
    inter_op_threads: int | None = None,
    where: str | None = None,
) -> ort.InferenceSession:
    """An InferenceSession for a path, bytes or ModelProto, on the best working providers.

    A model onnxruntime refuses raises InvalidModelError naming ``where`` (by default the
    path, ``<bytes>`` or ``the model``). A model with a newer IR version or opset than
    onnxruntime reads is converted in memory first; a file's external data is then still
    read from the file's folder (named in ``options`` as onnxruntime's external data folder).
    """
    providers = resolve_providers(providers, source="providers") if providers is not None else available_providers()
    options = options or session_options(intra_op_threads=intra_op_threads, inter_op_threads=inter_op_threads)
    on_cuda = CUDA in map(_provider_name, providers)
    if isinstance(model, str | os.PathLike):
        where = where or str(model)
        # A file on disk may carry external data next to it: onnxruntime reads it there,
        # but only after the same checks load() applies, and with a readable IR version.
        proto = load(model, load_external_data=False)
        if not _needs_changes(proto, on_cuda):
            return _session(str(model), options, providers, where, proto)
        _make_compatible(proto, where, on_cuda)
        if any(external_data_helper.uses_external_data(t) for t in external_data_helper._get_all_tensors(proto)):
            options.add_session_config_entry(_EXTERNAL_DATA_FOLDER, str(Path(model).resolve().parent))
        return _session(proto.SerializeToString(), options, providers, where, proto)
    if isinstance(model, bytes | bytearray):
        where = where or "<bytes>"
        proto = load(model)  # parsed here, so ours to convert in place
    else:
        where = where or "the model"
        refuse_unresolved_external_data(model, where=where)
        proto = model
    if exceeds_protobuf_limit(proto):  # save() writes what onnxruntime reads
        if (on_cuda and has_training_batch_norm(proto)) or has_dequantize(proto, roles.QUANT_PREFIX):
            proto = _own_copy(proto, model)
            if on_cuda:
                expand_training_batch_norm(proto)
            own_dequantize_inputs(proto, roles.QUANT_PREFIX)
        with tempfile.TemporaryDirectory(prefix="graphforge-session-") as tmp:
            path = save(proto, Path(tmp) / "model.onnx", external_data=True)
            return _session(str(path), options, providers, where, proto)
    if _needs_changes(proto, on_cuda):
        proto = _own_copy(proto, model)
        _make_compatible(proto, where, on_cuda)
    return _session(proto.SerializeToString(), options, providers, where, proto)


def _own_copy(proto: onnx.ModelProto, model) -> onnx.ModelProto:
    """``proto`` to change in place: a copy where it is the caller's ``model``."""
    if proto is not model:
        return proto
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def check_loads(model: ModelSource, *, where: str) -> None:
    """Raise InvalidModelError (naming ``where``) unless onnxruntime builds a session for
    ``model`` on the providers in use; the checker's complement (``PassManager(verify_with_ort=True)``)."""
    create_session(model, where=where)


def _needs_changes(proto: onnx.ModelProto, on_cuda: bool) -> bool:
    return (
        not is_runtime_compatible(proto)
        or (on_cuda and has_training_batch_norm(proto))
        or has_dequantize(proto, roles.QUANT_PREFIX)
    )


def _make_compatible(proto: onnx.ModelProto, where: str, on_cuda: bool = False) -> None:
    """``proto`` as the installed onnxruntime reads it, and on CUDA as its CUDA provider runs it
    (``expand_training_batch_norm``), in place."""
    try:
        make_runtime_compatible(proto)
    except ModelSaveError as exc:
        raise InvalidModelError(f"onnxruntime cannot load {where}: {exc}") from None
    if on_cuda:
        expand_training_batch_norm(proto)
    own_dequantize_inputs(proto, roles.QUANT_PREFIX)


#: onnxruntime graph optimizations a program with recomputed nodes is run without:
#: CommonSubexpressionElimination would merge the recompute pass's copies back into the forward
#: nodes they copy (keeping the activations alive after all); FastGeluFusion (onnxruntime 1.31)
#: fuses a forward GELU whose inner tensor a recomputed copy reads and drops the node that makes
#: it, leaving a model onnxruntime then refuses
RECOMPUTE_DISABLED_OPTIMIZERS = ("CommonSubexpressionElimination", "FastGeluFusion")
#: what a model with a backward is run without: onnxruntime 1.31's NchwcTransformer, given a
#: gradient program whose Conv weights are constants (``autodiff`` alone, no optimizer), changed
#: ResNet-18's gradients by up to 1.5% of their largest value against float64 autograd (5e-6
#: without it, as torch's own float32: tests/runtime/test_backward_sessions.py's case); a
#: training program's weights are inputs, which it leaves alone anyway. Kept where the backward
#: reads no constant weight and no BatchNorm is in training mode (``nchwc_safe``): a frozen
#: backbone's convolutions, constants read by the forward alone, then run in its blocked layout
#: (a MobileNetV2's step 1.4-2× faster: docs/benchmarks.md, Transfer learning)
BACKWARD_DISABLED_OPTIMIZERS = ("NchwcTransformer",)
#: what a model with a training-mode BatchNormalization is run without: onnxruntime 1.31's
#: ConstantSharing makes initializers of equal values one buffer, and the CPU kernel writes the
#: running statistics' update into its running-mean and -variance inputs' buffers in place; where
#: those are initializers equal to the scale or bias (a fresh BatchNorm's zeros and ones, in a
#: program without an optimizer, whose statistics stay initializers), it overwrote them, and
#: every run normalised with other values (tests/runtime/test_sessions.py)
TRAINING_BATCHNORM_DISABLED_OPTIMIZERS = ("ConstantSharing",)
#: what a program with quantized weights (the quantize_frozen pass) is run without: onnxruntime
#: 1.31's MatMulAddFusion makes a Gemm of a quantized product and the Add of its lora adapter's
#: delta before the QDQ fusions run, and a DequantizeLinear → Gemm whose C is no constant is not
#: fused into MatMulNBits (tests/passes/test_quantize_frozen.py: 1 of 3 products fused with it)
QUANTIZED_DISABLED_OPTIMIZERS = ("MatMulAddFusion",)


def cuda_defaults(providers: Sequence[Any]) -> list[Any]:
    """``providers`` with CUDA_DEFAULT_OPTIONS for the CUDA provider where its entry does not set
    them (``$GRAPHFORGE_TF32=1`` turns TF32 back on). Both were measured on an H200:

    * ``use_tf32=0``: onnxruntime's CUDA provider uses TF32 by default, which rounds
      MatMul/Gemm/Conv operands to 10 mantissa bits: a 512x512 MatMul's relative error is 3e-4
      against 2e-7 in full float32. torch computes float32 matmuls in full precision by
      default, and graphforge's gradients are checked against torch's (the CUDA tests fail at
      their tolerances with TF32 on).
    * ``arena_extend_strategy=kSameAsRequested``: the default arena grows by doubling, and
      each session has its own arena; a GPT-2 small training step held 4392 MiB of the device
      with doubling and 3722 MiB without it, at the same step time (34.2 and 34.9 ms)."""
    defaults = dict(CUDA_DEFAULT_OPTIONS)
    if os.environ.get(ENV_TF32, "").strip() == "1":
        defaults["use_tf32"] = "1"
    out: list[Any] = []
    for entry in providers:
        name, given = (entry[0], dict(entry[1])) if isinstance(entry, tuple) else (entry, {})
        if name == CUDA:
            entry = (name, {**defaults, **given})
        out.append(entry)
    return out


def _session(
    source: str | bytes, options: ort.SessionOptions, providers: list[Any], where: str, proto: onnx.ModelProto | None
):
    providers = cuda_defaults(providers)
    if proto is not None:
        _check_nchwc_layout(proto, where)
    names = [n.name for n in proto.graph.node] if proto is not None else []
    disabled = []
    if any(name.startswith(roles.RECOMPUTE_PREFIX) for name in names):
        disabled += RECOMPUTE_DISABLED_OPTIMIZERS
    if any(name.startswith(roles.GRAD_PREFIX) for name in names) and not nchwc_safe(proto):
        disabled += BACKWARD_DISABLED_OPTIMIZERS
    if proto is not None and has_training_batch_norm(proto):
        disabled += TRAINING_BATCHNORM_DISABLED_OPTIMIZERS
    if proto is not None and has_dequantize(proto, roles.QUANT_PREFIX):
        quantized_options(options)
        disabled += QUANTIZED_DISABLED_OPTIMIZERS
    try:
        # no fallback: onnxruntime would print to stdout and quietly continue on the CPU
        return ort.InferenceSession(
            source, options, providers=providers, enable_fallback=0, disabled_optimizers=disabled or None
        )
    except Exception as exc:
        raise InvalidModelError(f"onnxruntime cannot load {where}: {one_line(exc)}") from None


def quantized_options(options: ort.SessionOptions) -> ort.SessionOptions:
    """``options`` for a program with quantized weights (the quantize_frozen pass): onnxruntime's
    MatMulNBits (the forward's fused DequantizeLinear → MatMul) at accuracy level 1 unless
    ``options`` or ``$GRAPHFORGE_NBITS_ACCURACY`` set another. Its default, 4, quantizes the
    activations to int8 in the product: measured on onnxruntime 1.31's CPU, a 64 → 48 int4
    product of activations of about 10 was off by 0.66 against the unfused product; at 0
    or 1 (float32 activations) it equals it exactly. 2 and 3 compute in float16 and bfloat16."""
    try:
        options.get_session_config_entry(_NBITS_ACCURACY)
        return options  # set by the caller
    except RuntimeError:  # onnxruntime's answer where it is not set
        pass
    level = os.environ.get(ENV_NBITS_ACCURACY, "").strip() or NBITS_ACCURACY_DEFAULT
    if level not in {"0", "1", "2", "3", "4"}:
        raise GraphforgeError(
            f"${ENV_NBITS_ACCURACY} must be 0, 1, 2, 3 or 4 (onnxruntime's accuracy levels), got {level!r}"
        )
    options.add_session_config_entry(_NBITS_ACCURACY, level)
    return options


def nchwc_safe(proto: onnx.ModelProto) -> bool:
    """Whether a program with a backward may run with onnxruntime's NchwcTransformer: no
    backward node reads a constant of rank 3 or more (a convolution's weight, or what the
    session folds from one) and no BatchNormalization is in training mode. A frozen backbone's
    program is one: its constant weights are read by the forward alone."""
    return not has_training_batch_norm(proto) and not backward_constants(proto)


def backward_constants(proto: onnx.ModelProto) -> set[str]:
    """The constants of rank 3 or more (initializers that are no input, Constant nodes' values)
    that a backward node reads: what onnxruntime's NchwcTransformer may lay out in channel
    blocks under a backward kernel that reads them plain."""
    fed = {i.name for i in proto.graph.input}  # an initializer that is an input too is a default, fed each run
    constants = {t.name for t in proto.graph.initializer if len(t.dims) >= 3 and t.name not in fed}
    for node in proto.graph.node:
        if node.op_type == "Constant" and any(a.name == "value" and len(a.t.dims) >= 3 for a in node.attribute):
            constants.update(node.output)
    read = set()
    for node in proto.graph.node:
        if node.name.startswith(roles.GRAD_PREFIX):
            read.update(constants.intersection(node.input))
    return read


def _check_nchwc_layout(proto: onnx.ModelProto, where: str) -> None:
    """A program fused for onnxruntime's NCHWc kernels (passes/fusion) lays its weights out in
    the channel blocks of the CPU it was compiled on; with another block the kernels would
    read them wrong, silently."""
    if roles.FUSION not in roles.metadata_of(proto):
        return  # not fused (most models): their roles are not read for this
    fused = ProgramRoles.of_proto(proto).nchwc_block
    if fused is not None and fused != nchwc_block_size():
        here = nchwc_block_size()
        raise InvalidModelError(
            f"{where} was fused for onnxruntime's NCHWc kernels with {fused}-channel blocks, and this CPU "
            f"{'uses ' + str(here) if here else 'has none'}: compile it again here, or without "
            "fuse's conv_input_grad_nchwc (fuse(rules=[relu_backward_mask, maxpool_backward_unpool]))"
        )
