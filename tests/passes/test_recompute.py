"""The recompute pass: the same numbers as no recomputation, less memory as the budget falls
(predicted, and measured in a process of its own), its heuristics on their own."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import models
import numpy as np
import onnx
import pytest
from graphforge.passes.recompute import EXPENSIVE, NEVER, forward_nodes, layer_inputs, min_cut_saved

import graphforge
from graphforge.analysis.memory import dims_of
from graphforge.errors import GraphforgeError
from graphforge.graph import Model
from graphforge.placement.step_memory import step_memory
from graphforge.program import ProgramRoles
from graphforge.runtime import Module

pytest.importorskip("torch")

TRAIN = "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-3)"
BUDGETS = (1.0, 0.75, 0.5, 0.25, 0.0)
DIMS = 'dims=["batch=4", "seq=16"]'


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gpt2") / "gpt2.onnx"
    return models.export_transformer(path, n_layer=3, n_embd=64, n_head=4)


def _batch(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    vocab = models.GPT2_CONFIG["vocab_size"]
    ids = rng.integers(0, vocab, (4, 16))
    # the loss takes logits [batch, seq, vocab] as torch's cross_entropy does: classes on axis 1
    return {"input_ids": ids, "labels": rng.integers(0, 16, (4, vocab))}


def _compile(path: Path, recompute: str = "") -> onnx.ModelProto:
    loss = "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-3)"
    return graphforge.compile(path, loss + (f", {recompute}" if recompute else "")).model


def test_losses_and_every_gradient_equal_no_recomputation(gpt2):
    reference = _compile(gpt2)
    grads = list(ProgramRoles.of_proto(reference).gradients.values())
    batches = [_batch(seed) for seed in range(3)]
    expected = Module(reference, device="cpu")
    for spec in ("recompute(budget=0.5)", "recompute(budget=0)", "recompute(level=1)"):
        program = _compile(gpt2, f"{spec[:-1]}, {DIMS})")
        assert any(n.name.startswith("recompute::") for n in program.graph.node), spec
        module = Module(program, device="cpu")
        for batch in batches:
            got = module.train_step(**batch, outputs=grads)
            want = expected.train_step(**batch, outputs=grads)
            for name, a, b in zip(["loss", *grads], got, want, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=f"{spec}: {name}")
        expected = Module(reference, device="cpu")  # the next spec starts from the same weights


def test_predicted_peak_falls_as_the_budget_falls(gpt2):
    peaks = []
    for budget in BUDGETS:
        program = _compile(gpt2, f"recompute(budget={budget}, {DIMS})")
        dims = dims_of(program, _batch())
        peaks.append(step_memory(program, dims=dims).peak)
        assert [d.dim_param for d in program.graph.input[0].type.tensor_type.shape.dim] == ["batch", "seq"]
    assert all(a >= b for a, b in itertools.pairwise(peaks)), peaks
    assert peaks[-1] < peaks[0]


def test_level_1_keeps_only_where_one_activation_crosses(gpt2):
    """A GPT-2 block keeps its residual stream where it enters the attention and where it
    enters the MLP (one activation alone crosses at each), nothing else of the block."""
    program = Model.from_proto(_compile(gpt2))
    layers = layer_inputs(program)
    blocks = {name.split("/h.")[1].split("/")[0] for name in layers if "/h." in name}
    assert len(blocks) >= 2  # block inputs (the last block's output feeds ln_f)
    recomputed = Model.from_proto(_compile(gpt2, f"recompute(level=1, {DIMS})"))
    forward = {t.name for n in forward_nodes(recomputed.graph) for t in n.outputs}
    read = {
        t.name
        for n in recomputed.graph.nodes
        if n.name.startswith(("grad::", "recompute::"))
        for t in n.inputs
        if t.name in forward
    }
    per_block = {}
    for name in read:
        if "/h." in name:
            per_block.setdefault(name.split("/h.")[1].split("/")[0], set()).add(name)
    assert len(per_block) == 3 and all(names <= layers and len(names) <= 2 for names in per_block.values()), per_block


def test_a_random_op_is_never_recomputed():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from _training_models import dropout_mlp_onnx

    program = graphforge.compile(
        dropout_mlp_onnx(), "loss(kind=mse, output=y), autodiff, sgd(lr=0.1), recompute(budget=0)"
    ).model
    assert not [n for n in program.graph.node if n.name.startswith("recompute::") and n.op_type == "Dropout"]
    dropout = next(n for n in program.graph.node if n.op_type == "Dropout")
    readers = [n for n in program.graph.node if set(n.input) & set(dropout.output)]
    assert any(n.name.startswith("grad::") for n in readers)  # the backward reads the mask it drew


def test_min_cut_on_a_chain_saves_the_cheapest_tensor():
    """x -> a (big) -> b (small) -> c (big), the backward reading c: save b, recompute c."""
    program = Model.from_proto(
        onnx.parser.parse_model(
            """
            <ir_version: 8, opset_import: ["" : 17]>
            g (float[8] x) => (float[8] c)
            {
                a = Relu(x)
                b = Neg(a)
                c = Abs(b)
            }
            """
        )
    )
    forward = program.graph.nodes
    sizes = {"a": 100, "b": 1, "c": 100}
    assert min_cut_saved(forward, ["c"], sizes, banned=set()) == set()  # all from x: nothing saved
    assert min_cut_saved(forward, ["c"], sizes, banned={"Relu"}) == {"b"}
    assert min_cut_saved(forward, ["c"], sizes, banned={"Relu"}, kept={"a"}) == {"a"}


def test_the_lists_say_why():
    assert all(reason for reason in {**NEVER, **EXPENSIVE}.values())
    assert "Dropout" in NEVER and "MatMul" in EXPENSIVE


def test_bad_parameters_and_a_second_run_are_refused(gpt2):
    with pytest.raises(GraphforgeError, match="budget"):
        _compile(gpt2, "recompute(budget=1.5)")
    with pytest.raises(GraphforgeError, match="level"):
        _compile(gpt2, "recompute(level=2)")
    with pytest.raises(GraphforgeError, match="once"):
        _compile(gpt2, f"recompute(budget=0, {DIMS}), recompute(budget=0, {DIMS})")
    with pytest.raises(GraphforgeError, match="optimizer"):
        graphforge.compile(gpt2, "loss(kind=cross_entropy, output=logits), autodiff, recompute(budget=0)")


@pytest.mark.slow
def test_measured_peak_falls_on_an_activation_heavy_model(tmp_path):
    """4 blocks of 256 at batch 16 × 128 with a small vocabulary: activations are most of a
    step's memory. Measured in a process of its own (benchmarks/memory_bench.py)."""
    spec = importlib.util.spec_from_file_location(
        "benchmarks.memory_bench", Path(__file__).resolve().parents[2] / "benchmarks" / "memory_bench.py"
    )
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    config = {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 512, "seq": 128}
    model, _, batches, _ = bench.tb.prepare(bench.tb.Spec("gpt2", "GPT-2 4×256", 16, config, steps=3), tmp_path)
    measured = []
    for budget in (1.0, 0.0):
        program = graphforge.compile(model, f'{TRAIN}, recompute(budget={budget}, dims=["batch=16", "seq=128"])')
        path = graphforge.save(program.model, tmp_path / f"budget-{budget}.onnx")
        measured.append(bench.measure(bench.graphforge_job(path, batches, in_place=True, steps=3))["peak_mib"])
    assert measured[1] < measured[0], measured  # seen: 487 -> 463 MiB (see docs/benchmarks.md, Memory)


def test_cse_leaves_the_recomputed_copies_alone(gpt2):
    program = _compile(gpt2, f"recompute(level=1, {DIMS}), cse")
    assert sum(n.name.startswith("recompute::") for n in program.graph.node) > 10


def test_a_sequence_is_recomputed_as_a_sequence():
    """torch.onnx's dynamo exporter, unoptimized, writes GPT-2's split of Q, K and V as
    SplitToSequence and SequenceAt: a recomputed copy of a sequence is a sequence too (it was
    typed a tensor, and the program refused), and the program trains as it does without
    recomputation."""
    import torch

    ids = torch.randint(0, models.GPT2_CONFIG["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(0))
    exported = torch.onnx.export(
        models.gpt2_module(), (ids,), dynamo=True, optimize=False, input_names=["input_ids"],
        output_names=["logits"], dynamic_shapes=({0: "batch", 1: "seq"},),
    )  # fmt: skip
    model = exported.model_proto
    assert any(n.op_type == "SplitToSequence" for n in model.graph.node)
    reference = graphforge.compile(model, TRAIN).model
    program = graphforge.compile(model, f"{TRAIN}, recompute(budget=0, {DIMS})").model
    assert any(n.name.startswith("recompute::") and n.op_type == "SequenceAt" for n in program.graph.node)
    grads = list(ProgramRoles.of_proto(reference).gradients.values())
    batch = _batch()
    want = Module(reference, device="cpu").train_step(**batch, outputs=grads)
    got = Module(program, device="cpu").train_step(**batch, outputs=grads)
    for name, a, b in zip(["loss", *grads], got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=name)
