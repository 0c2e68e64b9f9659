"""Shared helpers for the generic-pass tests: parse fixtures, count ops, run models.

Fixtures are written in ONNX text form; ``run`` executes a model on onnxruntime's CPU
provider with graph optimizations off, so a pass that keeps the computation also keeps
the numbers bit for bit.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
from onnx import helper

import graphforge
from graphforge.graph import Model
from graphforge.pass_infra import Pass, PassResult

#: the generic cleanup pipeline, in the order a user writes it
GENERIC_PIPELINE = "identity_elimination, fold_constants, cse, dce, topo_sort"


def parse(text: str, *, check: bool = True) -> onnx.ModelProto:
    """A model from ONNX text form, checked (checker + strict shape inference) unless told not to."""
    model = onnx.parser.parse_model(text)
    if check:
        onnx.checker.check_model(model, full_check=True)
    return model


def graphs(graph: onnx.GraphProto) -> Iterable[onnx.GraphProto]:
    """A graph and every subgraph nested in its nodes' attributes."""
    stack = [graph]
    while stack:
        g = stack.pop()
        yield g
        for node in g.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    stack.append(attr.g)
                stack.extend(attr.graphs)


def ops(model: onnx.ModelProto) -> Counter[str]:
    """Op histogram over the main graph, its subgraphs and the local functions."""
    counts: Counter[str] = Counter()
    for g in graphs(model.graph):
        counts.update(n.op_type for n in g.node)
    for f in model.functions:
        counts.update(n.op_type for n in f.node)
    return counts


def op_list(graph: onnx.GraphProto | onnx.FunctionProto) -> list[str]:
    return [n.op_type for n in graph.node]


def names(graph: onnx.GraphProto | onnx.FunctionProto) -> list[str]:
    return [n.name for n in graph.node]


def branch(model: onnx.ModelProto, attr: str, node_index: int = 0) -> onnx.GraphProto:
    """The subgraph attribute ``attr`` of the main graph's node ``node_index``."""
    node = model.graph.node[node_index]
    return next(a.g for a in node.attribute if a.name == attr)


def initializer_names(model: onnx.ModelProto) -> set[str]:
    return {t.name for g in graphs(model.graph) for t in g.initializer}


def float_initializers(model: onnx.ModelProto) -> set[str]:
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
    return {t.name for g in graphs(model.graph) for t in g.initializer if t.data_type in floats}


def apply(model: onnx.ModelProto, pipeline: str | list[Pass], **options) -> graphforge.CompileResult:
    """Run a pipeline through the PassManager (which verifies every changed result)."""
    return graphforge.compile(model, pipeline, **options)


def run_pass(model: onnx.ModelProto, pass_: Pass) -> tuple[PassResult, onnx.ModelProto]:
    """Run one pass directly, without the PassManager's verification (for invalid inputs)."""
    result = pass_.run(Model.from_proto(model))
    return result, result.model.to_proto()


def feeds_for(model: onnx.ModelProto, seed: int = 0, dims: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """Seeded random inputs: symbolic dims take their value from ``dims`` (default 3)."""
    rng = np.random.default_rng(seed)
    dims = dict(dims or {})
    initializers = {t.name for t in model.graph.initializer}
    feeds = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor_type = value.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else dims.get(d.dim_param, 3) for d in tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        if dtype == np.bool_:
            feeds[value.name] = np.asarray(rng.random(shape) < 0.5)
        elif np.issubdtype(dtype, np.integer):  # small and non-negative: valid as token ids too
            feeds[value.name] = np.asarray(rng.integers(0, 6, size=shape), dtype=dtype)
        else:
            feeds[value.name] = np.asarray(rng.standard_normal(shape), dtype=dtype)
    return feeds


def run(model: onnx.ModelProto | str | Path, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Outputs of ``model`` on the feeds it takes (extra ones, e.g. an input a pass removed, are ignored)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    session = graphforge.create_session(model, providers=["CPUExecutionProvider"], options=options)
    return session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})


def assert_same_outputs(
    before: onnx.ModelProto,
    after: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
) -> None:
    """Both models give the same outputs, names and values (exactly, unless told a tolerance)."""
    assert [o.name for o in after.graph.output] == [o.name for o in before.graph.output]
    expected, actual = run(before, feeds), run(after, feeds)
    for name, e, a in zip((o.name for o in before.graph.output), expected, actual, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape, name
        if rtol or atol:
            np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=name)
        else:
            np.testing.assert_array_equal(a, e, err_msg=name)


def assert_topologically_sorted(graph: onnx.GraphProto) -> None:
    """Every node comes after the producers of what it (or its subgraphs) reads."""
    produced_at = {out: i for i, n in enumerate(graph.node) for out in n.output if out}
    for i, node in enumerate(graph.node):
        for name in _reads(node):
            assert produced_at.get(name, -1) < i, f"node {i} ({node.name or node.op_type}) reads {name!r} too early"


def _reads(node: onnx.NodeProto) -> set[str]:
    read = {name for name in node.input if name}
    for attr in node.attribute:
        for g in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            for sub in graphs(g):
                read |= {name for n in sub.node for name in n.input if name}
    return read


# --------------------------------------------------------------------------- a real exported model

_CNN_CACHE: dict[str, Path] = {}


def export_cnn(tmp_path_factory) -> Path:
    """A small Conv-BatchNorm-ReLU-MaxPool-Linear CNN exported by TorchScript (dynamo=False,
    no constant folding, fixed seed), input ``x`` [batch, 3, 8, 8], output ``logits``
    [batch, 10]. Exported once per test session."""
    if "cnn" in _CNN_CACHE:
        return _CNN_CACHE["cnn"]
    import torch

    class CNN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(8)
            self.pool = torch.nn.MaxPool2d(2)
            self.fc = torch.nn.Linear(8 * 4 * 4, 10)

        def forward(self, x):
            h = self.pool(torch.relu(self.bn(self.conv(x))))
            return self.fc(h.reshape(h.shape[0], -1))  # Shape/Gather/Concat/Reshape on the batch dim

    torch.manual_seed(0)
    model = CNN().eval()
    with torch.no_grad():  # non-trivial statistics (and no equal initializers for the exporter to tie)
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 1.5)
        model.bn.weight.uniform_(0.5, 1.5)
        model.bn.bias.uniform_(-0.5, 0.5)
    path = tmp_path_factory.mktemp("cnn") / "cnn.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (torch.randn(2, 3, 8, 8),),
            str(path),
            dynamo=False,
            do_constant_folding=False,
            input_names=["x"],
            output_names=["logits"],
            dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}},
            opset_version=17,
        )
    _CNN_CACHE["cnn"] = path
    return path


def check_on_cnn(tmp_path_factory, pipeline: str) -> graphforge.CompileResult:
    """Run ``pipeline`` on the exported CNN and check outputs at batch sizes 1 and 5, and that
    the batch dim stays symbolic and every parameter survives."""
    import pytest

    pytest.importorskip("torch")
    source = onnx.load(str(export_cnn(tmp_path_factory)))
    result = apply(source, pipeline)
    for batch in (1, 5):
        assert_same_outputs(source, result.model, feeds_for(source, seed=batch, dims={"batch": batch}))
    assert result.model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    assert result.model.graph.output[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    assert float_initializers(source) <= float_initializers(result.model)
    return result
