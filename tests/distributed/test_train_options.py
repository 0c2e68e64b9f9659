"""Every ``[train]`` key × every topology of ``graphforge train``: each trainer honours the
key, checked by its effect on a real run, or refuses the value in one line naming the key and
the topology (graphforge/train/trainers/options.py). A key of TrainConfig without a row fails.

Two runs per topology show every honoured key: one of non-default values (``epochs``,
``accumulate``, ``lr = 0``, ``device``, onnxruntime's dropout, an update), one of the defaults
(``steps``); one process trains here, the distributed topologies in one launch of four
processes (gloo on loopback) that prepares each config in turn in one World."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import _options_worker as worker
import numpy as np
import pytest
from _launch import REPO, start_ranks, wait_all

from graphforge.program import ProgramRoles
from graphforge.runtime import CheckpointState
from graphforge.train.config import TrainConfig

pytest.importorskip("torch")
sys.path.insert(0, str(REPO / "tests" / "train"))
import _train_helpers as th

WORKER = Path(__file__).parent / "_options_worker.py"
RANKS = 4
SAMPLES, BATCH = 64, 4
ACCUMULATED = th.PIPELINE.replace("lr=0.05", "lr=0.05, accumulate=true")
STAGED = f"{ACCUMULATED}, pipeline(stages=2, microbatches=2)"


@dataclass(frozen=True)
class Place:
    """A topology as this test starts it, and what it expects of it."""

    trainer: str
    #: what its refusals call it
    words: str
    #: how many processes share each global batch
    replicas: int
    sections: dict
    #: the update the run of non-defaults asks for, and what runs it ("zero": each replica its shard)
    update: str
    runs_update: str
    #: what update = "auto" runs
    auto: str


PLACES = {
    "one process": Place("OneProcess", "one process", 1, {}, "onnx", "onnx", "torch"),
    "data parallel": Place("DataParallelTrainer", "a data-parallel process", 4, {}, "onnx", "onnx", "onnx"),
    "zero": Place("ZeroTrainer", "a ZeRO process", 4, {"distributed": {"zero": 1}}, "torch", "zero", "zero"),
    "tensor group": Place(
        "TensorGroupTrainer", "a tensor group's member", 2, {"distributed": {"tensor": 2}}, "onnx", "onnx", "onnx"
    ),
    "pipeline stage": Place(
        "StageTrainer", "a pipeline stage", 2, {"model": {"pipeline": STAGED}}, "onnx", "onnx", "onnx"
    ),
    "tensor stage": Place(
        "TensorStageTrainer",
        "a pipeline stage of tensor groups",
        1,
        {"model": {"pipeline": STAGED}, "distributed": {"tensor": 2}},
        "onnx",
        "onnx",
        "onnx",
    ),
}
DISTRIBUTED = [name for name in PLACES if name != "one process"]


@dataclass(frozen=True)
class Refused:
    """A value the topology refuses, and words its one line must hold after the topology's name."""

    value: object
    words: str


HONOURED = "honoured"
TORCHRUN_DEVICE = Refused("cuda:1", "each process of a torchrun run takes its own device")
REDUCED = Refused("torch", "the program's ONNX update reads the gradients reduced across the replicas")
STAGE_UPDATE = Refused("torch", "each stage updates its own parameters in the program's ONNX update segments")
MICROBATCHES = Refused(3, "the program's pipeline runs 2 micro-batches per step")
SEVERAL = Refused(2, "several steps in one run take one process's whole program")

#: [train] key -> topology -> what a run shows: HONOURED (the key's effect, checked below) and refusals
TABLE: dict[str, dict[str, tuple]] = {
    "steps": {name: (HONOURED,) for name in PLACES},
    "epochs": {name: (HONOURED,) for name in PLACES},
    "accumulate": {
        **{name: (HONOURED,) for name in PLACES},
        "pipeline stage": (HONOURED, MICROBATCHES),
        "tensor stage": (HONOURED, MICROBATCHES),
    },
    "lr": {name: (HONOURED,) for name in PLACES},
    "device": {"one process": (HONOURED,), **{name: (HONOURED, TORCHRUN_DEVICE) for name in DISTRIBUTED}},
    "dropout": {name: (HONOURED,) for name in PLACES},
    "update": {
        "one process": (HONOURED,),
        "data parallel": (HONOURED, REDUCED),
        "zero": (
            HONOURED,
            Refused("onnx", "each process updates its shard of the optimizer states in torch's kernels"),
        ),
        "tensor group": (HONOURED, REDUCED),  # (two replicas of the group)
        "pipeline stage": (HONOURED, STAGE_UPDATE),
        "tensor stage": (HONOURED, STAGE_UPDATE),
    },
    "steps_per_run": {"one process": (HONOURED,), **{name: (SEVERAL,) for name in DISTRIBUTED}},
}

#: the run of non-default values, and the run of the defaults but its length
CHANGED = {"epochs": 1, "accumulate": 2, "lr": 0.0, "device": "cpu", "dropout": "onnxruntime"}
DEFAULTS = {"steps": 2}


def _configs(folder: Path, name: str, place: Place) -> dict[str, Path]:
    """The configs a topology runs: the two runs, and one per value it refuses."""
    trains = {"changed": {"steps": None, **CHANGED, "update": place.update}, "defaults": DEFAULTS}
    for key, row in TABLE.items():
        for refused in (r for r in row[name] if r != HONOURED):
            trains[f"{key}={refused.value}"] = {"steps": 1, key: refused.value}
    if name == "one process":  # four steps in runs of two, and one a run, the program's update both
        trains["several"] = {"steps": 4, "steps_per_run": 2, "update": "onnx"}
        trains["single"] = {"steps": 4, "update": "onnx"}
    configs = {}
    for case, train in trains.items():
        sections = {
            "model": {"pipeline": ACCUMULATED},
            "data": {"eval": None, "batch_size": BATCH},
            "log": {"every": 100, "tensorboard": False, "progress": False},
            "distributed": {"timeout_s": 30},
        }
        for section, table in place.sections.items():
            sections[section] = {**sections[section], **table}
        tag = f"{name.replace(' ', '-')}-{case}"
        document = {**th.base_config(**sections, train=train), "out": str(folder / tag)}
        configs[case] = th.write_config(folder, document, f"{tag}.toml")
    return configs


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict[str, dict[str, list[dict]]]:
    """topology -> config -> what each of its processes saw (graphforge/train's outcome)."""
    folder = th.with_dropout(th.workspace(tmp_path_factory.mktemp("options"), count=SAMPLES))
    configs = {name: _configs(folder, name, place) for name, place in PLACES.items()}
    spec = folder / "spec.json"
    launched = {f"{name}/{case}": str(path) for name in DISTRIBUTED for case, path in configs[name].items()}
    spec.write_text(json.dumps({"configs": launched, "out": str(folder), "timeout_s": 60}))
    ranks = start_ranks(RANKS, [str(WORKER), str(spec)], cwd=folder)
    # one process trains here meanwhile
    result = {"one process": {case: [worker.outcome(path, None)] for case, path in configs["one process"].items()}}
    for done in wait_all(ranks, timeout=240):
        assert done.returncode == 0, done.output[-4000:]
    by_rank = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(RANKS)]
    for name in DISTRIBUTED:
        result[name] = {case: [rank[f"{name}/{case}"] for rank in by_rank] for case in configs[name]}
    return result


# --------------------------------------------------------------------------- each key's effect


def _trained(seen: dict, case: str) -> list[dict]:
    """Each process's outcome of one run, which must have trained."""
    outcomes = seen[case]
    assert all("refused" not in o for o in outcomes), outcomes[0]
    return outcomes


def _parameters(outcome: dict) -> tuple[dict, dict]:
    """The checkpoint's parameters (loaded whole, from every process's file) and the program's initial ones."""
    out = Path(outcome["checkpoint"]).parent.parent
    names = ProgramRoles.read(out / "program.onnx").parameters
    saved, initial = CheckpointState.load(outcome["checkpoint"]), CheckpointState.from_program(out / "program.onnx")
    return {n: saved.tensors[n] for n in names}, {n: initial.tensors[n] for n in names}


def _steps(seen: dict, place: Place) -> None:
    """train.steps = 2: two steps, and the checkpoint of step 2."""
    for outcome in _trained(seen, "defaults"):
        assert outcome["step"] == 2
    assert CheckpointState.load(seen["defaults"][0]["checkpoint"]).step == 2


def _epochs(seen: dict, place: Place) -> None:
    """train.epochs = 1: one pass over this topology's share of the samples, 2 batches a step."""
    for outcome in _trained(seen, "changed"):
        assert outcome["step"] == SAMPLES // (place.replicas * BATCH) // 2


def _accumulate(seen: dict, place: Place) -> None:
    """train.accumulate = 2: each step reads two batches (of every replica), one epoch all the samples."""
    for outcome in _trained(seen, "changed"):
        assert outcome["microbatches"] == 2
    assert CheckpointState.load(seen["changed"][0]["checkpoint"]).properties["samples"] == SAMPLES


def _lr(seen: dict, place: Place) -> None:
    """train.lr = 0 (the program's is 0.05): the parameters end as they began, bit for bit
    (AdamW moves them by lr times its step); with the program's rate they move."""
    saved, initial = _parameters(_trained(seen, "changed")[0])
    assert CheckpointState.load(seen["changed"][0]["checkpoint"]).learning_rate == 0.0
    for name, value in initial.items():
        assert np.array_equal(saved[name], value), name
    saved, initial = _parameters(_trained(seen, "defaults")[0])
    for name, value in initial.items():
        assert not np.array_equal(saved[name], value), name


def _device(seen: dict, place: Place) -> None:
    """train.device = "cpu": every process trains on the CPU."""
    assert [o["device"] for o in _trained(seen, "changed")] == ["cpu"] * len(seen["changed"])


def _dropout(seen: dict, place: Place) -> None:
    """train.dropout: "onnxruntime" leaves its Dropout in what trains (the stage that has the
    layer); "seeded" (the default) replaces it with masks from the key each run is fed."""
    changed, defaults = _trained(seen, "changed"), _trained(seen, "defaults")
    assert any(o["dropout_nodes"] for o in changed) and not any(o["dropout_key"] for o in changed)
    assert any(o["dropout_key"] for o in defaults) and not any(o["dropout_nodes"] for o in defaults)


def _update(seen: dict, place: Place) -> None:
    """train.update: the value asked for runs the update it names, on every process; "auto"
    runs what the topology's table says, and the run says which."""
    assert [o["update"] for o in _trained(seen, "changed")] == [place.runs_update] * len(seen["changed"])
    defaults = _trained(seen, "defaults")
    assert [o["update"] for o in defaults] == [place.auto] * len(defaults)
    assert any("update" in note for note in defaults[0]["notes"]), defaults[0]["notes"]


def _steps_per_run(seen: dict, place: Place) -> None:
    """train.steps_per_run = 2 (one process): four steps in two runs end where four runs of one
    step end, bit for bit."""
    several, single = (_trained(seen, case)[0] for case in ("several", "single"))
    assert several["step"] == single["step"] == 4
    want, got = (CheckpointState.load(o["checkpoint"]).tensors for o in (single, several))
    for name, value in want.items():
        assert np.array_equal(got[name], value), name
    assert any("train.steps_per_run = 2" in note for note in several["notes"]), several["notes"]


EFFECTS = {
    "steps": _steps,
    "epochs": _epochs,
    "accumulate": _accumulate,
    "lr": _lr,
    "device": _device,
    "dropout": _dropout,
    "update": _update,
    "steps_per_run": _steps_per_run,
}


# --------------------------------------------------------------------------- the table


def test_every_train_key_has_a_row_for_every_topology():
    assert set(TABLE) == {f.name for f in dataclasses.fields(TrainConfig)} == set(EFFECTS)
    for key, row in TABLE.items():
        assert set(row) == set(PLACES), key


def test_each_topology_is_the_trainer_it_names(seen):
    for name, place in PLACES.items():
        for case in ("changed", "defaults"):
            assert {o["trainer"] for o in _trained(seen[name], case)} == {place.trainer}, (name, case)


@pytest.mark.parametrize("key", list(TABLE))
@pytest.mark.parametrize("topology", list(PLACES))
def test_each_option_is_honoured_or_refused_by_name(seen, key, topology):
    place = PLACES[topology]
    for expected in TABLE[key][topology]:
        if expected == HONOURED:
            EFFECTS[key](seen[topology], place)
            continue
        value = json.dumps(expected.value)
        for outcome in seen[topology][f"{key}={expected.value}"]:
            assert "refused" in outcome, outcome
            (line,) = outcome["refused"].splitlines()
            assert f".toml: train.{key} = {value} is not available for {place.words}: {expected.words}" in line
