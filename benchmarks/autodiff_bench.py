"""Autodiff benchmark: graphforge's gradient builder beside onnxruntime-training's generate_artifacts.

Models, each with one scalar output ``loss``:

* synthetic ladders of 1k, 10k and 100k nodes: ten ops per layer (MatMul, Add, Tanh, Sigmoid,
  Mul, a residual Add, a Sub reaching two layers back, Relu, Mul, Add) over eight shared
  parameter pairs, so tensors have several readers and parameters many;
* GPT-2 small (12 layers, 768 wide, random weights from ``transformers.GPT2Config``) with its
  cross-entropy loss, exported once by TorchScript (``dynamo=False``,
  ``do_constant_folding=False``, an all-ones attention mask) and cached under the temp dir.

Measured, each the median of N runs with ``time.perf_counter``, each run after ``gc.collect()``
(as in a fresh process: the graphs of earlier runs would otherwise be rescanned by the collector):

* ``build_gradients``: the driver alone on a graph whose shapes are already inferred;
* ``autodiff pass``: ``graphforge.compile(model, "autodiff", verify=False)``, which adds
  importing the model, shape inference, cleanup and exporting it back;
* ``generate_artifacts``: onnxruntime-training 1.19.2 (``loss=None``: the model's output is the
  loss; no optimizer) in its own virtual environment ``.bench-venv-ort-training/``, created
  here when missing: the package exists only up to Python 3.11 and cannot share an
  environment with onnxruntime-gpu. It is run as a subprocess that prints JSON.
"""

from __future__ import annotations

import gc
import json
import platform
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import graphforge

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers

TITLE = "Autodiff"

REPO = Path(__file__).resolve().parent.parent
CACHE = helpers.CACHE_ROOT
ORT_VENV = REPO / ".bench-venv-ort-training"
ORT_REQUIREMENTS = ["onnxruntime-training==1.19.2", "onnx<=1.17", "numpy<2"]
ORT_TIMEOUT_S = 600

#: (label, layers or None for GPT-2, runs); quick mode keeps the first two
SYNTHETIC = [("ladder 1k", 100, 5), ("ladder 10k", 1000, 3), ("ladder 100k", 10000, 1)]
GPT2_RUNS = 3


# --------------------------------------------------------------------------- models


def ladder(layers: int, width: int = 16, groups: int = 8) -> onnx.ModelProto:
    """The synthetic model: ``layers`` * 10 + 1 nodes, x [batch, width] -> loss."""
    rng = np.random.default_rng(0)
    initializers = [numpy_helper.from_array(np.array(0.5, np.float32), "half")]
    for k in range(groups):
        initializers.append(numpy_helper.from_array(rng.standard_normal((width, width), np.float32) * 0.1, f"w{k}"))
        initializers.append(numpy_helper.from_array(rng.standard_normal(width, np.float32) * 0.1, f"b{k}"))
    nodes: list[onnx.NodeProto] = []

    def op(kind: str, *inputs: str) -> str:
        out = f"t{len(nodes)}"
        nodes.append(helper.make_node(kind, list(inputs), [out], name=f"{kind}_{len(nodes)}"))
        return out

    h = prev = "x"
    for i in range(layers):
        k = i % groups
        a = op("Add", op("MatMul", h, f"w{k}"), f"b{k}")
        r = op("Add", op("Mul", op("Tanh", a), op("Sigmoid", a)), h)
        e = op("Mul", op("Relu", op("Sub", r, prev)), "half")
        prev, h = h, op("Add", e, r)
    nodes.append(helper.make_node("ReduceSum", [h], ["loss"], keepdims=0, name="loss"))
    graph = helper.make_graph(
        nodes,
        f"ladder{layers}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


# --------------------------------------------------------------------------- measuring graphforge


@dataclass
class Row:
    label: str
    forward_nodes: int
    parameters: int
    build_s: float = float("nan")
    build_runs: list[float] = field(default_factory=list)
    pass_s: float = float("nan")
    pass_runs: list[float] = field(default_factory=list)
    backward_nodes: int = 0
    ort_s: float = float("nan")
    ort_runs: list[float] = field(default_factory=list)
    ort_backward_nodes: int | None = None
    ort_contrib_nodes: int | None = None
    ort_note: str = ""


def parameter_names(model: onnx.ModelProto) -> list[str]:
    """The float initializers (what the autodiff pass trains by default)."""
    floats = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
    return [t.name for t in model.graph.initializer if t.data_type in floats]


def time_build_gradients(model: onnx.ModelProto, runs: int) -> list[float]:
    from graphforge.passes.autodiff import build_gradients

    from graphforge.graph import Model
    from graphforge.shapes import infer_shapes

    inferred = infer_shapes(Model.from_proto(model)).to_proto()
    times = []
    for _ in range(runs):
        graph = Model.from_proto(inferred).graph  # a fresh graph each run: building mutates it
        loss = next(t for t in graph.outputs if t.name == "loss")
        params = [t for name, t in graph.tensors().items() if name in set(parameter_names(model))]
        gc.collect()
        start = time.perf_counter()
        build_gradients(graph, loss, params)
        times.append(time.perf_counter() - start)
    return times


def time_autodiff_pass(model: onnx.ModelProto, runs: int) -> tuple[list[float], int]:
    times, nodes = [], 0
    for _ in range(runs):
        gc.collect()
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # parameters without a gradient
            result = graphforge.compile(model, "autodiff", verify=False)
        times.append(time.perf_counter() - start)
        nodes = len(result.model.graph.node)
    return times, nodes


#: the whole training compile the issue times on GPT-2 small (its loss is already the model's output)
TRAINING_PIPELINE = "loss(output=loss), autodiff, adamw(lr=0.001, weight_decay=0.01)"
#: the issue's goal for it, in seconds
TRAINING_COMPILE_GOAL_S = 1.0


@dataclass
class TrainingCompile:
    """``graphforge.compile(source, TRAINING_PIPELINE)`` with its default checks: the total of
    each run, and the median run's split into the passes and the checks (with the exports they
    need). From a file, reading it is timed apart (``graphforge.load`` just before each run)
    and taken out of the run's total."""

    source: str
    runs: list[float]
    #: the median run's total, which ``passes`` and ``checks_s`` split
    seconds: float
    passes: dict[str, float]
    checks_s: float
    nodes: int
    #: from a file, the median run's read
    read_s: float = 0.0


def time_training_compile(source: onnx.ModelProto | Path, runs: int) -> TrainingCompile:
    timed = []
    for _ in range(runs):
        gc.collect()
        read = 0.0
        if isinstance(source, Path):
            start = time.perf_counter()
            graphforge.load(source)
            read = time.perf_counter() - start
            gc.collect()
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = graphforge.compile(source, TRAINING_PIPELINE)
        seconds = time.perf_counter() - start - read
        records = result.records
        timed.append((seconds, records, len(result.model.graph.node), read))
        del result  # the program holds every weight (0.5 GB)
    seconds, records, nodes, read = sorted(timed, key=lambda t: t[0])[len(timed) // 2]
    return TrainingCompile(
        source="a file, less its read" if isinstance(source, Path) else "a ModelProto already read",
        runs=[t[0] for t in timed],
        seconds=seconds,
        passes={r.name: r.seconds for r in records},
        checks_s=sum(r.verify_seconds for r in records),
        nodes=nodes,
        read_s=read,
    )


# --------------------------------------------------------------------------- onnxruntime-training, in its own venv

#: run by the ORT venv's interpreter: argv[1] is a JSON job, the last stdout line is JSON
ORT_SCRIPT = textwrap.dedent(
    """
    import json, statistics, sys, tempfile, time, types
    from pathlib import Path
    import onnxruntime
    onnxruntime.set_default_logger_severity(3)
    # onnxruntime.training's package __init__ imports torch (for ORTModule and its optimizers);
    # generate_artifacts needs none of it, so load the subpackage without running that __init__
    package = types.ModuleType("onnxruntime.training")
    package.__path__ = [str(Path(onnxruntime.__file__).parent / "training")]
    sys.modules["onnxruntime.training"] = package
    from onnxruntime.training import artifacts
    import onnx

    job = json.loads(sys.argv[1])
    times, backward, contrib = [], None, None
    forward = len(onnx.load(job["model"], load_external_data=False).graph.node)
    for _ in range(job["runs"]):
        with tempfile.TemporaryDirectory(prefix="ort-artifacts-") as out:
            start = time.perf_counter()
            artifacts.generate_artifacts(
                job["model"], requires_grad=job["params"], loss=None, optimizer=None, artifact_directory=out
            )
            times.append(time.perf_counter() - start)
            training = onnx.load(str(Path(out) / "training_model.onnx"), load_external_data=False)
            backward = len(training.graph.node) - forward
            contrib = sum(1 for n in training.graph.node if n.domain not in ("", "ai.onnx"))
    print(json.dumps({"runs": times, "backward_nodes": backward, "contrib_nodes": contrib,
                      "version": onnxruntime.__version__}))
    """
)


def _python_for_ort() -> str | None:
    """An interpreter of Python 3.11 or older (onnxruntime-training has no newer wheels)."""
    if sys.version_info < (3, 12):
        return sys.executable
    for name in ("python3.11", "python3.10", "python3.9"):
        found = shutil.which(name)
        if found:
            return found
    return None


def ort_python() -> tuple[str | None, str]:
    """The ORT venv's interpreter (creating the venv when missing), or None and why not."""
    python = ORT_VENV / "bin" / "python"
    stamp = ORT_VENV / ".installed"
    if python.exists() and stamp.exists():
        return str(python), ""
    base = _python_for_ort()
    if base is None:
        return None, (
            f"no Python 3.11 or older found (this is {platform.python_version()}); "
            "onnxruntime-training 1.19.2 has wheels for CPython 3.8-3.11 only"
        )
    steps = [
        [base, "-m", "venv", "--clear", str(ORT_VENV)],
        [str(python), "-m", "pip", "install", "--quiet", *ORT_REQUIREMENTS],
    ]
    for step in steps:
        proc = subprocess.run(step, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            lines = [line for line in proc.stderr.splitlines() if "is ignored" not in line]
            return None, f"`{' '.join(step[2:])}` failed: " + " ".join(lines[-3:])
    stamp.write_text(" ".join(ORT_REQUIREMENTS) + "\n")
    return str(python), ""


def time_ort(python: str, model_path: Path, params: list[str], runs: int) -> dict:
    job = json.dumps({"model": str(model_path), "params": params, "runs": runs})
    try:
        proc = subprocess.run(
            [python, "-c", ORT_SCRIPT, job], capture_output=True, text=True, timeout=ORT_TIMEOUT_S * runs
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {ORT_TIMEOUT_S * runs} s"}
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        return {"error": lines[-1] if lines else f"exit status {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- the run


def measure(label: str, model: onnx.ModelProto, path: Path, runs: int, python: str | None, why_not: str) -> Row:
    params = parameter_names(model)
    row = Row(label, len(model.graph.node), len(params))
    print(f"  {label}: {row.forward_nodes} nodes, {row.parameters} parameters", flush=True)
    row.build_runs = time_build_gradients(model, runs)
    row.build_s = statistics.median(row.build_runs)
    row.pass_runs, total_nodes = time_autodiff_pass(model, runs)
    row.pass_s = statistics.median(row.pass_runs)
    row.backward_nodes = total_nodes - row.forward_nodes
    print(f"    graphforge: build_gradients {row.build_s:.2f} s, autodiff pass {row.pass_s:.2f} s", flush=True)
    if python is None:
        row.ort_note = why_not
        return row
    result = time_ort(python, path, params, runs)
    if "error" in result:
        row.ort_note = result["error"]
    else:
        row.ort_runs = result["runs"]
        row.ort_s = statistics.median(row.ort_runs)
        row.ort_backward_nodes = result["backward_nodes"]
        row.ort_contrib_nodes = result["contrib_nodes"]
    print(f"    onnxruntime-training: {row.ort_s:.2f} s {row.ort_note}", flush=True)
    return row


def run(quick: bool = False) -> str:
    """Run the benchmark and return its markdown section body."""
    CACHE.mkdir(parents=True, exist_ok=True)
    python, why_not = ort_python()
    rows = []
    for label, layers, runs in SYNTHETIC[:2] if quick else SYNTHETIC:
        model = ladder(layers)
        path = CACHE / f"ladder{layers}.onnx"
        onnx.save(model, path)
        rows.append(measure(label, model, path, runs, python, why_not))
    if not quick:
        start = time.perf_counter()
        path = helpers.export_gpt2(CACHE / "gpt2-small-loss.onnx", helpers.GPT2_SMALL, with_loss=True)
        print(f"  GPT-2 small ready in {time.perf_counter() - start:.0f} s ({path})", flush=True)
        model = onnx.load(path)
        rows.append(measure("GPT-2 small", model, path, GPT2_RUNS, python, why_not))
        training = [time_training_compile(model, GPT2_RUNS), time_training_compile(path, GPT2_RUNS)]
        for form in training:
            print(f"  GPT-2 small, {TRAINING_PIPELINE}, from {form.source}: {form.seconds:.2f} s", flush=True)
    ort_version = helpers.ort_training_version(python)
    return report(rows, ort_version, why_not, None if quick else training)


def _us(seconds: float, nodes: int) -> str:
    return "–" if seconds != seconds else f"{seconds / nodes * 1e6:.0f}"


def _s(seconds: float) -> str:
    return "–" if seconds != seconds else f"{seconds:.2f}"


def report(rows: list[Row], ort_version: str, why_not: str, training: list[TrainingCompile] | None = None) -> str:
    import onnxruntime

    lines = [
        "Gradient graph construction time: graphforge's `autodiff` beside onnxruntime-training's",
        "`generate_artifacts` on the same models (each with one scalar output `loss`; every float",
        "initializer trainable; no optimizer). Times are medians of the runs column, in seconds",
        "(each run after `gc.collect()`);",
        "µs/node is time divided by forward nodes (flat means linear). `build_gradients` is the",
        "driver alone on a shape-inferred graph; `autodiff pass` is `graphforge.compile(model,",
        '"autodiff", verify=False)` end to end (import, shape inference, build, cleanup, export;',
        "shape inference reads a copy that leaves the large weights out, and the export copies them",
        "once, straight into the result); `generate_artifacts` also writes its three artifacts",
        "(training and eval models, checkpoint) to a temp dir. bwd/fwd is backward nodes over forward",
        "nodes.",
        "",
        "| model | fwd nodes | params | runs | build_gradients s | µs/node | autodiff pass s | µs/node "
        "| bwd/fwd | generate_artifacts s | µs/node | ORT bwd/fwd | ORT non-standard nodes |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        n = r.forward_nodes
        ort_ratio = "–" if r.ort_backward_nodes is None else f"{r.ort_backward_nodes / n:.2f}"
        contrib = "–" if r.ort_contrib_nodes is None else str(r.ort_contrib_nodes)
        lines.append(
            f"| {r.label} | {n:,} | {r.parameters} | {len(r.build_runs)} | {_s(r.build_s)} | {_us(r.build_s, n)} "
            f"| {_s(r.pass_s)} | {_us(r.pass_s, n)} | {r.backward_nodes / n:.2f} | {_s(r.ort_s)} | {_us(r.ort_s, n)} "
            f"| {ort_ratio} | {contrib} |"
        )
    notes = [f"- {r.label}: onnxruntime-training did not finish: {r.ort_note}" for r in rows if r.ort_note]
    if why_not:
        notes = [f"- onnxruntime-training could not be installed: {why_not}"]
    for form in training or ():
        median = form.seconds
        passes = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in form.passes.items())
        met = (
            "met" if median < TRAINING_COMPILE_GOAL_S else f"not met, {median / TRAINING_COMPILE_GOAL_S:.1f}× the goal"
        )
        read = f" (reading it took {form.read_s:.2f} s more)" if form.read_s else ""
        notes += [
            f"- GPT-2 small, the whole training compile `{TRAINING_PIPELINE}` with its default checks, from "
            f"{form.source}{read}: median {median:.2f} s of {len(form.runs)} runs "
            f"({', '.join(f'{t:.2f}' for t in form.runs)}), {form.nodes:,} nodes; in the median run the "
            f"passes took {passes}, and checking each pass's result (the checker, on an export without the weights; "
            f"the last one exported whole) {form.checks_s:.2f} s, and checking and importing the input "
            f"{form.seconds - sum(form.passes.values()) - form.checks_s:.2f} s. "
            f"The issue's goal, under {TRAINING_COMPILE_GOAL_S:.0f} s: {met}."
        ]
    cpu = helpers.cpu_name()
    cores = helpers.usable_cores()
    lines += [
        "",
        *notes,
        *([""] if notes else []),
        f"Machine: {cpu}, {cores} cores usable; Python {platform.python_version()}; graphforge "
        f"{graphforge.__version__}, onnx {onnx.__version__}, onnxruntime {onnxruntime.__version__}; "
        f"onnxruntime-training {ort_version} (in `.bench-venv-ort-training/`, with {', '.join(ORT_REQUIREMENTS[1:])}).",
        "Raw runs (s): "
        + json.dumps(
            {
                r.label: {"build": _round(r.build_runs), "pass": _round(r.pass_runs), "ort": _round(r.ort_runs)}
                for r in rows
            }
        ),
    ]
    return "\n".join(lines) + "\n"


def _round(values: list[float]) -> list[float]:
    return [round(v, 3) for v in values]
