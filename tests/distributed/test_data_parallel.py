"""Data parallelism against its oracle: N real processes (gloo on loopback) each training on
batch b equal one process training on batch N·b, for every parameter and optimizer state
after 50 steps; any bucketing equals one bucket; the replicas stay identical.

One launch per world size runs every case in turn (process start-up is most of the cost);
the single-process reference runs here, in the test process."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import models
import numpy as np
import pytest
from _batches import write_batches
from _launch import REPO, run_ranks

import graphforge
from graphforge.distributed import DataParallel
from graphforge.runtime import Module, Optimizer

pytest.importorskip("torch")

STEPS = 50
PER_RANK = 8  # samples per rank and micro-batch
SEQ = 8  # the transformer's sequence length
LAUNCH_TIMEOUT_S = 240
#: "within 1e-5 relative", per tensor: ||a - b|| <= RELATIVE * ||b||. The reductions run in
#: another order than one process's (per-rank means, then their mean), which AdamW's
#: normalised update carries into the parameters: one process with the rows of every batch
#: permuted already differs by 5e-6 on the transformer after 50 steps (1e-5 elementwise).
RELATIVE = 1e-5

#: the loss and autodiff of each model: class ids for the digits, regression targets for the
#: transformer's logits [batch, seq, vocab] (cross_entropy takes the classes on axis 1)
LOSS = {
    "digits": "loss(kind=cross_entropy, output=logits), autodiff",
    "gpt": "loss(kind=mse, output=logits), autodiff",
}
CASES = {
    # name: (model, pipeline after the loss and autodiff, micro-batches per step)
    "mlp-sgd-clip": ("digits", "sgd(lr=0.05, momentum=0.9, clip_grad_norm=1.0)", 1),
    "mlp-adamw-accumulate": ("digits", "adamw(lr=1e-2, weight_decay=0.01, accumulate=true)", 2),
    "gpt-adamw-clip": ("gpt", "adamw(lr=3e-3, clip_grad_norm=0.5)", 1),
    "gpt-sgd-accumulate": ("gpt", "sgd(lr=0.1, momentum=0.9, accumulate=true)", 2),
}
#: on 2 ranks only: the same training with other buckets, or without overlap (bit-identical)
VARIANTS = {
    "mlp-sgd-clip/many-buckets": ("mlp-sgd-clip", "allreduce(bucket_mb=0.0005)", True),
    "mlp-sgd-clip/no-overlap": ("mlp-sgd-clip", "allreduce(bucket_mb=0.0005)", False),
    "gpt-adamw-clip/many-buckets": ("gpt-adamw-clip", "allreduce(bucket_mb=0.002)", True),
    "mlp-adamw-accumulate/many-buckets": ("mlp-adamw-accumulate", "allreduce(bucket_mb=0.0005)", True),
}
ONE_BUCKET = "allreduce(bucket_mb=1000)"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, transformer_path) -> Path:
    """Programs (one bucket, and the variants' bucketings) and the global batches for 4 ranks
    (2 ranks and the references use the first rows of each)."""
    folder = tmp_path_factory.mktemp("data-parallel")
    forward = {"digits": REPO / "examples" / "digits" / "model.onnx", "gpt": transformer_path}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (model, optimizer, _) in CASES.items():
            program = graphforge.compile(str(forward[model]), f"{LOSS[model]}, {optimizer}, {ONE_BUCKET}").model
            graphforge.save(program, folder / f"{name}.onnx")
        for name, (base, allreduce, _) in VARIANTS.items():
            model, optimizer, _ = CASES[base]
            program = graphforge.compile(str(forward[model]), f"{LOSS[model]}, {optimizer}, {allreduce}").model
            graphforge.save(program, folder / f"{name.replace('/', '-')}.onnx")
    write_batches(folder, STEPS, 4 * PER_RANK, seq=SEQ, seed=0)
    return folder


def _case(folder: Path, name: str, ranks: int, *, overlap: bool = True) -> dict:
    base = VARIANTS[name][0] if name in VARIANTS else name
    model, _, accumulate = CASES[base]
    file = name.replace("/", "-")
    return {
        "program": str(folder / f"{file}.onnx"),
        "batches": str(folder / f"{model}-{accumulate}-{ranks}.npz"),
        "steps": STEPS,
        "accumulate": accumulate,
        "overlap": overlap,
        "out": str(folder / f"{file}-{ranks}"),
    }


def _global_batches(folder: Path, ranks: int) -> None:
    """The batches of a world of ``ranks``: the first ranks · PER_RANK rows of each."""
    for model in ("digits", "gpt"):
        for accumulate in (1, 2):
            arrays = np.load(folder / f"{model}-{accumulate}.npz")
            np.savez(
                folder / f"{model}-{accumulate}-{ranks}.npz", **{k: v[:, : ranks * PER_RANK] for k, v in arrays.items()}
            )


@pytest.fixture(scope="module")
def two_ranks(workspace) -> Path:
    _global_batches(workspace, 2)
    cases = [_case(workspace, n, 2) for n in CASES]
    cases += [_case(workspace, n, 2, overlap=VARIANTS[n][2]) for n in VARIANTS]
    _launch(workspace, 2, cases)
    return workspace


@pytest.fixture(scope="module")
def four_ranks(workspace) -> Path:
    _global_batches(workspace, 4)
    _launch(workspace, 4, [_case(workspace, n, 4) for n in CASES])
    return workspace


def _launch(folder: Path, ranks: int, cases: list[dict]) -> None:
    spec = folder / f"spec-{ranks}.json"
    spec.write_text(json.dumps({"cases": cases, "timeout_s": 60}))
    finished = run_ranks(ranks, [str(Path(__file__).parent / "_worker.py"), str(spec)], timeout=LAUNCH_TIMEOUT_S)
    for f in finished:
        assert f.returncode == 0, f"rank {f.rank} exited with {f.returncode}:\n{f.output[-4000:]}"


def _reference(folder: Path, name: str, ranks: int) -> tuple[list[float], dict[str, np.ndarray]]:
    """One process, batch ranks · PER_RANK: what the replicas must equal."""
    case = _case(folder, name, ranks)
    batches = np.load(case["batches"])
    module = Module(case["program"], device="cpu")
    optimizer = Optimizer(module)
    losses, accumulate = [], case["accumulate"]
    for step in range(STEPS):
        for micro in range(accumulate):
            feeds = {n: batches[n][step * accumulate + micro] for n in batches.files}
            losses.append(float(module.train_step(**feeds) if accumulate == 1 else module(**feeds)))
        if accumulate > 1:
            optimizer.step()
            module.lazy_reset_grad()
    return losses, module.runner.read_tensors()


def _replicas(folder: Path, name: str, ranks: int) -> list[dict[str, np.ndarray]]:
    """What each rank ended with: the losses it reported, and its carried tensors but the
    gradient accumulators (each rank's own micro-batches, before the reduction)."""
    file = name.replace("/", "-")
    local = _accumulators(folder, name, ranks)
    return [
        {k: v for k, v in np.load(folder / f"{file}-{ranks}-rank{r}.npz").items() if k not in local}
        for r in range(ranks)
    ]


def _accumulators(folder: Path, name: str, ranks: int) -> set[str]:
    roles = graphforge.ProgramRoles.of_proto(graphforge.load(_case(folder, name, ranks)["program"]))
    return {c.input for c in roles.carried_with_role("accumulator")}


def _assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for name, expected in want.items():
        scale = float(np.linalg.norm(expected.astype(np.float64)))
        error = float(np.linalg.norm(got[name].astype(np.float64) - expected))
        assert error <= RELATIVE * scale, f"{what}: {name} differs by {error / max(scale, 1e-30):.3g} relative"


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_n_ranks_of_batch_b_equal_one_rank_of_batch_n_times_b(name, ranks, request):
    folder = request.getfixturevalue("two_ranks" if ranks == 2 else "four_ranks")
    replicas = _replicas(folder, name, ranks)
    losses, state = _reference(folder, name, ranks)
    state = {k: v for k, v in state.items() if k not in _accumulators(folder, name, ranks)}
    for rank, replica in enumerate(replicas[1:], start=1):  # every replica applied the same update
        for tensor, value in replica.items():
            assert np.array_equal(value, replicas[0][tensor]), f"rank {rank}'s {tensor} differs from rank 0's"
    reported = replicas[0].pop("__losses__")
    np.testing.assert_allclose(reported, losses, rtol=1e-5, err_msg="the loss a step reports is the mean over ranks")
    _assert_close(replicas[0], state, f"{name} on {ranks} ranks after {STEPS} steps")
    initial = graphforge.CheckpointState.from_program(_case(folder, name, ranks)["program"]).tensors
    moved = [t for t in initial if t in state and not np.array_equal(initial[t], state[t])]
    assert len(moved) > len(initial) // 2  # it trained


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_any_bucketing_and_no_overlap_equal_one_bucket_bit_for_bit(variant, two_ranks):
    """On 2 ranks every element's reduction is a + b, whatever the buckets: bit-identical."""
    base = VARIANTS[variant][0]
    (bucketed, *_), (one, *_) = _replicas(two_ranks, variant, 2), _replicas(two_ranks, base, 2)
    program = graphforge.load(_case(two_ranks, variant, 2)["program"])
    assert len(graphforge.ProgramRoles.of_proto(program).allreduce.buckets) > 2
    for tensor, value in one.items():
        assert np.array_equal(bucketed[tensor], value), f"{variant}: {tensor}"


def test_batchnorm_statistics_are_rank_0s_before_each_forward_as_ddp_broadcast_buffers(tmp_path):
    import _training_programs as tp

    program = graphforge.compile(tp.cnn_with_batchnorm().program, "allreduce").model
    graphforge.save(program, tmp_path / "cnn.onnx")
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "cnn.npz",
        x=rng.standard_normal((10, 2 * PER_RANK, 3, 8, 8)).astype(np.float32),
        labels=rng.integers(0, tp.CNN_CLASSES, (10, 2 * PER_RANK)),
    )
    case = {
        "program": str(tmp_path / "cnn.onnx"),
        "batches": str(tmp_path / "cnn.npz"),
        "steps": 10,
        "out": str(tmp_path / "cnn"),
        "broadcast_buffers_at_end": True,
    }
    _launch(tmp_path, 2, [case])
    ranks = [dict(np.load(tmp_path / f"cnn-rank{r}.npz")) for r in range(2)]
    buffers = {c.input for c in graphforge.ProgramRoles.of_proto(program).carried_with_role("buffer")}
    assert buffers
    initial = graphforge.CheckpointState.from_program(program).tensors
    for name in buffers:
        # each rank's last forward updated them from its own samples; the broadcast made them rank 0's
        assert not np.array_equal(ranks[0][f"__before__{name}"], ranks[1][f"__before__{name}"]), name
        assert np.array_equal(ranks[1][name], ranks[0][f"__before__{name}"]), name
        assert not np.array_equal(ranks[0][name], initial[name]), name
    for name in ranks[0]:
        if not name.startswith("__"):
            assert np.array_equal(ranks[0][name], ranks[1][name]), name


@pytest.mark.parametrize("optimizer", ["adamw(lr=0.05, clip_grad_norm=0.5)", "sgd(lr=0.05, accumulate=true)"])
def test_the_cut_and_reduced_step_of_one_rank_equals_the_plain_module_exactly(world_of_one, optimizer):
    program = graphforge.compile(
        models.tanh_mlp(), f"loss(kind=mse, output=y), autodiff, {optimizer}, allreduce(bucket_mb=0.0001)"
    ).model
    plain, replica = Module(program, device="cpu"), Module(program, device="cpu")
    parallel = DataParallel(replica, world_of_one)
    assert len(parallel.buckets) == 4
    optimizers = [Optimizer(plain), Optimizer(replica)]
    for batch in models.tanh_mlp_batches(6):
        if plain.accumulates:
            losses = [float(m(**batch)) for m in (plain, replica)]
            for o in optimizers:
                o.step()
        else:
            losses = [float(m.train_step(**batch)) for m in (plain, replica)]
        assert losses[0] == losses[1]
        assert plain.last_grad_norm == replica.last_grad_norm
    for name, value in plain.runner.read_tensors().items():
        assert np.array_equal(replica.runner.read_tensors([name])[name], value), name
    assert parallel.stats.steps == 6


def test_data_parallel_refuses_a_program_without_the_allreduce_pass_and_a_second_wrapping(world_of_one):
    plain = graphforge.compile(models.tanh_mlp(), "loss(kind=mse, output=y), autodiff, sgd(lr=0.1)").model
    with pytest.raises(graphforge.GraphforgeError, match="no gradient allreduce: compile it with the allreduce pass"):
        DataParallel(Module(plain, device="cpu"), world_of_one)
    module = Module(graphforge.compile(plain, "allreduce").model, device="cpu")
    DataParallel(module, world_of_one)
    with pytest.raises(graphforge.GraphforgeError, match="already data-parallel"):
        DataParallel(module, world_of_one)
