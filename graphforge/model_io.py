"""Model files: load and save, in one place.

Every path in and out of graphforge goes through here so that three rules hold everywhere:
the IR version and opset written are ones the installed onnxruntime reads, external data
never escapes the model's folder, and a save is atomic (temp file + rename).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Protocol

import onnx
from google.protobuf.message import DecodeError, EncodeError
from onnx import external_data_helper, numpy_helper

from graphforge.errors import ModelLoadError, ModelSaveError, one_line
from graphforge.ort_compat import is_runtime_compatible, make_runtime_compatible
from graphforge.payloads import (
    EXTERNAL_DATA_THRESHOLD,
    TENSOR_DATA_FIELDS,
    all_tensors,
    copy_fields,
    copy_without_initializers,
    exceeds_protobuf_limit,
    raw_data_size,
    serialized_within_limit,
)
from graphforge.stand_ins import is_stand_in
from graphforge.tempfiles import move_into_place, temp_folder_beside


class Exportable(Protocol):
    """What ``save`` writes besides a ModelProto: a Model (graphforge.graph)."""

    def to_proto(self) -> onnx.ModelProto: ...


ModelSource = str | os.PathLike | bytes | onnx.ModelProto


def load(source: ModelSource, *, load_external_data: bool = True, copy: bool = True) -> onnx.ModelProto:
    """Load a model from a path, bytes or a ModelProto (returned as a copy; with
    ``copy=False``, itself, checked, for a caller that only reads it and would rather not
    copy its weights).

    External data is read from the model's folder; a location that escapes that folder
    (absolute, or with ``..``) is refused before anything is read. Bytes and a ModelProto
    have no folder, so one that still refers to external data is refused unless
    ``load_external_data=False`` (the caller then resolves it).
    """
    if isinstance(source, onnx.ModelProto):
        proto = source
        if copy:
            proto = onnx.ModelProto()
            proto.CopyFrom(source)
        proto = _checked(proto, "<ModelProto>")
        if load_external_data:
            refuse_unresolved_external_data(proto, where="<ModelProto>")
        return proto
    if isinstance(source, bytes | bytearray):
        proto = _checked(_parse(bytes(source), "<bytes>"), "<bytes>")
        if load_external_data:
            refuse_unresolved_external_data(proto, where="<bytes>")
        return proto
    path = Path(source)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file")
    if path.is_dir():
        raise ModelLoadError(f"{path}: is a folder, expected an .onnx file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read ({exc.strerror or exc})") from None
    proto = _checked(_parse(data, str(path)), str(path))
    check_external_data_locations(proto, path.parent, where=str(path))
    if load_external_data and _uses_external_data(proto):
        try:
            external_data_helper.load_external_data_for_model(proto, str(path.parent))
        except (OSError, ValueError, onnx.checker.ValidationError) as exc:
            raise ModelLoadError(f"{path}: cannot read its external data ({one_line(exc)})") from None
    return proto


def _parse(data: bytes, where: str) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError):
        raise ModelLoadError(f"{where}: not an ONNX model (the bytes do not parse as a ModelProto)") from None
    return proto


def _checked(proto: onnx.ModelProto, where: str) -> onnx.ModelProto:
    # protobuf parses many byte strings leniently (unknown fields are skipped), so a text
    # file or random bytes can "parse"; a real model always has an IR version and opsets.
    if proto.ir_version <= 0 or not proto.HasField("graph") or not proto.opset_import:
        raise ModelLoadError(f"{where}: not an ONNX model (no IR version, graph or opset import)")
    return proto


def _uses_external_data(proto: onnx.ModelProto) -> bool:
    return any(external_data_helper.uses_external_data(t) for t in all_tensors(proto))


def _external_location(tensor: onnx.TensorProto) -> str:
    return next((e.value for e in tensor.external_data if e.key == "location"), "")


def check_external_data_locations(proto: onnx.ModelProto, base_dir: Path, *, where: str) -> None:
    """Refuse external data that would be read from outside the model's folder."""
    base = base_dir.resolve()
    for tensor in all_tensors(proto):
        if not external_data_helper.uses_external_data(tensor):
            continue
        location = _external_location(tensor)
        if not location:
            raise ModelLoadError(f"{where}: tensor {tensor.name!r} is marked as external data but names no file")
        target = (base / location).resolve()
        if os.path.isabs(location) or not target.is_relative_to(base):
            raise ModelLoadError(
                f"{where}: tensor {tensor.name!r} stores its data at {location!r}, outside the model's "
                f"folder {base}; refusing to read it"
            )


def refuse_unresolved_external_data(proto: onnx.ModelProto, *, where: str, stand_ins: bool = False) -> None:
    """Refuse a model held in memory that still refers to external data files.

    Such a model has no folder to read them from (onnxruntime would read them relative to
    the current directory, unchecked), so it must be loaded from its path instead.
    ``stand_ins``: weights left out on purpose (``stand_ins.weights_left_out``) are allowed.
    """
    for tensor in all_tensors(proto):
        if external_data_helper.uses_external_data(tensor) and not (stand_ins and is_stand_in(tensor)):
            raise ModelLoadError(
                f"{where}: tensor {tensor.name!r} keeps its data in the external file "
                f"{_external_location(tensor)!r}, which a model held in memory has no folder to read from; "
                f"load the model from its path instead"
            )


def save(
    model: onnx.ModelProto | Exportable,
    path: str | os.PathLike,
    *,
    external_data: bool | None = None,
    runtime_compatible: bool = True,
) -> Path:
    """Write a model atomically, readable by the installed onnxruntime.

    ``external_data=None`` writes tensors to ``<name>.data`` beside the model only when the
    model would not fit in one protobuf (2 GiB); True forces it, False forbids it. The
    caller's model is not modified. Either both files are replaced, or neither is.
    ``runtime_compatible=False`` keeps the IR version and opsets as they are (for a file
    that only onnx's own tools read).
    """
    proto = model if isinstance(model, onnx.ModelProto) else model.to_proto()
    path = Path(path)
    if not path.parent.is_dir():
        what = "is not a folder" if path.parent.exists() else "does not exist"
        raise ModelSaveError(f"{path}: folder {path.parent} {what}")
    for tensor in all_tensors(proto):
        if external_data_helper.uses_external_data(tensor):
            raise ModelSaveError(
                f"{path}: tensor {tensor.name!r} still refers to external data ({_external_location(tensor)!r}); "
                f"load the model with its external data before saving it"
            )
    # A model that needs no change is written as it is (a copy would copy its weights), and
    # serializing it measures it: ByteSize() would serialize it a second time, just to measure.
    serialized = None
    if external_data is not True and (not runtime_compatible or is_runtime_compatible(proto)):
        serialized = serialized_within_limit(proto)
    if serialized is not None:
        to_external, out, payload_sources, runtime_compatible = False, proto, {}, False
    else:
        over_limit = exceeds_protobuf_limit(proto)
        if external_data is False and over_limit:
            raise ModelSaveError(f"{path}: the model is over 2 GiB and must be saved with external data")
        to_external = over_limit if external_data is None else external_data
        # Moving tensors to external data rewrites them in place: work on a copy. One that will
        # go to the data file leaves the large payloads out, to be read from the caller's model.
        if to_external:
            out, payload_sources = _copy_leaving_out_payloads(proto)
        else:
            out, payload_sources = onnx.ModelProto(), {}
            out.CopyFrom(proto)
    data_name = path.name + ".data"
    data_path = path.parent / data_name
    try:
        with temp_folder_beside(path) as tmp_dir:  # locked: a later run's remove_stale knows it is ours
            tmp_model, tmp_data, backup = tmp_dir / path.name, tmp_dir / data_name, tmp_dir / "previous.data"
            if to_external:
                _move_tensors_to_file(out, tmp_data, location=data_name, sources=payload_sources)
            # after moving the tensors out: onnx's version converter cannot take a model over 2 GiB
            if runtime_compatible:
                make_runtime_compatible(out)
            tmp_model.write_bytes(out.SerializeToString() if serialized is None else serialized)
            del serialized
            if not tmp_data.exists():
                move_into_place(tmp_model, path)
                return path
            if data_path.exists():
                _link_or_copy(data_path, backup)
            move_into_place(tmp_data, data_path)
            try:
                move_into_place(tmp_model, path)
            except OSError:
                if backup.exists():
                    os.replace(backup, data_path)
                else:
                    data_path.unlink()
                raise
    except ModelSaveError as exc:
        raise ModelSaveError(f"{path}: {exc}") from None
    except (OSError, ValueError, EncodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else one_line(exc)
        raise ModelSaveError(f"{path}: cannot write ({reason})") from None
    return path


def _copy_leaving_out_payloads(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[int, onnx.TensorProto]]:
    """A copy of ``proto`` without the raw_data of its large main-graph initializers, and
    for each of those (by position) the caller's tensor that still holds it.

    Copying a >2 GiB model whole just to move its weights out would hold them twice.
    """
    out = copy_without_initializers(proto)
    sources: dict[int, onnx.TensorProto] = {}
    for index, tensor in enumerate(proto.graph.initializer):
        copy = out.graph.initializer.add()
        if raw_data_size(tensor) >= EXTERNAL_DATA_THRESHOLD:
            copy_fields(tensor, copy, "raw_data")
            sources[index] = tensor
        else:
            copy.CopyFrom(tensor)
    return out, sources


def _move_tensors_to_file(
    proto: onnx.ModelProto,
    data_file: Path,
    *,
    location: str,
    sources: dict[int, onnx.TensorProto] | None = None,
) -> None:
    """Write every initializer of at least EXTERNAL_DATA_THRESHOLD bytes to ``data_file``
    and point the tensor at it (``location``, relative to the model's folder). ``sources``
    maps main-graph initializers, by position, to the tensor that holds their payload.

    onnx's own helpers test the location against the current directory and skip tensors
    kept in typed fields (float_data, ...), so this writes the file itself; each tensor's
    payload is copied out of the protobuf once, and offsets are page aligned for mmap.
    """
    sources = sources or {}
    with open(data_file, "wb") as f:
        # the main graph's initializers come first, in order, then those of subgraphs
        for position, tensor in enumerate(external_data_helper._get_initializer_tensors(proto)):
            if tensor.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
                continue
            source = sources.get(position)
            if source is not None:
                payload = source.raw_data
            elif tensor.HasField("raw_data"):
                payload = tensor.raw_data
                if len(payload) < EXTERNAL_DATA_THRESHOLD:
                    continue
            else:  # typed fields hold little-endian values once written raw: from_array does that
                payload = numpy_helper.from_array(numpy_helper.to_array(tensor)).raw_data
                if len(payload) < EXTERNAL_DATA_THRESHOLD:
                    continue
            offset = -f.tell() % 4096 + f.tell()
            f.seek(offset)
            f.write(payload)
            del payload
            for data_field in TENSOR_DATA_FIELDS:
                tensor.ClearField(data_field)
            tensor.data_location = onnx.TensorProto.EXTERNAL
            length = f.tell() - offset
            for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
                tensor.external_data.add(key=key, value=value)
        if f.tell() == 0:
            f.close()
            data_file.unlink()


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
