"""Sessions in one place: which execution providers work here, and a session factory.

``onnxruntime-gpu`` lists CUDAExecutionProvider even on a machine without a GPU, and asking
for it there prints errors. So CUDA is offered only when the CUDA driver answers with at
least one device *and* a probe session really runs on it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import onnx
import onnxruntime as ort

from graphforge.errors import GraphforgeError
from graphforge.graph import PROTOBUF_LIMIT, ModelSource, load, make_runtime_compatible, runtime_limits, save

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
_SHORT_NAMES = {"cuda": CUDA, "cpu": CPU}
ENV_PROVIDERS = "GRAPHFORGE_PROVIDERS"
ENV_THREADS = "GRAPHFORGE_THREADS"


def _cuda_driver_has_device() -> bool:
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    if libcuda.cuInit(0) != 0 or libcuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return False
    return count.value > 0


@functools.cache
def _cuda_works() -> bool:
    if CUDA not in ort.get_available_providers() or not _cuda_driver_has_device():
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
        session = ort.InferenceSession(model.SerializeToString(), options, providers=[CUDA, CPU])
    except Exception:
        return False
    return session.get_providers()[0] == CUDA


def available_providers() -> list[str]:
    """Providers to use, best first: ``$GRAPHFORGE_PROVIDERS`` if set, else CUDA (if it works) then CPU."""
    override = os.environ.get(ENV_PROVIDERS, "").strip()
    if override:
        return _parse_override(override)
    return [CUDA, CPU] if _cuda_works() else [CPU]


def _parse_override(text: str) -> list[str]:
    names = [_SHORT_NAMES.get(n.strip().lower(), n.strip()) for n in text.split(",") if n.strip()]
    known = ort.get_available_providers()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise GraphforgeError(
            f"${ENV_PROVIDERS} names {', '.join(unknown)}, which this onnxruntime does not have; "
            f"it has: {', '.join(known)}"
        )
    if CUDA in names and not _cuda_works():
        raise GraphforgeError(f"${ENV_PROVIDERS} asks for CUDA, but no CUDA device is usable on this machine")
    return names


def session_options(*, intra_op_threads: int | None = None, inter_op_threads: int | None = None) -> ort.SessionOptions:
    """Session options with thread counts (``$GRAPHFORGE_THREADS`` sets the intra-op default)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if intra_op_threads is None and os.environ.get(ENV_THREADS):
        try:
            intra_op_threads = int(os.environ[ENV_THREADS])
        except ValueError:
            raise GraphforgeError(f"${ENV_THREADS} must be a whole number, got {os.environ[ENV_THREADS]!r}") from None
    if intra_op_threads is not None:
        options.intra_op_num_threads = intra_op_threads
    if inter_op_threads is not None:
        options.inter_op_num_threads = inter_op_threads
    return options


def create_session(
    model: ModelSource,
    *,
    providers: Sequence[str] | None = None,
    options: ort.SessionOptions | None = None,
    intra_op_threads: int | None = None,
    inter_op_threads: int | None = None,
) -> ort.InferenceSession:
    """An InferenceSession for a path, bytes or ModelProto, on the best working providers."""
    providers = list(providers) if providers is not None else available_providers()
    options = options or session_options(intra_op_threads=intra_op_threads, inter_op_threads=inter_op_threads)
    if isinstance(model, str | os.PathLike):
        # A file on disk may carry external data next to it: let onnxruntime read it there,
        # but only after the same checks load() applies, and with a readable IR version.
        proto = load(model, load_external_data=False)
        if _runtime_reads_as_is(proto):
            return ort.InferenceSession(str(model), options, providers=providers)
        proto = load(model)
    else:
        proto = load(model) if isinstance(model, bytes | bytearray) else model
    compatible = onnx.ModelProto()
    compatible.CopyFrom(proto)
    make_runtime_compatible(compatible)
    if compatible.ByteSize() > PROTOBUF_LIMIT:
        with tempfile.TemporaryDirectory(prefix="graphforge-session-") as tmp:
            path = save(compatible, Path(tmp) / "model.onnx", external_data=True)
            return ort.InferenceSession(str(path), options, providers=providers)
    return ort.InferenceSession(compatible.SerializeToString(), options, providers=providers)


def _runtime_reads_as_is(proto: onnx.ModelProto) -> bool:
    max_ir, max_opset = runtime_limits()
    opsets_ok = all(o.version <= max_opset for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    return proto.ir_version <= max_ir and opsets_ok
