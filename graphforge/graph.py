"""Model I/O in one place: load, save, and the Model that passes work on.

Every path in and out of graphforge goes through here so that three rules hold everywhere:
the IR version and opset written are ones the installed onnxruntime reads, external data
never escapes the model's folder, and a save is atomic (temp file + rename).
"""

from __future__ import annotations

import functools
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs
from google.protobuf.message import DecodeError
from onnx import external_data_helper

from graphforge.errors import ModelLoadError, ModelSaveError

#: protobuf refuses to serialize a message of 2 GiB or more
PROTOBUF_LIMIT = 2**31 - 1
#: tensors at least this large go to the external data file when one is written
EXTERNAL_DATA_THRESHOLD = 1024

ModelSource = str | os.PathLike | bytes | onnx.ModelProto


@dataclass
class Model:
    """A model as passes see it: an onnx-graphsurgeon graph plus the model-level fields
    graphsurgeon does not keep (metadata_props, model doc string, domain, version).

    The metadata is where passes record roles (parameters, gradients, loss, ...), so one
    `.onnx` file stays a complete artifact.
    """

    graph: gs.Graph
    metadata: dict[str, str] = field(default_factory=dict)
    doc_string: str = ""
    domain: str = ""
    model_version: int = 0

    @classmethod
    def from_proto(cls, proto: onnx.ModelProto) -> Model:
        return cls(
            graph=gs.import_onnx(proto),
            metadata={p.key: p.value for p in proto.metadata_props},
            doc_string=proto.doc_string,
            domain=proto.domain,
            model_version=proto.model_version,
        )

    def to_proto(self) -> onnx.ModelProto:
        proto = gs.export_onnx(self.graph, do_type_check=False)
        del proto.metadata_props[:]
        for key in sorted(self.metadata):
            proto.metadata_props.add(key=key, value=self.metadata[key])
        proto.doc_string = self.doc_string
        proto.domain = self.domain
        proto.model_version = self.model_version
        return proto

    def copy(self) -> Model:
        return Model(self.graph.copy(), dict(self.metadata), self.doc_string, self.domain, self.model_version)


# --------------------------------------------------------------------------- loading


def load(source: ModelSource, *, load_external_data: bool = True) -> onnx.ModelProto:
    """Load a model from a path, bytes or a ModelProto (returned as a copy).

    External data is read from the model's folder; a location that escapes that folder
    (absolute, or with ``..``) is refused before anything is read.
    """
    if isinstance(source, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(source)
        return _checked(proto, "<ModelProto>")
    if isinstance(source, bytes | bytearray):
        return _checked(_parse(bytes(source), "<bytes>"), "<bytes>")
    path = Path(source)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file")
    if path.is_dir():
        raise ModelLoadError(f"{path}: is a folder, expected an .onnx file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read ({exc.strerror})") from None
    proto = _checked(_parse(data, str(path)), str(path))
    check_external_data_locations(proto, path.parent, where=str(path))
    if load_external_data and _uses_external_data(proto):
        try:
            external_data_helper.load_external_data_for_model(proto, str(path.parent))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: cannot read its external data ({exc})") from None
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
    return any(external_data_helper.uses_external_data(t) for t in _all_tensors(proto))


def _all_tensors(proto: onnx.ModelProto):
    return external_data_helper._get_all_tensors(proto)


def check_external_data_locations(proto: onnx.ModelProto, base_dir: Path, *, where: str) -> None:
    """Refuse external data that would be read from outside the model's folder."""
    base = base_dir.resolve()
    for tensor in _all_tensors(proto):
        if not external_data_helper.uses_external_data(tensor):
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        target = (base / location).resolve()
        if not location or os.path.isabs(location) or not target.is_relative_to(base):
            raise ModelLoadError(
                f"{where}: tensor {tensor.name!r} stores its data at {location!r}, outside the model's "
                f"folder {base}; refusing to read it"
            )


# --------------------------------------------------------------------------- runtime compatibility


@functools.cache
def runtime_limits() -> tuple[int, int]:
    """(max IR version, max ai.onnx opset) that the installed onnxruntime loads.

    Probed once with tiny models instead of a version table, so a newer or older
    onnxruntime is handled without an edit here.
    """
    import onnxruntime as ort
    from onnx import helper

    def loads(ir: int, opset: int) -> bool:
        graph = helper.make_graph(
            [helper.make_node("Identity", ["x"], ["y"])],
            "probe",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = ir
        options = ort.SessionOptions()
        options.log_severity_level = 4
        try:
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception:
            return False
        return True

    ir = next(v for v in range(onnx.IR_VERSION, 2, -1) if loads(v, 13))
    opset = next(v for v in range(onnx.defs.onnx_opset_version(), 6, -1) if loads(ir, v))
    return ir, opset


def make_runtime_compatible(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Lower the IR version, and the ai.onnx opset if needed, to what onnxruntime reads.

    Mutates and returns ``proto``. Lowering the IR version only relabels the file (the
    newer IR versions add data types, which a model using them keeps); lowering the
    opset goes through onnx's version converter, and fails loudly if that cannot be done.
    """
    max_ir, max_opset = runtime_limits()
    if proto.ir_version > max_ir:
        proto.ir_version = max_ir
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is not None and opset > max_opset:
        from onnx import version_converter

        try:
            converted = version_converter.convert_version(proto, max_opset)
        except Exception as exc:
            raise ModelSaveError(
                f"the model uses ai.onnx opset {opset}, onnxruntime reads at most {max_opset}, "
                f"and converting it failed: {exc}"
            ) from None
        converted.ir_version = min(converted.ir_version, max_ir)
        proto.CopyFrom(converted)
    return proto


# --------------------------------------------------------------------------- saving


def save(
    model: onnx.ModelProto | Model,
    path: str | os.PathLike,
    *,
    external_data: bool | None = None,
) -> Path:
    """Write a model atomically, readable by the installed onnxruntime.

    ``external_data=None`` writes tensors to ``<name>.data`` beside the model only when the
    model would not fit in one protobuf (2 GiB); True forces it, False forbids it. The
    caller's model is not modified. Either both files are replaced, or neither is.
    """
    proto = model.to_proto() if isinstance(model, Model) else model
    path = Path(path)
    if not path.parent.exists():
        raise ModelSaveError(f"{path}: folder {path.parent} does not exist")
    over_limit = proto.ByteSize() > PROTOBUF_LIMIT
    if external_data is False and over_limit:
        raise ModelSaveError(f"{path}: the model is over 2 GiB and must be saved with external data")
    too_big = over_limit if external_data is None else external_data
    # Converting to external data rewrites tensors in place: work on a copy.
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    make_runtime_compatible(out)
    data_name = path.name + ".data"
    tmp_dir = Path(tempfile.mkdtemp(prefix=".graphforge-save-", dir=path.parent))
    try:
        tmp_model = tmp_dir / path.name
        if too_big:
            external_data_helper.convert_model_to_external_data(
                out, all_tensors_to_one_file=True, location=data_name, size_threshold=EXTERNAL_DATA_THRESHOLD
            )
            external_data_helper.write_external_data_tensors(out, str(tmp_dir))
        tmp_model.write_bytes(out.SerializeToString())
        if too_big:
            os.replace(tmp_dir / data_name, path.parent / data_name)
        os.replace(tmp_model, path)
    except OSError as exc:
        raise ModelSaveError(f"{path}: cannot write ({exc.strerror or exc})") from None
    finally:
        for leftover in tmp_dir.iterdir():
            leftover.unlink()
        tmp_dir.rmdir()
    return path
