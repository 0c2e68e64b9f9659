"""Frozen weights as constants of the session, against the same weights fed as inputs.

A frozen weight (the frozen role: ``autodiff(frozen=...)``, ``lora``, torch's
``requires_grad=False``) is an initializer of the training program, so onnxruntime may prepack it
for its GEMMs. This measures what that gives: an MLP 1024-1024-1024-1024-10 (ReLU) whose first
three layers are frozen (``autodiff(frozen=['0.*', '2.*', '4.*'])``) and whose head trains with AdamW,
batch 64, one step = one ``session.run`` of the program on plain onnxruntime; the same program with
the frozen weights turned into graph inputs (fed the same arrays every run) is the other side. Both
compute the same numbers (checked); the median of the timed runs, the two sides taking turns.

    python benchmarks/frozen_bench.py            # prints the markdown section
    python benchmarks/run.py frozen              # writes it into docs/benchmarks.md
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers
import train_bench

TITLE = "Frozen weights as session constants"
SIZES = [1024, 1024, 1024, 1024, 10]
BATCH, ROUNDS, STEPS = 64, 5, 20


def _programs(folder: Path, sizes: list[int]):
    """The compiled program (frozen weights as initializers) and its twin reading them as inputs."""
    import onnx

    import graphforge

    spec = train_bench.Spec("mlp", "MLP", BATCH, {"sizes": sizes}, steps=STEPS)
    model = train_bench.export(train_bench.build_torch(spec), train_bench.make_batches(spec, 1)[0][0],
                               folder / "mlp.onnx", "x")  # fmt: skip
    frozen = [f"{2 * i}.*" for i in range(len(sizes) - 2)]
    pipeline = f"loss(kind=cross_entropy, output=logits), autodiff(frozen={frozen}), adamw(lr=1e-3)"
    constants = graphforge.compile(str(model), pipeline).model
    names = {t.name for t in constants.graph.initializer if t.name.startswith(tuple(f[:-1] for f in frozen))}
    inputs = onnx.ModelProto()
    inputs.CopyFrom(constants)
    fed = {t.name: onnx.numpy_helper.to_array(t) for t in inputs.graph.initializer if t.name in names}
    kept = [t for t in inputs.graph.initializer if t.name not in names]
    del inputs.graph.initializer[:]
    inputs.graph.initializer.extend(kept)
    for name, value in fed.items():
        inputs.graph.input.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, value.shape))
    return spec, constants, inputs, fed


def _feeds(session, program, batch: tuple[np.ndarray, np.ndarray]) -> dict:
    """Every graph input: the batch, the carried tensors at their initial values, lr and step."""
    from graphforge.program import ProgramRoles
    from graphforge.runtime import CheckpointState

    roles = ProgramRoles.read(program)
    feeds = dict(CheckpointState.from_program(program).tensors)
    feeds.update(zip(roles.batch_input_names(), batch, strict=True))
    types = {i.name: i.type for i in session.get_inputs()}
    feeds[roles.lr_input] = np.array(1e-3, np.float32)
    feeds[roles.step_input] = np.array(1, np.int64 if "int64" in types[roles.step_input] else np.float32)
    return {name: feeds[name] for name in types if name in feeds}


def run(quick: bool = False) -> str:
    import onnxruntime as ort

    sizes = [256, 256, 256, 256, 10] if quick else SIZES
    threads = helpers.usable_cores()
    with tempfile.TemporaryDirectory() as tmp:
        spec, constants, inputs, fed = _programs(Path(tmp), sizes)
        batch = train_bench.make_batches(spec, 1)[0]
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        sides = {}
        for label, program, extra in (("constants", constants, {}), ("inputs", inputs, fed)):
            session = ort.InferenceSession(program.SerializeToString(), options, providers=["CPUExecutionProvider"])
            feeds = {**_feeds(session, constants, batch), **extra}
            sides[label] = (session, feeds)
        first = {k: s.run(None, f)[0] for k, (s, f) in sides.items()}
        np.testing.assert_allclose(
            first["inputs"], first["constants"], rtol=1e-4, atol=1e-6
        )  # prepacked GEMMs round otherwise
        times: dict[str, list[float]] = {k: [] for k in sides}
        for _ in range(ROUNDS):
            for label, (session, feeds) in sides.items():
                for _ in range(STEPS):
                    started = time.perf_counter()
                    session.run(None, feeds)
                    times[label].append(time.perf_counter() - started)
    median = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    layers = "-".join(map(str, sizes))
    return (
        f"MLP {layers} (ReLU), its first {len(sizes) - 2} layers frozen, the head trained with AdamW; batch {BATCH}; "
        f"{threads} threads; one step = one run of the program on onnxruntime {helpers.version('onnxruntime')} "
        f"({helpers.cpu_name()}); median of {ROUNDS * STEPS} runs a side, the sides taking turns.\n\n"
        "| frozen weights | ms a step | × constants |\n|---|---:|---:|\n"
        f"| session constants (graphforge's programs) | {median['constants']:.2f} | 1.00× |\n"
        f"| graph inputs, fed each run | {median['inputs']:.2f} | {median['inputs'] / median['constants']:.2f}× |\n"
    )


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
