"""The two sides of a diff: a model's structure parsed, its large weights left in the file.

A diff reads every node, but of the weights it only needs to know whether they are equal:
so for a file the main graph's initializers are parsed without their ``raw_data``, whose
bytes stay in a read-only memory map of the file and are compared there. For GPT-2 small
(500 MB of weights) this halves the time of a diff: protobuf no longer copies the weights
into Python bytes objects, twice per model. Anything unusual (external data, a field
written twice, bytes that do not scan) falls back to ``graphforge.load``, which also gives
the error message a bad file deserves.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import external_data_helper, numpy_helper

from graphforge.errors import one_line
from graphforge.model_io import ModelSource, load
from graphforge.payloads import exceeds_protobuf_limit
from graphforge.stand_ins import copy_leaving_values_out, mark_left_out
from graphforge.verify import CHECK_ERRORS, light_problem

#: raw_data payloads at least this large stay in the file
LAZY_PAYLOAD_BYTES = 4096

_MODEL_GRAPH = 7  # ModelProto.graph
_GRAPH_INITIALIZER = 5  # GraphProto.initializer
_TENSOR_RAW_DATA = 9  # TensorProto.raw_data
_LEN = 2  # wire type of length-delimited fields


class _NotScannable(Exception):
    """The bytes are not the plain layout the fast path reads; use the ordinary loader."""


@dataclass(eq=False)
class Side:
    """One model of a diff. ``proto``'s main-graph initializers may lack their raw_data:
    read tensor bytes through ``tensor_bytes``."""

    proto: onnx.ModelProto
    label: str
    path: Path | None = None
    #: main-graph initializer position -> (offset, length) of its raw_data in ``_buffer``
    _payloads: dict[int, tuple[int, int]] = field(default_factory=dict)
    _buffer: mmap.mmap | None = None

    @property
    def stripped(self) -> bool:
        return bool(self._payloads)

    def payload(self, position: int) -> np.ndarray | None:
        """The raw_data bytes of main-graph initializer ``position`` kept in the file, else None."""
        region = self._payloads.get(position)
        if region is None or self._buffer is None:
            return None
        offset, length = region
        return np.frombuffer(self._buffer, dtype=np.uint8, count=length, offset=offset)

    def full_proto(self) -> onnx.ModelProto:
        """The whole model, weights included (numeric mode needs them)."""
        if not self.stripped:
            return self.proto
        assert self.path is not None
        return load(self.path)


def open_side(source: ModelSource | Side, label: str | None = None) -> Side:
    """A path, bytes or ModelProto as one side of a diff (errors as ``graphforge.load`` gives them)."""
    if isinstance(source, Side):
        return source
    if isinstance(source, onnx.ModelProto):
        return Side(load(source), label or "<ModelProto>")
    if isinstance(source, bytes | bytearray):
        return Side(load(bytes(source)), label or "<bytes>")
    path = Path(source)
    name = label or str(source)
    try:
        return _open_lazily(path, name)
    except (_NotScannable, OSError, ValueError, DecodeError):
        return Side(load(path), name, path)


def _open_lazily(path: Path, label: str) -> Side:
    if not path.is_file():
        raise _NotScannable
    with open(path, "rb") as f:
        buffer = _map(f.fileno())
    skeleton, payloads = _strip_payloads(buffer)
    proto = onnx.ModelProto()
    proto.ParseFromString(skeleton)
    if proto.ir_version <= 0 or not proto.HasField("graph") or not proto.opset_import:
        raise _NotScannable
    if any(external_data_helper.uses_external_data(t) for t in external_data_helper._get_all_tensors(proto)):
        raise _NotScannable  # load() checks where external data lives, and reads it
    if len(proto.graph.initializer) < len(payloads) or not payloads:
        if not payloads:  # nothing was large: the skeleton is the model
            return Side(proto, label, path)
        raise _NotScannable
    return Side(proto, label, path, payloads, buffer)


def _map(fileno: int) -> mmap.mmap:
    """A read-only map of the whole file, its page tables filled up front where Linux can:
    comparing GPT-2 small's weights took 0.9 s through page faults, 0.1 s populated."""
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if populate:
        return mmap.mmap(fileno, 0, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ)
    return mmap.mmap(fileno, 0, access=mmap.ACCESS_READ)


def _varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise _NotScannable
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _fields(buf, start: int, end: int):
    """(field number, wire type, field start, payload start, field end) of each field in buf[start:end]."""
    pos = start
    while pos < end:
        field_start = pos
        tag, pos = _varint(buf, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            _, pos = _varint(buf, pos)
            payload = pos
        elif wire == 1:
            payload, pos = pos, pos + 8
        elif wire == _LEN:
            length, payload = _varint(buf, pos)
            pos = payload + length
        elif wire == 5:
            payload, pos = pos, pos + 4
        else:  # groups: never written by onnx
            raise _NotScannable
        if pos > end:
            raise _NotScannable
        yield number, wire, field_start, payload, pos


def _strip_payloads(buf) -> tuple[bytes, dict[int, tuple[int, int]]]:
    """The model's bytes with large initializer raw_data fields cut out, and where they were."""
    pieces: list[bytes] = []
    graph: tuple[int, int] | None = None
    for number, wire, start, payload, end in _fields(buf, 0, len(buf)):
        if number == _MODEL_GRAPH and wire == _LEN:
            if graph is not None:
                raise _NotScannable  # a repeated message field merges: leave that to protobuf
            graph = (payload, end)
        else:
            pieces.append(buf[start:end])
    if graph is None:
        raise _NotScannable
    graph_bytes, payloads = _strip_graph(buf, *graph)
    pieces.append(_encode_varint(_MODEL_GRAPH << 3 | _LEN) + _encode_varint(len(graph_bytes)) + graph_bytes)
    return b"".join(pieces), payloads


def _strip_graph(buf, start: int, end: int) -> tuple[bytes, dict[int, tuple[int, int]]]:
    pieces: list[bytes] = []
    payloads: dict[int, tuple[int, int]] = {}
    run_start = start  # unchanged bytes are copied in runs
    position = 0
    for number, wire, field_start, payload, field_end in _fields(buf, start, end):
        if number != _GRAPH_INITIALIZER or wire != _LEN:
            continue
        cut = _raw_data_field(buf, payload, field_end)
        if cut is not None:
            (raw_start, raw_payload, raw_end) = cut
            tensor = buf[payload:raw_start] + buf[raw_end:field_end]
            pieces.append(buf[run_start:field_start])
            pieces.append(_encode_varint(_GRAPH_INITIALIZER << 3 | _LEN) + _encode_varint(len(tensor)) + tensor)
            run_start = field_end
            payloads[position] = (raw_payload, raw_end - raw_payload)
        position += 1
    pieces.append(buf[run_start:end])
    return b"".join(pieces), payloads


def _raw_data_field(buf, start: int, end: int) -> tuple[int, int, int] | None:
    found = None
    for number, wire, field_start, payload, field_end in _fields(buf, start, end):
        if number == _TENSOR_RAW_DATA:
            if wire != _LEN or found is not None:
                raise _NotScannable
            found = (field_start, payload, field_end)
    if found is None or found[2] - found[1] < LAZY_PAYLOAD_BYTES:
        return None
    return found


def tensor_bytes(side: Side | None, position: int | None, tensor: onnx.TensorProto) -> bytes | np.ndarray:
    """A tensor's values as bytes in one canonical layout (little-endian, C order)."""
    if side is not None and position is not None:
        kept = side.payload(position)
        if kept is not None:
            return kept
    if tensor.HasField("raw_data"):
        return tensor.raw_data
    if tensor.data_type == onnx.TensorProto.STRING:
        return b"\0".join(tensor.string_data)
    return numpy_helper.to_array(tensor).astype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).tobytes()


def tensor_array(side: Side | None, position: int | None, tensor: onnx.TensorProto) -> np.ndarray:
    """A tensor's values as a NumPy array. Raw bytes are viewed, not copied: a weight kept in
    the file is read straight off the memory map (read-only), one in ``raw_data`` from the one
    copy protobuf gives of it. Other layouts (typed fields, 4-bit types) go through onnx."""
    kept = side.payload(position) if side is not None and position is not None else None
    dtype = raw_dtype(tensor.data_type)
    if dtype is not None and not tensor.external_data:
        shape = tuple(tensor.dims)
        count = int(np.prod(shape, dtype=np.int64))
        raw = kept if kept is not None else (tensor.raw_data if tensor.HasField("raw_data") else None)
        if raw is not None and len(raw) == count * dtype.itemsize:
            return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape)
        if kept is not None:
            raise ValueError(f"{tensor.name!r}: {len(raw)} bytes of raw_data for {count} {dtype} values")
    if kept is not None:  # a packed type kept in the file: onnx unpacks it
        copy = onnx.TensorProto()
        copy.CopyFrom(tensor)
        copy.raw_data = kept.tobytes()
        return numpy_helper.to_array(copy)
    return numpy_helper.to_array(tensor)


def raw_dtype(data_type: int) -> np.dtype | None:
    """The little-endian NumPy type whose bytes are ``data_type``'s raw_data, one element per
    item; None for strings and the packed 4-bit types."""
    if data_type in _PACKED or data_type == onnx.TensorProto.STRING:
        return None
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(data_type))
    except (KeyError, ValueError, TypeError):
        return None
    if dtype.kind == "O":
        return None
    return dtype.newbyteorder("<") if dtype.itemsize > 1 and dtype.kind in "iufc" else dtype


_PACKED = {
    getattr(onnx.TensorProto, name)
    for name in ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
    if hasattr(onnx.TensorProto, name)
}


def bytes_equal(a: bytes | np.ndarray, b: bytes | np.ndarray, chunk: int = 1 << 22) -> bool:
    """Equality of two byte buffers, compared in chunks (no buffer-sized temporary)."""
    if isinstance(a, bytes) and isinstance(b, bytes):
        return a == b
    x = np.frombuffer(a, dtype=np.uint8) if isinstance(a, bytes) else a
    y = np.frombuffer(b, dtype=np.uint8) if isinstance(b, bytes) else b
    if len(x) != len(y):
        return False
    return all(np.array_equal(x[i : i + chunk], y[i : i + chunk]) for i in range(0, len(x), chunk))


# --------------------------------------------------------------------------- validity


def model_problem(side: Side) -> str | None:
    """What the ONNX checker (full check: topological order, types, strict shape inference)
    first finds wrong with the model, as one line; None when it passes.

    The checker reads large weights only to check their length, so it is given the model
    with those weights as stand-ins (``verify.light_problem``), their lengths checked here:
    for GPT-2 small it takes 30 ms, not seconds."""
    light = _light_copy(side)
    if light is not None and not exceeds_protobuf_limit(light):
        return light_problem(light)
    return _problem_of_file(side) if side.path is not None else None


def _light_copy(side: Side) -> onnx.ModelProto | None:
    """The model with its large weights as stand-ins; None where one cannot stand in (a
    payload whose length does not fit its shape: the checker must see it)."""
    if not side.stripped:
        return copy_leaving_values_out(side.proto) or side.proto
    light = onnx.ModelProto()
    light.CopyFrom(side.proto)
    for position, (_, length) in side._payloads.items():
        tensor = light.graph.initializer[position]
        dtype = raw_dtype(tensor.data_type)
        if dtype is None or length != int(np.prod(tuple(tensor.dims), dtype=np.int64)) * dtype.itemsize:
            return None
        mark_left_out(tensor)
    return light


def _problem_of_file(side: Side) -> str | None:
    assert side.path is not None
    try:
        onnx.checker.check_model(str(side.path), full_check=True)
    except CHECK_ERRORS as exc:
        return one_line(exc)
    return None
