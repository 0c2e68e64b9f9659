"""The golden folder on disk: reading it (refusing anything malformed with one clear line)
and writing expectations deterministically.

::

    golden_models/
      expected_failures.json          the expected-failure table (optional)
      <model>/model.onnx              ONNX test-directory layout, written by build.py
      <model>/test_data_set_N/input_i.pb, output_i.pb, extra_input_i.pb
      <model>/golden.json             pipelines and tolerances, written by hand
      <model>/expected/<pipeline>.json            structure + value index (readable, diffable)
      <model>/expected/<pipeline>.npz             the values (deterministic zip of .npy)
      <model>/expected/<pipeline>.graph.onnx.gz   the compiled graph, large float weights zeroed

Only ``graphforge golden update`` writes ``expected/``.
"""

from __future__ import annotations

import fnmatch
import gzip
import io
import json
import math
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from graphforge.digests import sha256_bytes
from graphforge.errors import GraphforgeError, InvalidModelError, ModelLoadError
from graphforge.golden.fingerprint import graph_inputs, iter_float_initializers
from graphforge.model_io import load
from graphforge.tempfiles import write_atomically
from graphforge.verify import verify_model

EXPECTATION_FORMAT = "graphforge-golden/1"
CONFIG_FILE = "golden.json"
XFAIL_FILE = "expected_failures.json"
EXPECTED_DIR = "expected"
#: the built-in case that runs the shipped model.onnx against its ONNX test data
TEST_DATA = "test_data"
#: the stage every pipeline runs: the compiled program's outputs on every test data set
RUN = "run"
#: float initializers with more elements than this are zeroed in the stored graph (the
#: graph is kept for structural diffs; the shipped model.onnx holds the real weights)
ZEROED_OVER = 16
_PIPELINE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_DEFAULT_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


class GoldenError(GraphforgeError):
    """The golden folder is missing or malformed (bad input: the CLI exits 2)."""


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float

    def __str__(self) -> str:
        return f"rtol={self.rtol:g}, atol={self.atol:g}"


@dataclass(frozen=True)
class ToleranceRule:
    """One entry of ``tolerances``: globs on the pipeline id, the stage and the value name."""

    tolerance: Tolerance
    pipeline: str = "*"
    stage: str = "*"
    output: str = "*"

    def matches(self, pipeline: str, stage: str, name: str) -> bool:
        return (
            fnmatch.fnmatchcase(pipeline, self.pipeline)
            and fnmatch.fnmatchcase(stage, self.stage)
            and fnmatch.fnmatchcase(name, self.output)
        )


@dataclass(frozen=True)
class PipelineSpec:
    id: str
    text: str
    stages: tuple[str, ...] = (RUN,)


@dataclass
class ModelConfig:
    """``<model>/golden.json``::

    {
      "description": "what the model is for",
      "pipelines": {
        "cleanup": "identity_elimination, fold_constants, cse, dce, topo_sort",
        "train": {"pipeline": "loss(kind=cross_entropy, output=logits), autodiff", "stages": ["run"]}
      },
      "tolerance": {"rtol": 1e-5, "atol": 1e-6},
      "tolerances": [
        {"output": "*_grad", "rtol": 1e-4, "atol": 1e-6},
        {"pipeline": "test_data", "output": "logits", "rtol": 1e-4, "atol": 1e-5}
      ]
    }

    ``tolerance`` is the model's default; the first ``tolerances`` entry whose globs match
    (``pipeline``, ``stage``, ``output``; each ``*`` when left out) wins. ``test_data`` is
    the pipeline id of the shipped model run against its ONNX test data.
    """

    description: str
    pipelines: dict[str, PipelineSpec]
    default: Tolerance
    rules: list[ToleranceRule]

    def tolerance(self, pipeline: str, stage: str, name: str) -> Tolerance:
        return next((r.tolerance for r in self.rules if r.matches(pipeline, stage, name)), self.default)


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GoldenError(f"{path}: no such file ({what})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise GoldenError(f"{path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    except json.JSONDecodeError as exc:
        raise GoldenError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None


def _expect(condition: bool, path: Path, message: str) -> None:
    if not condition:
        raise GoldenError(f"{path}: {message}")


def _tolerance(value: Any, path: Path, where: str) -> Tolerance:
    _expect(isinstance(value, dict), path, f"{where} must be an object with rtol and atol")
    numbers = {}
    for key in ("rtol", "atol"):
        number = value.get(key, _DEFAULT_TOLERANCE[key])
        ok = isinstance(number, int | float) and not isinstance(number, bool) and math.isfinite(number) and number >= 0
        _expect(ok, path, f"{where}.{key} must be a number ≥ 0, got {number!r}")
        numbers[key] = float(number)
    return Tolerance(**numbers)


def read_config(path: Path) -> ModelConfig:
    data = _read_json(path, "every golden model folder needs one: its pipelines and tolerances")
    _expect(isinstance(data, dict), path, "must hold a JSON object")
    unknown = set(data) - {"description", "pipelines", "tolerance", "tolerances"}
    _expect(not unknown, path, f"unknown key(s) {', '.join(sorted(unknown))}")
    pipelines_raw = data.get("pipelines", {})
    _expect(isinstance(pipelines_raw, dict), path, "pipelines must be an object: id -> pipeline text")
    pipelines = {}
    for pid, spec in pipelines_raw.items():
        _expect(bool(_PIPELINE_ID.fullmatch(pid)), path, f"pipeline id {pid!r} must be letters, digits, _ . -")
        _expect(pid != TEST_DATA, path, f"pipeline id {TEST_DATA!r} is reserved for the shipped model's test data")
        if isinstance(spec, str):
            spec = {"pipeline": spec}
        _expect(isinstance(spec, dict), path, f"pipeline {pid!r} must be text or an object")
        text, stages = spec.get("pipeline"), spec.get("stages", [RUN])
        _expect(isinstance(text, str) and bool(text.strip()), path, f"pipeline {pid!r} has no pipeline text")
        _expect(
            isinstance(stages, list) and bool(stages) and all(isinstance(s, str) for s in stages),
            path,
            f"pipeline {pid!r}: stages must be a list of stage names",
        )
        pipelines[pid] = PipelineSpec(pid, text, tuple(stages))
    default = _tolerance(data.get("tolerance", _DEFAULT_TOLERANCE), path, "tolerance")
    rules_raw = data.get("tolerances", [])
    _expect(isinstance(rules_raw, list), path, "tolerances must be a list")
    rules = []
    for i, raw in enumerate(rules_raw):
        where = f"tolerances[{i}]"
        _expect(isinstance(raw, dict), path, f"{where} must be an object")
        extra = set(raw) - {"pipeline", "stage", "output", "rtol", "atol"}
        _expect(not extra, path, f"{where} has unknown key(s) {', '.join(sorted(extra))}")
        globs = {k: raw.get(k, "*") for k in ("pipeline", "stage", "output")}
        _expect(all(isinstance(g, str) for g in globs.values()), path, f"{where}: pipeline, stage, output are globs")
        rules.append(ToleranceRule(_tolerance(raw, path, where), **globs))
    description = data.get("description", "")
    _expect(isinstance(description, str), path, "description must be text")
    return ModelConfig(description, pipelines, default, rules)


# --------------------------------------------------------------------------- test data


@dataclass
class TestDataSet:
    """One ``test_data_set_N``: inputs and outputs by graph name, in graph order, and extra feeds."""

    index: int
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    extra: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"test_data_set_{self.index}"

    def feed(self, name: str) -> np.ndarray | None:
        return self.inputs[name] if name in self.inputs else self.extra.get(name)


def _numbered(folder: Path, prefix: str) -> list[Path]:
    found = {}
    for path in folder.glob(f"{prefix}_*.pb"):
        suffix = path.stem.removeprefix(prefix + "_")
        if suffix.isdigit():
            found[int(suffix)] = path
    missing = [i for i in range(len(found)) if i not in found]
    _expect(not missing, folder, f"{prefix}_{missing[0] if missing else 0}.pb is missing (files are numbered from 0)")
    return [found[i] for i in range(len(found))]


def read_tensor(path: Path) -> tuple[str, np.ndarray]:
    tensor = onnx.TensorProto()
    try:
        tensor.ParseFromString(path.read_bytes())
        array = numpy_helper.to_array(tensor)
    except OSError as exc:
        raise GoldenError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (DecodeError, ValueError, TypeError, RuntimeError) as exc:
        raise GoldenError(f"{path}: not a TensorProto ({type(exc).__name__}: {exc})") from None
    _expect(int(np.prod(tensor.dims, dtype=np.int64)) == array.size, path, "not a TensorProto (no data for its dims)")
    return tensor.name, array


def _named(paths: list[Path], names: list[str], folder: Path, what: str) -> dict[str, np.ndarray]:
    _expect(len(paths) == len(names), folder, f"holds {len(paths)} {what} file(s), the model has {len(names)} {what}s")
    arrays = {}
    for i, (path, graph_name) in enumerate(zip(paths, names, strict=True)):
        name, array = read_tensor(path)
        _expect(name in ("", graph_name), path, f"is named {name!r}, but the model's {what} {i} is {graph_name!r}")
        arrays[graph_name] = array
    return arrays


def read_test_sets(folder: Path, model: onnx.ModelProto) -> list[TestDataSet]:
    input_names = [v.name for v in graph_inputs(model.graph)]
    output_names = [v.name for v in model.graph.output]
    sets = []
    numbered = {}
    for path in folder.glob("test_data_set_*"):
        suffix = path.name.removeprefix("test_data_set_")
        if path.is_dir() and suffix.isdigit():
            numbered[int(suffix)] = path
    for index in sorted(numbered):
        data = numbered[index]
        inputs = _named(_numbered(data, "input"), input_names, data, "input")
        outputs = _named(_numbered(data, "output"), output_names, data, "output")
        extra = {}
        for path in _numbered(data, "extra_input"):
            name, array = read_tensor(path)
            _expect(bool(name), path, "an extra input must carry the name of the input it feeds")
            extra[name] = array
        sets.append(TestDataSet(index, inputs, outputs, extra))
    return sets


# --------------------------------------------------------------------------- a model folder


@dataclass
class GoldenModel:
    name: str
    folder: Path
    config: ModelConfig
    model: onnx.ModelProto
    test_sets: list[TestDataSet]

    @property
    def expected_dir(self) -> Path:
        return self.folder / EXPECTED_DIR

    def expectation_ids(self) -> list[str]:
        """Pipeline ids that have an expectation file, recorded or stale."""
        if not self.expected_dir.is_dir():
            return []
        return sorted(p.name.removesuffix(".json") for p in self.expected_dir.glob("*.json"))


def read_model(folder: Path) -> GoldenModel:
    config = read_config(folder / CONFIG_FILE)
    try:
        model = load(folder / "model.onnx")
        verify_model(model, where=str(folder / "model.onnx"))
    except (ModelLoadError, InvalidModelError) as exc:
        raise GoldenError(str(exc)) from None
    test_sets = read_test_sets(folder, model)
    _expect(bool(test_sets), folder, "has no test_data_set_N folder (build it with golden_models/build.py)")
    return GoldenModel(folder.name, folder, config, model, test_sets)


@dataclass(frozen=True)
class ExpectedFailure:
    model: str
    pipeline: str
    reason: str


def read_expected_failures(path: Path) -> list[ExpectedFailure]:
    """``expected_failures.json``: ``{"expected_failures": [{"model", "pipeline", "reason"}, ...]}``."""
    if not path.exists():
        return []
    data = _read_json(path, "the expected-failure table")
    entries = data.get("expected_failures") if isinstance(data, dict) else None
    _expect(isinstance(entries, list), path, 'must hold {"expected_failures": [{"model", "pipeline", "reason"}, ...]}')
    table, seen = [], set()
    for i, entry in enumerate(entries):
        ok = isinstance(entry, dict) and set(entry) == {"model", "pipeline", "reason"}
        ok = ok and all(isinstance(entry[k], str) and entry[k].strip() for k in entry)
        _expect(ok, path, f"entry {i} must have exactly model, pipeline and reason, each non-empty text")
        key = (entry["model"], entry["pipeline"])
        _expect(key not in seen, path, f"entry {i} repeats {entry['model']} / {entry['pipeline']}")
        seen.add(key)
        table.append(ExpectedFailure(entry["model"], entry["pipeline"], entry["reason"]))
    return table


# --------------------------------------------------------------------------- expectations


@dataclass
class Value:
    """One recorded value: the output ``name`` of stage ``stage`` on test data set ``set``."""

    stage: str
    set: int
    name: str
    array: np.ndarray

    @property
    def key(self) -> str:
        return f"{self.stage}/{self.set}/{self.name}"

    def describe(self) -> str:
        where = f"test_data_set_{self.set}"
        return f"output {self.name!r} ({where})" if self.stage == RUN else f"{self.stage} {self.name!r} ({where})"


@dataclass
class Expectation:
    """What one pipeline must produce from one golden model.

    ``values`` is open to more stages: ``run`` (the compiled program's outputs: forward
    outputs, loss, gradients) is the one this format starts with; a training stage
    (parameters after N optimizer steps) and an inference-export stage (the pruned model's
    outputs) record their values the same way, under their own stage names.
    """

    model: str
    pipeline: str
    pipeline_text: str
    stages: tuple[str, ...]
    structure: dict
    values: list[Value]
    graph: onnx.ModelProto | None = None


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, data)


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An .npz (numpy.load reads it) whose bytes depend only on the arrays: fixed timestamps."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for key, array in arrays.items():
            member = io.BytesIO()
            np.lib.format.write_array(member, np.asarray(array).copy(order="C"), allow_pickle=False)
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            archive.writestr(info, member.getvalue())
    return buffer.getvalue()


def skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every float initializer over ZEROED_OVER elements zeroed: the graph,
    small constants and weight shapes stay, for structural diffs, and compresses to little."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for tensor in iter_float_initializers(out):
        if int(np.prod(tensor.dims, dtype=np.int64)) > ZEROED_OVER:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
            zeroed = numpy_helper.from_array(np.zeros(tuple(tensor.dims), dtype), tensor.name)
            tensor.CopyFrom(zeroed)
    return out


def expectation_paths(folder: Path, pipeline: str) -> tuple[Path, Path, Path]:
    base = folder / EXPECTED_DIR
    return base / f"{pipeline}.json", base / f"{pipeline}.npz", base / f"{pipeline}.graph.onnx.gz"


def write_expectation(folder: Path, expectation: Expectation) -> None:
    """Write the three files; values and graph first, the JSON that names their digests last."""
    json_path, npz_path, graph_path = expectation_paths(folder, expectation.pipeline)
    values = npz_bytes({v.key: v.array for v in expectation.values})
    graph = b""
    if expectation.graph is not None:
        graph = gzip.compress(skeleton(expectation.graph).SerializeToString(deterministic=True), mtime=0)
    document = {
        "format": EXPECTATION_FORMAT,
        "model": expectation.model,
        "pipeline": expectation.pipeline,
        "pipeline_text": expectation.pipeline_text,
        "stages": list(expectation.stages),
        "structure": expectation.structure,
        "values_file": npz_path.name,
        "values_sha256": sha256_bytes(values),
        "graph_file": graph_path.name if graph else None,
        "graph_sha256": sha256_bytes(graph) if graph else None,
        "values": [
            {"stage": v.stage, "set": v.set, "name": v.name, "dtype": v.array.dtype.name, "shape": list(v.array.shape)}
            for v in expectation.values
        ],
    }
    _atomic_write(npz_path, values)
    if graph:
        _atomic_write(graph_path, graph)
    else:
        graph_path.unlink(missing_ok=True)
    _atomic_write(json_path, (format_json(document) + "\n").encode())


def _scalar(value: Any) -> bool:
    return not isinstance(value, dict | list)


def _inline(value: Any, in_list: bool) -> bool:
    if _scalar(value) or (isinstance(value, list) and all(map(_scalar, value))):
        return True
    if isinstance(value, dict) and in_list:  # a list entry on one line: one line per value in a diff
        return all(_scalar(v) or (isinstance(v, list) and all(map(_scalar, v))) for v in value.values())
    return False


def format_json(value: Any, depth: int = 0, in_list: bool = False) -> str:
    """JSON indented for reading and for line diffs: objects one key per line, lists of
    scalars (shapes) and flat list entries (signatures, value records) on one line."""
    if _inline(value, in_list):
        return json.dumps(value, ensure_ascii=False)
    pad, end = "  " * (depth + 1), "  " * depth
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(k, ensure_ascii=False)}: {format_json(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + end + "}" if items else "{}"
    items = [pad + format_json(v, depth + 1, in_list=True) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + end + "]" if items else "[]"


def remove_expectation(folder: Path, pipeline: str) -> None:
    for path in expectation_paths(folder, pipeline):
        path.unlink(missing_ok=True)


def _read_bytes(path: Path, digest: str, json_path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise GoldenError(f"{path}: no such file (named by {json_path.name})") from None
    except OSError as exc:
        raise GoldenError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if sha256_bytes(data) != digest:
        raise GoldenError(
            f"{path}: its contents do not match the sha256 that {json_path.name} records "
            "(a damaged file or a half-merged update; rerun graphforge golden update)"
        )
    return data


def read_expectation(folder: Path, pipeline: str) -> Expectation | None:
    """The expectation of ``pipeline``, or None when none is recorded; GoldenError when damaged."""
    json_path, npz_path, graph_path = expectation_paths(folder, pipeline)
    if not json_path.exists():
        return None
    doc = _read_json(json_path, "an expectation")
    _expect(isinstance(doc, dict), json_path, "must hold a JSON object")
    _expect(
        doc.get("format") == EXPECTATION_FORMAT,
        json_path,
        f"unknown format {doc.get('format')!r} (this graphforge reads {EXPECTATION_FORMAT!r})",
    )
    required = ("pipeline", "pipeline_text", "stages", "structure", "values_sha256", "values")
    missing = [k for k in required if k not in doc]
    _expect(not missing, json_path, f"lacks {', '.join(missing)}")
    _expect(doc["pipeline"] == pipeline, json_path, f"records pipeline {doc['pipeline']!r}, not {pipeline!r}")
    structure = doc["structure"]
    keys = ("nodes", "op_histogram", "fingerprint", "inputs", "outputs", "metadata")
    _expect(isinstance(structure, dict) and all(k in structure for k in keys), json_path, "structure is incomplete")
    _expect(isinstance(doc["values"], list), json_path, "values must be a list")

    data = _read_bytes(npz_path, doc["values_sha256"], json_path)
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise GoldenError(f"{npz_path}: not a readable .npz ({exc})") from None
    values = []
    for i, entry in enumerate(doc["values"]):
        ok = isinstance(entry, dict) and {"stage", "set", "name", "dtype", "shape"} <= set(entry)
        _expect(ok, json_path, f"values[{i}] must have stage, set, name, dtype and shape")
        value = Value(entry["stage"], entry["set"], entry["name"], np.empty(0))
        _expect(value.key in arrays, npz_path, f"has no array {value.key!r}, which {json_path.name} lists")
        value.array = arrays[value.key]
        recorded = (value.array.dtype.name, list(value.array.shape))
        _expect(
            recorded == (entry["dtype"], entry["shape"]),
            npz_path,
            f"array {value.key!r} is {recorded[0]} {recorded[1]}, {json_path.name} says {entry['dtype']} {entry['shape']}",
        )
        values.append(value)

    graph = None
    if doc.get("graph_file"):
        raw = _read_bytes(graph_path, doc.get("graph_sha256") or "", json_path)
        graph = onnx.ModelProto()
        try:
            graph.ParseFromString(gzip.decompress(raw))
        except (OSError, EOFError, DecodeError) as exc:
            raise GoldenError(f"{graph_path}: not a gzipped ONNX model ({exc})") from None
    return Expectation(
        doc.get("model", folder.name),
        pipeline,
        doc["pipeline_text"],
        tuple(doc["stages"]),
        structure,
        values,
        graph,
    )
