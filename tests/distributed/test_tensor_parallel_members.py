"""Tensor parallelism across real processes (gloo on loopback, every launch under a timeout):
T members, each running its own program (the forward and its loss split by
``tensor_parallel(size=T, rank=r)`` after the loss pass) on the same batches, summing across
the group where the split ends. The oracle is one process running the whole program (the same pass without
``rank``: the markers are Identity) on the same batches: the losses, the eval loss and
every parameter and optimizer state joined from the members' slices must equal it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import models
import numpy as np
import pytest
from _launch import REPO, environment, finish, run_ranks, spawn
from _tensor_parallel_worker import member_pipeline

import graphforge
from graphforge.distributed import DistributedError
from graphforge.distributed.tensor_parallel import (
    TensorParallel,
    carried_axes,
    carried_split,
    join_tensors,
    member_state,
    member_tensors,
)
from graphforge.errors import GraphforgeError
from graphforge.program import ProgramRoles
from graphforge.runtime import CheckpointState, Module, Optimizer

pytest.importorskip("torch")
pytest.importorskip("transformers")

STEPS = 20
BATCH, SEQ = 4, 8
LAUNCH_TIMEOUT_S = 300
#: every parameter and optimizer state, elementwise. The members sum their partial products
#: in another order than one process's matrix product (and the vocabulary-parallel
#: cross-entropy its exponentials): the losses differ by 1e-7, and AdamW's normalised update
#: carries that into near-zero gradients' parameters: 4e-7 after 20 steps here, but 1.0e-5 in
#: one element of Llama's q_proj (of 4096) at T = 2 and 4 alike, where one process's
#: programs with and without the split's markers differ by 1.2e-6 already
TOLERANCE = 2e-5
ADAMW = "adamw(lr=1e-3, weight_decay=0.01)"
#: name: (forward model, loss and autodiff), every attention and MLP split: a GPT-2 of 2 layers
#: and 4 heads (tied embeddings and LM head split along the vocabulary under a vocabulary-parallel
#: cross-entropy, TorchScript export: a fused QKV Gemm split per section, Gemm between
#: reshapes, tanh GELU), a BERT encoder (2 heads, erf GELU), a Llama-style model
#: (dynamo export: x·Wᵀ, ONNX's Attention op, 8 query and 4 key/value heads, rotary, RMSNorm,
#: SwiGLU's gate and up projections, its own embedding and LM head split along the vocabulary),
#: the shipped digits MLP (Gemm, ReLU)
CASES = {
    "gpt2": ("gpt2.onnx", "loss(kind=cross_entropy, output=logits), autodiff"),
    "bert": ("bert.onnx", "loss(kind=mse, output=hidden), autodiff"),
    "llama": ("llama.onnx", "loss(kind=cross_entropy, output=logits), autodiff"),
    "digits": (str(REPO / "examples" / "digits" / "model.onnx"), "loss(kind=cross_entropy, output=logits), autodiff"),
}
#: cases with an optimizer of their own: clipping by the global norm, which is the whole model's
#: (each member's squares summed across the group), small enough to clip at every step
OPTIMIZERS = {"gpt2": "adamw(lr=1e-3, weight_decay=0.01, clip_grad_norm=0.05)"}
#: GPT-2 again with every activation recomputed that can be (recompute(budget=0) after the
#: optimizer): the copies of the forward's sums are sums again, cut after as the originals
CASES["gpt2-recompute"] = CASES["gpt2"]
OPTIMIZERS["gpt2-recompute"] = f"{OPTIMIZERS['gpt2']}, recompute(budget=0.0)"


def _batches(name: str, steps: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if name == "digits":
        return {
            "images": rng.integers(0, 17, (steps, 8, 8, 8)).astype(np.uint8),
            "labels": rng.integers(0, 10, (steps, 8)),
        }
    if name == "llama":
        ids = rng.integers(0, models.LLAMA_VOCAB, (steps, BATCH, SEQ))
        return {"input_ids": ids, "labels": rng.integers(0, models.LLAMA_VOCAB, (steps, BATCH, SEQ))}
    ids = rng.integers(0, 64, (steps, BATCH, SEQ))
    if name.startswith("gpt2"):
        return {"input_ids": ids, "labels": rng.integers(0, 64, (steps, BATCH, SEQ))}
    return {"input_ids": ids, "labels": rng.standard_normal((steps, BATCH, SEQ, 32)).astype(np.float32)}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tensor-parallel")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models.export_transformer(folder / "gpt2.onnx", n_layer=2, n_head=4, classes_first=True)
        models.export_bert(folder / "bert.onnx")
        models.export_dynamo(models.llama_module(heads=8, kv_heads=4), folder / "llama.onnx", 23)
    for name in CASES:
        np.savez(folder / f"{name}-batches.npz", **_batches(name, STEPS, seed=len(name)))
    return folder


def _model(folder: Path, name: str) -> str:
    return str(folder / CASES[name][0]) if not Path(CASES[name][0]).is_absolute() else CASES[name][0]


def _spec(folder: Path, label: str, names: list[str], pipeline=None, **settings) -> Path:
    """The worker's spec: a case per model of ``names`` (its pipeline: ``pipeline(name)``, by
    default its loss and its optimizer), its outputs named ``<name>-<label>``, ``settings``
    (data, zero, stages) in each."""
    cases = [
        {
            "model": _model(folder, name),
            "pipeline": pipeline(name) if pipeline else f"{CASES[name][1]}, {OPTIMIZERS.get(name, ADAMW)}",
            "batches": str(folder / f"{name}-batches.npz"),
            "out": str(folder / f"{name}-{label}"),
            "in_place": name != "digits",  # the two-buffer update for one of them
            **settings,
        }
        for name in names
    ]
    spec = folder / f"spec-{label}.json"
    spec.write_text(json.dumps({"cases": cases, "timeout_s": 60}))
    return spec


def _run_spec(spec: Path, processes: int) -> None:
    argv = [str(Path(__file__).parent / "_tensor_parallel_worker.py"), str(spec)]
    for f in run_ranks(processes, argv, timeout=LAUNCH_TIMEOUT_S):
        assert f.returncode == 0, f"rank {f.rank} exited with {f.returncode}:\n{f.output[-4000:]}"


def _launch(folder: Path, size: int, names: list[str], data: int = 1, zero: int = 0) -> Path:
    label = (f"{size}" if data == 1 else f"{size // data}x{data}") + (f"-zero{zero}" if zero else "")
    _run_spec(_spec(folder, label, names, data=data, zero=zero), size)
    return folder


@pytest.fixture(scope="module")
def two_members(workspace) -> Path:
    return _launch(workspace, 2, list(CASES))


@pytest.fixture(scope="module")
def four_members(workspace) -> Path:
    return _launch(workspace, 4, ["gpt2", "llama"])


@pytest.fixture(scope="module")
def tensor_by_data(workspace) -> Path:
    """4 processes: 2 data replicas of tensor groups of 2 (also with ZeRO stage 2 over the
    replicas). The Llama-style model's replicas of tensor groups run in tensor_by_stages' mesh."""
    plain = json.loads(_spec(workspace, "2x2", ["gpt2", "digits"], data=2).read_text())
    sharded = json.loads(_spec(workspace, "2x2-zero2", ["gpt2", "digits"], data=2, zero=2).read_text())
    spec = workspace / "spec-2x2-both.json"  # one launch for both (each launch starts 4 processes)
    spec.write_text(json.dumps({**plain, "cases": plain["cases"] + sharded["cases"]}))
    _run_spec(spec, 4)
    return workspace


def _whole_program(folder: Path, name: str, size: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipeline = member_pipeline(f"{CASES[name][1]}, {OPTIMIZERS.get(name, ADAMW)}", size)
        return graphforge.compile(_model(folder, name), pipeline).model


def _reference(folder: Path, name: str, size: int) -> tuple[Module, list[float], float]:
    """One process, the whole program, the same batches: what the members must equal."""
    module = Module(_whole_program(folder, name, size), device="cpu", update="onnx")
    batches = np.load(folder / f"{name}-batches.npz")
    losses = [float(module.train_step(**{n: batches[n][s] for n in batches.files})) for s in range(STEPS)]
    module.eval()
    evaluated = float(module(**{n: batches[n][-1] for n in batches.files}))
    module.train()
    return module, losses, evaluated


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "size"),
    [
        ("gpt2", 2),
        ("bert", 2),
        ("llama", 2),
        ("digits", 2),
        ("gpt2-recompute", 2),
        ("llama", 4),  # four members: grouped-query heads in fours (GPT-2's fused QKV sections split alike in twos)
    ],
)
def test_t_members_equal_one_process_of_the_whole_program(name, size, request):
    folder = request.getfixturevalue("two_members" if size == 2 else "four_members")
    reference, losses, evaluated = _reference(folder, name, size)
    got = np.load(folder / f"{name}-{size}-losses.npz")
    np.testing.assert_allclose(got["losses"], losses, rtol=TOLERANCE, atol=TOLERANCE)
    np.testing.assert_allclose(got["eval"], evaluated, rtol=TOLERANCE, atol=TOLERANCE)
    if name in ("gpt2", "llama"):  # logits split along the vocabulary: the group's argmax is the whole's
        batch = {n: v[-1] for n, v in np.load(folder / f"{name}-batches.npz").items()}
        reference.eval()
        _, logits = reference(**batch, outputs=["logits"])
        reference.train()
        np.testing.assert_array_equal(got["argmax"], np.argmax(logits, axis=1))
    # the global gradient norm is the whole model's (the slices' squares summed across the group)
    np.testing.assert_allclose(got["grad_norm"], reference.last_grad_norm, rtol=TOLERANCE)
    if name in OPTIMIZERS:
        assert reference.last_grad_norm > 0.05  # clipped: the members clipped by the same norm
    whole = CheckpointState.load(folder / f"{name}-{size}-whole.safetensors", reference.train_program)
    want = reference.state.tensors
    assert set(whole.tensors) == set(want)
    for tensor, value in want.items():
        np.testing.assert_allclose(whole.tensors[tensor], value, rtol=0, atol=TOLERANCE, err_msg=tensor)
    assert whole.step == STEPS

    # each member held 1/T of every split parameter, and summed across the group
    axes = carried_axes(reference.roles)
    assert axes, "the pass split nothing"
    for rank in range(size):
        report = json.loads((folder / f"{name}-{size}-rank{rank}.json").read_text())
        assert report["reductions"] > 0
        for parameter, shape in report["shapes"].items():
            expected = list(want[parameter].shape)
            if parameter in axes:
                expected[axes[parameter]] //= size
            assert shape == expected, parameter


@pytest.mark.parametrize("name", ["gpt2", "digits", "gpt2-zero2", "digits-zero2"])
def test_a_mesh_of_data_replicas_of_tensor_groups_equals_one_process(name, tensor_by_data):
    """T × D = 2 × 2 (World.mesh: ranks ordered data, then tensor): each replica's tensor group
    splits the model, each replica takes half of every batch's rows, the gradients are
    averaged across the replicas between forward/backward and the update (with ZeRO stage 2:
    reduce-scattered, each replica updating its shard, the global norm summed across the
    replicas and the tensor group). One process running the whole program on the whole
    batches is the oracle, as for T alone."""
    folder = tensor_by_data
    name, _, zero = name.partition("-")
    label = f"2x2-{zero}" if zero else "2x2"
    reference, losses, evaluated = _reference(folder, name, 2)
    got = np.load(folder / f"{name}-{label}-losses.npz")
    np.testing.assert_allclose(got["losses"], losses, rtol=TOLERANCE, atol=TOLERANCE)
    np.testing.assert_allclose(got["eval"], evaluated, rtol=TOLERANCE, atol=TOLERANCE)
    np.testing.assert_allclose(got["grad_norm"], reference.last_grad_norm, rtol=TOLERANCE)
    whole = CheckpointState.load(folder / f"{name}-{label}-whole.safetensors", reference.train_program)
    for tensor, value in reference.state.tensors.items():
        np.testing.assert_allclose(whole.tensors[tensor], value, rtol=0, atol=TOLERANCE, err_msg=tensor)
    axes = carried_axes(reference.roles)
    for rank in range(4):  # ranks 0, 1 and 2, 3: the two replicas' tensor groups, members 0 and 1
        report = json.loads((folder / f"{name}-{label}-rank{rank}.json").read_text())
        for parameter, shape in report["shapes"].items():
            expected = list(reference.state.tensors[parameter].shape)
            if parameter in axes:
                expected[axes[parameter]] //= 2
            assert shape == expected, parameter


@pytest.fixture(scope="module")
def tensor_by_stages(workspace) -> Path:
    """8 processes: 2 data replicas of pipelines of 2 stages whose every stage is a tensor
    group of 2 (T × S × D; graphforge train's tests run T × S alone), the Llama-style model
    alone (rotary, grouped-query attention, its vocabulary split: the most the split does;
    eight processes share this machine's cores, so one model)."""
    accumulating = "adamw(lr=1e-3, weight_decay=0.01, accumulate=true), pipeline(stages=2, microbatches=2)"
    pipeline = lambda name: f"{CASES[name][1]}, {accumulating}"  # noqa: E731
    _run_spec(_spec(workspace, "2x2x2", ["llama"], pipeline, stages=2, data=2), 8)
    return workspace


def _accumulating_reference(folder: Path, name: str, microbatches: int) -> tuple[Module, list[float]]:
    """One process, the whole program accumulating its gradients over the same micro-batches
    a pipelined step runs (their sum, as the pipeline's), then one update: what a pipeline
    equals; the loss is the micro-batches' mean, as the pipeline reports it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accumulating = f"{CASES[name][1]}, adamw(lr=1e-3, weight_decay=0.01, accumulate=true)"
        program = graphforge.compile(_model(folder, name), member_pipeline(accumulating, 2)).model
    module = Module(program, device="cpu", update="onnx")
    optimizer = Optimizer(module)
    batches = np.load(folder / f"{name}-batches.npz")
    losses = []
    for step in range(STEPS):
        rows = len(batches[batches.files[0]][step]) // microbatches
        micro = [float(module(**{n: batches[n][step][i * rows : (i + 1) * rows] for n in batches.files}))
                 for i in range(microbatches)]  # fmt: skip
        optimizer.step()
        module.lazy_reset_grad()
        losses.append(sum(micro) / microbatches)
    return module, losses


#: T × S: the micro-batches' gradients are accumulated in each stage's own runs and the
#: members' partial products summed between them, in another order than one process's; where
#: a gradient is near zero, AdamW's normalised update carries the 1e-7 difference into a
#: parameter as up to 1.2e-5 after 20 steps (1 element of Llama's 4096 in q_proj)
STAGED_TOLERANCE = 5e-5


@pytest.mark.parametrize("name", ["llama"])
def test_data_replicas_of_pipelines_of_tensor_groups_equal_one_process(name, tensor_by_stages):
    """T × S × D = 2 × 2 × 2 (World.mesh(tensor=2, stages=2) over 8 processes: a pipeline's
    stages are the same member of two tensor groups, the replicas the same stage and member of
    two pipelines): each stage's segments are cut after its group's sums, each replica's
    pipeline takes half of the rows of each of a batch's 2 micro-batches, and each stage's
    accumulated gradients are averaged with its replica's (StageReplicas.of_mesh, the mesh's
    data group) before the update. The oracle: one process, the whole program accumulating
    over the whole micro-batches; the losses within 1e-5, every parameter and optimizer state
    of each stage, joined from its tensor group, within STAGED_TOLERANCE."""
    folder = tensor_by_stages
    reference, losses = _accumulating_reference(folder, name, 2)
    got = np.load(folder / f"{name}-2x2x2-losses.npz")
    np.testing.assert_allclose(got["losses"], losses, rtol=TOLERANCE, atol=TOLERANCE)
    joined = {}
    for stage in range(2):
        joined.update(np.load(folder / f"{name}-2x2x2-stage{stage}.npz"))
    assert set(joined) == set(reference.state.tensors)  # every tensor of the whole program, in one stage or the other
    # (a replica's gradient accumulators hold its own rows' sums: the average is taken at the update)
    scratch = {c.input for c in reference.roles.carried_with_role("accumulator")}
    for tensor, value in reference.state.tensors.items():
        if tensor not in scratch:
            np.testing.assert_allclose(joined[tensor], value, rtol=0, atol=STAGED_TOLERANCE, err_msg=tensor)


@contextlib.contextmanager
def _two_namespaces():
    """Two network namespaces joined by a veth pair, each end with an address of its own
    (10.213.0.1 and .2): two nodes, as far as torchrun, c10d and gloo can tell. Skips with
    the reason where they cannot be made (not root, no ``ip``, a container without the right)."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("network namespaces need root and iproute2's ip")
    tag = f"{os.getpid() % 10**6}"
    names, ends = [f"gf{tag}n{i}" for i in range(2)], [f"gf{tag}v{i}" for i in range(2)]
    commands = [["ip", "netns", "add", n] for n in names]
    commands.append(["ip", "link", "add", ends[0], "type", "veth", "peer", "name", ends[1]])
    for i, (name, end) in enumerate(zip(names, ends, strict=True)):
        commands += [
            ["ip", "link", "set", end, "netns", name],
            ["ip", "-n", name, "addr", "add", f"{NODE_ADDRESSES[i]}/24", "dev", end],
            ["ip", "-n", name, "link", "set", end, "up"],
            ["ip", "-n", name, "link", "set", "lo", "up"],
        ]
    try:
        for command in commands:
            done = subprocess.run(command, capture_output=True, text=True, timeout=30)
            if done.returncode:
                pytest.skip(f"network namespaces cannot be made here: {' '.join(command)}: {done.stderr.strip()}")
        yield names, ends
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


NODE_ADDRESSES = ("10.213.0.1", "10.213.0.2")


@pytest.mark.slow
def test_two_nodes_in_network_namespaces_equal_one_process(workspace):
    """Two nodes for real: each a network namespace of its own running its own torchrun
    (--nnodes=2, c10d rendezvous at the first node's address, gloo over the veth link
    between them), 2 processes each: a tensor group within each node, data parallelism
    across the two. The same oracle as the mesh on one machine: one process, the whole
    program, the whole batches."""
    folder = workspace
    spec = _spec(folder, "nodes", ["gpt2", "digits"], data=2)
    worker = str(Path(__file__).parent / "_tensor_parallel_worker.py")
    with _two_namespaces() as (names, ends):
        procs = []
        for node, (name, end) in enumerate(zip(names, ends, strict=True)):
            # the first node hosts the rendezvous store (c10d cannot tell from an address no
            # hostname resolves to); each advertises its own address to the other
            argv = ["ip", "netns", "exec", name, sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                    "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={NODE_ADDRESSES[0]}:29512",
                    f"--rdzv-conf=is_host={int(node == 0)}", f"--local-addr={NODE_ADDRESSES[node]}",
                    "--rdzv-id=graphforge-two-nodes", "--max-restarts=0", worker, str(spec)]  # fmt: skip
            procs.append(spawn(argv, env=environment(GLOO_SOCKET_IFNAME=end)))
        for node, proc in enumerate(procs):
            done = finish(proc, LAUNCH_TIMEOUT_S)
            assert done.returncode == 0, f"node {node} exited with {done.returncode}:\n{done.stdout[-4000:]}"
    reports = [json.loads((folder / f"gpt2-nodes-rank{r}.json").read_text()) for r in range(4)]
    assert sorted(r["node"] for r in reports) == [0, 0, 1, 1]
    for report in reports:  # each tensor group within one node, its replicas across the two
        assert {reports[r]["node"] for r in report["tensor_ranks"]} == {report["node"]}
    for name in ("gpt2", "digits"):
        reference, losses, evaluated = _reference(folder, name, 2)
        got = np.load(folder / f"{name}-nodes-losses.npz")
        np.testing.assert_allclose(got["losses"], losses, rtol=TOLERANCE, atol=TOLERANCE)
        np.testing.assert_allclose(got["eval"], evaluated, rtol=TOLERANCE, atol=TOLERANCE)
        whole = CheckpointState.load(folder / f"{name}-nodes-whole.safetensors", reference.train_program)
        for tensor, value in reference.state.tensors.items():
            np.testing.assert_allclose(whole.tensors[tensor], value, rtol=0, atol=TOLERANCE, err_msg=tensor)


@pytest.mark.slow
def test_the_joined_state_resumes_on_one_process_and_on_another_t(two_members):
    """The state joined from 2 members trains on, on one process, as the reference that never
    stopped; a member of 4 takes its slices of it."""
    folder = two_members
    reference, _, _ = _reference(folder, "gpt2", 2)
    batch = {n: v[0] for n, v in np.load(folder / "gpt2-batches.npz").items()}
    whole = CheckpointState.load(folder / "gpt2-2-whole.safetensors")
    resumed = Module(reference.train_program, whole, device="cpu", update="onnx")
    np.testing.assert_allclose(resumed.train_step(**batch), reference.train_step(**batch), rtol=1e-6)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipeline = member_pipeline(f"{CASES['gpt2'][1]}, {OPTIMIZERS['gpt2']}", 4, rank=1)
        member = graphforge.compile(_model(folder, "gpt2"), pipeline).model
    saved = CheckpointState.load(folder / "gpt2-2-whole.safetensors")
    state = member_state(saved.copy(), member)
    assert state.step == STEPS
    split = carried_split(ProgramRoles.read(member))
    assert any(sections for _, sections in split.values())  # c_attn's Q, K and V sections
    for name, value in saved.tensors.items():
        if name in split:
            axis, sections = split[name]
            parts = np.split(value, np.cumsum(sections)[:-1], axis=axis) if sections else [value]
            expected = np.concatenate([np.split(p, 4, axis=axis)[1] for p in parts], axis=axis)
        else:
            expected = value
        np.testing.assert_array_equal(state.tensors[name], expected, err_msg=name)


@pytest.mark.slow
def test_a_member_that_dies_stops_the_others_within_the_timeout_with_one_line_naming_it(workspace):
    """Member 1 exits at step 3: member 0's next sum fails, the survivors check in, and it
    stops with one line naming rank 1, well within the launch's timeout (no hang)."""
    folder = workspace
    case = {
        "model": _model(folder, "digits"),
        "pipeline": f"{CASES['digits'][1]}, {ADAMW}",
        "batches": str(folder / "digits-batches.npz"),
        "out": str(folder / "digits-dies"),
        "die_at_step": 3,
    }
    spec = folder / "spec-dies.json"
    spec.write_text(json.dumps({"cases": [case], "timeout_s": 8}))  # (the survivor checks in for 8 s)
    argv = [str(Path(__file__).parent / "_tensor_parallel_worker.py"), str(spec)]
    survivor, dead = run_ranks(2, argv, timeout=120)
    assert dead.returncode == 17
    assert survivor.returncode == 3, survivor.output[-3000:]
    (line,) = [x for x in survivor.output.splitlines() if x.startswith("error: ")]
    assert "rank 0: the tensor-parallel sum of" in line and "step 4" in line and "rank 1 did not answer" in line
    assert survivor.seconds < 60


def test_member_slices_join_back_to_the_whole():
    rng = np.random.default_rng(0)
    whole = {"w": rng.standard_normal((6, 8)), "v": rng.standard_normal((8, 6)), "b": rng.standard_normal(4)}
    axes = {"w": 1, "v": 0}
    members = [member_tensors(whole, axes, r, 2) for r in range(2)]
    assert members[1]["w"].shape == (6, 4) and members[1]["v"].shape == (4, 6) and members[1]["b"] is whole["b"]
    joined = join_tensors(members, axes)
    for name, value in whole.items():
        np.testing.assert_array_equal(joined[name], value)
    # a fused QKV weight: each member holds its part of every section
    qkv = {"w": np.arange(2 * 12).reshape(2, 12)}
    members = [member_tensors(qkv, {"w": (1, (4, 4, 4))}, r, 2) for r in range(2)]
    np.testing.assert_array_equal(members[1]["w"][0], [2, 3, 6, 7, 10, 11])
    np.testing.assert_array_equal(join_tensors(members, {"w": (1, (4, 4, 4))})["w"], qkv["w"])


DIGITS = str(REPO / "examples" / "digits" / "model.onnx")
LOSS = "loss(kind=cross_entropy, output=logits), autodiff"


def test_refusals_name_what_is_wrong(world_of_one, tmp_path):
    whole = graphforge.compile(DIGITS, f"tensor_parallel(size=2), {LOSS}, {ADAMW}").model
    with pytest.raises(
        GraphforgeError, match=r"not one member's: compile each member's program with tensor_parallel\(size=2, rank=r\)"
    ):
        TensorParallel(Module(whole, device="cpu"), world_of_one)
    member = graphforge.compile(DIGITS, f"tensor_parallel(size=2, rank=1), {LOSS}, {ADAMW}").model
    with pytest.raises(
        DistributedError, match=r"rank 0, member 0 of a tensor group of 1: its program is member 1's of 2"
    ):
        TensorParallel(Module(member, device="cpu"), world_of_one)
    with pytest.raises(GraphforgeError, match="one tensor-parallel member's program, which holds slices"):
        Module(member, device="cpu").export_model_for_inferencing(tmp_path / "member.onnx", ["logits"])
    assert not (tmp_path / "member.onnx").exists()
    lamb = graphforge.compile(DIGITS, f"tensor_parallel(size=1, rank=0), {LOSS}, lamb(lr=1e-3)").model
    with pytest.raises(GraphforgeError, match="cannot use LAMB yet: its trust ratio takes each whole parameter's norm"):
        TensorParallel(Module(lamb, device="cpu"), world_of_one)
    with pytest.raises(GraphforgeError, match=r"parameter 'rank': expected a number in \[0, 2\), got 2"):
        graphforge.compile(DIGITS, f"tensor_parallel(size=2, rank=2), {LOSS}")


@pytest.mark.parametrize("capture", [False, True])
def test_one_member_of_one_trains_as_the_plain_program(world_of_one, transformer_path, capture):
    """T = 1 through the whole path (parts cut at the markers, the hook between them): the
    plain program, bit for bit, over a change of dims (GPT-2, 1 layer). Capture-ready (what
    CUDA runs), every part runs against fixed buffers: the model is specialized to the batch's
    dims before it is cut, so the part reading GPT-2's flattened activation ([batch · seq,
    features], a dim no batch input names) has fixed shapes too."""
    pipeline = f"loss(kind=mse, output=logits), autodiff, {ADAMW}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        member = graphforge.compile(str(transformer_path), f"tensor_parallel(size=1, rank=0), {pipeline}").model
        plain = graphforge.compile(str(transformer_path), pipeline).model
    a = Module(member, device="cpu", update="onnx", capture=capture)
    b = Module(plain, device="cpu", update="onnx")
    TensorParallel(a, world_of_one)
    rng = np.random.default_rng(3)
    for step in range(6):
        seq = 8 if step < 3 else 6
        batch = {
            "input_ids": rng.integers(0, 64, (2, seq)),
            "labels": rng.standard_normal((2, seq, 64)).astype(np.float32),
        }
        np.testing.assert_array_equal(a.train_step(**batch), b.train_step(**batch))
    for name, value in b.parameters.items():
        np.testing.assert_array_equal(a.parameters[name], value, err_msg=name)
    if capture:
        assert a.runner.capture_refused == {}
        assert sum(bound.static_inputs is not None for bound in a.runner._sessions.values()) >= 3
