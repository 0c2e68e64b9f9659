"""The benchmarks run end to end on tiny models: their sides start, train alike and answer, and
each report has its shape (no timing is checked).

Marked ``bench``: `make bench-check` runs them, and `make bench` first; `make test` leaves them
out (their dozens of processes were a tenth of the suite's time, for scripts no user runs).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.bench

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "train_bench.py"


def _load():
    spec = importlib.util.spec_from_file_location("benchmarks.train_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_train_benchmark_reports_every_column(tmp_path):
    bench = _load()
    tiny = bench.Spec("mlp", "MLP 8-4-3", 4, {"sizes": [8, 4, 3]}, steps=5)
    report = bench.benchmark([tiny], ("graphforge", "torch"), quick=True, gemm_n=128, cache=tmp_path, quiet_wait_s=0)
    header = next(line for line in report.splitlines() if line.startswith("| model | batch"))
    for column in ("GFLOP/step", "bound ms", "graphforge ms", "torch eager ms", "torch.compile ms"):
        assert column in header
    row = next(line for line in report.splitlines() if line.startswith("| MLP 8-4-3 | 4 |"))
    assert row.count("|") == header.count("|")
    assert "eager / graphforge" in report and "MiB: graphforge" in report
    assert "MLP 8-4-3: torch's first 5 losses" in report and "graphforge " in report
    assert "did not run" not in report
    lines = report.splitlines()
    table = lines.index("| model | forward | loss | backward | optimizer | largest op types |")
    where = lines[table + 2]
    assert where.startswith("| MLP 8-4-3 | ")
    shares = [int(cell.strip().rstrip("%")) for cell in where.split("|")[2:6]]  # forward, loss, backward, optimizer
    assert 97 <= sum(shares) <= 103  # rounded shares of one total
    forward, _, backward, optimizer = shares  # the loss, a handful of nodes, can round to 0%
    assert forward > 0 and backward > 0 and optimizer > 0


@pytest.mark.slow
def test_data_parallel_benchmark_runs_every_distributed_configuration(tmp_path):
    """Two real processes for each DP run (gloo on loopback), with overlap and without, and
    torch DDP's; the report has their rows (the one-process rows are train_bench's steps)."""
    sys.path.insert(0, str(BENCH.parent))
    import dp_bench

    distributed = tuple(label for label, _, processes, *_ in dp_bench.RUNS if processes > 1)
    report = dp_bench.report(dp_bench.benchmark(quick=True, passes=1, cache=tmp_path, only=distributed))
    for label in distributed:
        assert f"| {label} | " in report
    assert "graphforge DP / torch DDP:" in report and "(agree)" in report and "without it" in report


@pytest.mark.slow
def test_pipeline_benchmark_measures_and_simulates_every_row(tmp_path):
    """Two stage processes per run; every row has a measured and a simulated bubble."""
    sys.path.insert(0, str(BENCH.parent))
    import pp_bench

    measured = pp_bench.benchmark(quick=True, cache=tmp_path)
    report = pp_bench.report(measured)
    for schedule, micro in pp_bench.QUICK_RUNS:
        assert f"| {schedule} | {micro} | " in report
    for result in measured.values():
        for row in result["rows"]:
            assert 0 <= row["measured"] < 1 and 0 <= row["simulated"] < 1
    assert "More stages, simulated" in report


@pytest.mark.slow
def test_cuda_benchmark_sides_train_alike(tmp_path, monkeypatch):
    """The CUDA benchmark's measuring processes, run on the CPU (its trial mode): graphforge,
    torch eager and torch.compile train the same model to the same losses and report a step time; without a working CUDA
    provider the benchmark says why it is skipped."""
    from dataclasses import asdict

    from graphforge.runtime.sessions import CUDA, provider_works

    monkeypatch.setenv("GRAPHFORGE_BENCH_DEVICE", "cpu")
    sys.path.insert(0, str(BENCH.parent))
    import cuda_bench
    import train_bench

    tiny = train_bench.Spec("mlp", "MLP 8-4-3", 4, {"sizes": [8, 4, 3]}, steps=4)
    _, program, batches, _ = train_bench.prepare(tiny, tmp_path)
    common = {"spec": asdict(tiny), "batches": str(batches), "device": "cpu"}
    ours = cuda_bench.measure({**common, "side": "graphforge", "program": str(program), "capture": True})
    torch_side = cuda_bench.measure({**common, "side": "torch"})
    compiled = cuda_bench.measure({**common, "side": "torch", "compile": "aot_eager"})
    assert "error" not in ours and "error" not in torch_side and "error" not in compiled, (ours, torch_side, compiled)
    assert ours["losses"] == pytest.approx(torch_side["losses"], rel=1e-5)
    assert compiled["losses"] == pytest.approx(torch_side["losses"], rel=1e-5)  # the compiled side trains alike
    assert ours["step_s"] > 0 and ours["peak_mib"] is None  # no device memory on the CPU
    uncaptured = cuda_bench.measure({**common, "side": "graphforge", "program": str(program), "capture": False})
    assert uncaptured["losses"] == ours["losses"]  # the capture-ready mode computes what the normal one does
    assert [label for label, _ in cuda_bench.sides("bfloat16")] == [
        "graphforge, mixed_precision(bfloat16)",
        "torch eager, autocast(bfloat16)",
        "torch.compile, autocast(bfloat16)",
    ]
    monkeypatch.setattr(cuda_bench, "ROWS", "3, 2")  # make cuda-check ROWS=...: a second call on a GPU lease
    assert cuda_bench.chosen(quick=False) == [cuda_bench.FULL[2], cuda_bench.FULL[1]]
    monkeypatch.setattr(cuda_bench, "ROWS", "9")
    with pytest.raises(SystemExit, match="name rows 1 to 4"):
        cuda_bench.chosen(quick=False)
    monkeypatch.setattr(cuda_bench, "DEVICE", "cuda")
    assert (cuda_bench.unavailable() is None) == provider_works(CUDA)


@pytest.mark.slow
def test_mixed_precision_benchmark_reports_every_side(tmp_path, monkeypatch):
    """Each side in its own process on the CPU; the report has a row per side and the losses."""
    sys.path.insert(0, str(BENCH.parent))
    import mixed_precision_bench as mp
    import train_bench as tb

    monkeypatch.setenv("GRAPHFORGE_BENCH_DEVICE", "cpu")
    tiny = tb.Spec("gpt2", "GPT-2 1×32", 2, {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "seq": 8}, 5)
    report = mp.table("cpu", [tiny], tmp_path)
    for label, _ in mp.sides("cpu"):
        row = next(line for line in report.splitlines() if line.startswith(f"| GPT-2 1×32 | {label} |"))
        assert "failed" not in row and row.count("|") == 7
    assert "first losses" in report
    assert [label for label, _ in mp.sides("cuda")][-1] == "torch eager, autocast(float16) + GradScaler"


@pytest.mark.slow
def test_update_benchmark_reports_every_optimizer(tmp_path):
    """Every side of the update benchmark runs on a tiny MLP and the table has its rows."""
    sys.path.insert(0, str(BENCH.parent))
    import update_bench

    tiny = _load().Spec("mlp", "MLP 8-4-3", 4, {"sizes": [8, 4, 3]}, steps=5)
    rows = [(tiny.label, kind, update_bench.measure(tiny, kind, tmp_path, steps=2)) for kind in update_bench.UPDATES]
    report = update_bench.report(rows)
    for kind in update_bench.UPDATES:
        assert f"| MLP 8-4-3 | {kind} | " in report
    assert "adamw: torch._fused_adamw_" in report and "lamb: torch's foreach kernels" in report
    assert "| — (none) |" in report  # torch.optim has no LAMB


@pytest.mark.slow
def test_ondevice_benchmark_trains_alike_on_every_side(tmp_path):
    """Every side of the on-device benchmark (Node, Chromium, Python, TensorFlow.js) trains the
    digits MLP from the same weights to the same losses, and the report has every column; and
    TensorFlow.js, given the CNN's weights permuted to its channels-last layout, computes the
    CNN's losses as graphforge does."""
    sys.path.insert(0, str(BENCH.parent))
    import ondevice_bench as ob

    if ob.unavailable():
        pytest.skip(ob.unavailable())
    results = ob.benchmark(quick=True, cache=tmp_path)
    row = results["rows"]["digits/1"]
    runnable = [s for s in ob.SIDES if ob._missing(s) is None]
    want = row["python"]["losses"]
    for side in runnable:
        assert "error" not in row[side.key], (side.key, row[side.key])
        np.testing.assert_allclose(row[side.key]["losses"], want, rtol=1e-4, err_msg=side.key)
        assert row[side.key]["peakMiB"] > 10
    for side in (s for s in runnable if s.where == "chromium"):
        assert row[side.key]["isolated"] and row[side.key]["downloadedBytes"] > 100_000
    report = ob.report(results)
    header = next(line for line in report.splitlines() if line.startswith("| model | threads | graphforge JS"))
    digits = next(line for line in report.splitlines() if line.startswith("| digits MLP 64-64-10 | 1 | "))
    assert digits.count("|") == header.count("|") and "—" not in digits.split("|")[3]
    assert "Goal: ≥ 1.5× TensorFlow.js" in report and "Where a step of graphforge's runtime goes" in report

    # a CNN small enough for TensorFlow.js's cpu backend, its last feature map 2×2 over 3 channels
    tiny = ob.Spec(
        "cnn",
        "CNN 16×16",
        {"kind": "cnn", "input": [16, 16, 1], "convs": [{"filters": 2, "kernel": 3}, {"filters": 3, "kernel": 3}]},
        (1, 16, 16),
    )
    sides = [s for s in ob.SIDES if s.key in ("gf-node", "tfjs-cpu-node")]
    timing = {"warmup": 3, "blocks": 1, "blockSeconds": 0}
    row = ob.benchmark(cache=tmp_path, specs=[tiny], sides=sides, counts=[1], timing=timing)["rows"]["cnn/1"]
    if ob._missing(sides[1]) is None:
        np.testing.assert_allclose(row["tfjs-cpu-node"]["losses"], row["gf-node"]["losses"], rtol=1e-4)


@pytest.mark.slow
def test_transfer_benchmark_trains_alike_on_every_side(tmp_path):
    """The frozen-backbone benchmark's sides (torch eager, graphforge Python, the JS runtime on
    onnxruntime-node with the frozen weights constants and as inputs, onnxruntime-web wasm) train
    the tiny MobileNetV2 from the same weights to the same first losses; the report has every row
    and the profile."""
    sys.path.insert(0, str(BENCH.parent))
    import transfer_bench as tb

    results = tb.measure(quick=True, cache=tmp_path)
    rows = results["rows"]
    want = rows["torch eager"]["losses"]
    for label, _, backend, _ in tb.SIDES:
        if backend is not None and tb.steps_bench.unavailable():
            continue
        assert "error" not in rows[label], (label, rows[label])
        np.testing.assert_allclose(rows[label]["losses"][:3], want, rtol=1e-4, err_msg=label)
    report = tb.report(results)
    assert all(f"| {label} | " in report for label, *_ in tb.SIDES)
    assert "step with the ONNX update goes" in report and "backward" in report and "Goals: " in report
