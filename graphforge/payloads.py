"""A model's payloads (the bytes of its weights) and the copies that leave them out.

Shape inference and the checker read an initializer's type and shape, and its values only
when they are a small constant input (a Reshape's shape, Range's bounds, Resize's scales); the
checker also checks the values are long enough. Checking, inferring shapes of, or copying a
model with large weights spends nearly all of its time serializing and parsing them, so the copies here leave the large floating-point ones out
(integers are kept: shapes are integers). A stand-in is marked as external data at LEFT_OUT,
which the checker and shape inference both accept without reading; the checker needs a file of
that name beside the model it checks. Sizes are measured from dims and types, never by reading
a payload (reading a bytes field copies it). Protobuf messages only: no file, no Model.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import onnx
from google.protobuf.message import EncodeError
from onnx import external_data_helper

from graphforge.ir import FLOAT_TYPES

#: protobuf refuses to serialize a message of 2 GiB or more
PROTOBUF_LIMIT = 2**31 - 1


#: tensors at least this large go to the external data file when one is written
EXTERNAL_DATA_THRESHOLD = 1024


#: the external-data location that a tensor whose values were left out names (a stand-in);
#: no file of that name is ever read: the checker only sees that one exists
LEFT_OUT = "graphforge-values-left-out"


def stand_in(name: str, data_type: int, dims) -> onnx.TensorProto:
    tensor = onnx.TensorProto(name=name, data_type=data_type, dims=list(dims))
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=LEFT_OUT)
    return tensor


def is_stand_in(tensor: onnx.TensorProto) -> bool:
    """Whether ``tensor`` is a stand-in whose values were left out of a copy."""
    return tensor.data_location == onnx.TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == LEFT_OUT for e in tensor.external_data
    )


def can_leave_out(tensor: onnx.TensorProto) -> bool:
    """A floating-point initializer of at least EXTERNAL_DATA_THRESHOLD bytes, held in
    raw_data alone (the one storage whose check is only its length, see ``long_enough``)."""
    if tensor.data_type not in FLOAT_TYPES or tensor.data_type not in ELEMENT_BITS:
        return False
    if tensor.data_location == onnx.TensorProto.EXTERNAL or not tensor.HasField("raw_data"):
        return False
    return raw_data_size(tensor) >= EXTERNAL_DATA_THRESHOLD and not any(
        len(getattr(tensor, f)) for f in TENSOR_DATA_FIELDS[1:]
    )


def long_enough(tensor: onnx.TensorProto) -> bool:
    """What the checker checks of a tensor ``can_leave_out`` accepts: enough bytes for its
    shape. (Measuring raw_data copies it, ~0.15 ms per MB, so only verification does.)"""
    return len(tensor.raw_data) >= raw_data_size(tensor)


def copy_leaving_values_out(proto: onnx.ModelProto, known: Collection[str] = ()) -> onnx.ModelProto | None:
    """A copy of ``proto`` for the checker, whose large floating-point main-graph
    initializers are stand-ins, their lengths checked here (but for those named in
    ``known``, known to be long enough: ``graph.known_long_enough``); None when there is none."""
    initializers = proto.graph.initializer
    left_out = [can_leave_out(t) and (t.name in known or long_enough(t)) for t in initializers]
    if not any(left_out):
        return None
    out = copy_without_initializers(proto)
    for tensor, leave_out in zip(initializers, left_out, strict=True):
        if leave_out:
            out.graph.initializer.append(stand_in(tensor.name, tensor.data_type, tensor.dims))
        else:
            out.graph.initializer.add().CopyFrom(tensor)
    return out


def without_values(proto: onnx.ModelProto, names: Collection[str]) -> onnx.ModelProto:
    """A copy of ``proto`` whose main-graph initializers named in ``names`` are stand-ins
    (``is_stand_in``: name, type and shape, no values), for a holder that gets their values
    elsewhere; the others are copied."""
    out = copy_without_initializers(proto)
    for tensor in proto.graph.initializer:
        if tensor.name in names:
            out.graph.initializer.append(stand_in(tensor.name, tensor.data_type, tensor.dims))
        else:
            out.graph.initializer.add().CopyFrom(tensor)
    return out


def weights_left_out(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``proto`` whose weights are stand-ins: each large floating-point main-graph
    initializer, and each one held in an external file (a model read without its external
    data), left out. What compiles for shapes and costs alone (``PassManager(shapes_only=True)``):
    the planner's programs, of a model however large, in no more memory than its graph."""
    external = onnx.TensorProto.EXTERNAL
    names = {t.name for t in proto.graph.initializer if t.data_location == external or can_leave_out(t)}
    return without_values(proto, names)


def exceeds_protobuf_limit(proto: onnx.ModelProto) -> bool:
    """Whether ``proto`` is too large to serialize as one protobuf (2 GiB).

    The initializers' payloads are summed first: protobuf's own ByteSize() serializes the
    whole message to measure it, and raises instead of answering for a message over the limit.
    Tensors held in node attributes are left to ByteSize(): finding them walks every node in
    Python, which took longer than ByteSize() itself on the light exports that the checks and
    shape inference measure (GPT-2 small's training program: 23 ms against 3 ms).
    """
    if sum(raw_data_size(t) for t in proto.graph.initializer) > PROTOBUF_LIMIT:
        return True
    try:
        return proto.ByteSize() > PROTOBUF_LIMIT
    except (EncodeError, ValueError):
        return True


def _element_bits() -> dict[int, int]:
    bits = {}
    for data_type in onnx.TensorProto.DataType.values():
        if data_type in (onnx.TensorProto.UNDEFINED, onnx.TensorProto.STRING):
            continue
        try:
            bits[data_type] = onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize * 8
        except (KeyError, ValueError, TypeError):
            continue
    # packed types: numpy holds one per byte, raw_data packs them; others unknown here are measured
    for name, width in (("INT4", 4), ("UINT4", 4), ("FLOAT4E2M1", 4), ("INT2", 2), ("UINT2", 2)):
        if hasattr(onnx.TensorProto, name):
            bits[getattr(onnx.TensorProto, name)] = width
    for name in ("FLOAT6E2M3", "FLOAT6E3M2"):
        bits.pop(getattr(onnx.TensorProto, name, -1), None)
    return bits


ELEMENT_BITS = _element_bits()


def raw_data_size(tensor: onnx.TensorProto) -> int:
    """Bytes in a tensor's raw_data, from its dims and type where they tell: reading the
    field would copy it (a second gigabyte for a gigabyte tensor)."""
    if not tensor.HasField("raw_data"):
        return 0
    bits = ELEMENT_BITS.get(tensor.data_type)
    if bits is None:
        return len(tensor.raw_data)
    return (math.prod(tensor.dims) * bits + 7) // 8


def copy_without_initializers(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``proto`` with everything but its main graph's initializers, which are never
    read (so never copied): the caller adds the ones it keeps, or stand-ins for them."""
    out = onnx.ModelProto()
    copy_fields(proto, out, "graph")
    copy_fields(proto.graph, out.graph, "initializer")
    return out


def copy_fields(src, dst, skip: str) -> None:
    """Copy every field of protobuf message ``src`` into ``dst`` but ``skip``, never reading
    ``skip`` (reading a bytes field copies it)."""
    for field_descriptor in src.DESCRIPTOR.fields:
        name = field_descriptor.name
        if name == skip:
            continue
        repeated = getattr(field_descriptor, "is_repeated", None)
        if repeated is None:  # protobuf before 5: the label tells
            repeated = field_descriptor.label == field_descriptor.LABEL_REPEATED
        if repeated:
            if len(getattr(src, name)):
                getattr(dst, name).extend(getattr(src, name))
        elif src.HasField(name):
            if field_descriptor.message_type is not None:
                getattr(dst, name).CopyFrom(getattr(src, name))
            else:
                setattr(dst, name, getattr(src, name))


TENSOR_DATA_FIELDS = (
    "raw_data",
    "float_data",
    "int32_data",
    "string_data",
    "int64_data",
    "double_data",
    "uint64_data",
)


def all_tensors(proto: onnx.ModelProto):
    """Every tensor of ``proto`` that can hold a payload: initializers and attributes, in subgraphs too."""
    return external_data_helper._get_all_tensors(proto)


def serialized_within_limit(proto: onnx.ModelProto) -> bytes | None:
    """``proto`` serialized, or None when it is over protobuf's limit (2 GiB)."""
    if sum(raw_data_size(t) for t in all_tensors(proto)) > PROTOBUF_LIMIT:
        return None
    try:
        data = proto.SerializeToString()
    except (EncodeError, ValueError):
        return None
    return data if len(data) <= PROTOBUF_LIMIT else None
