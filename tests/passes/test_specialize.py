"""specialize(dims): a program at fixed dims with its shape computations folded. The oracle is
the unspecialized program run by onnxruntime on the same inputs: the same values, bit for bit
on the CPU, from a model in which no node waits for the host (graphforge.analysis.host_sync)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import models
import numpy as np
import onnx
import pytest
from graphforge.passes.specialize import SPECIALIZED, specialized

import graphforge
from graphforge.analysis.host_sync import host_syncs
from graphforge.errors import PipelineError
from graphforge.graph import Model
from graphforge.inspection.host_syncs import session_syncs

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent / "autodiff"))
import torch_models  # noqa: E402  (tests/passes/autodiff: needs torch)

GRADIENTS = "loss(kind=cross_entropy, output=logits), autodiff"


def _syncs(model: onnx.ModelProto) -> list:
    return host_syncs(Model.from_proto(model).graph)


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = graphforge.create_session(model, providers=["CPUExecutionProvider"])
    return session.run([o.name for o in model.graph.output], feeds)


@pytest.fixture(scope="module")
def gpt2_gradients(transformer_path) -> onnx.ModelProto:
    return graphforge.compile(transformer_path, GRADIENTS).model


@pytest.fixture(scope="module")
def bert_program(tmp_path_factory) -> onnx.ModelProto:
    """A 2-layer BERT masked LM (its attention mask built inside), TorchScript, AdamW."""
    path = tmp_path_factory.mktemp("bert") / "bert.onnx"
    example = torch.randint(
        0, torch_models.BERT_CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0)
    )
    dynamic = {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 2: "seq"}}
    torch_models.export(torch_models.bert(), example, path, "input_ids", dynamic)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return graphforge.compile(path, f"{GRADIENTS}, adamw(lr=1e-3)").model


def _lm_feeds(batch: int, seq: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, vocab, (batch, seq)), "labels": rng.integers(0, vocab, (batch, seq))}


def test_a_gpt2_program_at_fixed_dims_computes_the_same_without_waiting_for_the_host(gpt2_gradients):
    """The logits are [batch, seq, vocab] here, so cross_entropy's classes are the seq axis and
    the labels [batch, vocab]: their dim is named too."""
    model = gpt2_gradients
    assert _syncs(model)  # the export's shape arithmetic: Shape, Gather, Concat into Reshapes
    result = graphforge.compile(model, 'specialize(dims=["batch=3", "seq=5", "labels_dim1=64"])')
    fixed = result.model
    assert _syncs(fixed) == [], [s.describe() for s in _syncs(fixed)]
    assert len(fixed.graph.node) < 0.6 * len(model.graph.node)
    assert result.records[0].note == "no node syncs with the host"
    assert graphforge.roles.metadata_of(fixed)[SPECIALIZED] == '{"batch": 3, "labels_dim1": 64, "seq": 5}'
    rng = np.random.default_rng(1)
    feeds = {"input_ids": rng.integers(0, 64, (3, 5)), "labels": rng.integers(0, 5, (3, 64))}
    for ours, theirs in zip(_run(fixed, feeds), _run(model, feeds), strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_every_session_of_a_bert_step_at_fixed_dims_leaves_none(bert_program):
    dims = {"batch": 4, "seq": 6, "labels_dim1": torch_models.BERT_CONFIG["vocab_size"]}
    for session in session_syncs(bert_program, dims):
        assert session.syncs == [], (session.label, [s.describe() for s in session.syncs])
        assert session.nodes <= session.general_nodes
    forward = next(s for s in session_syncs(bert_program, {}) if s.label == "forward/backward")
    assert forward.syncs  # unspecialized: the mask and the shapes are computed at run time


def test_a_module_trains_bit_for_bit_as_the_unspecialized_program_across_dims(transformer_path, monkeypatch):
    """Five sets of dims: four specialized sessions, then the general one (Runner.MAX_SPECIALIZED)."""
    program = graphforge.compile(transformer_path, f"{GRADIENTS}, adamw(lr=1e-2)").model
    sizes = [(2, 8), (3, 5), (2, 8), (1, 7), (4, 3), (2, 6), (3, 5)]

    def train() -> tuple[list[float], dict[str, np.ndarray], graphforge.Module]:
        module = graphforge.Module(program, device="cpu")
        graphforge.Optimizer(module)
        losses = []
        for i, (batch, seq) in enumerate(sizes):
            feeds = _lm_feeds(batch, seq, 64, seed=i)
            feeds["labels"] = np.random.default_rng(i).integers(0, seq, (batch, 64))
            losses.append(float(module.train_step(**feeds)))
        return losses, module.parameters, module

    losses, parameters, module = train()
    assert module.runner.specialize_refused == {}
    with monkeypatch.context() as patch:
        patch.setattr("graphforge.runtime.runner.specialized", lambda model, dims: model)
        general_losses, general_parameters, _ = train()
    assert losses == general_losses
    for name, value in parameters.items():
        np.testing.assert_array_equal(value, general_parameters[name], err_msg=name)


def test_specializing_to_the_dims_a_batch_has_makes_a_session_model_without_syncs(transformer_path):
    """``specialized`` binds only the dims a model's inputs have (a batch names more)."""
    model = graphforge.compile(transformer_path, GRADIENTS).model
    fixed = specialized(model, {"batch": 2, "seq": 4, "labels_dim1": 64, "unrelated": 9})
    assert _syncs(fixed) == []
    assert specialized(model, {"unrelated": 9}) is model


def test_a_dim_no_input_has_is_refused_by_name(gpt2_gradients):
    with pytest.raises(PipelineError, match=r"dims sequence: no graph input has such a dim; the inputs' symbolic dims: "
                       r"batch, labels_dim1, seq"):  # fmt: skip
        graphforge.compile(gpt2_gradients, 'specialize(dims=["sequence=5"])')
    with pytest.raises(PipelineError, match=r"dims entry 'batch': write name=size"):
        graphforge.compile(gpt2_gradients, 'specialize(dims=["batch"])')


def test_unnamed_dims_stay_symbolic(gpt2_gradients):
    fixed = graphforge.compile(gpt2_gradients, 'specialize(dims=["batch=3"])').model
    ids = next(i for i in fixed.graph.input if i.name == "input_ids")
    assert [d.dim_value or d.dim_param for d in ids.type.tensor_type.shape.dim] == [3, "seq"]
    feeds = {"input_ids": np.zeros((3, 7), np.int64), "labels": np.zeros((3, 64), np.int64)}
    for ours, theirs in zip(_run(fixed, feeds), _run(gpt2_gradients, feeds), strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_host_syncs_name_each_kind_of_node():
    model = models.parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        syncs (float[N, 4] x, bool c) => (float[A, B] y, float[4] z, float[4] w) {
            nz = NonZero(x)
            count = Shape(nz)
            flat = Reshape(x, count)
            y = Identity(flat)
            four = Constant <value = int64[1] {4}> ()
            z = Reshape(x, four)
            w = If(c) <then_branch = g1 () => (float[4] a) { a = Identity(z) },
                       else_branch = g2 () => (float[4] b) { b = Neg(z) }>
        }
    """)  # fmt: skip
    found = {s.op: s.reason for s in _syncs(model)}
    assert found == {
        "NonZero": "its output's shape depends on its input's values",
        "Shape": "a shape computed on the host at run time",
        "Reshape": "reads count on the host, computed at run time",
        "If": "control flow: its condition is read on the host",
    }


def test_shapes_left_at_run_time_and_what_reads_them_are_on_the_host():
    """A Shape or Size the step computes, the arithmetic over it, and a node that reads the
    result beside device values: each needs the host (a CUDA graph cannot replay them)."""
    model = models.parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        shapes (float[N, 4] x) => (float[N, 4] y, float[N, 4] z) {
            s = Shape(x)
            zero = Constant <value = int64[1] {0}> ()
            n = Gather(s, zero)
            n2 = Mul(n, n)
            nf = Cast <to = 1> (n2)
            y = Add(x, nf)
            count = Size(x)
            cf = Cast <to = 1> (count)
            two = Constant <value = float[1] {2.0}> ()
            twice = Mul(cf, two)
            z = Mul(x, twice)
        }
    """)  # fmt: skip
    found = [(s.node or s.op, s.reason) for s in _syncs(model)]
    names = {n.output[0]: n.op_type for n in model.graph.node}
    assert [names.get(n, n) for n, _ in found] == [
        "Shape",
        "Gather",
        "Mul",
        "Cast",
        "Add",
        "Size",
        "Cast",
        "Mul",
        "Mul",
    ]
    reasons = [r for _, r in found]
    assert reasons[0] == reasons[5] == "a shape computed on the host at run time"
    assert (
        reasons[1] == "shape arithmetic on the host, over s" and reasons[3] == "shape arithmetic on the host, over n2"
    )
    assert reasons[4] == "reads nf, computed on the host" and reasons[8] == "reads twice, computed on the host"


def test_size_folds_at_fixed_dims_as_shape_does():
    """The gradient of a slice or a mean takes its element count from a Size: at fixed dims
    it is a constant, and the Range over it no longer waits for the host."""
    model = models.parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        sized (float[N, S] x) => (float[M] y) {
            count = Size(x)
            zero = Constant <value = int64 {0}> ()
            one = Constant <value = int64 {1}> ()
            r = Range(zero, count, one)
            y = Cast <to = 1> (r)
        }
    """)  # fmt: skip
    assert {s.op for s in _syncs(model)} == {"Size", "Range"}  # the Cast reads what Range wrote on the device
    fixed = specialized(model, {"N": 3, "S": 5})
    assert _syncs(fixed) == [] and "Size" not in {n.op_type for n in fixed.graph.node}
    feeds = {"x": np.ones((3, 5), np.float32)}
    np.testing.assert_array_equal(_run(fixed, feeds)[0], _run(model, feeds)[0])
    np.testing.assert_array_equal(_run(fixed, feeds)[0], np.arange(15, dtype=np.float32))


def test_a_specialization_made_once_is_found_the_next_time(gpt2_gradients, monkeypatch):
    """Per process, by the model's bytes and the dims: the second runner (a resume, an eval
    copy, a profiled twin) finds it; each caller gets a copy of its own; other dims, another
    model, or a model too large to keep (one holding its weights) are made afresh."""
    from graphforge.passes import specialize as module

    made = []
    real = module.Specialize.run
    monkeypatch.setattr(module.Specialize, "run", lambda self, model: made.append(self.dims) or real(self, model))
    monkeypatch.setattr(module, "_cache", type(module._cache)())
    first = specialized(gpt2_gradients, {"batch": 2, "seq": 8})
    first.graph.node.pop()  # the caller's own copy: the next caller's is whole
    second = specialized(gpt2_gradients, {"batch": 2, "seq": 8, "other": 3})  # a dim it lacks: not in the key
    assert made == [("batch=2", "seq=8")]
    assert len(second.graph.node) == len(first.graph.node) + 1
    specialized(gpt2_gradients, {"batch": 3, "seq": 8})
    assert made == [("batch=2", "seq=8"), ("batch=3", "seq=8")]
    monkeypatch.setattr(module, "CACHED_MAX_BYTES", gpt2_gradients.ByteSize() - 1)
    specialized(gpt2_gradients, {"batch": 2, "seq": 8})
    assert len(made) == 3


@pytest.mark.parametrize("program", ["gpt2", "bert"])
def test_folding_the_constant_part_alone_makes_the_model_folding_the_whole_graph_makes(
    program, gpt2_gradients, bert_program, monkeypatch
):
    """fold_constants hands onnx-graphsurgeon only the nodes it may fold (gs copies what it is
    given); the specialized model is byte for byte the one the whole graph's folding makes.
    (Each model is specialized once before: the first specialization in a process names a
    few tensors otherwise, whichever way it folds.)"""
    from graphforge.passes import fold_constants

    model = gpt2_gradients if program == "gpt2" else bert_program
    dims = ("batch=2", "seq=6", "labels_dim1=64") if program == "gpt2" else ("batch=2", "seq=6")
    graphforge.passes.Specialize(dims=dims).run(Model.from_proto(model))

    def made(dims):
        return graphforge.passes.Specialize(dims=dims).run(Model.from_proto(model)).model.to_proto()

    parts = []
    real = fold_constants._constant_part
    monkeypatch.setattr(
        fold_constants, "_constant_part", lambda graph, limit: parts.append(real(graph, limit)) or parts[-1]
    )
    part = made(dims)
    assert parts and all(p is not None and len(p.nodes) < len(model.graph.node) for p in parts)
    monkeypatch.setattr(fold_constants, "_constant_part", lambda graph, limit: None)
    whole = made(dims)
    assert part.SerializeToString(deterministic=True) == whole.SerializeToString(deterministic=True)
