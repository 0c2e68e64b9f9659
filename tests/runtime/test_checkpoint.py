"""Checkpoints: resume is bit-identical, saves are atomic, and every corrupt or mismatched
checkpoint is refused naming the file and the tensor, with nothing overwritten."""

from __future__ import annotations

import json
import os
import re
import struct

import _training_models as tm
import models
import numpy as np
import pytest

import graphforge
import graphforge.runtime.checkpoint as checkpoint_module
from graphforge import CheckpointError, CheckpointManager, CheckpointState, Module, Optimizer
from graphforge.runtime import CosineSchedule, schedule_from_state_dict
from graphforge.runtime.checkpoint import checksum

pytest.importorskip("torch")
safetensors_numpy = pytest.importorskip("safetensors.numpy")


@pytest.fixture(scope="module")
def mlp_bytes():
    return tm.mlp_onnx()


@pytest.fixture(scope="module")
def program(mlp_bytes):
    return tm.compile_program(mlp_bytes, "adamw(lr=0.01, weight_decay=0.1)")


@pytest.fixture(scope="module")
def accumulating_program(mlp_bytes):
    return tm.compile_program(mlp_bytes, "sgd(lr=0.05, momentum=0.9, accumulate=true)")


def _train(module, optimizer, schedule, batches, *, fused):
    for x, target in batches:
        if fused:
            module.train_step(x, target)
        else:
            module(x, target)
            optimizer.step()
        schedule.step()


@pytest.mark.parametrize("fused", [False, True], ids=["call+step", "train_step"])
def test_resume_is_bit_identical(program, tmp_path, fused):
    """10 steps, save, load into a new Module, 10 more == 20 uninterrupted steps, bit for bit
    (parameters, optimizer states, step, learning-rate schedule)."""
    data = tm.batches(20, seed=3)

    whole = Module(program, device="cpu")
    whole_optimizer = Optimizer(whole)
    _train(whole, whole_optimizer, CosineSchedule(whole_optimizer, warmup_steps=4, total_steps=20), data, fused=fused)

    first = Module(program, device="cpu")
    first_optimizer = Optimizer(first)
    schedule = CosineSchedule(first_optimizer, warmup_steps=4, total_steps=20)
    _train(first, first_optimizer, schedule, data[:10], fused=fused)
    first.state.scheduler = schedule.state_dict()
    first.state.seeds = {"data": 3}
    first.state.data_position = {"epoch": 0, "batch": 10}
    first.state.properties["note"] = "halfway"
    path = first.state.save(tmp_path / "ck.safetensors")

    state = CheckpointState.load(path, program)
    assert (state.step, state.seeds, state.data_position, state.properties) == (
        10,
        {"data": 3},
        {"epoch": 0, "batch": 10},
        {"note": "halfway"},
    )
    second = Module(program, state, device="cpu")
    second_optimizer = Optimizer(second)
    resumed_schedule = schedule_from_state_dict(state.scheduler, second_optimizer)
    assert second_optimizer.get_learning_rate() == first_optimizer.get_learning_rate()
    _train(second, second_optimizer, resumed_schedule, data[10:], fused=fused)

    assert second.state.step == whole.state.step == 20
    resumed, uninterrupted = second.state.tensors, whole.state.tensors
    assert sorted(resumed) == sorted(uninterrupted)
    for name, value in uninterrupted.items():
        assert np.array_equal(resumed[name], value), name


def test_resume_mid_accumulation_keeps_the_accumulated_gradients(accumulating_program, tmp_path):
    data = tm.batches(4, batch=3, seed=4)
    whole = Module(accumulating_program, device="cpu")
    for x, target in data[:3]:
        whole(x, target)
    whole.train_step(*data[3])

    first = Module(accumulating_program, device="cpu")
    for x, target in data[:2]:
        first(x, target)
    first.state.save(tmp_path / "mid.safetensors")
    state = CheckpointState.load(tmp_path / "mid.safetensors", accumulating_program)
    assert any(not np.all(state.tensors[n] == 0) for n in state.tensors if n.endswith("_grad_acc"))
    assert state.grad_reset_pending is False  # saved mid-accumulation: the next call adds
    second = Module(accumulating_program, state, device="cpu")
    second(*data[2])
    second.train_step(*data[3])
    for name, value in whole.state.tensors.items():
        assert np.array_equal(second.state.tensors[name], value), name


def test_state_roundtrip_keeps_values_dtypes_and_roles(program, tmp_path):
    state = CheckpointState.from_program(program)
    state.learning_rate = 0.003
    path = state.save(tmp_path / "init.safetensors")
    loaded = CheckpointState.load(path, program)
    assert loaded.learning_rate == 0.003 and loaded.step == 0
    assert {s.name: s.role for s in loaded.specs} == {s.name: s.role for s in state.specs}
    for name, value in state.tensors.items():
        assert loaded.tensors[name].dtype == value.dtype
        assert np.array_equal(loaded.tensors[name], value), name
    # the properties are JSON in the safetensors header: readable with any safetensors tool
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    document = json.loads(header["__metadata__"]["graphforge.checkpoint"])
    assert document["format"] == "graphforge.checkpoint" and document["learning_rate"] == 0.003


def test_a_scalar_parameter_keeps_its_shape_through_training_and_a_checkpoint(tmp_path):
    """A 0-d parameter (CLIP's logit_scale) stays 0-d in the device buffers and in the file,
    so the checkpoint loads back for the program that wrote it."""
    program = graphforge.compile(
        models.tanh_mlp(scalar_scale=True), "loss(kind=mse, output=y), autodiff, adam(lr=0.1)"
    ).model
    module = Module(program, device="cpu")
    for batch in models.tanh_mlp_batches(2):
        module.train_step(**batch)
    assert module.parameters["scale"].shape == () and module.parameters["scale"] != 1.5
    path = module.state.save(tmp_path / "scalar.safetensors")
    loaded = CheckpointState.load(path, program)
    assert loaded.tensors["scale"].shape == () and loaded.tensors["scale"] == module.parameters["scale"]
    resumed = Module(program, loaded, device="cpu")
    batch = models.tanh_mlp_batches(1, seed=7)[0]
    assert np.array_equal(resumed.train_step(**batch), module.train_step(**batch))


# --------------------------------------------------------------------------- refusals


def _rewrite(path, *, drop=None, add=None, replace=None, document=None):
    """Write ``path`` again with tensors or the JSON document changed (a forged checkpoint)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 -- safe_open is no dict
        meta = f.metadata()
    doc = json.loads(meta["graphforge.checkpoint"])
    if drop:
        del tensors[drop]
        doc["tensors"] = [t for t in doc["tensors"] if t["name"] != drop]
    if add:
        name, value = add
        tensors[name] = value
        doc["tensors"].append(
            {"name": name, "role": "optimizer", "dtype": value.dtype.name, "shape": list(value.shape)}
        )
    if replace:  # a manifest kept consistent, checksum included
        name, value = replace
        tensors[name] = value
        for t in doc["tensors"]:
            if t["name"] == name:
                t["dtype"], t["shape"], t["crc32"] = value.dtype.name, list(value.shape), checksum(value)
    text = document(doc) if document else json.dumps(doc)
    safetensors_numpy.save_file(tensors, str(path), metadata={"graphforge.checkpoint": text})


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def _garbage(path):
    path.write_bytes(b"definitely not a checkpoint")


def _data_ranges(path):
    """(name, first byte, end) of each tensor's data in the file, in file order."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    ranges = [(n, *v["data_offsets"]) for n, v in header.items() if n != "__metadata__"]
    return [(n, 8 + length + a, 8 + length + b) for n, a, b in sorted(ranges, key=lambda r: r[1])]


def _flip_a_byte(path):
    """One bit of the second tensor's data flipped: the file still parses, the values differ."""
    name, start, end = _data_ranges(path)[1]
    data = bytearray(path.read_bytes())
    data[(start + end) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    return name


def _cut_in_second_tensor(path):
    name, start, _ = _data_ranges(path)[1]
    path.write_bytes(path.read_bytes()[: start + 2])
    return name


CORRUPTIONS = {
    "missing tensor": (lambda p: _rewrite(p, drop="0.weight.exp_avg"), "no tensor '0.weight.exp_avg'"),
    "extra tensor": (
        lambda p: _rewrite(p, add=("0.weight.momentum_buffer", np.zeros((16, 8), np.float32))),
        "tensor '0.weight.momentum_buffer' is not carried by the program",
    ),
    "wrong shape": (
        lambda p: _rewrite(p, replace=("2.bias", np.zeros(4, np.float32))),
        r"tensor '2.bias' is float32 \[4\], the program expects float32 \[3\]",
    ),
    "wrong dtype": (
        lambda p: _rewrite(p, replace=("2.bias", np.zeros(3, np.float64))),
        r"tensor '2.bias' is float64 \[3\], the program expects float32 \[3\]",
    ),
    "truncated": (_truncate, r"truncated: tensor '.+' needs data bytes \d+\.\.\d+ but the file holds only \d+"),
    "truncated in the header": (lambda p: p.write_bytes(p.read_bytes()[:40]), "truncated inside its header"),
    "bytes appended": (lambda p: p.write_bytes(p.read_bytes() + b"xx"), "2 unexpected byte"),
    "empty": (lambda p: p.write_bytes(b""), "0 bytes: empty"),
    "not a checkpoint": (_garbage, "not a readable checkpoint"),
    "flipped bit": (_flip_a_byte, "is damaged: its bytes do not match the checksum saved with it"),
    "invalid JSON": (lambda p: _rewrite(p, document=lambda d: json.dumps(d)[:-5]), "not valid JSON"),
    "manifest disagrees": (
        lambda p: _rewrite(p, document=lambda d: json.dumps({**d, "tensors": d["tensors"][1:]})),
        "is in the file but not in its manifest",
    ),
    "bad step": (lambda p: _rewrite(p, document=lambda d: json.dumps({**d, "step": -1})), "its step is -1"),
    "newer format": (
        lambda p: _rewrite(p, document=lambda d: json.dumps({**d, "version": 99})),
        "format version 99",
    ),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_or_mismatched_checkpoint_is_refused(program, tmp_path, case):
    corrupt, message = CORRUPTIONS[case]
    good = CheckpointState.from_program(program).save(tmp_path / "good.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(good.read_bytes())
    corrupt(bad)
    corrupted_bytes = bad.read_bytes()
    with pytest.raises(CheckpointError, match=message) as info:
        state = CheckpointState.load(bad)
        Module(program, state, device="cpu")  # mismatches are found against the program
    assert str(bad) in str(info.value)
    assert bad.read_bytes() == corrupted_bytes  # nothing was rewritten
    if case in ("missing tensor", "extra tensor", "wrong shape", "wrong dtype"):
        with pytest.raises(CheckpointError, match=message):
            CheckpointState.load(bad, program)


def test_a_damaged_or_cut_tensor_is_named(program, tmp_path):
    path = CheckpointState.from_program(program).save(tmp_path / "ck.safetensors")
    original = path.read_bytes()
    name = _flip_a_byte(path)
    with pytest.raises(CheckpointError, match=rf"tensor '{re.escape(name)}' is damaged"):
        CheckpointState.load(path)
    path.write_bytes(original)
    name = _cut_in_second_tensor(path)
    with pytest.raises(
        CheckpointError, match=rf"truncated: tensor '{re.escape(name)}' needs data bytes .* more tensor"
    ):
        CheckpointState.load(path)


def test_a_checkpoint_without_checksums_still_loads(program, tmp_path):
    """Checkpoints written before checksums were saved: nothing to verify, nothing refused."""
    path = CheckpointState.from_program(program).save(tmp_path / "ck.safetensors")
    _rewrite(path, document=lambda d: json.dumps({**d, "tensors": [
        {k: v for k, v in t.items() if k != "crc32"} for t in d["tensors"]]}))  # fmt: skip
    state = CheckpointState.load(path, program)
    assert all(spec.crc32 is None for spec in state.specs)


def test_a_long_list_of_mismatches_is_capped(mlp_bytes, program, tmp_path):
    """An adamw checkpoint offered to an sgd program: every moment is extra; five are listed."""
    path = CheckpointState.from_program(program).save(tmp_path / "adamw.safetensors")
    sgd = tm.compile_program(mlp_bytes, "sgd(lr=0.1)")
    with pytest.raises(CheckpointError) as caught:
        CheckpointState.load(path, sgd)
    message = str(caught.value)
    assert message.count("is not carried by the program") == 5
    assert re.search(r"; \.\.\. and \d+ more$", message)
    assert "\n" not in message


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        CheckpointState.load(tmp_path / "nope.safetensors")


def test_unsaveable_properties_are_refused_before_anything_is_written(program, tmp_path):
    path = CheckpointState.from_program(program).save(tmp_path / "ck.safetensors")
    before = path.read_bytes()
    state = CheckpointState.from_program(program)
    state.properties["handle"] = object()
    with pytest.raises(CheckpointError, match=r"state\.properties cannot be saved as JSON"):
        state.save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["ck.safetensors"]


# --------------------------------------------------------------------------- atomic writes


def test_a_save_that_fails_half_way_leaves_the_previous_checkpoint(program, tmp_path, monkeypatch):
    module = Module(program, device="cpu")
    path = module.state.save(tmp_path / "ck.safetensors")
    before = path.read_bytes()
    module.train_step(*tm.batches(1)[0])

    def crash_half_way(target, tensors, metadata):
        with open(target, "wb") as f:
            f.write(b"\x00" * 64)  # part of a file, then the process "dies"
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_module, "_write_tensors", crash_half_way)
    with pytest.raises(CheckpointError, match="No space left on device"):
        module.state.save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["ck.safetensors"]  # no temp file left behind
    assert CheckpointState.load(path, program).step == 0


def test_a_crash_before_the_rename_leaves_the_previous_checkpoint(program, tmp_path, monkeypatch):
    module = Module(program, device="cpu")
    path = module.state.save(tmp_path / "ck.safetensors")
    before = path.read_bytes()
    module.train_step(*tm.batches(1)[0])

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_module.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        module.state.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["ck.safetensors"]
    module.state.save(path)  # and a later save goes through
    assert CheckpointState.load(path, program).step == 1


def test_checkpoint_manager_keeps_the_last_n(program, tmp_path):
    module = Module(program, device="cpu")
    manager = CheckpointManager(tmp_path / "ckpts", keep_last=2)
    assert manager.latest() is None and manager.load_latest() is None
    for x, target in tm.batches(5):
        module.train_step(x, target)
        manager.save(module.state)
    assert [step for step, _ in manager.checkpoints()] == [4, 5]
    assert manager.latest().name == "checkpoint-00000005.safetensors"
    assert manager.load_latest(program).step == 5
    with pytest.raises(Exception, match="keep_last must be"):
        CheckpointManager(tmp_path, keep_last=0)


def test_slices_along_an_axis_join_into_the_whole_and_a_missing_one_is_named(tmp_path):
    """A tensor-parallel checkpoint: each member's file holds its slices of the split tensors
    (along their axis), the main file the rest and the list of files; loading joins them, and
    one member's file gone or from another run is refused, naming the tensor."""
    rng = np.random.default_rng(0)
    whole = {"w": rng.standard_normal((4, 6)).astype(np.float32), "v": rng.standard_normal((6, 3)).astype(np.float32)}
    bias = rng.standard_normal(3).astype(np.float32)
    axes = {"w": 1, "v": 0}
    manager = CheckpointManager(tmp_path)
    state = CheckpointState({"w": whole["w"], "v": whole["v"], "b": bias}, [], step=5)
    files = []
    for rank in range(3):
        parts = {}
        for name, axis in axes.items():
            piece = np.split(whole[name], 3, axis=axis)[rank]
            parts[name] = (piece, rank * piece.shape[axis], whole[name].shape, axis)
        files.append(manager.save_slices(state, parts, rank, 3))
    path = manager.save(state, names=["b"], shards=files)
    loaded = CheckpointState.load(path)
    for name, value in {**whole, "b": bias}.items():
        np.testing.assert_array_equal(loaded.tensors[name], value, err_msg=name)
    assert loaded.step == 5 and sorted(loaded.tensors) == ["b", "v", "w"]

    piece = np.split(whole["w"], 3, axis=1)[1]
    manager.save_slices(state, {"w": (piece, 3, whole["w"].shape, 1), "v": (whole["v"][2:4], 2, (6, 3), 0)}, 1, 3)
    with pytest.raises(
        CheckpointError, match=r"tensor 'w' is not whole: .*holds a slice twice|tensor 'w' is not whole: indices"
    ):
        CheckpointState.load(path)
    files[1].unlink()
    with pytest.raises(CheckpointError, match=r"its shard checkpoint-00000005.tensor1-of-3.safetensors is missing"):
        CheckpointState.load(path)
