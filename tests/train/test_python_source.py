"""Data from Python: ``file.py:attr`` or ``module:attr`` naming a callable that returns an
iterable of dict batches; and Ctrl-C (a KeyboardInterrupt raised while fetching a batch),
in the API and through the real CLI process."""

from __future__ import annotations

import signal
import subprocess
import textwrap
import time

import _train_helpers as th
import pytest

import graphforge.train
from graphforge import CheckpointManager, CheckpointState, ConfigError
from graphforge.train import Interrupted

SOURCE = textwrap.dedent(
    """
    import numpy as np

    MIXING = np.random.default_rng(99).standard_normal((4, 3))
    seen_epochs = []


    def batches(epoch):
        seen_epochs.append(epoch)
        rng = np.random.default_rng(epoch)
        for _ in range(5):
            x = rng.standard_normal((6, 4)).astype(np.float32)
            yield {"x": x, "labels": np.argmax(x @ MIXING, axis=1)}


    class Sized:
        def __len__(self):
            return 5

        def __iter__(self):
            return batches(0)


    def sized():
        return Sized()


    fixed = [{"x": np.ones((2, 4), np.float32), "labels": np.zeros(2, np.int64)}]


    def interrupting():
        for index, batch in enumerate(batches(0)):
            if index == 3:
                raise KeyboardInterrupt
            yield batch


    def no_labels():
        yield {"x": np.ones((2, 4), np.float32)}


    def failing():
        yield from batches(0)
        raise RuntimeError("the disk is gone")
    """
)


def _folder(tmp_path, document_changes: dict, name: str = "train.toml"):
    folder = th.workspace(tmp_path)
    (folder / "source.py").write_text(SOURCE)
    document = th.base_config(
        data={"train": "source.py:batches", "eval": "source.py:fixed", "batch_size": None, "seed": None},
        train={"steps": 12},
        eval={"every": 6},
    )
    for section, values in document_changes.items():
        document[section] = {k: v for k, v in {**document.get(section, {}), **values}.items() if v is not None}
    return folder, th.write_config(folder, document, name)


def test_a_python_file_source_trains_across_epochs(tmp_path):
    folder, config = _folder(tmp_path, {})
    result = graphforge.train.run(config, out=folder / "out", quiet=True)
    assert result.step == 12 and set(result.eval) == {"eval_loss", "eval_accuracy"}
    state = CheckpointState.load(result.checkpoint)
    assert state.data_position == {"epoch": 2, "batch": 2}  # 5 batches an epoch, length unknown


def test_a_module_source_beside_the_config_with_epochs_from_its_length(tmp_path):
    folder, config = _folder(
        tmp_path,
        {
            "data": {"train": "source:sized", "eval": None},
            "train": {"steps": None, "epochs": 2},
            "eval": {"every": None},
        },
    )
    result = graphforge.train.run(config, out=folder / "out", quiet=True)
    assert result.total_steps == 10 and result.step == 10


def test_epochs_need_a_length(tmp_path):
    folder, config = _folder(tmp_path, {"train": {"steps": None, "epochs": 2}})
    with pytest.raises(ConfigError, match=r"train.epochs needs the number of batches per epoch.*give train.steps"):
        graphforge.train.run(config, out=folder / "out", quiet=True)


@pytest.mark.parametrize(
    ("attr", "message"),
    [
        ("no_labels", r"data.train: batch 0 has no 'labels'; the program takes: x, labels"),
        ("failing", r"data.train: .*source.py:failing failed at batch 5: the disk is gone"),
        ("missing", r"data.train: .*source.py has no attribute 'missing'"),
    ],
)
def test_bad_sources_are_named(tmp_path, attr, message):
    folder, config = _folder(tmp_path, {"data": {"train": f"source.py:{attr}", "eval": None}, "eval": {"every": None}})
    with pytest.raises(ConfigError, match=message):
        graphforge.train.run(config, out=folder / "out", quiet=True)


def test_batching_keys_do_not_apply_to_a_python_source(tmp_path):
    folder, config = _folder(tmp_path, {"data": {"batch_size": 4}})
    with pytest.raises(ConfigError, match=r"data.batch_size applies to array data; the Python source"):
        graphforge.train.run(config, out=folder / "out", quiet=True)


def test_keyboard_interrupt_saves_a_final_checkpoint(tmp_path):
    folder, config = _folder(
        tmp_path, {"data": {"train": "source.py:interrupting", "eval": None}, "eval": {"every": None}}
    )
    with pytest.raises(Interrupted) as caught:
        graphforge.train.run(config, out=folder / "out", quiet=True)
    assert isinstance(caught.value, KeyboardInterrupt) and caught.value.step == 3
    assert CheckpointManager(folder / "out/checkpoints").latest() == caught.value.checkpoint
    state = CheckpointState.load(caught.value.checkpoint)
    assert state.step == 3 and state.data_position == {"epoch": 0, "batch": 3}


def test_keyboard_interrupt_through_the_cli_exits_130_with_one_line(tmp_path):
    folder, config = _folder(
        tmp_path, {"data": {"train": "source.py:interrupting", "eval": None}, "eval": {"every": None}}
    )
    proc = th.cli("train", config, "--out", "out", "--quiet", cwd=folder)
    line = th.assert_one_line_error(
        proc, "interrupted at step 3; saved out/checkpoints/checkpoint-00000003.safetensors", status=130
    )
    assert "run the same command again to resume" in line
    assert CheckpointState.load(folder / "out/checkpoints/checkpoint-00000003.safetensors").step == 3


SLOW = textwrap.dedent(
    """
    import time
    import numpy as np

    def batches():
        rng = np.random.default_rng(0)
        while True:
            time.sleep(0.005)
            yield {"x": rng.standard_normal((4, 4)).astype(np.float32), "labels": rng.integers(0, 3, 4)}
    """
)


def test_ctrl_c_stops_after_the_step_saves_and_exits_130(tmp_path):
    """A real SIGINT to the CLI process once it has logged a step."""
    folder = th.workspace(tmp_path)
    (folder / "slow.py").write_text(SLOW)
    document = th.base_config(data={"train": "slow.py:batches", "eval": None, "batch_size": None, "seed": None})
    document["train"] = {"steps": 1_000_000}
    config = th.write_config(folder, document)
    proc = subprocess.Popen(
        [str(th.GRAPHFORGE), "train", str(config), "--out", "out"],
        cwd=folder,
        env=th.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = folder / "out/log.jsonl"
    try:
        while not (log.is_file() and log.read_text().strip()) and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    line = th.assert_one_line_error(done, "interrupted at step ", status=130)
    step = int(line.split("interrupted at step ")[1].split(";")[0])
    assert step >= 2
    latest = CheckpointManager(folder / "out/checkpoints").latest()
    assert latest.name == f"checkpoint-{step:08d}.safetensors" and str(latest.relative_to(folder)) in line
    assert CheckpointState.load(latest).step == step
