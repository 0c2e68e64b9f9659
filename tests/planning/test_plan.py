"""``graphforge plan``: the splits of N processes it weighs, what it predicts of each (read
from the programs it compiles: nothing runs), and the configs it writes, which
``graphforge train`` then runs under torchrun as they are."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))  # its torchrun helpers
import _train_runs as runs
from _launch import REPO

import graphforge.train
from graphforge.pass_manager import parse_pipeline
from graphforge.planning.configs import plan_config, write_planned
from graphforge.planning.planner import Hardware, Split, plan, splits
from graphforge.train.config import load_config

pytest.importorskip("torch")
th = runs.th  # the training helpers (tests/train), which _train_runs puts on the path
DIGITS = REPO / "examples" / "digits"
PIPELINE = "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-2)"
GRAPHFORGE = Path(sys.executable).parent / "graphforge"


def _plan(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(GRAPHFORGE), "plan", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_the_splits_are_those_graphforge_runs_with_a_batch_each_replica_divides():
    got = set(splits(4, 8))
    assert {Split(4, zero=z) for z in (0, 1, 2)} <= got
    assert {Split(2, 2), Split(1, 4), Split(2, 1, 2, 2), Split(2, 1, 2, 4), Split(1, 1, 4, 4), Split(1, 1, 4, 8)} <= got
    # tensor groups as a pipeline's stages, and data-parallel replicas of such pipelines
    assert {Split(1, 2, 2, 2), Split(1, 2, 2, 4)} <= got
    assert {Split(2, 2, 2, 2), Split(2, 2, 2, 4)} <= set(splits(8, 16))
    assert {Split(2, 2, zero=z) for z in (1, 2)} <= got  # ZeRO over a mesh's replicas
    assert Split(2, 2, recompute=0.0) in got and not any(s.stages > 1 and s.recompute < 1 for s in got)
    # without stages, steps that accumulate 2 or 4 batches (not with recompute as well)
    assert {Split(4, 1, 1, 2), Split(2, 2, 1, 4, zero=1), Split(1, 4, 1, 2)} <= got
    assert not any(s.stages == 1 < s.microbatches and s.recompute < 1 for s in got)
    assert Split(4, 1, 1, 4) not in got  # a replica's 2 samples do not make 4 micro-batches
    assert all(s.processes == 4 and 8 % (s.data * s.microbatches) == 0 for s in got)
    assert Split(4) not in splits(4, 6)  # 6 samples do not split into 4 replicas


def test_the_predictions_follow_the_programs():
    """Each prediction reads the split's own program: the gradients' reduction only with
    replicas, the tensor sums only in a tensor group; a member holds less than a replica,
    ZeRO's shards less than whole states; twice the replicas halve the compute a process does."""
    model = onnx.load(DIGITS / "model.onnx")
    hardware = Hardware(flops=1e9, memory=2**30, overhead=0.0)  # the FLOPs alone
    done = {c.split: c.prediction for c in plan(model, parse_pipeline(PIPELINE), 64, {}, 2, hardware)}
    assert all(p is not None and p.fits for p in done.values()), done
    data, tensor, staged = done[Split(2)], done[Split(1, 2)], done[Split(1, 1, 2, 2)]
    assert data.data_s > 0 and data.tensor_s == 0 and tensor.tensor_s > 0 and tensor.data_s == 0
    assert tensor.memory < data.memory
    # tensor groups as stages: both kinds of communication's share in each process, and less memory
    four = {c.split: c.prediction for c in plan(model, parse_pipeline(PIPELINE), 64, {}, 4, hardware)}
    both = four[Split(1, 2, 2, 2)]
    assert both is not None and both.tensor_s > 0 and 0 < both.bubble < 1 and both.data_s == 0
    assert both.memory < done[Split(1, 1, 2, 2)].memory
    assert done[Split(2, zero=2)].memory < done[Split(2, zero=1)].memory < data.memory
    assert 0 < staged.bubble < 1 and staged.tensor_s == staged.data_s == 0
    one = {c.split: c.prediction for c in plan(model, parse_pipeline(PIPELINE), 64, {}, 1, hardware)}[Split(1)]
    assert data.compute_s == pytest.approx(one.compute_s / 2, rel=0.15)  # the update is not halved
    # a split graphforge would refuse to run is no candidate, and says why
    lamb = {c.split: c for c in plan(model, parse_pipeline(PIPELINE.replace("adamw", "lamb")), 64, {}, 2, hardware)}
    assert lamb[Split(1, 2)].prediction is None and "LAMB does not run tensor-parallel" in lamb[Split(1, 2)].reason
    assert lamb[Split(2)].prediction is not None


def test_a_memory_bandwidth_weighs_the_bytes_each_node_moves():
    """With Hardware.memory_bandwidth each node takes the longer of its FLOPs and its bytes
    (a roofline): at a memory far slower than the FLOPs, a data-parallel replica, which runs
    the elementwise update over every parameter, computes for more than half of what one
    process does, and more than a tensor-parallel member, which updates half of the
    parameters (and takes the whole batch); at a memory far faster, the FLOPs alone."""
    model = onnx.load(DIGITS / "model.onnx")
    flops_only = Hardware(flops=1e15, memory=2**30, overhead=0.0)

    def compute(hardware, processes, split):
        return {c.split: c.prediction for c in plan(model, parse_pipeline(PIPELINE), 64, {}, processes, hardware)}[
            split
        ].compute_s

    slow = dataclasses.replace(flops_only, memory_bandwidth=1e6)
    one, replica, member = compute(slow, 1, Split(1)), compute(slow, 2, Split(2)), compute(slow, 2, Split(1, 2))
    assert one > 100 * compute(flops_only, 1, Split(1))
    assert replica > 0.6 * one and replica > member
    fast = dataclasses.replace(flops_only, memory_bandwidth=1e30)
    assert compute(fast, 1, Split(1)) == pytest.approx(compute(flops_only, 1, Split(1)))


def test_recomputation_trades_compute_for_memory(transformer_path):
    """GPT-2 (1 layer): recompute(budget=0) in the program predicts less memory and more
    compute than the same split without it (the copies of the forward are in its FLOPs)."""
    pipeline = parse_pipeline("loss(kind=mse, output=logits), autodiff, adamw(lr=1e-3)")
    hardware = Hardware(flops=1e9, memory=2**30, overhead=0.0)
    done = {c.split: c.prediction for c in plan(onnx.load(transformer_path), pipeline, 8, {"seq": 8}, 1, hardware)}
    plain, recomputed = done[Split(1)], done[Split(1, recompute=0.0)]
    assert recomputed.memory < plain.memory and recomputed.compute_s > plain.compute_s


def test_accumulation_trades_runs_for_memory(transformer_path):
    """GPT-2 (1 layer), 64 sequences of 32 a step: accumulating 2 batches of 32 holds half of
    the activations (the accumulators besides) for a run more per step, the same FLOPs."""
    pipeline = parse_pipeline("loss(kind=mse, output=logits), autodiff, adamw(lr=1e-3)")
    hardware = Hardware(flops=1e9, memory=2**30)  # (each run's overhead: the one thing accumulation adds)
    done = {c.split: c.prediction for c in plan(onnx.load(transformer_path), pipeline, 64, {"seq": 32}, 1, hardware)}
    plain, accumulated = done[Split(1)], done[Split(1, 1, 1, 2)]
    assert accumulated.memory < plain.memory
    assert accumulated.compute_s == pytest.approx(plain.compute_s + hardware.overhead, rel=0.01)


def test_an_accumulating_member_sums_its_update_once_a_step():
    """A tensor member accumulating M batches sums its forward/backward's partial products once a
    batch, and the update's (the global norm, for clipping) once a step: on a link of latency
    alone, each sum costs the latency."""
    pipeline = parse_pipeline("loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-2, clip_grad_norm=1.0)")
    latency = 1e-3
    hardware = Hardware(flops=1e15, memory=2**30, memory_bandwidth=1e18, bandwidth=1e18, latency=latency)
    done = {c.split: c.prediction for c in plan(onnx.load(DIGITS / "model.onnx"), pipeline, 64, {}, 2, hardware)}
    sums = {m: round(done[Split(1, 2, 1, m)].tensor_s / latency) for m in (1, 2, 4)}
    update = 2 * sums[1] - sums[2]  # M=1: f + u, M=2: 2f + u
    assert update >= 1  # the norm's sum across the group
    assert sums[4] == 4 * (sums[1] - update) + update


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return th.workspace(tmp_path_factory.mktemp("plan"), count=64, eval_count=20)


def test_the_config_it_writes_runs_under_torchrun(folder):
    """The planned config keeps the config's keys and comments, sets the split (here a tensor
    group, the one split that fits a small memory) and a replica's share of the batch, and
    graphforge train runs it on the processes it was planned for."""
    cfg = runs.config(folder, "base.toml", {"checkpoint": {"every": 4}, "data": {"batch_size": 8}})
    done = _plan(
        cfg, "--processes", "2", "--memory-per-process", "1GiB", "--top", "20", "-o", "planned.toml", cwd=folder
    )
    assert done.returncode == 0, done.stderr
    first = done.stdout
    best = next(line for line in first.splitlines() if "D=" in line and "│" in line)  # the table's first row
    data = int(best.split("D=")[1].split()[0])
    tensor = int(best.split("T=")[1].split()[0])
    planned = load_config(folder / "planned.toml")
    assert f"wrote planned.toml (D={data} T={tensor}" in first
    assert planned.data.batch_size == 8 // data and planned.distributed.tensor == tensor  # a replica's share
    # a memory only a tensor member's half of the weights fits
    member = _memory_of(first, "D=1 T=2 S=1")
    replica = _memory_of(first, "D=2 T=1 S=1 ")
    assert member < replica
    limit = f"{int((member + replica) / 2)}B"
    done = _plan(cfg, "--processes", "2", "--memory-per-process", limit, "-o", "tensor.toml", cwd=folder)
    assert done.returncode == 0, done.stderr
    tensor = load_config(folder / "tensor.toml")
    assert tensor.distributed.tensor == 2 and tensor.data.batch_size == 8
    text = (folder / "tensor.toml").read_text()
    assert text.startswith("# planned by graphforge plan for 2 processes: D=1 T=2")
    # the header's command, as written, from the folder graphforge plan ran in
    command = text.split("run (from the folder graphforge plan ran in): ")[1].splitlines()[0]
    assert command == "torchrun --nproc-per-node=2 -m graphforge train tensor.toml"
    runs.launch(folder, folder / "tensor.toml", folder / "out", "--steps", "4")
    assert (folder / "out" / "checkpoints").is_dir()


def test_a_planned_accumulation_is_written_as_train_accumulate_and_trains(folder):
    """A split that accumulates M batches a step is written as data.batch_size = a 1/M of the
    step's batch and train.accumulate = M (a config that accumulates already counts its
    accumulation in the step's batch), and graphforge train runs it."""
    # (the pipeline as a user spells it: arguments in their order, a default written out)
    spelled = "loss(output=logits, kind=cross_entropy), autodiff, adamw(lr=0.05, weight_decay=0.01, accumulate=true)"
    sections = {"data": {"batch_size": 4}, "train": {"accumulate": 2}, "model": {"pipeline": spelled}}
    cfg = runs.config(folder, "accumulating.toml", sections)
    planned = plan_config(cfg, 1, Hardware(flops=1e9, memory=2**30))
    assert planned.batch == 8 and Split(1, 1, 1, 4) in {c.split for c in planned.candidates}
    write_planned(planned, Split(1, 1, 1, 4), folder / "accumulate4.toml", "planned: D=1 T=1 S=1 M=4")
    written = load_config(folder / "accumulate4.toml")
    assert (written.data.batch_size, written.train.accumulate) == (2, 4)
    assert written.model.pipeline == spelled  # the user's text, as it was
    write_planned(planned, Split(1), folder / "whole.toml", "planned: D=1 T=1 S=1")
    whole = load_config(folder / "whole.toml")
    assert (whole.data.batch_size, whole.train.accumulate) == (8, 1)
    recomputed = Split(1, recompute=0.0)
    write_planned(planned, recomputed, folder / "recompute.toml", "planned: D=1 T=1 S=1 recompute")
    added = load_config(folder / "recompute.toml").model.pipeline
    assert added.startswith(f"{spelled}, recompute(budget=0.0")  # only what the planner adds is new
    before, after = (cfg.read_text().splitlines(), (folder / "whole.toml").read_text().splitlines())
    changed = {line for line in after if not line.startswith("#")} - set(before)
    assert changed <= {"batch_size = 8"} and not any(line.startswith("accumulate") for line in after), changed
    result = graphforge.train.run(folder / "accumulate4.toml", steps=2, out=folder / "accumulated", quiet=True)
    assert result.step == 2


def test_a_model_whose_weights_are_not_here_plans_as_the_whole_one(folder):
    """The planner reads the graph alone: a model saved with its weights in an external file,
    that file gone (a model larger than this machine, say), plans to the predictions the
    whole model gets."""
    onnx.save(onnx.load(folder / "model.onnx"), folder / "graph-only.onnx", save_as_external_data=True,
              location="graph-only.data", size_threshold=0)  # fmt: skip
    (folder / "graph-only.data").unlink()
    whole = runs.config(folder, "whole.toml", {"data": {"batch_size": 8}})
    graph_only = runs.config(
        folder, "graph-only.toml", {"data": {"batch_size": 8}, "model": {"path": "graph-only.onnx"}}
    )
    hardware = Hardware(flops=1e9, memory=2**30)
    want, got = (plan_config(c, 2, hardware).candidates for c in (whole, graph_only))
    assert [(c.split, c.prediction, c.reason) for c in got] == [(c.split, c.prediction, c.reason) for c in want]
    assert any(c.prediction is not None for c in got)


def test_groups_one_node_holds_take_its_link():
    """With 2 processes a node, a D=2 × T=2 mesh sums within nodes on the node's own link and
    reduces the gradients across them on the slower one; a pipeline of two stages (T=1)
    sends within a node."""
    model = onnx.load(DIGITS / "model.onnx")
    flat = Hardware(flops=1e9, memory=2**30, overhead=0.0)
    nodes = dataclasses.replace(flat, node_processes=2, node_bandwidth=100 * flat.bandwidth, node_latency=0.0)
    assert nodes.link(2) == (100 * flat.bandwidth, 0.0) and nodes.link(4) == (flat.bandwidth, flat.latency)
    before, after = (
        {c.split: c.prediction for c in plan(model, parse_pipeline(PIPELINE), 64, {}, 4, h)} for h in (flat, nodes)
    )
    mesh, staged = Split(2, 2), Split(2, 1, 2, 2)
    assert after[mesh].tensor_s < before[mesh].tensor_s / 10 and after[mesh].data_s == before[mesh].data_s
    assert after[staged].compute_s < before[staged].compute_s and after[staged].data_s == before[staged].data_s
    assert after[Split(1, 4)] is None and before[Split(1, 4)] is not None  # a tensor group across nodes


def _memory_of(table: str, split: str) -> float:
    """The memory column of ``split``'s row, in bytes."""
    row = next(line for line in table.splitlines() if split in line)
    return _bytes([c.strip() for c in row.split("│") if c.strip()][6])


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def test_what_it_cannot_plan_is_one_line(folder):
    cfg = runs.config(folder, "refused.toml", {"data": {"batch_size": 8}})
    done = _plan(cfg, "--processes", "2", "--memory-per-process", "10B", cwd=folder)
    assert done.returncode == 2 and "no split of 2 processes fits 10 B a process" in done.stderr
    least = done.stderr.split("the least any needs is ")[1].split(" a process")[0]
    assert _bytes(least) > 10 and "(D=" in done.stderr  # and which split needs that little
    done = _plan(cfg, "--processes", "2", "--memory-per-process", "lots", cwd=folder)
    assert done.returncode == 2 and "write a size, e.g. 16GiB" in done.stderr
    staged = runs.config(folder, "staged.toml", {"model": {"pipeline": f"{th.PIPELINE}, pipeline(stages=2)"}})
    done = _plan(staged, "--processes", "2", "--memory-per-process", "1GiB", cwd=folder)
    assert done.returncode == 2 and "already has pipeline(...)" in done.stderr
    assert "Traceback" not in done.stderr
