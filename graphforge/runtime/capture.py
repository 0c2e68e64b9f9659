"""The runner's capture-ready mode: sessions that run against fixed buffers.

A CUDA graph replays the kernels its capture recorded on the addresses they read and wrote
then. onnxruntime's ``enable_cuda_graph`` captures a session's run that way, so a captured
session must find every input and write every output at the same address on every run, and
allocate nothing that outlives a run. The runner's capture-ready mode (``Runner(static=True)``)
makes that so for each session whose inputs and outputs all have fixed shapes (a session
specialized to a batch's dims): each input the caller feeds (the batch, the learning rate, the
step count, the dropout key) gets a buffer of its own that every run's value is copied into;
each output, fetched to the host or sent on to another segment, is written into a buffer of its
own (the host copy is taken from there); the carried tensors are the runner's own buffers, one
captured graph for each assignment of their ping-pong buffers (onnxruntime's ``gpu_graph_id``).

On the CPU the mode runs without capture and computes what the normal mode computes, bit for
bit (the tests hold it to that); on CUDA a session that cannot be captured (a node on the host,
control flow: onnxruntime refuses it when the session is made) runs uncaptured against the same
buffers, and the reason is kept (``Runner.capture_refused``), never raised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from graphforge.errors import GraphforgeError
from graphforge.runtime.dlpack import copy_on_device
from graphforge.runtime.sessions import CUDA

#: onnxruntime's run option that picks which of a session's captured graphs a run captures or replays
GRAPH_ID = "gpu_graph_id"


def fixed_shape_refusal(model: onnx.ModelProto, names: Sequence[str]) -> str | None:
    """Why the inputs and outputs ``names`` of ``model`` cannot all have fixed buffers (one whose
    shape is known only at run time), or None."""
    values = {v.name: v for v in [*model.graph.input, *model.graph.output]}
    for name in names:
        value = values.get(name)
        if value is None or not value.type.HasField("tensor_type"):
            return f"{name!r} is not a tensor"
        tensor = value.type.tensor_type
        if not tensor.HasField("shape") or not all(d.HasField("dim_value") for d in tensor.shape.dim):
            return f"the shape of {name!r} is known only at run time"
    return None


def shape_and_dtype(model: onnx.ModelProto, name: str) -> tuple[tuple[int, ...], np.dtype]:
    """The fixed shape and dtype of ``model``'s input or output ``name`` (fixed_shape_refusal: None)."""
    for value in [*model.graph.input, *model.graph.output]:
        if value.name == name:
            tensor = value.type.tensor_type
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type))
            return tuple(d.dim_value for d in tensor.shape.dim), dtype
    raise GraphforgeError(f"the model has no input or output {name!r}")


def captured_providers(providers: Sequence[Any]) -> list[Any]:
    """``providers`` with onnxruntime's CUDA graph capture asked of the CUDA provider."""
    out = []
    for entry in providers:
        name, options = (entry[0], dict(entry[1])) if isinstance(entry, tuple) else (entry, {})
        out.append((name, {**options, "enable_cuda_graph": "1"}) if name == CUDA else entry)
    return out


def run_options(graph_id: int) -> ort.RunOptions:
    """Run options that capture (first runs) or replay the session's graph number ``graph_id``."""
    options = ort.RunOptions()
    options.add_run_config_entry(GRAPH_ID, str(graph_id))
    return options


def copy_feed(buffer: ort.OrtValue, value: Any, name: str, expected: np.dtype) -> bool:
    """Copy the fed ``value`` (a host array, or an OrtValue) into the input's fixed ``buffer``.
    A host array converts to ``expected`` where no value changes (int32 labels to int64);
    an OrtValue already at the buffer's address is left as it is. Returns whether the copy
    was queued on torch's stream (device to device: dlpack.synchronize before a run reads it)."""
    if isinstance(value, ort.OrtValue):
        if value.data_ptr() == buffer.data_ptr():
            return False
        _check_shape(name, tuple(value.shape()), tuple(buffer.shape()))
        if value.device_name().lower() == "cpu":
            buffer.update_inplace(value.numpy())
            return False
        copy_on_device(buffer, value)
        return True
    array = feed_array(name, value, expected)
    _check_shape(name, array.shape, tuple(buffer.shape()))
    buffer.update_inplace(array)
    return False


def feed_array(name: str, value: Any, expected: np.dtype | None) -> np.ndarray:
    """A fed host value as the C-ordered array of the input's dtype ``expected``, converted
    where no value changes (int32 labels to int64), else refused."""
    array = np.asarray(value, order="C")  # (ascontiguousarray would make a 0-d scalar 1-d)
    if expected is not None and array.dtype != expected:
        if not np.can_cast(array.dtype, expected, casting="safe"):
            raise GraphforgeError(
                f"batch input {name!r} must be {np.dtype(expected).name} (or a type that converts to it "
                f"without loss), got {array.dtype.name}"
            )
        array = array.astype(expected)
    return array


def _check_shape(name: str, got: tuple[int, ...], fixed: tuple[int, ...]) -> None:
    if got != fixed:
        raise GraphforgeError(f"batch input {name!r} has shape {list(got)}; this session's buffer has {list(fixed)}")
