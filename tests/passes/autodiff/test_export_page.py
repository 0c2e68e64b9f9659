"""The "Exporting from PyTorch for training" guide's block runs as written (in a fresh folder),
and the programs it compiles train what torch trains: the TorchScript export keeps
BatchNormalization in training mode and Dropout; the dynamo export keeps the parameters."""

from __future__ import annotations

import warnings

import onnx
import pytest
from _pages import page_block, run_block

PAGE = "docs/guides/pytorch-export.md"

pytestmark = pytest.mark.slow  # two exports, one by dynamo


def test_the_export_block_runs(tmp_path, monkeypatch):
    block = page_block(PAGE, "python", "torch.onnx.export", "TrainingMode")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(block, PAGE, "exec", dont_inherit=True), namespace)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing written beside the reader's files
    exported = onnx.load("out/net_ts.onnx")
    batch_norm = next(n for n in exported.graph.node if n.op_type == "BatchNormalization")
    assert any(a.name == "training_mode" and a.i == 1 for a in batch_norm.attribute)
    assert "Dropout" in {n.op_type for n in exported.graph.node}
    params = {i.name for i in onnx.load("out/mlp_dynamo.onnx").graph.initializer}
    assert {"0.weight", "0.bias", "2.weight", "2.bias"} <= params
    program = namespace["program"]  # the last one compiled: the dynamo export's
    assert {o.name for o in program.graph.output} >= {"loss", "0.weight_grad", "2.bias_grad"}


def test_the_train_program_block_runs(tmp_path, monkeypatch):
    """The guide's train_program block, run after the export block it continues (its net, x)."""
    export = page_block(PAGE, "python", "torch.onnx.export", "TrainingMode")
    block = page_block(PAGE, "python", "train_program(")
    monkeypatch.chdir(tmp_path)
    namespace = run_block(PAGE, export, block)
    module = namespace["module"]
    assert sorted(module.parameters) == sorted(name for name, _ in namespace["net"].named_parameters())
    assert sorted(module.buffers) == ["1.running_mean", "1.running_var"]
