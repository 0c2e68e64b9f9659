"""Build the small models shipped in golden_models/, deterministically, from code.

python golden_models/build.py            # rewrite every model
python golden_models/build.py --check    # exit 1 if a shipped model differs from a rebuild
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
OPSET = 17


def demo_mlp() -> onnx.ModelProto:
    """A 64-32-10 MLP for 8×8 digit images, written the way exporters write graphs: the
    flatten shape computed at run time from constants, Identity aliases, a duplicated
    subexpression and a dead debug branch — material for the generic passes."""
    rng = np.random.default_rng(0)

    def param(name: str, *shape: int) -> TensorProto:
        fan_in = shape[0]
        return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32), name)

    initializers = [
        param("fc1.weight", 64, 32),
        numpy_helper.from_array(np.zeros(32, np.float32), "fc1.bias"),
        param("fc2.weight", 32, 10),
        numpy_helper.from_array(np.zeros(10, np.float32), "fc2.bias"),
    ]
    nodes = [
        helper.make_node("Constant", [], ["minus_one"], value=numpy_helper.from_array(np.array([-1], np.int64))),
        helper.make_node("Constant", [], ["pixels"], value=numpy_helper.from_array(np.array([64], np.int64))),
        helper.make_node("Concat", ["minus_one", "pixels"], ["flat_shape"], axis=0),
        helper.make_node("Reshape", ["images", "flat_shape"], ["flat"], name="flatten"),
        helper.make_node("Identity", ["flat"], ["flat_alias"]),
        helper.make_node("MatMul", ["flat_alias", "fc1.weight"], ["h_mm"], name="fc1/MatMul"),
        helper.make_node("Add", ["h_mm", "fc1.bias"], ["h_pre"], name="fc1/Add"),
        helper.make_node("Relu", ["h_pre"], ["h"], name="relu"),
        # the exporter traced the activation twice (e.g. a residual read): a CSE target
        helper.make_node("Relu", ["h_pre"], ["h_again"], name="relu_again"),
        helper.make_node("Add", ["h", "h_again"], ["h2"], name="double"),
        helper.make_node("MatMul", ["h2", "fc2.weight"], ["o_mm"], name="fc2/MatMul"),
        helper.make_node("Add", ["o_mm", "fc2.bias"], ["logits"], name="fc2/Add"),
        # a debug statistic nobody reads: dead code
        helper.make_node("ReduceMean", ["h"], ["h_mean"], name="debug/mean", keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "demo_mlp",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="graphforge-golden")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


MODELS = {"demo_mlp": demo_mlp}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for name, build in MODELS.items():
        path = HERE / name / "model.onnx"
        data = build().SerializeToString(deterministic=True)
        if args.check:
            if not path.exists() or path.read_bytes() != data:
                stale.append(name)
            continue
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
        print(f"wrote {path.relative_to(HERE.parent)} ({len(data):,} bytes)")
    if stale:
        print("out of date: " + ", ".join(stale) + " (run python golden_models/build.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
