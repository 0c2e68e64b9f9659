"""Several steps in one run: samples a second for k = 1, 4, 16 training steps per onnxruntime run
(the steps pass, passes/steps.py), in graphforge's three runtimes, on the on-device benchmark's
models (benchmarks/ondevice_bench.py: the same programs, artifacts and batches of 64, Adam).

* graphforge Python: ``Module.train_step`` (k = 1) and ``Module.train_steps`` on k stacked
  batches (the program's ONNX update: ``update="onnx"``);
* graphforge JS on onnxruntime-node: ``runStep`` (k = 1, train_step.onnx) and ``runSteps(feeds, k)``
  (train_steps.onnx);
* graphforge JS on onnxruntime-web's wasm backend in Node (the digits MLP only: the 784-1024-1024-10
  MLP's wasm step takes seconds).

Each side in its own process, one intra-op thread (the machine is shared), its losses awaited
every run; the stacked batches are made before timing. Time: warm-up runs (3, and 1.5 s at least),
then 5 blocks of about 0.5 s; the median block's time a step, as samples a second; each side and k
is measured in 3 rounds taken in turn (the machine is shared, its load moves), the fastest kept. The last column
is the step's time against Python's one step a run (``Module.train_step``), the goal the issue set
(onnxruntime-node within 1.2× of it on the MLP 784-1024-1024-10).

    .venv/bin/python benchmarks/steps_bench.py            # prints the markdown section
    .venv/bin/python benchmarks/run.py steps              # writes it into docs/benchmarks.md
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import helpers  # noqa: E402
import ondevice_bench as od  # noqa: E402

TITLE = "Several steps in one run"
KS = (1, 4, 16)
#: each configuration's runs, taken in turn; the fastest is reported
ROUNDS = 3
THREADS = 1
CACHE = helpers.cache("steps")


def unavailable() -> str | None:
    if od.NODE is None:
        return "node is not on PATH"
    if not (od.REPO / "js" / "node_modules" / "onnxruntime-node").is_dir():
        return "js/node_modules has no onnxruntime-node (make install)"
    return None


def _python(job: dict) -> dict:
    """graphforge's Module in a fresh process (this file with ``--python JOB``)."""
    done = subprocess.run(
        [sys.executable, __file__, "--python", json.dumps(job)], capture_output=True, text=True, timeout=900
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-600:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _python_child(job: dict) -> dict:
    import graphforge

    batches = od.read_batches(job["batches"])
    k = job["k"]
    runs = [
        [np.stack([batches[(r * k + i) % len(batches)][n] for i in range(k)]) for n in range(len(batches[0]))]
        for r in range(max(1, -(-len(batches) // k)))
    ]
    module = graphforge.Module(
        job["program"], device="cpu", intra_op_threads=job["threads"], inter_op_threads=1, update="onnx"
    )
    count = [0]

    def once() -> list[float]:
        feeds = batches[count[0] % len(batches)] if k == 1 else runs[count[0] % len(runs)]
        count[0] += 1
        return [float(module.train_step(*feeds))] if k == 1 else [float(x) for x in module.train_steps(*feeds)]

    return timed(once, job, steps_a_run=k)


def timed(once, job: dict, *, steps_a_run: int = 1, losses_kept: int = 5) -> dict:
    """Warm-up runs (at least 3, for ``job["warmupSeconds"]``), then ``job["blocks"]`` blocks of
    about ``job["blockSeconds"]``: each block's milliseconds a step, and the first losses.
    ``once()`` runs ``steps_a_run`` steps and returns their losses."""
    losses, runs, last, begun = [], 0, 0.0, time.perf_counter()
    while runs < 3 or time.perf_counter() - begun < job["warmupSeconds"]:
        started = time.perf_counter()
        losses += once()
        runs += 1
        last = time.perf_counter() - started
    per_block = max(1, round(job["blockSeconds"] / max(last, 1e-6)))
    blocks = []
    for _ in range(job["blocks"]):
        started = time.perf_counter()
        for _ in range(per_block):
            once()
        blocks.append((time.perf_counter() - started) * 1e3 / (per_block * steps_a_run))
    return {"blocks": blocks, "losses": losses[:losses_kept]}


def _node(job: dict) -> dict:
    done = subprocess.run(
        [od.NODE, str(HERE / "js" / "steps.mjs"), json.dumps(job)], capture_output=True, text=True, timeout=900
    )
    if done.returncode != 0:
        raise RuntimeError(od._first_error(done.stderr))
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(quick: bool, rounds: int | None = None) -> dict:
    """Per model: {side: {k: its run}}, each run the fastest of ``rounds`` (taken in turn, every
    side and k once a round: on a shared machine the load moves between them)."""
    specs = [s for s in od.SPECS if s.key in (("digits",) if quick else ("digits", "mlp"))]
    timing = {
        "warmupSeconds": 0.5 if quick else 1.5,
        "blockSeconds": 0.2 if quick else 0.5,
        "blocks": 3 if quick else 5,
    }
    rounds = rounds or (1 if quick else ROUNDS)
    results = {}
    for spec in specs:
        spec = od.Spec(spec.key, spec.label, spec.layers, spec.input_shape, batches=16)
        common = od.prepare(spec, CACHE / spec.key)
        sides = [("Python", _python, None), ("JS onnxruntime-node", _node, "node")]
        if spec.key == "digits":
            sides.append(("JS onnxruntime-web wasm (Node)", _node, "web"))
        rows = {label: {} for label, _, _ in sides}
        for _ in range(rounds):
            for label, run, backend in sides:
                for k in (1, 4) if quick else KS:
                    job = {**common, **timing, "threads": THREADS, "k": k, "backend": backend}
                    try:
                        done = run(job)
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        done = {"error": str(exc)[:200]}
                    kept = rows[label].get(k)
                    if kept is None or "error" in kept or ("blocks" in done and _ms(done) < _ms(kept)):
                        rows[label][k] = done
        results[spec.label] = rows
    return results


def report(results: dict) -> str:
    ks = sorted({k for rows in results.values() for side in rows.values() for k in side})
    head = " | ".join(f"k = {k} samples/s" for k in ks)
    lines = [
        f"Batch {od.BATCH}, Adam, one intra-op thread a side; k steps a run (k = 1: `train_step` / `runStep`, "
        f"else `train_steps` / `runSteps`); each cell the fastest of {ROUNDS} rounds taken in turn. Load at the end: "
        f"{_load()}.",
        "",
        f"| model | runtime | {head} | fastest k's step / Python's at k = 1 |",
        "| --- | --- |" + " ---: |" * (len(ks) + 1),
    ]
    for model, rows in results.items():
        python_step = _ms(rows["Python"].get(1))
        for side, by_k in rows.items():
            cells = []
            for k in ks:
                ms = _ms(by_k.get(k))
                cells.append(f"{od.BATCH / ms * 1e3:,.0f}" if ms else "failed")
            times = [t for t in (_ms(by_k.get(k)) for k in ks) if t]
            ratio = f"{min(times) / python_step:.2f}×" if times and python_step else "-"
            lines.append(f"| {model} | {side} | {' | '.join(cells)} | {ratio} |")
    lines.append("")
    for model, rows in results.items():
        python_step = _ms(rows["Python"].get(1))
        for side, by_k in rows.items():
            if side == "Python" or not python_step:
                continue
            ratios = ", ".join(f"k = {k} {_ms(by_k[k]) / python_step:.2f}×" for k in ks if _ms(by_k.get(k)))
            lines.append(f"{model}: {side}'s step against Python's one step a run: {ratios}.")
    lines.append("")
    for model, rows in results.items():
        firsts = {side: by_k.get(1, {}).get("losses", [])[:3] for side, by_k in rows.items()}
        shown = "; ".join(f"{side} {', '.join(f'{x:.6f}' for x in losses)}" for side, losses in firsts.items())
        lines.append(f"{model}: first losses at k = 1: {shown}.")
    errors = [
        f"{model} {side} k = {k}: {r['error']}"
        for model, rows in results.items()
        for side, by_k in rows.items()
        for k, r in by_k.items()
        if "error" in r
    ]
    lines += ["", *errors] if errors else []
    return "\n".join(lines) + "\n"


def _ms(result: dict | None) -> float | None:
    return statistics.median(result["blocks"]) if result and "blocks" in result else None


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {helpers.usable_cores()} cores, {helpers.cpu_name()}"


def run(quick: bool) -> str:
    return report(measure(quick))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--python":
        print(json.dumps(_python_child(json.loads(sys.argv[2]))))
    else:
        print(run("--quick" in sys.argv))
