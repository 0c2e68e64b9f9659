"""Kernel rates: the figures behind ``graphforge plan``'s CPU defaults, measured on this machine.

The planner (graphforge.planning.planner) prices each node of a program at the longer of its FLOPs
at ``Hardware.flops`` and its bytes at ``Hardware.memory_bandwidth``. On the CPU its defaults
(graphforge.planning.configs: CPU_FLOPS_PER_CORE, CPU_MEMORY_BANDWIDTH) are what single
onnxruntime kernels reach here, not what whole steps reach (a step's rate already mixes the
two bounds, and would count them twice):

* compute: a MatMul of [512, 256] × [256, 8192] (one of GPT-2 2×256's LM-head products), in a
  session of 1 thread and of one thread a core;
* memory: a Mul of two vectors of 8M float32 (three 32 MiB streams, far past the caches: the
  shape of an elementwise optimizer update), in one session of 1 thread, one of a thread a core,
  and one single-threaded session in each of N processes at once (the planner's memory is
  shared by the processes of a run).

Each figure is the median of repeated runs after a warm-up. Run alone:

    python benchmarks/kernel_rates_bench.py
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers

TITLE = "Kernel rates (the planner's CPU defaults)"
MATMUL = (512, 256, 8192)  # M, K, N
ELEMENTS = 8 * 2**20
REPEATS = 30


def _model(op: str, a: list[int], b: list[int], out: list[int]):
    graph = helper.make_graph(
        [helper.make_node(op, ["a", "b"], ["y"])],
        op.lower(),
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, a),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, b),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _case(kind: str):
    """(model, feeds, work per run): FLOPs for the MatMul, bytes moved for the Mul."""
    rng = np.random.default_rng(0)
    if kind == "matmul":
        m, k, n = MATMUL
        feeds = {"a": rng.standard_normal((m, k), np.float32), "b": rng.standard_normal((k, n), np.float32)}
        return _model("MatMul", [m, k], [k, n], [m, n]), feeds, 2.0 * m * k * n
    feeds = {"a": rng.standard_normal(ELEMENTS, np.float32), "b": rng.standard_normal(ELEMENTS, np.float32)}
    return _model("Mul", [ELEMENTS], [ELEMENTS], [ELEMENTS]), feeds, 3.0 * 4 * ELEMENTS


def _rate(kind: str, threads: int, start_at: float | None = None) -> float:
    """Work per second (median run) of one session of ``threads`` threads; ``start_at``: wait
    for that wall-clock time first (the processes of a concurrent measurement start together)."""
    from graphforge.runtime.sessions import CPU, create_session

    model, feeds, work = _case(kind)
    session = create_session(model, providers=[CPU], intra_op_threads=threads, inter_op_threads=1)
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    binding.bind_output("y")
    for _ in range(3):
        session.run_with_iobinding(binding)
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.time()))
    times = []
    for _ in range(REPEATS):
        began = time.perf_counter()
        session.run_with_iobinding(binding)
        times.append(time.perf_counter() - began)
    return work / statistics.median(times)


def _concurrent(kind: str, processes: int) -> float:
    """The sum of ``processes`` single-threaded sessions' rates, run at the same time (each
    process this script again, ``--rate``)."""
    start_at = time.time() + 5.0  # past every process's start and warm-up
    argv = [sys.executable, __file__, "--rate", kind, repr(start_at)]
    workers = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    return sum(float(w.communicate(timeout=300)[0]) for w in workers)


def measure() -> dict:
    cores = os.cpu_count() or 1
    return {
        "cores": cores,
        "matmul": {"1 thread": _rate("matmul", 1), f"{cores} threads": _rate("matmul", cores)},
        "mul": {
            "1 thread": _rate("mul", 1),
            f"{cores} threads": _rate("mul", cores),
            f"{cores} processes × 1 thread (sum)": _concurrent("mul", cores),
        },
    }


def report(measured: dict) -> str:
    from graphforge.planning.configs import CPU_FLOPS_PER_CORE, CPU_MEMORY_BANDWIDTH

    cores = measured["cores"]
    m, k, n = MATMUL
    rows = [f"| MatMul [{m}, {k}] × [{k}, {n}] | {label} | {rate / 1e9:.0f} GFLOP/s |"
            for label, rate in measured["matmul"].items()]  # fmt: skip
    rows += [f"| Mul of 2 × {ELEMENTS // 2**20}M float32 | {label} | {rate / 1e9:.1f} GB/s |"
             for label, rate in measured["mul"].items()]  # fmt: skip
    per_core = measured["matmul"]["1 thread"]
    shared = max(measured["mul"].values())
    return "\n".join([
        f"{helpers.cpu_name()}, {cores} cores; onnxruntime sessions of the single op (graphforge's "
        f"create_session), median of {REPEATS} runs after a warm-up.",
        "",
        "| kernel | threads | rate |",
        "| --- | --- | --- |",
        *rows,
        "",
        f"- The planner's defaults (graphforge/planning/configs.py): CPU_FLOPS_PER_CORE = "
        f"{CPU_FLOPS_PER_CORE / 1e9:.0f} GFLOP/s (measured here: {per_core / 1e9:.0f} a core), "
        f"CPU_MEMORY_BANDWIDTH = {CPU_MEMORY_BANDWIDTH / 1e9:g} GB/s shared by a run's processes "
        f"(measured here: at most {shared / 1e9:.1f}).",
        "- On another machine, pass its figures to `graphforge plan` (`--flops`, `--memory-bandwidth`) "
        "instead: the defaults are this machine's.",
    ]) + "\n"  # fmt: skip


def run(quick: bool = False) -> str:
    return report(measure())


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--rate":
        print(_rate(sys.argv[2], 1, float(sys.argv[3])))
    else:
        print(run())
