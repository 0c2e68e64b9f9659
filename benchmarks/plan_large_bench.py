"""Plans past this machine: ``graphforge plan``'s picks for GPT-2 XL and a 7B Llama-2-style
model on 8, 64 and 512 GPUs, beside the splits their public training recipes use.

Nothing here trains. Each model is exported on PyTorch's meta device (no weight is ever
made), its graph written without weights (graphforge.payloads.stand_in for each), and the
planner compiles every split's program from it for shapes and costs alone, as it does for a
model read without its external data. The hardware is stated, not measured: H100 SXM
80 GB, eight to a node, NVLink within a node and InfiniBand between nodes (the figures in
HARDWARE). The programs are float32, as exported, at TF32 tensor-core rates.

    python benchmarks/plan_large_bench.py          # prints the markdown section
    python benchmarks/run.py plan_large            # writes it into docs/benchmarks.md
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers

TITLE = "Plans for large models"
CACHE = helpers.cache("plan-large")
PIPELINE = "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=3e-4, weight_decay=0.1)"

#: H100 SXM 80 GB (assumed, not measured): TF32's 495 TFLOP/s dense peak at 40% sustained;
#: NVLink 4 within a node of 8 at an all-reduce bus bandwidth of 360 GB/s and 10 µs a
#: message; InfiniBand NDR between nodes, 400 Gb/s a GPU, at 40 GB/s and 20 µs; 50 µs of
#: launch overhead a run (captured CUDA graphs); HBM3's 3.35 TB/s at 80% for the kernels
#: that stream memory (the elementwise update, the norms, the softmax)
HARDWARE = {
    "flops": 0.4 * 495e12,
    "memory_bandwidth": 0.8 * 3.35e12,
    "memory": 80 * 10**9,
    "bandwidth": 40e9,
    "latency": 20e-6,
    "overhead": 50e-6,
    "node_processes": 8,
    "node_bandwidth": 360e9,
    "node_latency": 10e-6,
}
GPUS = (8, 64, 512)
TOP = 3


@dataclass(frozen=True)
class Recipe:
    """A public recipe's split for one of the models, as its source states it."""

    gpus: int
    data: int
    tensor: int
    stages: int
    zero: int
    source: str


@dataclass(frozen=True)
class Large:
    label: str
    family: str  # "gpt2" or "llama"
    config: dict
    seq: int
    #: sequences in one forward and backward over all GPUs (an optimizer step's accumulation round), by GPU count
    batch: dict
    recipes: list = field(default_factory=list)


MODELS = [
    Large(
        "GPT-2 XL (1.56B: 48 layers × 1600, vocabulary 50257, tied embeddings)",
        "gpt2",
        {"n_layer": 48, "n_embd": 1600, "n_head": 25, "vocab_size": 50257},
        seq=1024,
        # llm.c: 1M tokens a step, 16 sequences a GPU a round (8 rounds on 8 GPUs)
        batch={8: 128, 64: 1024, 512: 1024},
        recipes=[
            Recipe(
                8, 8, 1, 1, 1, "llm.c `scripts/run_gpt2_1558M.sh`: 8 × H100, data-parallel with ZeRO-1, no recompute"
            ),
        ],
    ),
    Large(
        "Llama-2-7B-style (6.7B: 32 layers × 4096, 32 heads, SwiGLU 11008, vocabulary 32000)",
        "llama",
        {
            "num_hidden_layers": 32,
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "intermediate_size": 11008,
            "vocab_size": 32000,
        },
        seq=4096,
        # NeMo's recipe: a global batch of 512, one sequence a GPU a round
        batch={8: 8, 64: 64, 512: 512},
        recipes=[
            Recipe(8, 4, 2, 1, 1, "NeMo `llm/recipes/llama2_7b.py`: T = 2, S = 1, the distributed (ZeRO-1) Adam"),
        ],
    ),
]
QUICK = [
    Large("GPT-2 4×256 (quick)", "gpt2", {"n_layer": 4, "n_embd": 256, "n_head": 8, "vocab_size": 512}, 64, {8: 16}),
]


def graph_only(large: Large, cache: Path = CACHE):
    """``large``'s export without weights (a stand-in for each), made once into ``cache``."""
    import onnx

    cache.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(repr((large.family, sorted(large.config.items()), large.seq)).encode()).hexdigest()[:12]
    path = cache / f"{large.family}-{key}.onnx"
    if not path.exists():
        path.write_bytes(_export(large).SerializeToString())
    return onnx.load(path, load_external_data=False)


def _export(large: Large):
    """torch.onnx's dynamo exporter on the meta device; onnxscript's optimizer (which turns the
    exporter's sequences into plain splits) with every weight left unread."""
    import onnx_ir as ir
    import onnxscript
    import torch

    from graphforge.ir import TORCH_KIND_PROP
    from graphforge.stand_ins import stand_in

    with torch.device("meta"):
        module = _module(large).eval()
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = torch.onnx.export(
            module, (ids,), dynamo=True, optimize=False, input_names=["input_ids"], output_names=["logits"],
            dynamic_shapes=({0: "batch", 1: "seq"},), verbose=False,
        )  # fmt: skip
    model = exported.model
    shapes = {}
    for name, value in model.graph.initializers.items():
        shapes[name] = (value.dtype.value, [int(d) for d in value.shape.dims])
        value.const_value = None  # (meta tensors: nothing to fold or write)
    logging.getLogger("onnx_ir").setLevel(logging.ERROR)  # "does not have a constant value", for each
    onnxscript.optimizer.optimize(model)
    proto = ir.serde.serialize_model(model)
    # the weights stand-ins (a serialized value-less initializer may be left out); what the
    # optimizer folded into new initializers (shapes, say) as it made them
    del proto.graph.initializer[:]
    for name, value in model.graph.initializers.items():
        if value.const_value is None:
            proto.graph.initializer.append(stand_in(name, *shapes[name]))
        else:
            proto.graph.initializer.append(ir.serde.serialize_tensor(value.const_value))
            proto.graph.initializer[-1].name = name
            if name not in shapes:
                # folded by the optimizer from the module's constants (the causal mask's zeros):
                # a constant, as torch.export calls lifted ones, which autodiff does not train
                # (an exporter optimizing real weights names such values val_<n>, which it reads so)
                proto.graph.initializer[-1].metadata_props.add(key=TORCH_KIND_PROP, value="CONSTANT_TENSOR")
    return proto


def _module(large: Large):
    """The transformers model (random weights, none downloaded) returning logits [batch,
    vocabulary, seq]: cross_entropy's classes on axis 1."""
    import torch
    import transformers

    if large.family == "gpt2":
        config = transformers.GPT2Config(
            **large.config, n_positions=large.seq, attn_implementation="eager", use_cache=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        inner = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            **large.config, max_position_embeddings=large.seq, attn_implementation="eager", use_cache=False,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=None,
        )  # fmt: skip
        inner = transformers.LlamaForCausalLM(config)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            mask = torch.ones_like(input_ids)  # (transformers traces a dynamic sequence only with a mask)
            return self.inner(input_ids=input_ids, attention_mask=mask).logits.transpose(1, 2)

    return Logits()


def plans(large: Large, gpus: int, cache: Path = CACHE) -> tuple[list, float]:
    """The planner's candidates for ``large`` on ``gpus`` GPUs, and the seconds it took."""
    from graphforge.pass_manager import parse_pipeline
    from graphforge.planning.planner import Hardware, plan

    model = graph_only(large, cache)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # blocks left whole for some T: the reasons are in the candidates
        found = plan(model, parse_pipeline(PIPELINE), large.batch[gpus], {"seq": large.seq}, gpus, Hardware(**HARDWARE))
    return found, time.perf_counter() - started


def run(quick: bool = False) -> str:
    models = QUICK if quick else MODELS
    sections = []
    for large in models:
        for gpus in sorted(large.batch):
            found, seconds = plans(large, gpus)
            sections.append(_table(large, gpus, found, seconds))
            print(f"{large.label} on {gpus}: planned in {seconds:.0f} s", file=sys.stderr, flush=True)
    return _report(models, sections)


def _table(large: Large, gpus: int, found: list, seconds: float) -> str:
    from graphforge.planning.planner import Split

    predicted = {c.split: c.prediction for c in found if c.prediction is not None}
    fitting = [c for c in found if c.prediction is not None and c.prediction.fits]
    lines = [
        f"**{large.label}, {gpus} GPUs**: {large.batch[gpus]} sequences of {large.seq} a round "
        f"({len(predicted)} splits predicted, {len(fitting)} fit, in {seconds:.0f} s)"
        + ("; none fits: those closest to fitting" if not fitting and predicted else ""),
        "",
        "| split | step | compute | tensor sums | gradients | bubble | memory a GPU | fits |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    # where none fits, those closest to fitting; and the fastest with recomputation, beside
    by_memory = sorted((c for c in found if c.prediction is not None), key=lambda c: c.prediction.memory)
    shown = fitting[:TOP] or by_memory[:TOP]
    recomputed = [c for c in (fitting or by_memory) if c.split.recompute < 1]
    if recomputed and recomputed[0] not in shown:
        shown.append(recomputed[0])
    recipes = [r for r in large.recipes if r.gpus == gpus]
    theirs = {
        r: next((c for c in found if c.split == Split(r.data, r.tensor, r.stages, zero=r.zero)), None) for r in recipes
    }
    shown += [c for c in theirs.values() if c is not None and c.prediction is not None and c not in shown]
    for candidate in shown:
        p = candidate.prediction
        lines.append(
            f"| {candidate.split} | {p.step_s * 1e3:.1f} ms | {p.compute_s * 1e3:.1f} ms | {p.tensor_s * 1e3:.1f} ms "
            f"| {p.data_s * 1e3:.1f} ms | {p.bubble:.0%} | {p.memory / 2**30:.1f} GiB | {'yes' if p.fits else 'no'} |"
        )
    for recipe, mine in theirs.items():
        split = Split(recipe.data, recipe.tensor, recipe.stages, zero=recipe.zero)
        said = (
            "predicted above"
            if mine is not None and mine.prediction is not None
            else f"not predicted: {mine.reason if mine else 'not a candidate'}"
        )
        lines.append(f"\nThe recipe's split ({recipe.source}): {split}, {said}.")
    refused = [c for c in found if c.prediction is None]
    if refused:
        lines.append(f"\nNot predicted ({len(refused)}), for example: {refused[0].reason}")
    return "\n".join(lines)


def _report(models: list, sections: list[str]) -> str:
    h = HARDWARE
    return "\n\n".join(
        [
            "What `graphforge plan` picks for models and machines this one cannot hold, from their graphs alone: "
            "each model exported on PyTorch's meta device, its weights stand-ins, every split's program compiled "
            "for shapes and costs (`benchmarks/plan_large_bench.py`).",
            f"Hardware (stated, not measured): H100 SXM, {h['memory'] / 1e9:.0f} GB each, {h['node_processes']} "
            f"to a node; {h['flops'] / 1e12:.0f} TFLOP/s sustained (40% of TF32's dense peak: the programs are "
            f"float32), each node the longer of its FLOPs and its bytes at {h['memory_bandwidth'] / 1e12:.1f} TB/s "
            f"(80% of HBM3's); NVLink {h['node_bandwidth'] / 1e9:.0f} GB/s and {h['node_latency'] * 1e6:.0f} µs within a "
            f"node, InfiniBand {h['bandwidth'] / 1e9:.0f} GB/s and {h['latency'] * 1e6:.0f} µs between nodes; "
            f"{h['overhead'] * 1e6:.0f} µs a run. Tensor groups stay within a node. AdamW; a round is one "
            "forward and backward of the global batch (a step may accumulate several).",
            *sections,
        ]
    )


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
