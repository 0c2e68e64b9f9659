"""The pipeline pass and the stages it records: the partition's optimum against brute force,
where it cuts real models, refusals that name the tensor or parameter, and the stages run
in threads (a queue per channel) against one process running the micro-batches in turn."""

from __future__ import annotations

import itertools
import queue
import threading
import warnings
from pathlib import Path

import models
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphforge
from graphforge.analysis.partition import balanced_cuts, stage_sums
from graphforge.errors import GraphforgeError
from graphforge.program import ProgramRoles
from graphforge.runtime import CheckpointState, Module, Optimizer
from graphforge.runtime.runner import to_numpy

ADAMW = "adamw(lr=1e-2, clip_grad_norm=0.5, accumulate=true)"
MSE = f"loss(kind=mse, output=y), autodiff, {ADAMW}"


# --------------------------------------------------------------------------- the partition


@pytest.mark.parametrize("seed", range(30))
def test_balanced_cuts_equal_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 11))
    weights = rng.integers(1, 50, n).astype(float).tolist()
    stages = int(rng.integers(1, n + 1))
    allowed = sorted(rng.choice(np.arange(1, n), size=int(rng.integers(stages - 1, n)), replace=False).tolist())
    best = min(max(stage_sums(weights, cuts)) for cuts in itertools.combinations(allowed, stages - 1))
    cuts = balanced_cuts(weights, stages, allowed)
    assert len(cuts) == stages - 1 and set(cuts) <= set(allowed)
    assert max(stage_sums(weights, cuts)) == best


def test_too_few_cut_points_are_refused():
    with pytest.raises(GraphforgeError, match="3 stages need 2 cut points, but the model has only 1"):
        balanced_cuts([1, 2, 3], 3, [1])


# --------------------------------------------------------------------------- the pass on models


def _skip_model(seed: int = 0) -> onnx.ModelProto:
    """x → fc1 → tanh → h1 → fc2 → tanh → h2 → fc3 → h3; y = h3 + h1: a connection that
    skips a stage when the cuts are after h1 and h2."""
    rng = np.random.default_rng(seed)

    def weight(name, *shape):
        return numpy_helper.from_array((0.4 * rng.standard_normal(shape)).astype(np.float32), name)

    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["a1"], name="fc1"),
        helper.make_node("Tanh", ["a1"], ["h1"], name="act1"),
        helper.make_node("MatMul", ["h1", "w2"], ["a2"], name="fc2"),
        helper.make_node("Tanh", ["a2"], ["h2"], name="act2"),
        helper.make_node("MatMul", ["h2", "w3"], ["h3"], name="fc3"),
        helper.make_node("Add", ["h3", "h1"], ["y"], name="skip"),
    ]
    graph = helper.make_graph(
        nodes,
        "skip",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6])],
        [weight("w1", 6, 6), weight("w2", 6, 6), weight("w3", 6, 6)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _mask_beside_model(seed: int = 0) -> onnx.ModelProto:
    """x → fc1 → h1 → fc2 → a2; y = a2 × neg(tanh(sigmoid(x))): while the factor made from the
    batch alone (a mask, say) is computed, h1 is the one activation live, at three positions."""
    rng = np.random.default_rng(seed)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h1"], name="fc1"),
        helper.make_node("Sigmoid", ["x"], ["s1"], name="s1"),
        helper.make_node("Tanh", ["s1"], ["s2"], name="s2"),
        helper.make_node("Neg", ["s2"], ["s3"], name="s3"),
        helper.make_node("MatMul", ["h1", "w2"], ["a2"], name="fc2"),
        helper.make_node("Mul", ["a2", "s3"], ["y"], name="scale"),
    ]
    weights = [numpy_helper.from_array(rng.standard_normal((6, 6)).astype(np.float32), n) for n in ("w1", "w2")]
    graph = helper.make_graph(
        nodes,
        "mask_beside",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6])],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_tensor_alone_at_several_positions_is_one_cut_point():
    from graphforge.graph import Model
    from graphforge.placement.stages import forward_chain, plan_stages

    program = graphforge.compile(_mask_beside_model(), MSE).model
    forward, _, points = forward_chain(plan_stages(Model.from_proto(program), []))
    names = list(points.values())
    assert len(names) == len(set(names)) and "h1" in names
    # made where it is first alone: right after fc1
    assert forward[min(p for p, n in points.items() if n == "h1") - 1].name == "fc1"
    role = _role(graphforge.compile(_mask_beside_model(), f"{MSE}, pipeline(stages=3, microbatches=3)").model)
    assert len(set(role.cuts)) == 2


def _role(program: onnx.ModelProto):
    return ProgramRoles.of_proto(program).stages


def test_the_role_records_stages_parameters_costs_and_partial_norms():
    program = graphforge.compile(_skip_model(), f"{MSE}, pipeline(stages=3, microbatches=2, cuts=[h1, h2])").model
    role = _role(program)
    assert (role.stages, role.microbatches, role.schedule, role.cuts) == (3, 2, "1f1b", ("h1", "h2"))
    assert role.parameters == (("w1",), ("w2",), ("w3",))
    assert [s for s, _ in role.partial_norms] == [0, 1, 2]
    assert role.costs["parameter_bytes"] == [144, 144, 144]
    assert len(role.costs["flops"]) == 3 and role.costs["slowest"] >= role.costs["balanced"]


def test_automatic_cuts_on_an_mlp_follow_the_weights():
    program = graphforge.compile(models.tanh_mlp(), f"{MSE}, pipeline(stages=2, microbatches=2)").model
    role = _role(program)
    assert len(role.cuts) == 1
    assert role.parameters[0] and role.parameters[1]
    assert role.costs["optimum"] == pytest.approx(role.costs["slowest"])


@pytest.fixture(scope="module")
def gpt4(tmp_path_factory):
    pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return models.export_transformer(
            tmp_path_factory.mktemp("gpt4") / "gpt.onnx", n_layer=4, tie_word_embeddings=False
        )


def test_on_a_transformer_the_automatic_cut_falls_between_blocks(gpt4):
    text = (
        "loss(kind=mse, output=logits), autodiff, adamw(lr=1e-3, accumulate=true), "
        'pipeline(stages=2, microbatches=2, dims=["batch=4", "seq=16"])'
    )
    role = _role(graphforge.compile(gpt4, text).model)
    (cut,) = role.cuts
    # the residual stream leaving a block (GPT-2's blocks end with their MLP's residual Add_1)
    assert cut.endswith("/Add_1_output_0") and "/h." in cut, cut
    flops = role.costs["flops"]
    assert max(flops) / sum(flops) < 0.6


def test_tied_weights_are_refused_with_the_parameter_named(tmp_path):
    pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tied = models.export_transformer(tmp_path / "tied.onnx", n_layer=2)
    text = "loss(kind=mse, output=logits), autodiff, adamw(lr=1e-3, accumulate=true), pipeline(stages=2)"
    with pytest.raises(GraphforgeError, match=r"parameter '.*wte.weight' is read by the forward of stages \[0, 1\]"):
        graphforge.compile(tied, text)


@pytest.mark.parametrize(
    ("cuts", "message"),
    [
        ("[nowhere]", "cut 1: the program has no tensor 'nowhere'"),
        ("[x]", "cut 1: 'x' is not made by the forward .*an input"),
        ("[w1_grad]", "cut 1: 'w1_grad' is not made by the forward .*backward or the update"),
        ("[h2, h1]", r"cut 2 \('h1'\) is computed before cut 1"),
        ("[loss]", "the last stage would be empty"),
        ("[h1]", "3 stages need 2 cuts, got 1"),
    ],
)
def test_bad_cuts_are_refused_with_the_reason(cuts, message):
    stages = 3 if cuts == "[h1]" or cuts == "[h2, h1]" else 2
    with pytest.raises(GraphforgeError, match=message):
        graphforge.compile(_skip_model(), f"{MSE}, pipeline(stages={stages}, cuts={cuts})")


def test_a_program_without_accumulation_is_refused():
    with pytest.raises(GraphforgeError, match="accumulate=true"):
        graphforge.compile(models.tanh_mlp(), "loss(kind=mse, output=y), autodiff, adamw(lr=1e-2), pipeline")


def test_the_program_still_runs_on_one_process():
    """One process runs a pipeline program as it is: the micro-batches in turn equal the
    program without the pass (only the norm's sum runs in another order)."""
    plain = graphforge.compile(_skip_model(), MSE).model
    staged = graphforge.compile(_skip_model(), f"{MSE}, pipeline(stages=3, microbatches=2, cuts=[h1, h2])").model
    params = []
    for program in (plain, staged):
        module = Module(program, device="cpu")
        optimizer = Optimizer(module)
        for batch in models.tanh_mlp_batches(6, seed=3):
            batch = {"x": np.tile(batch["x"], (1, 2))[:, :6], "labels": np.tile(batch["labels"], (1, 2))}
            module(**batch)
            optimizer.step()
            module.lazy_reset_grad()
        params.append(module.parameters)
    for name, value in params[0].items():
        np.testing.assert_allclose(params[1][name], value, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- the stages, in threads


class _Channels:
    """Stages of one process talking through queues: the executor's logic without processes."""

    def __init__(self, stages: int):
        self.stages = stages
        self.queues = {(a, b): queue.Queue() for a in range(stages) for b in range(stages)}
        self.barrier = threading.Barrier(stages, timeout=30)
        self.slots: list = [None] * stages

    def transport(self, stage: int):
        channels = self

        class Transport:
            def __init__(self):
                self.stage, self.stages = stage, channels.stages

            def send(self, peer, values, what):
                channels.queues[(stage, peer)].put([to_numpy(v) for v in values])

            def receive(self, peer, dtypes, what):
                import onnxruntime as ort

                got = channels.queues[(peer, stage)].get(timeout=30)
                return [ort.OrtValue.ortvalue_from_numpy(np.asarray(g, d)) for g, d in zip(got, dtypes, strict=True)]

            def gather(self, value, what):
                channels.slots[stage] = value
                channels.barrier.wait()
                out = list(channels.slots)
                channels.barrier.wait()
                return out

            def broadcast(self, values, source, what):
                if stage == source:
                    channels.slots[0] = list(values)
                channels.barrier.wait()
                out = list(channels.slots[0])
                channels.barrier.wait()
                return out

            def flush(self):
                pass

        return Transport()


def _skip_steps(rng, count: int, micro: int) -> list[list[dict[str, np.ndarray]]]:
    """``count`` steps of ``micro`` micro-batches of 4 rows for ``_skip_model`` under mse."""
    return [
        [
            {
                "x": rng.standard_normal((4, 6)).astype(np.float32),
                "labels": rng.standard_normal((4, 6)).astype(np.float32),
            }
            for _ in range(micro)
        ]
        for _ in range(count)
    ]


def _one_process(program, steps) -> tuple[Module, list[float]]:
    """The oracle: one process running each step's micro-batches in turn, then the update;
    the module and each step's mean loss."""
    module = Module(program, device="cpu")
    optimizer = Optimizer(module)
    losses = []
    for step in steps:
        losses.append(float(np.mean([float(module(**mb)) for mb in step])))
        optimizer.step()
        module.lazy_reset_grad()
    return module, losses


def _in_threads(program, steps):
    from graphforge.distributed.stages import Stage

    role = _role(program)
    channels = _Channels(role.stages)
    results, errors = [None] * role.stages, []

    def run(stage):
        try:
            pipeline = Stage(program, CheckpointState.from_program(program), channels.transport(stage))
            losses = [pipeline.train_step(step).loss for step in steps]
            results[stage] = (losses, pipeline.tensors())
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(role.stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return results


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_connection_that_skips_a_stage_is_relayed(schedule):
    pytest.importorskip("torch")
    program = graphforge.compile(
        _skip_model(), f'{MSE}, pipeline(stages=3, microbatches=3, cuts=[h1, h2], schedule="{schedule}")'
    ).model
    rng = np.random.default_rng(0)
    steps = _skip_steps(rng, 3, 3)
    module, losses = _one_process(program, steps)
    results = _in_threads(program, steps)
    expected = module.runner.read_tensors()
    for stage_losses, tensors in results:
        np.testing.assert_allclose(stage_losses, losses, rtol=1e-6)
        for name, value in tensors.items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-6, atol=1e-7)
    assert sorted(n for _, t in results for n in t) == sorted(expected)


def test_a_stage_without_parameters_takes_part():
    """Cut after the model's output: the last stage holds only the loss (no parameters, no
    update), the first stage everything else."""
    pytest.importorskip("torch")
    program = graphforge.compile(_skip_model(), f"{MSE}, pipeline(stages=2, microbatches=2, cuts=[y])").model
    assert _role(program).parameters[1] == ()
    rng = np.random.default_rng(1)
    steps = _skip_steps(rng, 2, 2)
    module, _ = _one_process(program, steps)
    (_, first), (_, last) = _in_threads(program, steps)
    assert last == {}
    for name, value in first.items():
        np.testing.assert_allclose(value, module.runner.read_tensors()[name], rtol=1e-6, atol=1e-7)


def test_a_first_stage_without_parameters_runs_no_backward():
    """The digits MLP cut after its input's preprocessing: stage 0 casts, scales and
    flattens the images and has nothing to differentiate."""
    pytest.importorskip("torch")
    text = "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-2, accumulate=true)"
    program = graphforge.compile(
        Path(__file__).resolve().parents[2] / "examples" / "digits" / "model.onnx",
        f"{text}, pipeline(stages=2, microbatches=2, cuts=[flat])",
    ).model
    rng = np.random.default_rng(0)
    steps = [
        [
            {"images": rng.integers(0, 17, (4, 8, 8)).astype(np.uint8), "labels": rng.integers(0, 10, 4)}
            for _ in range(2)
        ]
        for _ in range(2)
    ]
    module, _ = _one_process(program, steps)
    (_, first), (_, last) = _in_threads(program, steps)
    assert first == {}
    for name, value in last.items():
        np.testing.assert_allclose(value, module.runner.read_tensors()[name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("stages", [2, 3])
def test_batchnorm_statistics_and_dropout_masks_follow_one_process(tmp_path, stages):
    """A CNN with BatchNorm and Dropout: each micro-batch's forward updates the running
    statistics the next micro-batch's forward reads, on whichever stage; the dropout masks
    are the ones one process draws. Parameters, states and buffers all equal."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 8 * 8, 10),
    ).train()
    path = tmp_path / "cnn.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net,
            (torch.randn(4, 3, 8, 8),),
            str(path),
            dynamo=False,
            training=torch.onnx.TrainingMode.TRAINING,
            do_constant_folding=False,
            input_names=["x"],
            output_names=["logits"],
            dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}},
        )
    text = "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-2, clip_grad_norm=1.0, accumulate=true)"
    program = graphforge.compile(path, f"{text}, pipeline(stages={stages}, microbatches=3)").model
    rng = np.random.default_rng(0)
    steps = [
        [
            {"x": rng.standard_normal((4, 3, 8, 8)).astype(np.float32), "labels": rng.integers(0, 10, 4)}
            for _ in range(3)
        ]
        for _ in range(3)
    ]
    module, losses = _one_process(program, steps)
    results = _in_threads(program, steps)
    expected = module.runner.read_tensors()
    assert any("running_mean" in n for n in expected)
    for stage_losses, tensors in results:
        np.testing.assert_allclose(stage_losses, losses, rtol=1e-6)
        for name, value in tensors.items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-6, atol=1e-7, err_msg=name)
    assert sorted(n for _, t in results for n in t) == sorted(expected)
