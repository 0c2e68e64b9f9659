"""Small models, data and configs for the training tests, all written into a test's tmp folder.

The model is built with onnx.helper (no torch): ``x`` float32 [batch, 4] → Gemm 4→8 → Tanh →
Gemm 8→3 → ``logits``; the labels are a fixed linear function's argmax, so it learns quickly.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
from _tracebacks import assert_no_traceback
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parent.parent.parent
GRAPHFORGE = Path(sys.executable).parent / "graphforge"
N_IN, HIDDEN, CLASSES = 4, 8, 3
PIPELINE = "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=0.05)"


def classifier(path: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.uniform(-0.5, 0.5, (HIDDEN, N_IN)).astype(np.float32), "fc1.weight"),
        numpy_helper.from_array(rng.uniform(-0.5, 0.5, HIDDEN).astype(np.float32), "fc1.bias"),
        numpy_helper.from_array(rng.uniform(-0.5, 0.5, (CLASSES, HIDDEN)).astype(np.float32), "fc2.weight"),
        numpy_helper.from_array(rng.uniform(-0.5, 0.5, CLASSES).astype(np.float32), "fc2.bias"),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "fc1.weight", "fc1.bias"], ["h_pre"], transB=1),
        helper.make_node("Tanh", ["h_pre"], ["h"]),
        helper.make_node("Gemm", ["h", "fc2.weight", "fc2.bias"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", N_IN])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def with_dropout(folder: Path, ratio: float = 0.3) -> Path:
    """``folder``'s model.onnx (the classifier) with Dropout(ratio, training) after the hidden layer."""
    model = onnx.load(folder / "model.onnx")
    graph = model.graph
    tanh = next(n for n in graph.node if n.op_type == "Tanh")
    tanh.output[0] = "h_full"
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.array(ratio, np.float32), "ratio"),
            numpy_helper.from_array(np.array(True), "train"),
        ]
    )
    graph.node.insert(
        list(graph.node).index(tanh) + 1, helper.make_node("Dropout", ["h_full", "ratio", "train"], ["h"])
    )
    onnx.save(model, folder / "model.onnx")
    return folder


def samples(count: int, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mixing = np.random.default_rng(99).standard_normal((N_IN, CLASSES))
    if np.issubdtype(dtype, np.integer):
        x = rng.integers(0, 16, (count, N_IN)).astype(dtype)
        labels = np.argmax((x.astype(np.float64) - 7.5) @ mixing, axis=1)
    else:
        x = rng.standard_normal((count, N_IN)).astype(dtype)
        labels = np.argmax(x.astype(np.float64) @ mixing, axis=1)
    return {"x": x, "labels": labels.astype(np.int64)}


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | Path):
        return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(value)


def toml(document: dict) -> str:
    """A TOML text for a config dict: top-level keys, then one [table] per section."""
    lines = [f"{k} = {toml_value(v)}" for k, v in document.items() if not isinstance(v, dict)]
    for name, table in document.items():
        if isinstance(table, dict):
            lines += ["", f"[{name}]", *(f"{k} = {toml_value(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"


def workspace(folder: Path, *, count: int = 48, eval_count: int = 20, dtype=np.float32) -> Path:
    """model.onnx, train.npz and eval.npz in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    classifier(folder / "model.onnx")
    np.savez(folder / "train.npz", **samples(count, seed=1, dtype=dtype))
    np.savez(folder / "eval.npz", **samples(eval_count, seed=2, dtype=dtype))
    return folder


def base_config(**sections) -> dict:
    """A config dict (model, data, train, log); ``sections`` update or add sections (None removes
    a section, or a key inside one)."""
    document = {
        "model": {"path": "model.onnx", "pipeline": PIPELINE},
        "data": {"train": "train.npz", "eval": "eval.npz", "batch_size": 8, "seed": 3},
        "train": {"steps": 12},
        "log": {"every": 2},
    }
    for name, table in sections.items():
        if table is None:
            document.pop(name, None)
        elif isinstance(table, dict) and isinstance(document.get(name), dict):
            merged = {**document[name], **table}
            document[name] = {k: v for k, v in merged.items() if v is not None}  # a None value removes a key
        else:
            document[name] = table
    return document


def write_config(folder: Path, document: dict, name: str = "train.toml") -> Path:
    path = folder / name
    path.write_text(toml(document))
    return path


def env() -> dict[str, str]:
    environment = dict(os.environ)
    environment.pop("PYTHONPATH", None)
    environment["GRAPHFORGE_PROVIDERS"] = "cpu"
    environment["COLUMNS"] = "200"
    return environment


def cli(*args, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(GRAPHFORGE), *map(str, args)], cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout
    )


def cli_many(runs: dict[str, tuple[list, Path]], timeout: int = 120) -> dict[str, subprocess.CompletedProcess]:
    """Several graphforge processes at once (each pays the import time; 2 cores run them in parallel)."""
    started = {
        key: subprocess.Popen(
            [str(GRAPHFORGE), *map(str, args)],
            cwd=cwd,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for key, (args, cwd) in runs.items()
    }
    done = {}
    for key, proc in started.items():
        stdout, stderr = proc.communicate(timeout=timeout)
        done[key] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return done


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str, status: int = 2) -> str:
    """Exit ``status``, exactly one line on stderr holding every fragment, no traceback."""
    assert proc.returncode == status, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert_no_traceback(proc.stderr + proc.stdout)
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def read_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a TensorBoard folder's event files: tag -> [(step, value)], file by file.

    Event files are TFRecord files: per record a little-endian uint64 length, its masked
    CRC32C (uint32), the serialized Event, and the data's masked CRC32C."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for file in sorted(folder.glob("events.out.tfevents.*")):
        data, pos = file.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            pos += 12
            event = event_pb2.Event.FromString(data[pos : pos + length])
            pos += length + 4
            for value in event.summary.value:
                scalars[value.tag].append((event.step, value.simple_value))
    return dict(scalars)
