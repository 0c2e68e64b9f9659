"""A model's payloads (the bytes of its weights): their sizes, protobuf's limit, and copies of
a model that never read them (the copies with stand-ins for them are ``stand_ins.py``'s).

Sizes are measured from dims and types, never by reading a payload (reading a bytes field
copies it). Protobuf messages only: no file, no Model.
"""

from __future__ import annotations

import math

import onnx
from google.protobuf.message import EncodeError
from onnx import external_data_helper

#: protobuf refuses to serialize a message of 2 GiB or more
PROTOBUF_LIMIT = 2**31 - 1


#: tensors at least this large go to the external data file when one is written
EXTERNAL_DATA_THRESHOLD = 1024


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
