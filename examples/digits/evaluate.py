"""Score an exported digits model on the test split with a plain onnxruntime session.

python examples/digits/evaluate.py out/digits/model.onnx [--data data/digits/test.npz] [--min-accuracy 0.93]

Prints the accuracy and exits with status 1 when it is below --min-accuracy. Uses only
onnxruntime and NumPy: the exported model needs nothing from graphforge.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

REPO = Path(__file__).resolve().parent.parent.parent
#: the accuracy `make demo` promises (README); the demo's run reaches about 0.98
MIN_ACCURACY = 0.93


def accuracy(model: str | Path, data: str | Path) -> float:
    """The share of test images whose argmax logit is the label."""
    with np.load(data) as split:
        images, labels = split["images"], split["labels"]
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"images": images})
    return float(np.mean(np.argmax(logits, axis=1) == labels))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="the exported inference model")
    parser.add_argument("--data", type=Path, default=REPO / "data/digits/test.npz", help="the test split (.npz)")
    parser.add_argument("--min-accuracy", type=float, default=MIN_ACCURACY, help="fail below this accuracy")
    args = parser.parse_args()
    score = accuracy(args.model, args.data)
    with np.load(args.data) as split:
        count = len(split["labels"])
    verdict = "ok" if score >= args.min_accuracy else "FAILED"
    print(
        f"test accuracy {score:.4f} on {count} images (onnxruntime {ort.__version__}): {verdict}, needs ≥ {args.min_accuracy}"
    )
    return 0 if score >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
