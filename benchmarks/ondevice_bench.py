"""Training on device: graphforge's JavaScript runtime (js/) on onnxruntime-node and on
onnxruntime-web's wasm backend (in Node and in headless Chromium), graphforge in Python, and
TensorFlow.js on its backends that install here, training the same models from the same
weights on the same batches with the same optimizer, in one run.

Models, batch 64, cross-entropy on the class labels, Adam (lr 1e-3, betas 0.9/0.999, eps 1e-8,
no weight decay; graphforge's ``adamw(weight_decay=0)``, TensorFlow.js's ``tf.train.adam``):

* the digits MLP of ``make demo`` (examples/digits/model.onnx: uint8 8×8 pixels scaled inside
  the model, 64-64-10), on the shipped digits;
* an MLP 784-1024-1024-10 (ReLU), on random inputs;
* the CNN of TensorFlow.js's MNIST tutorial (5×5 convolutions of 8 and 16 filters, each with
  ReLU and a 2×2 max-pool, then 256→10), on random 28×28 images.

The ONNX models are built here from NumPy weights (seeded, initialised as torch.nn does);
TensorFlow.js's layers get the same weights in its layouts (kernels transposed, the dense layer
after the convolutions permuted from channels-first to channels-last), so both sides compute
the same function: the first losses agree, which the report shows.

Sides, each in its own process (Node, Python, or a fresh headless Chromium per side):

* graphforge JS: ``TrainingSession.runStep`` (the whole-step model, ``train_step.onnx``) on
  onnxruntime-node 1.30 (its CPU provider) and on onnxruntime-web 1.30's wasm backend;
* graphforge Python: ``Module.train_step`` on the same program (onnxruntime's Python package);
* TensorFlow.js 4.22: ``optimizer.minimize`` over a ``tf.sequential`` model, on its ``cpu``
  backend (plain JavaScript, one thread) and its ``wasm`` backend (XNNPACK, SIMD; threads
  where the page is cross-origin isolated). tfjs-node's install script downloads libtensorflow
  from storage.googleapis.com, which this machine cannot reach: it is reported as not installed.

Every step awaits its loss (a training loop that logs it), and each side's threads are the
row's (onnxruntime's intra-op threads, the wasm thread pools; TensorFlow.js's cpu backend has
one thread only). Time: warm-up steps (5, and 3 s at least: V8 compiles a large wasm module's
optimized code in the background, which took seconds for onnxruntime-web's), then 5 blocks of
about 0.6 s; the median block's time a step.
Memory: each process's peak resident memory (Node's ``maxRSS``, Python's ``ru_maxrss``, the
largest Chromium renderer's ``VmHWM``). Size: what a page downloads for the side (the
libraries and their wasm, measured in Chromium), and the packages installed for Node/Python.
Where a graphforge step goes: the whole-step model run bare (its state fed, nothing carried),
fetching every output, fetching into outputs allocated once, and fetching the loss alone;
the first less the last is the cost of handing the carried tensors to JavaScript, the step
less the first the runtime's own.

    .venv/bin/python benchmarks/ondevice_bench.py     # prints the markdown section
    .venv/bin/python benchmarks/run.py ondevice       # writes it into docs/benchmarks.md
    .venv/bin/python benchmarks/run.py ondevice --quick   # the digits at one thread, into out/

The section ends with benchmarks/wasm_kernels.py's subsection: where onnxruntime-web's wasm
kernels and the native ones part ways on a transformer's training step.
"""

from __future__ import annotations

import itertools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "ondevice"))  # the file format the JS drivers read
sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers  # noqa: E402  (what the benchmarks share)
import train_bench as tb  # noqa: E402
from _tensor_file import write_tensors  # noqa: E402

TITLE = "Training on device"
HERE = Path(__file__).resolve().parent / "js"
NODE = shutil.which("node")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CACHE = helpers.cache("ondevice")
BATCH = 64
LR = 1e-3
PIPELINE = f"loss(kind=cross_entropy, output=logits), autodiff, adamw(lr={LR}, weight_decay=0)"


@dataclass
class Spec:
    key: str
    label: str
    #: how TensorFlow.js builds it (benchmarks/js/sides.mjs)
    layers: dict
    input_shape: tuple[int, ...]
    batches: int = 4


SPECS = [
    Spec("digits", "digits MLP 64-64-10", {"kind": "mlp", "sizes": [64, 64, 10], "scale": 1 / 16}, (8, 8)),
    Spec("mlp", "MLP 784-1024-1024-10", {"kind": "mlp", "sizes": [784, 1024, 1024, 10]}, (784,)),
    Spec(
        "cnn",
        "CNN (TF.js MNIST tutorial)",
        {"kind": "cnn", "input": [28, 28, 1], "convs": [{"filters": 8, "kernel": 5}, {"filters": 16, "kernel": 5}]},
        (1, 28, 28),
    ),
]


# --------------------------------------------------------------------------- models


def _uniform(rng: np.random.Generator, fan_in: int, shape: tuple[int, ...]) -> np.ndarray:
    bound = 1.0 / np.sqrt(fan_in)
    return rng.uniform(-bound, bound, shape).astype(np.float32)


def _save(nodes, inputs, initializers, path: Path) -> Path:
    graph = helper.make_graph(
        nodes,
        path.stem,
        inputs,
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        [numpy_helper.from_array(v, n) for n, v in initializers.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    import graphforge

    graphforge.save(model, path)
    return path


def _mlp(sizes: list[int], path: Path, rng) -> tuple[Path, list[np.ndarray]]:
    nodes, weights, tf = [], {}, []
    current = "x"
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        w, b = _uniform(rng, fan_in, (fan_out, fan_in)), _uniform(rng, fan_in, (fan_out,))
        weights[f"fc{i}.weight"], weights[f"fc{i}.bias"] = w, b
        tf += [np.ascontiguousarray(w.T), b]  # a dense kernel is [in, out]
        last = i == len(sizes) - 2
        out = "logits" if last else f"fc{i}"
        nodes.append(helper.make_node("Gemm", [current, f"fc{i}.weight", f"fc{i}.bias"], [out], transB=1))
        if not last:
            nodes.append(helper.make_node("Relu", [out], [f"relu{i}"]))
            out = f"relu{i}"
        current = out
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", sizes[0]])]
    return _save(nodes, inputs, weights, path), tf


def _cnn(layers: dict, path: Path, rng) -> tuple[Path, list[np.ndarray]]:
    height, width, channels = layers["input"]
    nodes, weights, tf = [], {}, []
    current = "x"
    for i, conv in enumerate(layers["convs"]):
        k, filters = conv["kernel"], conv["filters"]
        fan_in = channels * k * k
        w, b = _uniform(rng, fan_in, (filters, channels, k, k)), _uniform(rng, fan_in, (filters,))
        weights[f"conv{i}.weight"], weights[f"conv{i}.bias"] = w, b
        tf += [np.ascontiguousarray(w.transpose(2, 3, 1, 0)), b]  # [kh, kw, in, out]
        nodes += [
            helper.make_node("Conv", [current, f"conv{i}.weight", f"conv{i}.bias"], [f"conv{i}"]),
            helper.make_node("Relu", [f"conv{i}"], [f"relu{i}"]),
            helper.make_node("MaxPool", [f"relu{i}"], [f"pool{i}"], kernel_shape=[2, 2], strides=[2, 2]),
        ]
        current, channels = f"pool{i}", filters
        height, width = (height - k + 1) // 2, (width - k + 1) // 2
    flat = channels * height * width
    w, b = _uniform(rng, flat, (10, flat)), _uniform(rng, flat, (10,))
    weights["fc.weight"], weights["fc.bias"] = w, b
    # ONNX flattens channels-first (c, h, w), TensorFlow.js channels-last (h, w, c)
    tf += [np.ascontiguousarray(w.reshape(10, channels, height, width).transpose(2, 3, 1, 0).reshape(flat, 10)), b]
    nodes += [
        helper.make_node("Flatten", [current], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"], transB=1),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, layers["input"][0], layers["input"][1]])
    ]
    return _save(nodes, inputs, weights, path), tf


def _digits(path: Path) -> tuple[Path, list[np.ndarray]]:
    model = onnx.load(REPO / "examples" / "digits" / "model.onnx")
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    shutil.copyfile(REPO / "examples" / "digits" / "model.onnx", path)
    return path, [
        np.ascontiguousarray(values["fc1.weight"].T),
        values["fc1.bias"],
        np.ascontiguousarray(values["fc2.weight"].T),
        values["fc2.bias"],
    ]


def _batches(spec: Spec, rng) -> list[dict[str, np.ndarray]]:
    if spec.key == "digits":
        with np.load(REPO / "data" / "digits" / "train.npz") as data:
            images, labels = data["images"], data["labels"]
        return [
            {
                "images": images[i * BATCH : (i + 1) * BATCH],
                "labels": labels[i * BATCH : (i + 1) * BATCH].astype(np.int64),
            }
            for i in range(spec.batches)
        ]
    return [
        {
            "x": rng.standard_normal((BATCH, *spec.input_shape)).astype(np.float32),
            "labels": rng.integers(0, 10, BATCH).astype(np.int64),
        }
        for _ in range(spec.batches)
    ]


def prepare(spec: Spec, folder: Path) -> dict:
    """The model, its program and artifacts, TensorFlow.js's weights and the batches, in ``folder``;
    the job's common part."""
    import graphforge
    from graphforge.ondevice.artifacts import write_artifacts

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    model, tf_weights = (
        _digits(folder / "model.onnx")
        if spec.key == "digits"
        else _mlp(spec.layers["sizes"], folder / "model.onnx", rng)
        if spec.layers["kind"] == "mlp"
        else _cnn(spec.layers, folder / "model.onnx", rng)
    )
    program = graphforge.compile(model, PIPELINE).model
    graphforge.save(program, folder / "program.onnx")
    manifest = write_artifacts(program, folder / "artifacts")
    batches = _batches(spec, rng)
    weights = write_tensors(folder / "weights.bin", [[(f"w{i}", w) for i, w in enumerate(tf_weights)]])[0]
    steps = write_tensors(folder / "batches.bin", [list(b.items()) for b in batches])
    return {
        "artifacts": str(folder / "artifacts"),
        "model": {**spec.layers, "classes": 10},
        "weights": {"file": str(folder / "weights.bin"), "tensors": weights},
        "batches": {"file": str(folder / "batches.bin"), "steps": steps},
        "lr": LR,
        "program": str(folder / "program.onnx"),
        # the parameters and the optimizer's state, which every step carries
        "carriedBytes": sum(int(np.prod(e.shape, dtype=np.int64)) * np.dtype(e.dtype).itemsize for e in manifest.state),
    }


# --------------------------------------------------------------------------- sides


def _node(job: dict, timeout: float) -> dict:
    done = subprocess.run(
        [NODE, str(HERE / "node.mjs"), json.dumps(job)], capture_output=True, text=True, timeout=timeout, cwd=HERE
    )
    if done.returncode != 0:
        raise RuntimeError(_first_error(done.stderr))
    return json.loads(done.stdout.strip().splitlines()[-1])


def read_batches(index: dict) -> list[list[np.ndarray]]:
    """The steps' arrays of the batch file an index describes (what the JS sides read too)."""
    raw = Path(index["file"]).read_bytes()
    return [
        [np.frombuffer(raw, t["dtype"], int(np.prod(t["shape"])), t["offset"]).reshape(t["shape"]) for t in step]
        for step in index["steps"]
    ]


def _python_child(job: dict) -> dict:
    """graphforge's Module in this (fresh) process, timed as sides.mjs times the JS sides."""
    import graphforge

    batches = read_batches(job["batches"])
    module = graphforge.Module(
        job["program"], device="cpu", intra_op_threads=job["threads"], inter_op_threads=1, update="onnx"
    )
    losses, last, step, begun = [], 0.0, 0, time.perf_counter()
    while step < job["warmup"] or time.perf_counter() - begun < job.get("warmupSeconds", 0):
        started = time.perf_counter()
        loss = float(module.train_step(*batches[step % len(batches)]))
        losses += [loss][: 5 - len(losses)]
        last = time.perf_counter() - started
        step += 1
    count = max(1, round(job["blockSeconds"] / max(last, 1e-6)))
    blocks = []
    for _ in range(job["blocks"]):
        started = time.perf_counter()
        for _ in range(count):
            float(module.train_step(*batches[step % len(batches)]))
            step += 1
        blocks.append((time.perf_counter() - started) * 1e3 / count)
    return {"blocks": blocks, "losses": losses, "peakMiB": tb._peak_mib()}


def _chromium(job: dict, site: Path, port: int, timeout: float) -> dict:
    """The side in a fresh headless Chromium, on pages served from ``site`` (cross-origin
    isolated, so the wasm backends may run threads); the job's files become URLs."""
    urls = {
        **job,
        "artifacts": _url(job["artifacts"], site),
        "weights": {**job["weights"], "file": _url(job["weights"]["file"], site)},
    }
    urls["batches"] = {**job["batches"], "file": _url(job["batches"]["file"], site)}
    name = f"job-{job['key']}-{job['side']}-{job['backend']}-{job['threads']}.json"
    (site / name).write_text(json.dumps(urls))
    with tempfile.TemporaryDirectory() as profile:
        drive = {
            "chromium": CHROMIUM,
            "profile": profile,
            "url": f"http://127.0.0.1:{port}/benchmarks/js/page.html?job=/{name}",
            "timeoutMs": int(timeout * 1000),
        }
        done = subprocess.run(
            [NODE, str(HERE / "chromium.mjs"), json.dumps(drive)],
            capture_output=True,
            text=True,
            timeout=timeout + 30,
            cwd=HERE,
        )
    if done.returncode != 0:
        raise RuntimeError(_first_error(done.stderr))
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "error" in result:
        raise RuntimeError(_first_error(result["error"]))
    return result


def _first_error(text: str) -> str:
    """The message of the error a child died of (the first line naming one), else its last lines."""
    for line in text.splitlines():
        if "Error:" in line:
            return line.strip()[line.strip().find("Error:") :][:400]
    return " ".join(text.split())[-400:]


def _url(path: str, site: Path) -> str:
    return "/" + Path(path).relative_to(site).as_posix()


@dataclass(frozen=True)
class Side:
    key: str
    label: str
    where: str  # node, chromium or python
    side: str  # graphforge, tfjs or python
    backend: str | None
    #: whether it takes more than one thread (TensorFlow.js's cpu backend is one thread of
    #: JavaScript; its wasm backend has threads only where SharedArrayBuffer is: the browser)
    threaded: bool = True


SIDES = [
    Side("gf-node", "graphforge JS, onnxruntime-node", "node", "graphforge", "node"),
    Side("gf-wasm-node", "graphforge JS, onnxruntime-web wasm, Node", "node", "graphforge", "web"),
    Side("gf-wasm-chromium", "graphforge JS, onnxruntime-web wasm, Chromium", "chromium", "graphforge", "web"),
    Side("python", "graphforge Python", "python", "python", None),
    Side("tfjs-wasm-node", "TF.js wasm, Node", "node", "tfjs", "wasm", threaded=False),
    Side("tfjs-cpu-node", "TF.js cpu, Node", "node", "tfjs", "cpu", threaded=False),
    Side("tfjs-wasm-chromium", "TF.js wasm, Chromium", "chromium", "tfjs", "wasm"),
    Side("tfjs-cpu-chromium", "TF.js cpu, Chromium", "chromium", "tfjs", "cpu", threaded=False),
]


def _missing(side: Side) -> str | None:
    """Why ``side`` cannot run on this machine, or None."""
    if side.where == "chromium" and not CHROMIUM:
        return "no Chromium on this machine"
    if side.side == "tfjs" and not (HERE / "node_modules" / "@tensorflow" / "tfjs").is_dir():
        return "TensorFlow.js is not installed (make install runs npm ci in benchmarks/js)"
    return None


def unavailable() -> str | None:
    if not NODE:
        return "no Node.js on this machine"
    if not (REPO / "js" / "node_modules" / "onnxruntime-node").is_dir():
        return "js/node_modules is missing (make install)"
    return None


def _site(cache: Path) -> Path:
    """The folder the Chromium sides are served from: the runtime and this benchmark's pages
    (links into the repository) beside the models and batches."""
    site = cache / "site"
    site.mkdir(parents=True, exist_ok=True)
    for name in ("js", "benchmarks"):
        link = site / name
        if not link.exists():
            link.symlink_to(REPO / name, target_is_directory=True)
    return site


def _serve(site: Path):
    import importlib.util
    import threading

    spec = importlib.util.spec_from_file_location("web_serve", REPO / "examples" / "web" / "serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    httpd = module.server(0, root=site)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def benchmark(
    quick: bool = False,
    *,
    cache: Path = CACHE,
    specs: list[Spec] | None = None,
    sides: list[Side] | None = None,
    timing: dict | None = None,
    counts: list[int] | None = None,
) -> dict:
    """Every side on every model at one thread and at the usable cores (quick: the digits at
    one thread, short blocks): ``rows`` maps "model/threads" to each side's result (or its
    ``error``), beside the models' labels, the thread counts, the bytes each model carries and
    the sizes on disk."""
    specs = specs or ([SPECS[0]] if quick else SPECS)
    sides = sides or SIDES
    counts = counts or ([1] if quick or helpers.usable_cores() == 1 else [1, helpers.usable_cores()])
    timing = timing or (
        {"warmup": 3, "blocks": 1, "blockSeconds": 0.05}
        if quick
        else {"warmup": 5, "warmupSeconds": 3, "blocks": 5, "blockSeconds": 0.6}
    )
    site = _site(cache)
    httpd = _serve(site) if any(s.where == "chromium" for s in sides) and CHROMIUM else None
    results: dict = {"rows": {}, "specs": {s.key: s.label for s in specs}, "counts": counts}
    try:
        for spec in specs:
            common = prepare(spec, site / "run" / spec.key)
            results.setdefault("carried", {})[spec.key] = common.pop("carriedBytes")
            for threads in counts:
                row = results["rows"].setdefault(f"{spec.key}/{threads}", {})
                for side in sides:
                    why = _missing(side)
                    if why:
                        row[side.key] = {"error": why}
                        continue
                    if threads > 1 and not side.threaded:
                        row[side.key] = {**results["rows"][f"{spec.key}/1"][side.key], "oneThread": True}
                        continue
                    job = {
                        **common,
                        **timing,
                        "key": spec.key,
                        "threads": threads,
                        "side": side.side,
                        "backend": side.backend,
                    }
                    timeout = 300 if quick else 900
                    started = time.perf_counter()
                    try:
                        if side.where == "python":
                            row[side.key] = tb.run_child(__file__, job, timeout=timeout)
                        elif side.where == "node":
                            row[side.key] = _node(job, timeout)
                        else:
                            row[side.key] = _chromium(job, site, httpd.server_address[1], timeout)
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        row[side.key] = {"error": " ".join(str(exc).split())[:400]}
                    print(
                        f"  {spec.key}, {threads} thread(s), {side.key}: {_cell(row[side.key])} ms/step "
                        f"({time.perf_counter() - started:.0f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
    results["sizes"] = sizes()
    return results


def _ms(result: dict) -> float | None:
    return statistics.median(result["blocks"]) if "blocks" in result else None


def _cell(result: dict) -> str:
    ms = _ms(result)
    return "failed" if ms is None else f"{ms:.3g}"


# --------------------------------------------------------------------------- sizes


def _du(*paths: Path) -> int:
    total = 0
    for path in paths:
        if path.is_file():
            total += path.stat().st_size
        elif path.is_dir():
            total += sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    return total


def sizes() -> dict[str, int]:
    """Bytes on disk of what each runtime needs (a page's downloads are measured in Chromium)."""
    modules = REPO / "js" / "node_modules"
    node_bin = modules / "onnxruntime-node" / "bin" / "napi-v6" / "linux" / "x64"
    web = modules / "onnxruntime-web" / "dist"
    out = {
        "graphforge JS runtime (js/src)": _du(REPO / "js" / "src"),
        "onnxruntime-node 1.30: its JS and this platform's native library": _du(
            modules / "onnxruntime-node" / "dist", modules / "onnxruntime-common" / "dist" / "esm", node_bin
        ),
        "onnxruntime-node 1.30 as npm installs it (every platform's binaries)": _du(modules / "onnxruntime-node"),
        "onnxruntime-web 1.30 in Node: its JS and the wasm it loads": _du(
            web / "ort.node.min.mjs", web / "ort-wasm-simd-threaded.mjs", web / "ort-wasm-simd-threaded.wasm"
        ),
    }
    tfjs = HERE / "node_modules" / "@tensorflow"
    if tfjs.is_dir():
        out[
            "TensorFlow.js 4.22 as npm installs it (@tensorflow/tfjs, -backend-wasm and their @tensorflow packages)"
        ] = _du(tfjs)
    import onnxruntime

    import graphforge

    out["graphforge Python: onnxruntime's package, graphforge's"] = _du(
        Path(onnxruntime.__file__).parent, Path(graphforge.__file__).parent
    )
    return out


# --------------------------------------------------------------------------- the report

#: the goals (issue 52): samples a second against TensorFlow.js's best in the same place, and
#: the JS step on onnxruntime-node against Python's
GOAL_TFJS = 1.5
GOAL_PYTHON = 1.2
NODE_PEERS = ("tfjs-wasm-node", "tfjs-cpu-node")
CHROMIUM_PEERS = ("tfjs-wasm-chromium", "tfjs-cpu-chromium")


def _ratio(row: dict, ours: str, peers: tuple[str, ...]) -> float | None:
    """How many times as fast ``ours`` is as the fastest of ``peers`` that ran."""
    mine = _ms(row.get(ours, {}))
    theirs = [ms for k in peers if (ms := _ms(row.get(k, {}))) is not None]
    return None if mine is None or not theirs else min(theirs) / mine


def report(results: dict) -> str:
    rows, labels = results["rows"], {s.key: s for s in SIDES}
    present = [s for s in SIDES if any(s.key in row for row in rows.values())]
    notes: dict[str, int] = {}

    def footnote(text: str) -> str:
        return f"[{notes.setdefault(text, len(notes) + 1)}]"

    def cell(result: dict) -> str:
        ms = _ms(result)
        if ms is None:
            return "— " + footnote(result.get("error", "failed"))
        text = f"{1000 / ms * BATCH:,.0f}"
        return text + (
            " " + footnote("one thread: the backend has no more (measured once, in the 1-thread row)")
            if result.get("oneThread")
            else ""
        )

    lines = [
        f"Samples a second (batch {BATCH}: 64 × steps a second), median of the timed blocks; each side in its own "
        f"process, the same weights, batches and Adam; {_agreement(rows)} "
        "Threads: the row's, for every side that takes them.",
        "",
        "| model | threads | "
        + " | ".join(s.label for s in present)
        + " | graphforge / TF.js, Node | graphforge / TF.js, Chromium | JS / Python step, onnxruntime-node |",
        "| --- | ---: | " + " | ".join("---:" for _ in present) + " | ---: | ---: | ---: |",
    ]
    verdicts_tfjs, verdicts_python = [], []
    for key, row in rows.items():
        model, threads = key.split("/")
        node_ratio = _ratio(row, "gf-node", NODE_PEERS)
        web_ratio = _ratio(row, "gf-wasm-chromium", CHROMIUM_PEERS)
        js, py = _ms(row.get("gf-node", {})), _ms(row.get("python", {}))
        js_py = js / py if js and py else None
        verdicts_tfjs += [
            (results["specs"][model], threads, where, r)
            for where, r in (("Node", node_ratio), ("Chromium", web_ratio))
            if r is not None
        ]
        if js_py is not None:
            verdicts_python.append((model, threads, js_py))
        lines.append(
            f"| {results['specs'][model]} | {threads} | "
            + " | ".join(cell(row.get(s.key, {"error": "not run"})) for s in present)
            + f" | {_x(node_ratio)} | {_x(web_ratio)} | {_x(js_py)} |"
        )
    lines += ["", *[f"{mark} {text}" for text, n in notes.items() for mark in [f"[{n}]"]]]
    lines += ["", "First losses:", ""]
    for key, row in rows.items():
        model, threads = key.split("/")
        if threads != "1":
            continue
        first = {labels[k].label: r["losses"][:3] for k, r in row.items() if "losses" in r}
        lines.append(
            f"- {results['specs'][model]}: "
            + "; ".join(f"{k} " + ", ".join(f"{v:.5f}" for v in ls) for k, ls in first.items())
        )
    lines += ["", "Peak resident memory, MiB (the process: Node, Python, or Chromium's renderer):", ""]
    lines += [
        "| model | threads | " + " | ".join(s.label for s in present) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in present) + " |",
    ]
    for key, row in rows.items():
        model, threads = key.split("/")
        lines.append(
            f"| {results['specs'][model]} | {threads} | "
            + " | ".join(f"{row[s.key]['peakMiB']:.0f}" if "peakMiB" in row.get(s.key, {}) else "—" for s in present)
            + " |"
        )
    lines += ["", "Sizes, MiB:", "", "| what | MiB |", "| --- | ---: |"]
    lines += [f"| {what} | {_mib(size)} |" for what, size in results["sizes"].items()]
    downloads = {}
    for row in rows.values():
        for k, r in row.items():
            if "downloadedBytes" in r:
                downloads[labels[k].label] = r["downloadedBytes"]
    lines += [
        f"| what a page downloads for {what} (the libraries, their wasm, the runtime) | {_mib(size)} |"
        for what, size in downloads.items()
    ]
    lines += [
        "",
        "Where a step of graphforge's runtime goes: the whole-step model run bare (its state fed, nothing carried), "
        "fetching every output as a step does, fetching them into outputs allocated once, and fetching the loss alone "
        "(the same computation, the carried tensors left in onnxruntime); ms, and Python's whole step beside:",
        "",
        "| model | threads | runtime | runStep | bare run, every output | into preallocated outputs | loss only "
        "| handing the carried tensors to JS | the rest (the runtime's own) | V8 collecting garbage, in the step "
        "| Python's Module.train_step |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, row in rows.items():
        model, threads = key.split("/")
        python = _ms(row.get("python", {}))
        for side in ("gf-node", "gf-wasm-node", "gf-wasm-chromium"):
            ours = row.get(side, {})
            if "bare" not in ours:
                continue
            step, bare = _ms(ours), ours["bare"]
            lines.append(
                f"| {results['specs'][model]} | {threads} | {labels[side].label.removeprefix('graphforge JS, ')} | {step:.3g} "
                f"| {bare['all']:.3g} | {bare['into']:.3g} | {bare['lossOnly']:.3g} "
                f"| {max(bare['all'] - bare['lossOnly'], 0) / step:.0%} | {max(step - bare['all'], 0) / step:.0%} "
                f"| {_share(ours.get('gcMsPerStep'), step)} "
                f"| {'—' if python is None else f'{python:.3g}'} |"
            )
    met_tfjs = [v for v in verdicts_tfjs if v[3] >= GOAL_TFJS]
    met_python = [v for v in verdicts_python if v[2] <= GOAL_PYTHON]
    lines += [
        "",
        f"Goal: ≥ {GOAL_TFJS}× TensorFlow.js's samples a second at equal threads, on each row, in Node and in Chromium: "
        f"met in {len(met_tfjs)} of {len(verdicts_tfjs)}"
        + (
            "; missed: "
            + ", ".join(f"{m} at {t} thread(s) in {w} ({r:.2f}×)" for m, t, w, r in verdicts_tfjs if r < GOAL_TFJS)
            if len(met_tfjs) < len(verdicts_tfjs)
            else ""
        )
        + ".",
        f"Goal: the JS step on onnxruntime-node within {GOAL_PYTHON}× of Python's: met in {len(met_python)} of {len(verdicts_python)}"
        + (
            "; missed: "
            + ", ".join(
                f"{results['specs'][m]} at {t} thread(s) ({r:.2f}×)" for m, t, r in verdicts_python if r > GOAL_PYTHON
            )
            if len(met_python) < len(verdicts_python)
            else ""
        )
        + ".",
    ]
    lines += ["", *_findings(results, verdicts_python)]
    return "\n".join(lines) + "\n"


def _agreement(rows: dict) -> str:
    """How far each side's first losses are from graphforge's in Python, at worst."""
    worst = [
        abs(a - b) / abs(b)
        for row in rows.values()
        if "losses" in row.get("python", {})
        for r in row.values()
        if "losses" in r
        for a, b in zip(r["losses"][:3], row["python"]["losses"][:3], strict=False)
    ]
    if not worst:
        return "no side's losses to compare."
    return f"the first losses of every side within {max(worst):.1e} (relative) of Python's (listed below)."


def _findings(results: dict, verdicts_python: list) -> list[str]:
    """What the profile says about the misses, and what TensorFlow.js's own runs say."""
    rows, out = results["rows"], []
    preallocated_helps = False
    for key, threads, ratio in verdicts_python:
        if ratio <= GOAL_PYTHON:
            continue
        label, row = results["specs"][key], rows[f"{key}/{threads}"]
        bare, step = row["gf-node"]["bare"], _ms(row["gf-node"])
        out.append(
            f"- {label}, {threads} thread(s), JS {ratio:.2f}× Python's step: onnxruntime-node's run of the step, "
            f"the carried tensors left in onnxruntime, takes {bare['lossOnly']:.3g} ms, Python's whole step "
            f"{_ms(row['python']):.3g} ms; handing the carried tensors ({results['carried'][key] / 2**20:.1f} MiB: the "
            f"parameters and Adam's two moments) to JavaScript takes {bare['all'] - bare['lossOnly']:.3g} ms of the "
            f"{step:.3g} ms step, and V8 collecting the buffers it let go of "
            f"{row['gf-node'].get('gcMsPerStep', float('nan')):.3g} ms."
        )
        preallocated_helps |= bare["into"] < 0.9 * bare["all"]
    if out:
        met = [results["specs"][k] for k in dict.fromkeys(k for k, _, r in verdicts_python if r <= GOAL_PYTHON)]
        out.append(
            "- Why: onnxruntime-node hands every output to JavaScript as a copy in a new ArrayBuffer, and its IO "
            "binding keeps outputs inside onnxruntime for GPU buffers only. "
            + (
                "Outputs allocated beforehand saved time on these rows (the preallocated column): the runtime "
                "could fetch into them. "
                if preallocated_helps
                else "Outputs allocated beforehand are no way around it: onnxruntime writes into them and the binding "
                "copies them once more (the preallocated column is no faster on these rows), so the runtime does "
                "not preallocate. "
            )
            + "Each step then lets go of the last step's carried tensors, which V8 frees in full mark-compact "
            "collections (the collection column). Python's Module keeps the carried tensors in onnxruntime between "
            "steps and updates them in place through IO binding."
            + (
                f" Where a model's carried tensors are small beside its compute ({', '.join(met)}) the JS step is "
                f"within {GOAL_PYTHON}× of Python's."
                if met
                else ""
            )
        )
    errors = {
        r["error"]
        for row in rows.values()
        for k, r in row.items()
        if k.startswith("tfjs") and "error" in r and "not installed" not in r["error"]
    }
    for error in sorted(errors):
        out.append(f"- TensorFlow.js could not train a model here: {error}")
    for row in rows.values():
        probe = next((r for k, r in row.items() if k == "tfjs-wasm-node" and "matmul" in r), None)
        if probe:
            matmul = probe["matmul"]
            rates = ", ".join(f"{name} {rate:.1f}" for name, rate in matmul.items())
            slowest = min(r for name, r in matmul.items() if name != "plain")
            out.append(
                f"- TensorFlow.js's wasm MatMul, [64, 1024] × [1024, 1024], GFLOP/s in Node: {rates}. A backward "
                f"pass's MatMuls take an operand transposed: up to {matmul['plain'] / slowest:.0f}× slower there."
            )
            break
    asked = max(results["counts"])
    browser = rows.get(f"{next(iter(results['specs']))}/{asked}", {}).get("tfjs-wasm-chromium", {})
    if asked > 1 and "threads" in browser:
        out.append(
            f"- TensorFlow.js's wasm backend in Chromium, asked for {asked} threads (`setThreadsCount`), reports "
            f"{browser['threads']} (`getThreadsCount`), its threaded build loaded in a cross-origin isolated page "
            f"(multithread support: {str(browser.get('multithread')).lower()}); in Node it has no threaded build."
        )
    out.append(
        "- tfjs-node (TensorFlow's C library under TensorFlow.js) is not a side: its install script downloads "
        "libtensorflow from storage.googleapis.com, outside the npm registry, which the machines this project runs "
        "on cannot reach (`npm install @tensorflow/tfjs-node` failed with ENOTFOUND there, 2026-11-29)."
    )
    return out


def _share(part: float | None, whole: float) -> str:
    return "—" if part is None else f"{part / whole:.0%}"


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f}" if size >= 2**20 else f"{size / 2**20:.2f}"


def _x(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio:.2f}×"


def run(quick: bool = False) -> str:
    """The section: the table and its profile, and (not quick) where the wasm build's kernels
    part ways from the native ones on transformers (wasm_kernels.py)."""
    text = report(benchmark(quick))
    if quick:
        return text
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import wasm_kernels

    return text + "\n" + wasm_kernels.section()


if __name__ == "__main__":
    tb.child_main(_python_child, run)
