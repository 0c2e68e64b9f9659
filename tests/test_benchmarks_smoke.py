"""The training-step benchmark runs end to end on a tiny MLP and reports every column.

No timing is checked: only that the workers start, train, answer and the report has its shape.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "train_bench.py"


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
def test_data_parallel_benchmark_runs_every_configuration(tmp_path):
    """Two real processes for each DP run (gloo on loopback); the report has every row."""
    sys.path.insert(0, str(BENCH.parent))
    import dp_bench

    report = dp_bench.report(dp_bench.benchmark(quick=True, passes=1, cache=tmp_path))
    for label, *_ in dp_bench.RUNS:
        assert f"| {label} | " in report
    assert "graphforge DP / torch DDP:" in report and "(agree)" in report


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
