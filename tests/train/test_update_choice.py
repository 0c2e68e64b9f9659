"""[train] update: what runs the optimizer update in ``graphforge train``. "auto" (the default)
takes torch's fused kernels where they run the program's update and says so; the run ends
where the program's own update ("onnx") ends it, within 1e-6; "torch" for a program they do
not run is one clear error."""

from __future__ import annotations

import _train_helpers as th
import numpy as np
import pytest

import graphforge.train
from graphforge import CheckpointState
from graphforge.errors import ConfigError

pytest.importorskip("torch")


def _config(folder, update: str, pipeline: str | None = None, **sections):
    document = th.base_config(train={"steps": 12, "update": update}, checkpoint={"every": 12}, **sections)
    if pipeline is not None:
        document["model"]["pipeline"] = pipeline
    return th.write_config(folder, document, f"train-{update}.toml")


@pytest.mark.parametrize("amp", ["", ", mixed_precision(dtype=float16, provider=cpu)"], ids=["float32", "float16"])
def test_auto_runs_torchs_kernel_and_ends_where_the_programs_update_does(tmp_path, amp):
    """A float16 program scales its loss: the kernel reads the gradients segment 0 unscaled and
    moves the scale as the program does."""
    folder = th.workspace(tmp_path / "ws")
    pipeline = th.PIPELINE + amp
    runs = {
        u: graphforge.train.run(_config(folder, u, pipeline), out=folder / f"out-{u}", quiet=True)
        for u in ("onnx", "auto")
    }
    want, got = (CheckpointState.load(runs[u].checkpoint).tensors for u in ("onnx", "auto"))
    assert set(got) == set(want)
    for name, value in want.items():
        assert np.linalg.norm(got[name] - value) <= 1e-6 * max(np.linalg.norm(value), 1e-12), name
    described = th.cli("train", _config(folder, "auto", pipeline), "--out", folder / "cli", cwd=folder)
    assert described.returncode == 0, described.stderr
    assert "update: torch._fused_adamw_ (adamw) over 4 parameters" in described.stdout


def test_torch_for_an_update_it_does_not_run_is_refused(tmp_path):
    """A profile traces the update as onnxruntime runs it."""
    folder = th.workspace(tmp_path / "ws")
    profile = {"profile": {"start": 2, "steps": 1}, "data": {"eval": None}}
    with pytest.raises(
        ConfigError, match=r'train.update = "torch" is not available for one process: \[profile\] traces the update'
    ):
        graphforge.train.run(_config(folder, "torch", **profile), out=folder / "out", quiet=True)
    done = th.cli("train", _config(folder, "auto", **profile), "--out", folder / "auto", cwd=folder)
    assert done.returncode == 0, done.stderr
    assert "update: the program's ONNX update ([profile] traces the update as onnxruntime runs it)" in done.stdout
