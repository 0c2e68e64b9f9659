"""A training run end to end: what it writes (program, checkpoints with keep_last, JSONL log,
TensorBoard scalars), what it reports, and the data it accepts."""

from __future__ import annotations

import json

import _train_helpers as th
import numpy as np
import pytest

import graphforge.train
from graphforge import CheckpointManager, CheckpointState, ConfigError, Module
from graphforge.train.logs import read_jsonl


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One run: 12 steps, log every 2, eval every 4, a checkpoint every 3 keeping 2."""
    folder = th.workspace(tmp_path_factory.mktemp("run"))
    config = th.write_config(
        folder,
        th.base_config(eval={"every": 4}, checkpoint={"every": 3, "keep_last": 2}, schedule={"kind": "linear"}),
    )
    result = graphforge.train.run(config, out=folder / "out", quiet=True)
    return folder, result


def test_run_writes_program_checkpoints_and_logs(finished):
    folder, result = finished
    out = folder / "out"
    assert result.step == result.total_steps == 12
    assert result.out == out and result.program == out / "program.onnx"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "checkpoint-00000009.safetensors",
        "checkpoint-00000012.safetensors",
    ]
    assert result.checkpoint == out / "checkpoints/checkpoint-00000012.safetensors"
    assert not [p for p in out.rglob("*") if p.name.startswith(".")]  # no temp files left
    state = CheckpointState.load(result.checkpoint, result.program)
    assert state.step == 12
    assert state.scheduler["kind"] == "linear" and state.scheduler["last_step"] == 12
    assert state.data_position == {"epoch": 2, "batch": 0}  # 48 samples = 6 batches per epoch
    assert state.seeds == {"data": 3, "dropout": 3}  # dropout masks follow data.seed
    assert state.properties["samples"] == 12 * 8
    assert result.loss is not None and np.isfinite(result.loss)
    assert set(result.eval) == {"eval_loss", "eval_accuracy"}


def test_jsonl_has_one_record_per_logged_step(finished):
    _, result = finished
    records = read_jsonl(result.log)
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10, 12]
    train_keys = {"step", "epoch", "samples", "loss", "lr", "grad_norm", "samples_per_s", "elapsed_s"}
    for record in records:
        assert train_keys <= set(record), record
        assert ("eval_loss" in record) == (record["step"] % 4 == 0)
        assert ("eval_accuracy" in record) == (record["step"] % 4 == 0)
    assert records[-1]["samples"] == 96 and records[-1]["epoch"] == 2.0
    assert records[-1]["eval_loss"] == pytest.approx(result.eval["eval_loss"])
    lrs = [r["lr"] for r in records]
    assert lrs == sorted(lrs, reverse=True) and lrs[0] < 0.05  # linear decay from the pipeline's lr


def test_tensorboard_scalars_read_back(finished):
    _, result = finished
    scalars = th.read_scalars(result.tensorboard)
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/samples_per_s"):
        assert [step for step, _ in scalars[tag]] == [2, 4, 6, 8, 10, 12], tag
    assert [step for step, _ in scalars["eval/accuracy"]] == [4, 8, 12]
    records = {r["step"]: r for r in read_jsonl(result.log)}
    for step, value in scalars["train/loss"]:
        assert value == pytest.approx(records[step]["loss"], rel=1e-6)


def test_training_learns_and_eval_matches_a_module_on_the_checkpoint(finished):
    folder, result = finished
    records = read_jsonl(result.log)
    assert records[-1]["loss"] < records[0]["loss"]
    module = Module(result.program, CheckpointState.load(result.checkpoint), device="cpu").eval()
    data = np.load(folder / "eval.npz")
    loss, logits = module(data["x"], data["labels"], outputs=["logits"])
    assert float(loss) == pytest.approx(result.eval["eval_loss"], rel=1e-5)  # eval batch 8 of 20: weighted mean
    assert np.mean(np.argmax(logits, 1) == data["labels"]) == pytest.approx(result.eval["eval_accuracy"])


def test_integer_data_is_cast_to_a_float_input_and_said_once(tmp_path, capsys):
    folder = th.workspace(tmp_path, dtype=np.uint8)
    config = th.write_config(folder, th.base_config(train={"steps": 3}))
    from rich.console import Console

    result = graphforge.train.run(config, out=folder / "out", console=Console(width=200))
    printed = capsys.readouterr().out
    assert printed.count("casting x uint8 → float32") == 1
    assert result.step == 3


def test_float64_data_for_a_float32_input_is_refused(tmp_path):
    folder = th.workspace(tmp_path, dtype=np.float64)
    config = th.write_config(folder, th.base_config())
    with pytest.raises(ConfigError, match=r"data.train: array 'x' is float64, the program input 'x' takes float32"):
        graphforge.train.run(config, out=folder / "out", quiet=True)
    assert not (folder / "out").exists()


def test_a_folder_of_npy_files_and_an_input_mapping(tmp_path):
    folder = th.workspace(tmp_path)
    arrays = th.samples(16, seed=4)
    (folder / "npy").mkdir()
    np.save(folder / "npy/features.npy", arrays["x"])
    np.save(folder / "npy/labels.npy", arrays["labels"])
    document = th.base_config(data={"train": "npy", "inputs": {"x": "features"}, "eval": "npy", "drop_last": True})
    result = graphforge.train.run(th.write_config(folder, document), out=folder / "out", quiet=True)
    assert result.step == 12 and "eval_accuracy" in result.eval


def test_epochs_count_batches_and_the_run_resumes_to_its_end(tmp_path):
    folder = th.workspace(tmp_path)
    document = th.base_config(train={"epochs": 2, "steps": None}, data={"drop_last": True, "batch_size": 10})
    config = th.write_config(folder, document)
    result = graphforge.train.run(config, out=folder / "out", quiet=True)
    assert result.total_steps == 2 * 4  # 48 samples, drop_last: 4 batches of 10
    again = graphforge.train.run(config, out=folder / "out", quiet=True)
    assert again.step == 8 and again.resumed_from == result.checkpoint and again.checkpoint == result.checkpoint
    assert len(CheckpointManager(folder / "out/checkpoints").checkpoints()) == 1


def test_no_resume_refuses_a_folder_with_checkpoints(tmp_path):
    folder = th.workspace(tmp_path)
    config = th.write_config(folder, th.base_config(train={"steps": 2}))
    graphforge.train.run(config, out=folder / "out", quiet=True)
    before = sorted(p.name for p in (folder / "out").rglob("*"))
    with pytest.raises(ConfigError, match=r"already holds checkpoints of an earlier run \(up to step 2\)"):
        graphforge.train.run(config, out=folder / "out", resume=False, quiet=True)
    assert sorted(p.name for p in (folder / "out").rglob("*")) == before


def test_an_explicit_checkpoint_to_resume_from(tmp_path):
    folder = th.workspace(tmp_path)
    config = th.write_config(folder, th.base_config(train={"steps": 4}))
    first = graphforge.train.run(config, out=folder / "a", quiet=True)
    document = th.base_config(train={"steps": 6}, checkpoint={"resume_from": "a/checkpoints"})
    second = graphforge.train.run(th.write_config(folder, document, "again.toml"), out=folder / "b", quiet=True)
    assert second.resumed_from == first.checkpoint and second.step == 6
    records = read_jsonl(second.log)
    assert [r["step"] for r in records] == [6]
    assert json.loads((folder / "b/log.jsonl").read_text().splitlines()[0])["step"] == 6
