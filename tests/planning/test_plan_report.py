"""What ``graphforge plan`` prints of a plan (graphforge.planning.report), on plans written
by hand: the table, the splits it could not weigh, the split it picks and the note it writes."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from graphforge.errors import GraphforgeError
from graphforge.planning.configs import ConfigPlan
from graphforge.planning.planner import Candidate, Hardware, Prediction, Split
from graphforge.planning.report import REASONS_SHOWN, best_fit, predicted, refusals, run_note, splits_table
from graphforge.train.config import Config

CONFIG = Config.from_dict({"model": {"path": "model.onnx", "pipeline": "dce"}, "data": {"train": "train.npz"}})
HARDWARE = Hardware(flops=2e9, memory=2**20, bandwidth=1e9, latency=1e-5)


def _plan(candidates: list[Candidate], processes: int = 2, hardware: Hardware = HARDWARE) -> ConfigPlan:
    return ConfigPlan(CONFIG, candidates, 8, {"batch": 8, "seq": 16}, processes, hardware)


def _predicted(split: Split, memory: int, compute_s: float = 1e-3) -> Candidate:
    fits = memory <= HARDWARE.memory
    return Candidate(split, Prediction(split, compute_s, 2e-3, 0.5e-3, 0.25, memory, fits))


def _rows(table) -> list[list[str]]:
    console = Console(file=io.StringIO(), width=300, color_system=None)
    console.print(table)
    lines = [line.replace("┃", "│") for line in console.file.getvalue().splitlines()]
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in lines if line.count("│") >= 2]


def test_the_table_shows_each_split_and_the_machine():
    nodes = Hardware(flops=2e9, memory=2**20, node_processes=2, node_bandwidth=1e11, node_latency=0.0)
    planned = _plan([_predicted(Split(2), 3 * 2**19), _predicted(Split(1, 2), 2**19)], 4, nodes)
    table = splits_table(planned, predicted(planned)[:1], "run.toml")
    assert table.title == (
        "run.toml on 4 processes: global batch 8 (batch=8, seq=16), 1.0 MiB each, 2 GFLOP/s each, "
        "1 GB/s and 2000 µs a message (2 a node, on its own link: 100 GB/s and 0 µs a message)"
    )
    assert _rows(table)[1:] == [["D=2 T=1 S=1", "3.50 ms", "1.00 ms", "2.00 ms", "0.50 ms", "25%", "1.5 MiB", "no"]]


def test_the_splits_it_could_not_weigh_are_said_first_with_reasons_then_by_name():
    refused = [Candidate(Split(1, 1, s, s), reason=f"reason {s}") for s in range(2, 2 + REASONS_SHOWN + 2)]
    said = refusals(_plan([_predicted(Split(2), 10), *refused]))
    assert said == [("not a candidate", f"reason {s}") for s in range(2, 2 + REASONS_SHOWN)] + [
        ("not candidates either", ", ".join(str(c.split) for c in refused[REASONS_SHOWN:]))
    ]
    assert refusals(_plan([_predicted(Split(2), 10)])) == []


def test_the_best_split_is_the_first_that_fits():
    slow_fits, fast_too_big = _predicted(Split(1, 2), 2**20, compute_s=9e-3), _predicted(Split(2), 2**20 + 1)
    assert best_fit(_plan([fast_too_big, slow_fits])) is slow_fits


def test_a_plan_with_nothing_to_pick_is_one_error():
    with pytest.raises(GraphforgeError, match=r"^no split of 2 processes could be predicted: T=2 needs more$"):
        predicted(_plan([Candidate(Split(1, 2), reason="T=2 needs more"), Candidate(Split(2), reason="other")]))
    too_big = [_predicted(Split(2), 3 * 2**20), _predicted(Split(1, 2), 2 * 2**20)]
    with pytest.raises(GraphforgeError) as raised:
        best_fit(_plan(too_big))
    assert str(raised.value) == (
        "no split of 2 processes fits 1.0 MiB a process; the least any needs is 2.0 MiB a process (D=1 T=2 S=1)"
    )


def test_the_note_says_what_was_predicted_and_how_to_run_it():
    best = _predicted(Split(2), 2**19)
    assert run_note(_plan([best]), best, Path("my plan.toml")) == (
        "planned by graphforge plan for 2 processes: D=2 T=1 S=1, predicted 3.50 ms a step, 512.0 KiB a process\n"
        "run (from the folder graphforge plan ran in): torchrun --nproc-per-node=2 -m graphforge train 'my plan.toml'"
    )
    alone = _predicted(Split(1), 2**19)
    assert run_note(_plan([alone], 1), alone, Path("plan.toml")).endswith(
        "for 1 process: D=1 T=1 S=1, predicted 3.50 ms a step, 512.0 KiB a process\n"
        "run (from the folder graphforge plan ran in): graphforge train plan.toml"
    )


def test_a_written_config_elsewhere_keeps_every_path_pointing_at_the_same_file(tmp_path):
    """The paths a config names (model, data, a text tokenizer and its cache) are relative to its
    folder: a planned config written to another folder names the same files from there."""
    import tomlkit

    from graphforge.planning.configs import _rebase

    base, folder = tmp_path / "runs", tmp_path / "planned" / "here"
    document = tomlkit.parse(
        '[model]\npath = "m.onnx"\n[data]\ntrain = "t.jsonl"\neval = "python:make"\ntokenizer = "tok"\ncache = "c"\n'
    )
    _rebase(document, base, folder)
    keys = [("model", "path"), ("data", "train"), ("data", "eval"), ("data", "tokenizer"), ("data", "cache")]
    assert {key: str(document[section][key]) for section, key in keys} == {
        "path": "../../runs/m.onnx",
        "train": "../../runs/t.jsonl",
        "eval": "python:make",
        "tokenizer": "../../runs/tok",
        "cache": "../../runs/c",
    }
