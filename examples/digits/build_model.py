"""Build the digits demo's forward model, deterministically, from code (no torch needed).

python examples/digits/build_model.py            # rewrite examples/digits/model.onnx
python examples/digits/build_model.py --check    # exit 1 if the shipped file differs from a rebuild

The model takes the raw images as the data ships them (``images``: uint8 [batch, 8, 8],
pixels 0–16) and does its own preprocessing: Cast to float, scale by 1/16, Flatten; then a
64→64 Linear + ReLU and a 64→10 Linear giving ``logits`` [batch, 10]. The weights are
initialised as torch.nn.Linear does (uniform in ±1/sqrt(fan_in)), from a fixed seed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
MODEL = HERE / "model.onnx"
SEED = 0
PIXELS, HIDDEN, CLASSES = 64, 64, 10


def _linear(rng: np.random.Generator, name: str, fan_in: int, fan_out: int) -> list[onnx.TensorProto]:
    bound = 1.0 / np.sqrt(fan_in)
    weight = rng.uniform(-bound, bound, (fan_out, fan_in)).astype(np.float32)
    bias = rng.uniform(-bound, bound, (fan_out,)).astype(np.float32)
    return [numpy_helper.from_array(weight, f"{name}.weight"), numpy_helper.from_array(bias, f"{name}.bias")]


def build() -> onnx.ModelProto:
    rng = np.random.default_rng(SEED)
    initializers = [*_linear(rng, "fc1", PIXELS, HIDDEN), *_linear(rng, "fc2", HIDDEN, CLASSES)]
    # the scale is a Constant node, not an initializer: initializers are what training updates
    scale = numpy_helper.from_array(np.array(1.0 / 16.0, np.float32), "scale")
    nodes = [
        helper.make_node("Cast", ["images"], ["pixels"], name="to_float", to=TensorProto.FLOAT),
        helper.make_node("Constant", [], ["scale"], name="scale", value=scale),
        helper.make_node("Mul", ["pixels", "scale"], ["scaled"], name="normalise"),
        helper.make_node("Flatten", ["scaled"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", "fc1.weight", "fc1.bias"], ["fc1.out"], name="fc1", transB=1),
        helper.make_node("Relu", ["fc1.out"], ["hidden"], name="relu"),
        helper.make_node("Gemm", ["hidden", "fc2.weight", "fc2.bias"], ["logits"], name="fc2", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "digits_mlp",
        [helper.make_tensor_value_info("images", TensorProto.UINT8, ["batch", 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="graphforge-example")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped model instead of writing it")
    args = parser.parse_args()
    data = build().SerializeToString()
    if args.check:
        same = MODEL.is_file() and MODEL.read_bytes() == data
        print(f"{MODEL.relative_to(HERE.parent.parent)}: {'up to date' if same else 'differs from a rebuild'}")
        return 0 if same else 1
    MODEL.write_bytes(data)
    print(f"wrote {MODEL.relative_to(HERE.parent.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
