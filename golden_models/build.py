"""Build the small models shipped in golden_models/, deterministically, from code.

python golden_models/build.py                 # rewrite every model and its test data
python golden_models/build.py gpt2_tiny       # rewrite only the models named
python golden_models/build.py --check         # exit 1 if a shipped file differs from a rebuild

Each model is a folder in the ONNX test-directory layout, as onnx's backend tests use it:

    <name>/model.onnx
    <name>/test_data_set_N/input_i.pb    the model's i-th input (a TensorProto named like it)
    <name>/test_data_set_N/output_i.pb   its i-th output, computed by an independent oracle
                                         (NumPy for the hand-written model, PyTorch for the others)
    <name>/test_data_set_N/extra_input_i.pb   feeds a compiled program adds (the loss pass's
                                         ``labels``); ONNX test runners ignore these files

The builder writes only those. ``<name>/golden.json`` (pipelines and tolerances) is written
by hand, and ``<name>/expected/`` by ``graphforge golden update``: after rebuilding a model,
run that and review the diff it prints. The golden check never re-exports: it compiles the
shipped model.onnx files, so PyTorch versions whose exporter writes different bytes do not
break it (``--check`` here does compare bytes, and is only meaningful with the pinned torch).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
OPSET = 17

Arrays = dict[str, np.ndarray]


@dataclass
class TestSet:
    """One test_data_set_N: the model's inputs and outputs in graph order, and extra feeds."""

    inputs: Arrays
    outputs: Arrays
    extra: Arrays = field(default_factory=dict)


@dataclass
class Built:
    model: onnx.ModelProto
    sets: list[TestSet]


# --------------------------------------------------------------------------- demo_mlp (hand-written)


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


def build_demo_mlp() -> Built:
    """demo_mlp, with its outputs computed by NumPy from the initializers (an independent oracle)."""
    model = demo_mlp()
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    rng = np.random.default_rng(100)
    images = rng.standard_normal((4, 8, 8)).astype(np.float32)
    h = np.maximum(images.reshape(-1, 64) @ weights["fc1.weight"] + weights["fc1.bias"], 0)
    logits = (2 * h) @ weights["fc2.weight"] + weights["fc2.bias"]
    labels = rng.integers(0, 10, size=4).astype(np.int64)
    return Built(model, [TestSet({"images": images}, {"logits": logits.astype(np.float32)}, {"labels": labels})])


# --------------------------------------------------------------------------- PyTorch models


def _torch():
    try:
        import torch
    except ImportError:
        sys.exit("building the PyTorch models needs torch: pip install -e '.[torch]'")
    torch.use_deterministic_algorithms(True)
    return torch


def _jitter_vectors(module, seed: int) -> None:
    """Perturb every 1-D parameter (biases, norm scales) with seeded noise.

    The TorchScript exporter merges initializers with equal values (fresh biases are all
    zeros, norm weights all ones) and re-exposes them through Identity, which would tie
    parameters that training must keep apart."""
    torch = _torch()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in module.parameters():
            if param.dim() == 1:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))


def _export(module, example: tuple, inputs: list[str], outputs: list[str], dynamic_axes: dict) -> onnx.ModelProto:
    """TorchScript export (dynamo=False, no constant folding: parameters stay named initializers)."""
    import io

    torch = _torch()
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # exporter deprecation and tracer warnings
        torch.onnx.export(
            module.eval(),
            example,
            buffer,
            dynamo=False,
            do_constant_folding=False,
            opset_version=OPSET,
            input_names=inputs,
            output_names=outputs,
            dynamic_axes=dynamic_axes,
        )
    model = onnx.load_from_string(buffer.getvalue())
    model.producer_name = "graphforge-golden (torch.onnx, TorchScript)"
    onnx.checker.check_model(model, full_check=True)
    return model


def _torch_outputs(module, arrays: list[np.ndarray]) -> list[np.ndarray]:
    torch = _torch()
    with torch.no_grad():
        result = module(*(torch.from_numpy(a) for a in arrays))
    results = result if isinstance(result, tuple) else (result,)
    return [r.numpy() for r in results]


def _fire_cnn(classes: int):
    """SqueezeNet 1.1's shape in miniature: a strided stem, fire modules (1×1 squeeze, then
    1×1 and 3×3 expands concatenated), ceil-mode max pools, a 1×1 conv classifier and a
    global average pool."""
    torch = _torch()
    nn = torch.nn

    class Fire(nn.Module):
        def __init__(self, cin: int, squeeze: int, expand: int):
            super().__init__()
            self.squeeze = nn.Conv2d(cin, squeeze, 1)
            self.expand1x1 = nn.Conv2d(squeeze, expand, 1)
            self.expand3x3 = nn.Conv2d(squeeze, expand, 3, padding=1)

        def forward(self, x):
            x = torch.relu(self.squeeze(x))
            return torch.cat([torch.relu(self.expand1x1(x)), torch.relu(self.expand3x3(x))], 1)

    class SqueezeNetMini(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(3, 16, 3, stride=2),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(3, stride=2, ceil_mode=True),
                Fire(16, 4, 8),
                Fire(16, 4, 8),
                nn.MaxPool2d(3, stride=2, ceil_mode=True),
                Fire(16, 8, 16),
            )
            self.classifier = nn.Sequential(
                nn.Dropout(0.5), nn.Conv2d(32, classes, 1), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1)
            )

        def forward(self, images):
            return torch.flatten(self.classifier(self.features(images)), 1)

    return SqueezeNetMini()


def build_squeezenet_mini() -> Built:
    """images [batch, 3, 32, 32] -> logits [batch, 10]; exported at batch 2, tested at batch 3."""
    torch = _torch()
    torch.manual_seed(0)
    module = _fire_cnn(classes=10)
    _jitter_vectors(module, 0)
    module.eval()
    axes = {"images": {0: "batch"}, "logits": {0: "batch"}}
    model = _export(module, (torch.zeros(2, 3, 32, 32),), ["images"], ["logits"], axes)
    rng = np.random.default_rng(200)
    images = rng.standard_normal((3, 3, 32, 32)).astype(np.float32)
    (logits,) = _torch_outputs(module, [images])
    labels = rng.integers(0, 10, size=3).astype(np.int64)
    return Built(model, [TestSet({"images": images}, {"logits": logits}, {"labels": labels})])


GPT2_CONFIG = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 128, "n_positions": 64}


def build_gpt2_tiny() -> Built:
    """A 2-layer GPT-2 with random weights (built from a config, never downloaded):
    input_ids int64 [batch, seq] -> logits [batch, vocab, seq], the classes on axis 1 as
    cross_entropy takes them. Exported at [2, 8], tested at [2, 8] and [3, 5]."""
    torch = _torch()
    from transformers import GPT2Config, GPT2LMHeadModel

    class ClassesFirst(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            # transformers 5.x traces a dynamic sequence length only with an explicit mask
            mask = torch.ones_like(input_ids)
            return self.inner(input_ids=input_ids, attention_mask=mask).logits.transpose(1, 2)

    torch.manual_seed(0)
    config = GPT2Config(
        **GPT2_CONFIG,
        attn_implementation="eager",
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    inner = GPT2LMHeadModel(config)
    _jitter_vectors(inner, 0)
    module = ClassesFirst(inner).eval()
    axes = {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 2: "seq"}}
    model = _export(module, (torch.zeros(2, 8, dtype=torch.int64),), ["input_ids"], ["logits"], axes)
    rng = np.random.default_rng(300)
    sets = []
    for batch, seq in ((2, 8), (3, 5)):
        ids = rng.integers(0, GPT2_CONFIG["vocab_size"], size=(batch, seq)).astype(np.int64)
        (logits,) = _torch_outputs(module, [ids])
        labels = rng.integers(0, GPT2_CONFIG["vocab_size"], size=(batch, seq)).astype(np.int64)
        sets.append(TestSet({"input_ids": ids}, {"logits": logits}, {"labels": labels}))
    return Built(model, sets)


def build_dynamic_attention() -> Built:
    """A pre-norm single-head self-attention block with a sequence-mean and a per-token head:
    x [batch, seq, 16] -> y [batch, seq, 8]. Batch and sequence are dynamic and reach
    MatMul, Softmax, ReduceMean and Split; tested at two different [batch, seq] sizes."""
    torch = _torch()
    nn = torch.nn

    class DynamicAttention(nn.Module):
        def __init__(self, width: int = 16, out: int = 8):
            super().__init__()
            self.width = width
            self.norm = nn.LayerNorm(width)
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
            self.head = nn.Linear(width, out)

        def forward(self, x):
            q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
            attention = torch.softmax(q @ k.transpose(1, 2) / self.width**0.5, dim=-1)
            h = x + self.proj(attention @ v)
            return self.head(torch.nn.functional.gelu(h - h.mean(dim=1, keepdim=True)))

    torch.manual_seed(0)
    module = DynamicAttention()
    _jitter_vectors(module, 0)
    module.eval()
    axes = {"x": {0: "batch", 1: "seq"}, "y": {0: "batch", 1: "seq"}}
    model = _export(module, (torch.zeros(2, 4, 16),), ["x"], ["y"], axes)
    rng = np.random.default_rng(400)
    sets = []
    for batch, seq in ((2, 5), (3, 7)):
        x = rng.standard_normal((batch, seq, 16)).astype(np.float32)
        (y,) = _torch_outputs(module, [x])
        labels = rng.standard_normal((batch, seq, 8)).astype(np.float32)
        sets.append(TestSet({"x": x}, {"y": y}, {"labels": labels}))
    return Built(model, sets)


MODELS: dict[str, Callable[[], Built]] = {
    "demo_mlp": build_demo_mlp,
    "squeezenet_mini": build_squeezenet_mini,
    "gpt2_tiny": build_gpt2_tiny,
    "dynamic_attention": build_dynamic_attention,
}


# --------------------------------------------------------------------------- writing


def _tensor_bytes(array: np.ndarray, name: str) -> bytes:
    return numpy_helper.from_array(np.asarray(array).copy(order="C"), name).SerializeToString(deterministic=True)


def model_files(built: Built) -> dict[str, bytes]:
    """Every file the builder owns in a model's folder, by relative path."""
    graph = built.model.graph
    initializers = {t.name for t in graph.initializer}
    input_names = [v.name for v in graph.input if v.name not in initializers]
    output_names = [v.name for v in graph.output]
    files = {"model.onnx": built.model.SerializeToString(deterministic=True)}
    for n, test_set in enumerate(built.sets):
        if list(test_set.inputs) != input_names or list(test_set.outputs) != output_names:
            raise AssertionError(f"test set {n} must name the inputs {input_names} and outputs {output_names} in order")
        folder = f"test_data_set_{n}"
        for kind, arrays in (("input", test_set.inputs), ("output", test_set.outputs), ("extra_input", test_set.extra)):
            for i, (name, array) in enumerate(arrays.items()):
                files[f"{folder}/{kind}_{i}.pb"] = _tensor_bytes(array, name)
    return files


def _owned(folder: Path) -> set[str]:
    """The files in ``folder`` the builder wrote (model.onnx and the test data sets)."""
    found = {"model.onnx"} if (folder / "model.onnx").exists() else set()
    for data_set in folder.glob("test_data_set_*"):
        found |= {str(p.relative_to(folder)) for p in data_set.glob("*.pb")}
    return found


#: how far a rebuilt expected output may be from the shipped one: the oracles' float sums
#: (NumPy's BLAS, PyTorch's kernels) round differently on other CPUs, by an ulp or so
OUTPUT_RTOL, OUTPUT_ATOL = 1e-5, 1e-6


def _same_file(path: Path, data: bytes) -> bool:
    """Whether the shipped ``path`` holds ``data``: the same bytes, or for an expected output
    (``output_i.pb``) the same name, type and shape with values within OUTPUT_RTOL/ATOL."""
    shipped = path.read_bytes()
    if shipped == data or not path.name.startswith("output_"):
        return shipped == data
    old, new = TensorProto.FromString(shipped), TensorProto.FromString(data)
    if (old.name, old.data_type, list(old.dims)) != (new.name, new.data_type, list(new.dims)):
        return False
    a, b = numpy_helper.to_array(old), numpy_helper.to_array(new)
    if not np.issubdtype(a.dtype, np.floating):
        return False
    return bool(np.allclose(a, b, rtol=OUTPUT_RTOL, atol=OUTPUT_ATOL))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"models to build (default: all of {', '.join(MODELS)})"
    )
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model {', '.join(unknown)}; the models are {', '.join(MODELS)}")
    stale = []
    for name in args.names or MODELS:
        folder = HERE / name
        files = model_files(MODELS[name]())
        if args.check:
            if _owned(folder) != set(files) or any(not _same_file(folder / p, data) for p, data in files.items()):
                stale.append(name)
            continue
        folder.mkdir(exist_ok=True)
        for data_set in folder.glob("test_data_set_*"):
            shutil.rmtree(data_set)
        for relative, data in files.items():
            (folder / relative).parent.mkdir(parents=True, exist_ok=True)
            (folder / relative).write_bytes(data)
        size = sum(len(d) for d in files.values())
        print(f"wrote {folder.relative_to(HERE.parent)}/ ({len(files)} files, {size:,} bytes)")
    if stale:
        print("out of date: " + ", ".join(stale) + " (run python golden_models/build.py)", file=sys.stderr)
        return 1
    if not args.check:
        print("now run `graphforge golden update golden_models` and review the diff it prints")
    return 0


if __name__ == "__main__":
    sys.exit(main())
