"""What a run does when something goes wrong or changes: a loss that is not finite stops it
keeping the last finite state; resuming with other data-order or schedule settings is
refused unless allowed; a checkpoint the loop cannot go on from is one clear error."""

from __future__ import annotations

import json

import _train_helpers as th
import numpy as np
import pytest

import graphforge.train
from graphforge import CheckpointError, CheckpointManager, CheckpointState, ConfigError
from graphforge.runtime.sessions import CUDA, provider_works
from graphforge.train import NonFiniteLoss
from graphforge.train.logs import read_jsonl

# --------------------------------------------------------------------------- a loss that is not finite


def _poisoned_workspace(folder, *, row: int):
    """48 samples, row ``row`` of x is nan: with batches of 8 in order, step row // 8 + 1 sees it."""
    th.workspace(folder)
    data = dict(np.load(folder / "train.npz"))
    data["x"][row] = np.nan
    np.savez(folder / "train.npz", **data)
    return folder


def _config(folder, **sections):
    document = th.base_config(
        data={"shuffle": False, "eval": None, **sections.pop("data", {})},
        train={"steps": 6, **sections.pop("train", {})},
        checkpoint={"every": 2, "keep_last": 2},
        **sections,
    )
    return th.write_config(folder, document)


def test_a_nan_loss_stops_with_status_3_keeping_the_last_finite_state(tmp_path):
    folder = _poisoned_workspace(tmp_path, row=3 * 8 + 5)  # step 4
    done = th.cli("train", _config(folder).name, "--out", "out", "-q", cwd=folder)
    line = th.assert_one_line_error(done, "step 4: the loss is nan (not finite)", "the step was undone", status=3)
    assert "saved the last finite state (step 3) to out/checkpoints/checkpoint-00000003.safetensors" in line
    manager = CheckpointManager(folder / "out" / "checkpoints")
    assert [step for step, _ in manager.checkpoints()] == [2, 3]  # the good one of step 2 is kept too
    state = CheckpointState.load(manager.latest())
    assert state.step == 3 and state.data_position == {"epoch": 0, "batch": 3}
    assert all(np.isfinite(v).all() for v in state.tensors.values())
    records = read_jsonl(folder / "out" / "log.jsonl")
    assert records[-1]["step"] == 4 and records[-1]["loss"] is None and records[-1]["stopped"] == "loss is nan"
    for tag, values in th.read_scalars(folder / "out" / "tensorboard").items():
        assert all(np.isfinite(v) for _, v in values), tag


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_state_kept_is_the_state_of_a_run_that_stopped_before(tmp_path, accumulate):
    """The failed step is undone exactly: the checkpoint equals a clean run of the steps before it."""
    pipeline = th.PIPELINE.replace("adamw(lr=0.05)", "adamw(lr=0.05, accumulate=true)")
    batch = {"batch_size": 8 // accumulate}
    model = {"pipeline": pipeline} if accumulate > 1 else {}
    poisoned = _poisoned_workspace(tmp_path / "poisoned", row=3 * 8 + 7)  # step 4, its last micro-batch
    config = _config(poisoned, train={"accumulate": accumulate}, data=batch, model=model)
    with pytest.raises(NonFiniteLoss) as caught:
        graphforge.train.run(config, out=poisoned / "out", quiet=True)
    assert caught.value.step == 3 and "step 4: the loss is nan" in str(caught.value)
    clean = th.workspace(tmp_path / "clean")
    result = graphforge.train.run(
        _config(clean, train={"accumulate": accumulate, "steps": 3}, data=batch, model=model),
        out=clean / "out",
        quiet=True,
    )
    kept, reference = CheckpointState.load(caught.value.checkpoint), CheckpointState.load(result.checkpoint)
    assert kept.step == reference.step == 3 and kept.data_position == reference.data_position
    # gradient accumulators may hold the failed step's first micro-batches: the next step overwrites them
    assert kept.grad_reset_pending
    roles = {spec.name: spec.role for spec in kept.specs}
    for name, value in reference.tensors.items():
        assert roles[name] == "accumulator" or np.array_equal(kept.tensors[name], value), name


def test_no_checkpoint_is_written_when_the_last_state_is_not_finite_either(tmp_path):
    """lr so large that the parameters overflow: no checkpoint with nan parameters is written."""
    folder = th.workspace(tmp_path)
    config = _config(folder, model={"pipeline": th.PIPELINE.replace("adamw(lr=0.05)", "sgd(lr=1e38)")})
    with pytest.raises(NonFiniteLoss) as caught:
        graphforge.train.run(config, out=folder / "out", quiet=True)
    assert caught.value.checkpoint is None or all(
        np.isfinite(v).all() for v in CheckpointState.load(caught.value.checkpoint).tensors.values()
    )
    for _, path in CheckpointManager(folder / "out" / "checkpoints").checkpoints():
        assert all(np.isfinite(v).all() for v in CheckpointState.load(path).tensors.values()), path


# --------------------------------------------------------------------------- resuming with other settings


def _resumable(tmp_path, **data):
    folder = th.workspace(tmp_path)
    document = th.base_config(data={"eval": None, **data}, train={"steps": 4}, schedule={"kind": "cosine"})
    graphforge.train.run(th.write_config(folder, document), out=folder / "out", quiet=True)
    return folder, document


@pytest.mark.parametrize(
    ("change", "key", "old", "new"),
    [
        ({"data": {"batch_size": 16}}, "data.batch_size", "8", "16"),
        ({"train": {"lr": 0.5}}, "train.lr", "0.05", "0.5"),
        ({"schedule": {"kind": "linear"}}, "schedule.kind", "'cosine'", "'linear'"),
        ({"data": {"seed": 4}}, "data.seed", "3", "4"),
        ({"train": {"steps": 8}}, "schedule.total_steps", "4", "8"),  # a longer cosine is another schedule
    ],
)
def test_resuming_with_a_changed_setting_is_refused_naming_it(tmp_path, change, key, old, new):
    folder, document = _resumable(tmp_path)
    for section, values in change.items():
        document[section] = {**document[section], **values}
    if "steps" not in change.get("train", {}):
        document["train"]["steps"] = 6
    config = th.write_config(folder, document, "changed.toml")
    with pytest.raises(ConfigError) as caught:
        graphforge.train.run(config, out=folder / "out", quiet=True)
    message = str(caught.value)
    assert f"{key} is {new} but out/checkpoints/checkpoint-00000004.safetensors was written with {key} = {old}" in (
        message.replace(str(folder) + "/", "")
    )
    assert "--allow-config-change" in message and "\n" not in message


def test_a_longer_constant_schedule_resumes_without_complaint(tmp_path):
    folder = th.workspace(tmp_path)
    document = th.base_config(data={"eval": None}, train={"steps": 4})
    graphforge.train.run(th.write_config(folder, document), out=folder / "out", quiet=True)
    result = graphforge.train.run(th.write_config(folder, document), steps=6, out=folder / "out", quiet=True)
    assert result.step == 6


def test_allow_config_change_goes_on_with_the_new_settings(tmp_path):
    folder, document = _resumable(tmp_path)
    document["data"]["batch_size"] = 16
    document["train"] = {"steps": 5, "lr": 0.5}
    config = th.write_config(folder, document, "changed.toml")
    done = th.cli("train", config.name, "--out", "out", "--allow-config-change", cwd=folder)
    assert done.returncode == 0, done.stderr
    assert "resuming with data.batch_size = 16 instead of the checkpoint's 8" in done.stdout
    assert "resuming with train.lr = 0.5 instead of the checkpoint's 0.05" in done.stdout
    assert "schedule cosine from lr 0.5 to 0 at step 5; at step 4: lr " in done.stdout  # the schedule used
    state = CheckpointState.load(folder / "out" / "checkpoints" / "checkpoint-00000005.safetensors")
    # 4 batches of 8 = 32 of the 48 samples were consumed: step 5 took the third (last) batch of 16
    assert state.data_position == {"epoch": 1, "batch": 0}
    assert state.properties["settings"]["data.batch_size"] == 16
    assert state.scheduler["base_lr"] == 0.5


def test_the_cli_refusal_is_one_line_with_status_2(tmp_path):
    folder, document = _resumable(tmp_path)
    document["data"]["batch_size"] = 16
    document["train"]["steps"] = 6
    done = th.cli("train", th.write_config(folder, document).name, "--out", "out", cwd=folder)
    th.assert_one_line_error(done, "data.batch_size is 16 but out/checkpoints/checkpoint-00000004.safetensors")


# --------------------------------------------------------------------------- checkpoints the loop cannot go on from


def _forge(path, **document_changes):
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    doc = json.loads(meta["graphforge.checkpoint"])
    nan_tensor = document_changes.pop("nan_tensor", None)
    if nan_tensor:
        tensors[nan_tensor] = np.full_like(tensors[nan_tensor], np.nan)
        for entry in doc["tensors"]:
            entry.pop("crc32", None)
    doc.update(document_changes)
    save_file(tensors, str(path), metadata={"graphforge.checkpoint": json.dumps(doc)})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"data_position": {"epoch": "x"}}, 'its data_position is {"epoch": "x"}, expected {"epoch": E, "batch": B}'),
        ({"data_position": [3]}, "its data_position is [3]"),
        ({"scheduler": {"kind": "cosine"}}, "its schedule state is unusable"),
        ({"nan_tensor": "fc1.weight"}, "tensor(s) fc1.weight hold nan or inf values"),
    ],
)
def test_a_checkpoint_the_loop_cannot_go_on_from_is_refused(tmp_path, change, message):
    folder, document = _resumable(tmp_path)
    path = folder / "out" / "checkpoints" / "checkpoint-00000004.safetensors"
    _forge(path, **change)
    forged = path.read_bytes()
    with pytest.raises(CheckpointError, match=r"checkpoint-00000004\.safetensors: ") as caught:
        graphforge.train.run(th.write_config(folder, document), steps=6, out=folder / "out", quiet=True)
    assert message in str(caught.value)
    assert path.read_bytes() == forged and len(list((folder / "out" / "checkpoints").iterdir())) == 1


# --------------------------------------------------------------------------- smaller things


def test_steps_on_the_command_line_stand_in_for_train_steps(tmp_path):
    folder = th.workspace(tmp_path)
    config = th.write_config(folder, th.base_config(train=None))
    with pytest.raises(ConfigError, match=r"give train\.steps or train\.epochs \(how long to train\), or --steps"):
        graphforge.train.run(config, out=folder / "none", quiet=True)
    assert graphforge.train.run(config, steps=3, out=folder / "out", quiet=True).step == 3


def test_int32_labels_are_widened_to_the_int64_input(tmp_path):
    folder = th.workspace(tmp_path)
    for name in ("train.npz", "eval.npz"):
        data = dict(np.load(folder / name))
        np.savez(folder / name, x=data["x"], labels=data["labels"].astype(np.int32))
    done = th.cli("train", th.write_config(folder, th.base_config()).name, "--out", "out", cwd=folder)
    assert done.returncode == 0, done.stderr
    assert "casting labels int32 → int64" in done.stdout


@pytest.mark.skipif(provider_works(CUDA), reason="a CUDA device works here")
def test_train_device_cuda_without_a_gpu_is_a_config_error(tmp_path):
    folder = th.workspace(tmp_path)
    config = th.write_config(folder, th.base_config(train={"device": "cuda"}))
    done = th.cli("train", config.name, "--out", "out", cwd=folder)
    th.assert_one_line_error(done, "train.toml: train.device: device 'cuda' asks for CUDA, but")
    assert not (folder / "out").exists()


def test_ctrl_c_while_starting_is_one_line_and_status_130(tmp_path, monkeypatch, capsys):
    import graphforge.cli
    import graphforge.train.loop

    def interrupted(config, world=None):
        raise KeyboardInterrupt

    folder = th.workspace(tmp_path)
    config = th.write_config(folder, th.base_config())
    monkeypatch.setattr(graphforge.train.loop, "prepare", interrupted)
    monkeypatch.setattr("sys.argv", ["graphforge", "train", str(config), "--out", str(folder / "out"), "-q"])
    with pytest.raises(SystemExit) as caught:
        graphforge.cli.main()
    assert caught.value.code == 130
    assert capsys.readouterr().err.strip().splitlines() == ["interrupted; no checkpoint written"]


# --------------------------------------------------------------------------- dropout


def test_dropout_runs_repeat_and_resume_bit_identically(tmp_path):
    runs = {}
    for name, steps in (("a", [8]), ("b", [8]), ("resumed", [4, 8])):
        folder = th.with_dropout(th.workspace(tmp_path / name))
        document = th.base_config(data={"eval": None}, train={"steps": steps[0]}, checkpoint={"every": 4})
        for count in steps:
            result = graphforge.train.run(
                th.write_config(folder, document), steps=count, out=folder / "out", quiet=True
            )
        runs[name] = CheckpointState.load(result.checkpoint)
    assert runs["a"].step == runs["resumed"].step == 8
    for name, value in runs["a"].tensors.items():
        assert np.array_equal(value, runs["b"].tensors[name]), name
        assert np.array_equal(value, runs["resumed"].tensors[name]), name
    assert runs["a"].seeds["dropout"] == 3  # data.seed
