"""What a quantized frozen base costs in accuracy: LoRA fine-tuning of the digits MLP
(examples/digits, 64-64-10) on a float32 base and on the same base stored as int8 and int4 by
the quantize_frozen pass (blocks of 32), on the same batches in the same order.

The base is first trained in float32 for a short while (PRETRAIN_STEPS of AdamW on the digits'
training set), so that the adapters fine-tune a base that is partly trained, as LoRA's are; then
each side adapts fc1 and fc2 (r=8, alpha=16) for STEPS steps of AdamW. The table gives the
training loss (the mean over windows of steps) and the held-out loss and accuracy at the end.

    python benchmarks/run.py quantized_base
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import helpers  # noqa: E402  (what the benchmarks share)

TITLE = "Quantized frozen base"
MODEL = REPO / "examples" / "digits" / "model.onnx"
DATA = REPO / "data" / "digits"
PRETRAIN_STEPS = 20  # under half an epoch of 32-image batches: the adapters have something to learn
STEPS = 100
BATCH = 32
LR = 3e-3  # the adapters' AdamW learning rate
LOSS = "loss(kind=cross_entropy, output=logits)"
LORA = "lora(r=8, alpha=16, targets=[fc1, fc2])"
SIDES = (
    ("float32", ""),
    ("int8", "quantize_frozen(bits=8, block=32), "),
    ("int4", "quantize_frozen(bits=4, block=32), "),
)
#: the windows of steps whose mean training loss the table gives
WINDOWS = ((0, 1), (1, 10), (10, 25), (25, 50), (50, 100))


def _batches(images: np.ndarray, labels: np.ndarray, steps: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(len(labels)) for _ in range(steps * BATCH // len(labels) + 1)])
    return [
        {"images": images[order[i * BATCH : (i + 1) * BATCH]], "labels": labels[order[i * BATCH : (i + 1) * BATCH]]}
        for i in range(steps)
    ]


def pretrained_base(train: dict[str, np.ndarray]):
    """The digits MLP after PRETRAIN_STEPS of float32 AdamW: its forward model with those weights."""
    from onnx import numpy_helper

    import graphforge

    program = graphforge.compile(str(MODEL), f"{LOSS}, autodiff, adamw(lr=1e-2)").model
    module = graphforge.Module(program, device="cpu")
    for batch in _batches(train["images"], train["labels"], PRETRAIN_STEPS, seed=1):
        module.train_step(**batch)
    forward = graphforge.load(str(MODEL))
    trained = module.parameters
    for tensor in forward.graph.initializer:
        if tensor.name in trained:
            tensor.CopyFrom(numpy_helper.from_array(trained[tensor.name], tensor.name))
    return forward


def fine_tune(base, quantize: str, train, test, steps: int) -> dict:
    import graphforge

    program = graphforge.compile(base, f"{LORA}, {quantize}{LOSS}, autodiff, adamw(lr={LR})").model
    module = graphforge.Module(program, device="cpu")
    losses = [float(module.train_step(**b)) for b in _batches(train["images"], train["labels"], steps, seed=2)]
    module.eval()
    loss, logits = module(images=test["images"], labels=test["labels"], outputs=["logits"])
    frozen = sum(t.ByteSize() for t in program.graph.initializer if ".lora_" not in t.name and "_next" not in t.name)
    return {
        "losses": losses,
        "test_loss": float(loss),
        "accuracy": float((np.argmax(logits, axis=1) == test["labels"]).mean()),
        "base_bytes": frozen,
    }


def benchmark(quick: bool) -> dict[str, dict]:
    train, test = (dict(np.load(DATA / f"{split}.npz")) for split in ("train", "test"))
    base = pretrained_base(train)
    steps = 20 if quick else STEPS
    return {label: fine_tune(base, quantize, train, test, steps) for label, quantize in SIDES}


def report(results: dict[str, dict]) -> str:
    windows = [(a, b) for a, b in WINDOWS if b <= len(next(iter(results.values()))["losses"])]
    head = ["base", *(f"steps {a + 1}–{b}" if b - a > 1 else f"step {b}" for a, b in windows)]
    head += ["held-out loss", "held-out accuracy", "base initializers"]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for label, r in results.items():
        means = [f"{np.mean(r['losses'][a:b]):.4f}" for a, b in windows]
        cells = [label, *means, f"{r['test_loss']:.4f}", f"{100 * r['accuracy']:.1f}%", f"{r['base_bytes']:,} B"]
        lines.append("| " + " | ".join(cells) + " |")
    intro = (
        f"LoRA (r=8, alpha=16 on fc1 and fc2) on the digits MLP after {PRETRAIN_STEPS} float32 AdamW steps "
        f"of pretraining, then {len(next(iter(results.values()))['losses'])} AdamW steps (lr {LR:g}, batches of "
        f"{BATCH}, the same batches for every side) on a float32 base and on the base stored by "
        "`quantize_frozen(bits=8|4, block=32)`. Training loss: the mean over the steps named; held-out: "
        "the 360 test images after the last step; base initializers: the bytes of the frozen base's "
        "tensors in the program (weights or integers and scales, biases)."
    )
    versions = ", ".join(f"{p} {helpers.version(p)}" for p in ("graphforge", "onnxruntime"))
    return "\n".join([intro, "", *lines, "", f"{versions}."])


def run(quick: bool) -> str:
    return report(benchmark(quick))


if __name__ == "__main__":
    print(run("--quick" in sys.argv))
