"""``graphforge plan``: a train config's splits over N processes, predicted
(graphforge.planning.planner), and the config written back with the one picked.

The config's step is taken as the global batch: ``data.batch_size`` × ``train.accumulate``,
what one process of it trains on in a step. A split of D data-parallel replicas gives each 1/D
of it, cut into the M micro-batches the split's step runs (a pipeline's, or batches it
accumulates): the written config's ``data.batch_size`` is one of those (graphforge train's
batch is a replica's micro-batch) and its ``train.accumulate`` M where there are no stages, so
every split trains on the same global batch a step. The sizes of the other symbolic dims (a sequence) come
from the first batch of ``data.train`` (an .npz file or a folder of .npy files), or ``dims``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import tomlkit

from graphforge.analysis.memory import dims_of
from graphforge.model_io import load
from graphforge.pass_manager import parse_pipeline, pipeline_text
from graphforge.planning.planner import (
    CPU_RUN_OVERHEAD,
    GLOO_BANDWIDTH,
    GLOO_LATENCY,
    Candidate,
    Hardware,
    Split,
    batch_dims_of,
    plan,
    planned_passes,
)
from graphforge.tempfiles import write_atomically
from graphforge.train.config import Config, ConfigError, load_config

#: FLOP/s of one onnxruntime CPU thread in a matrix product, and bytes/s the machine's memory
#: streams through an elementwise kernel, shared by all its processes: measured on the 2-core
#: EPYC VM the benchmarks run on by benchmarks/kernel_rates_bench.py (docs/benchmarks.md,
#: "Kernel rates"). Each node of a program takes the longer of the two
#: (graphforge.planning.planner): the kernels' figures, not the steps', which mix both bounds.
#: GPT-2 2×256's step (45.2 GFLOP, 5.7 GB moved) is then predicted at 417 ms where one process
#: measured 394 (docs/benchmarks.md, "Planning splits")
CPU_FLOPS_PER_CORE = 8.0e10
CPU_MEMORY_BANDWIDTH = 2.7e10


@dataclass(frozen=True)
class ConfigPlan:
    """A config's candidates (graphforge.planning.planner), the global batch and dims they assume."""

    config: Config
    candidates: list[Candidate]
    batch: int
    dims: dict[str, int]
    processes: int
    hardware: Hardware
    #: the inputs' batch dims (what a split divides)
    batch_dims: frozenset[str] = frozenset()


def default_hardware(
    processes: int,
    memory: int,
    *,
    node_processes: int = 0,
    node_bandwidth: float | None = None,
    node_latency: float | None = None,
    **given: float | None,
) -> Hardware:
    """This machine as N processes share it: each its share of the cores (graphforge train
    gives each process cores / N threads; more processes than cores take turns) at
    CPU_FLOPS_PER_CORE each, the memory's CPU_MEMORY_BANDWIDTH shared among them, and gloo on
    loopback, whose bandwidth and latency the turns stretch as they stretch the compute (4
    processes on 2 cores: 0.55 GB/s measured, where 2 have 1.0). ``given``: flops,
    memory_bandwidth, bandwidth, latency, overhead that replace the defaults; ``node_*``: the
    processes a node holds and their own link (Hardware's)."""
    cores = os.cpu_count() or 1
    turns = max(1.0, processes / cores)
    defaults = {
        "flops": CPU_FLOPS_PER_CORE * cores / processes,
        "memory_bandwidth": CPU_MEMORY_BANDWIDTH / processes,
        "bandwidth": GLOO_BANDWIDTH / turns,
        "latency": GLOO_LATENCY * turns,
        "overhead": CPU_RUN_OVERHEAD,
    }
    chosen = {k: (given.get(k) if given.get(k) is not None else v) for k, v in defaults.items()}
    node = {"node_processes": node_processes, "node_bandwidth": node_bandwidth, "node_latency": node_latency}
    return Hardware(memory=memory, **chosen, **node)


def plan_config(path: str | Path, processes: int, hardware: Hardware, dims: Mapping[str, int] | None = None):
    """The predictions for ``processes`` running the config at ``path``."""
    config = load_config(path)
    if config.model.path is None or config.model.pipeline is None:
        raise ConfigError(
            f"{config.where}: graphforge plan needs model.path and model.pipeline (it compiles each split's program), "
            "not model.program"
        )
    if config.data.batch_size is None:
        raise ConfigError(f"{config.where}: graphforge plan needs data.batch_size: the global batch it divides")
    for key in ("tensor_parallel", "pipeline"):
        if any(p.name == key for p in parse_pipeline(config.model.pipeline)):
            raise ConfigError(
                f"{config.where}: model.pipeline already has {key}(...): graphforge plan picks the split itself; "
                "leave it out"
            )
    model = load(config.model.path, load_external_data=False)  # (the planner reads shapes: no weight is read)
    passes = parse_pipeline(config.model.pipeline)
    batch = int(config.data.batch_size) * config.train.accumulate
    found = dict(dims or {}) or _dims_from_data(config, model, batch)
    candidates = plan(model, passes, batch, found, processes, hardware)
    return ConfigPlan(config, candidates, batch, found, processes, hardware, frozenset(batch_dims_of(model)))


def write_planned(planned: ConfigPlan, split: Split, target: Path, note: str) -> None:
    """The config ``planned`` read, with ``split`` in it, written to ``target`` at once (its
    comments and other keys as they were; ``note`` a comment above them)."""
    config = planned.config
    document = tomlkit.parse(Path(config.source).read_text())
    base = Path(config.source).parent
    model = document.setdefault("model", tomlkit.table())
    # a process's batch: its replica's share, cut into the micro-batches a step runs
    # (train.accumulate's without stages; the pipeline's, which sets train.accumulate itself)
    micro = planned.batch // (split.data * split.microbatches)
    replica = {**planned.dims, **dict.fromkeys(planned.batch_dims, micro)}
    passes = planned_passes(parse_pipeline(config.model.pipeline), split, replica)
    model["pipeline"] = pipeline_text(passes, config.model.pipeline, full=False)  # the user's spelling kept
    data = document.setdefault("data", tomlkit.table())
    data["batch_size"] = micro
    train = document.get("train")
    if split.stages == 1 and split.microbatches > 1:
        train = document.setdefault("train", tomlkit.table())
        train["accumulate"] = split.microbatches
    elif train is not None and "accumulate" in train:
        del train["accumulate"]
    distributed = document.setdefault("distributed", tomlkit.table())
    for key, value, default in (("tensor", split.tensor, 1), ("zero", split.zero, 0)):
        if value != default:
            distributed[key] = value
        elif key in distributed:
            del distributed[key]
    if not distributed:
        del document["distributed"]
    if target.absolute().parent.resolve() != base.resolve():  # paths in it are relative to its own folder
        _rebase(document, base, target.absolute().parent.resolve())
    text = "".join(f"# {line}\n" for line in note.splitlines()) + tomlkit.dumps(document)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(target, text.encode())


def _rebase(document, base: Path, folder: Path) -> None:
    paths = (
        ("model", "path"),
        ("data", "train"),
        ("data", "eval"),
        ("model", "program"),
        ("data", "tokenizer"),
        ("data", "cache"),
    )
    for section, key in paths:
        table = document.get(section)
        value = table.get(key) if table is not None else None
        if isinstance(value, str) and not value.startswith("python:") and not Path(value).is_absolute():
            table[key] = os.path.relpath((base / value).resolve(), folder)


def _dims_from_data(config: Config, model: onnx.ModelProto, batch: int) -> dict[str, int]:
    """The inputs' dims other than the batch, from the first batch of data.train."""
    location = config.data.train
    arrays = {}
    if isinstance(location, Path) and location.suffix == ".npz" and location.is_file():
        with np.load(location) as data:
            arrays = {name: data[name][:batch] for name in data.files}
    elif isinstance(location, Path) and location.is_dir():
        arrays = {p.stem: np.load(p, mmap_mode="r")[:batch] for p in location.glob("*.npy")}
    renamed = {program: config.data.inputs.get(program, program) for program in _inputs(model)}
    feeds = {program: arrays[array] for program, array in renamed.items() if array in arrays}
    if len(feeds) != len(renamed):
        missing = sorted(set(renamed) - set(feeds))
        raise ConfigError(
            f"{config.where}: graphforge plan reads the inputs' sizes from data.train's first batch, which has no "
            f"array for {', '.join(missing)}: give them as --dims name=size"
        )
    return dims_of(model, feeds)


def _inputs(model: onnx.ModelProto) -> list[str]:
    initializers = {t.name for t in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in initializers]
