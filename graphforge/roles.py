"""Roles recorded in a model's metadata_props, so one .onnx file is a complete artifact.

Passes write roles through these keys and helpers; everything else reads them through
``graphforge.program.ProgramRoles``. The keys are part of the file format users may inspect
(``graphforge inspect``, Netron's properties panel).
"""

from __future__ import annotations

import json
from typing import Protocol

import onnx

LOSS = "graphforge.loss"  # name of the scalar loss output
LABELS = "graphforge.labels"  # name of the labels input the loss pass added
#: the axis of the classes in the scores the loss pass read ("-1": the last), where not axis 1
LOSS_CLASS_AXIS = "graphforge.loss_class_axis"
PARAMETERS = "graphforge.parameters"  # JSON list of trainable parameter names
GRADIENTS = "graphforge.gradients"  # JSON object: parameter (or input) name -> gradient output name
#: JSON object: parameter name -> the tensor holding its gradient as the update reads it, after
#: accumulation and before anything else (norm, clipping, the update): the point where a pass
#: that reduces or rescales gradients (allreduce, mixed precision's unscale) inserts itself
GRADIENT_BOUNDARY = "graphforge.gradient_boundary"
OPTIMIZER = "graphforge.optimizer"  # JSON: {"kind": ..., "hyperparameters": {...}}
#: JSON: the gradients' reduction across data-parallel replicas (passes/allreduce.py):
#: {"average": bool, "bucket_mb": float, "buckets": [[parameter, ...], ...], "reduced": {parameter: tensor}}
ALLREDUCE = "graphforge.allreduce"
#: JSON: the pipeline stages (passes/stage_partition.py, the pass users write ``pipeline``):
#: {"stages", "microbatches", "schedule", "cuts": [tensor after stage k, ...], "partial_norms":
#: [[stage, tensor], ...], "parameters": [[parameter, ...] per stage], "costs": {...}}
STAGES = "graphforge.stages"
#: the key older programs recorded STAGES under (read, never written)
STAGES_BEFORE = "graphforge.pipeline"
#: JSON: the layers a group of processes splits (passes/tensor_parallel.py): {"size": T, "blocks":
#: [{"column": [...], "row": [...], "copy": tensor, "reduce": tensor, "reduce_adapter": a row adapter's x·Aᵀ
#: summed (its own g)}], "split": {parameter: axis}}
TENSOR_PARALLEL = "graphforge.tensor_parallel"
#: JSON: what the recompute pass did (budget, level, nodes recomputed, saved bytes before/after);
#: a runtime keeps onnxruntime from merging the recomputed copies back into the forward
RECOMPUTE = "graphforge.recompute"
#: JSON: what the mixed_precision pass did (passes/mixed_precision.py): {"dtype", "provider",
#: "keep_fp32", "loss_scale": {"kind": "dynamic"|"static"|"none", "scale", "growth_tracker",
#: "skipped", "update_skipped", "init_scale", "growth_factor", "backoff_factor",
#: "growth_interval"}, "nodes": {"low", "casts", "fallback"}}
MIXED_PRECISION = "graphforge.mixed_precision"
#: the constant the backward starts from (dL/dloss = 1): where loss scaling multiplies in the scale
LOSS_SEED = "graphforge.loss_seed"
#: JSON: what the fuse pass did (passes/fusion): {"provider", "fired": {rule: count}, "refused":
#: {rule: {reason: count}}}
FUSION = "graphforge.fusion"
STATE = "graphforge.state"  # JSON list: every tensor carried from step to step (see passes/optimizers.py)
LR = "graphforge.lr"  # name of the learning-rate input
DEFAULT_LR = "graphforge.default_lr"  # the learning rate the optimizer pass was given
STEP = "graphforge.step"  # name of the step-count input (steps done before this one)
RESET_GRAD = "graphforge.lazy_reset_grad"  # name of the accumulate-or-overwrite flag input
EXPORTED_FROM = "graphforge.exported_from"  # JSON: what an inference model was pruned from (passes/prune.py)
#: JSON object: weight -> {"by": what froze it}: the floating-point initializers a program reads and
#: never trains ("autodiff": its trainable/frozen patterns; "torch": requires_grad=False; "lora": an
#: adapter's base weight; "freeze": the freeze pass's backbone). Autodiff gives them no gradient, so
#: the optimizer gives them no state and data parallelism nothing to reduce; a session keeps them as
#: constants (initializers, never bound inputs), which onnxruntime may prepack
FROZEN = "graphforge.frozen"
#: JSON: the lora pass's adapters (passes/lora.py), one per module it adapted: {"adapters": [{"module",
#: "weight", "A", "B", "r", "alpha", "scale", "rslora", "dropout", "dtype", "fan_in_fan_out"}, ...],
#: "base": {weight: the CRC-32 of its values as the pass froze it}}: the base, by reference
LORA = "graphforge.lora"
#: JSON object: weight -> {"data", "scale", "bits", "block", "shape", "transposed"}: the frozen weights the
#: quantize_frozen pass (passes/quantize_frozen.py) stored as int4 or int8 (``data``, [in, out]) with a float
#: scale per ``block`` rows (``scale``), read through DequantizeLinear; ``shape``: the float weight's,
#: ``transposed``: stored as its transpose (a torch Linear's [out, in])
QUANTIZED = "graphforge.quantized"
#: JSON: the kv_cache pass's decoding model (passes/kv_cache.py): {"layers": [{"kv_heads", "head_dim"}, ...]},
#: layer i's cache being the inputs past_key_values.{i}.key/.value and the outputs present.{i}.key/.value
KV_CACHE = "graphforge.kv_cache"
#: JSON: what the steps pass made of a training program (passes/steps.py): {"k", "stacked": [input, ...],
#: "fixed": [input, ...], "carried": {input: output}, "scans": [output, ...]}: each stacked input is fed with a
#: new leading axis of k (step i reads slice i), each scan output comes back as [k, ...]
STEPS = "graphforge.steps"

#: suffix of the output that replaces a carried input after a step: ``P`` -> ``P_next``
NEXT_SUFFIX = "_next"
#: the optimizer's output of the global gradient norm (before clipping)
GRAD_NORM = "grad_norm"

#: name prefixes of the nodes (and constants) graphforge's passes generate, one per part of a
#: training program: never a user's parameter, what prune removes, how profiles split time
LOSS_PREFIX = "loss::"
GRAD_PREFIX = "grad::"
OPTIM_PREFIX = "optim::"
ALLREDUCE_PREFIX = "allreduce::"
STAGES_PREFIX = "stages::"
RECOMPUTE_PREFIX = "recompute::"
ZERO_PREFIX = "zero::"
#: the lora pass's nodes (the adapters' products): forward nodes, not in GENERATED_PREFIXES
LORA_PREFIX = "lora::"
#: the quantize_frozen pass's DequantizeLinear nodes and their integer weights and scales: forward nodes,
#: not in GENERATED_PREFIXES; a session gives each DequantizeLinear its own inputs (onnxruntime fuses
#: only a DequantizeLinear that alone reads its initializers into MatMulNBits)
QUANT_PREFIX = "quant::"
#: the kv_cache pass's nodes (the cache's concatenations, the positions' offsets): forward nodes
KV_CACHE_PREFIX = "kv_cache::"
#: the casts of the mixed_precision pass (precision.convert), and its loss scaling (under
#: ``optim::``): not in GENERATED_PREFIXES, as a cast may produce a forward output
AMP_PREFIX = "amp::"
GENERATED_PREFIXES = (
    LOSS_PREFIX,
    GRAD_PREFIX,
    OPTIM_PREFIX,
    ALLREDUCE_PREFIX,
    STAGES_PREFIX,
    RECOMPUTE_PREFIX,
    ZERO_PREFIX,
)
#: name prefixes of the constants graphforge's passes make, never a parameter: the generated
#: parts', the lora pass's (an adapter's scale) and the quantize_frozen pass's (scales)
PASS_CONSTANT_PREFIXES = (*GENERATED_PREFIXES, LORA_PREFIX, QUANT_PREFIX)
#: what each generated part computes, as profiles name it (the rest is the forward)
PROGRAM_PARTS = {
    LOSS_PREFIX: "loss",
    GRAD_PREFIX: "backward",
    OPTIM_PREFIX: "optimizer",
    ALLREDUCE_PREFIX: "allreduce",
    STAGES_PREFIX: "optimizer",
    RECOMPUTE_PREFIX: "backward",  # the backward's own work: it runs among the backward's nodes
    ZERO_PREFIX: "allreduce",
}

#: the model-local function marking a gradient's reduction across replicas: its body is an
#: Identity, so a program runs as it is on one process; a runtime with more cuts there
MARKER_DOMAIN = "graphforge"
ALLREDUCE_OP = "AllReduce"
#: the zero pass's markers: a gradient's reduce-scatter, and an updated parameter's all-gather
REDUCE_SCATTER_OP = "ReduceScatter"
ALL_GATHER_OP = "AllGather"
#: tensor parallelism's markers, Megatron-LM's f and g (passes/autodiff/rules/parallel.py): the
#: input of a layer split across a group, the same on every member (f: identity forward, its
#: gradient summed over the group), and the partial output of a layer split along its input,
#: summed over the group (g: the sum forward, its gradient handed to every member as it is)
TENSOR_PARALLEL_COPY_OP = "TensorParallelCopy"
TENSOR_PARALLEL_REDUCE_OP = "TensorParallelReduce"
#: the maximum over the group of a value each member computes (the vocabulary-parallel
#: softmax's shift, against overflow): identity on one process, no gradient (the loss does
#: not depend on the shift)
TENSOR_PARALLEL_MAX_OP = "TensorParallelMax"

#: suffix of a gradient output: the gradient of parameter P is the graph output P_grad
GRAD_SUFFIX = "_grad"


def grad_name(tensor_name: str) -> str:
    return tensor_name + GRAD_SUFFIX


def next_name(tensor_name: str) -> str:
    return tensor_name + NEXT_SUFFIX


def node_origin(name: str) -> tuple[str, str | None] | None:
    """(pass role, origin node) of a node a graphforge pass generated, from its name
    ``<role>::<origin>/<op>_<n>``: ``grad::fc1/MatMul/Gemm_3`` gives ("grad", "fc1/MatMul");
    ``loss::output`` gives ("loss", None); a user's node gives None. Any role is read, so the
    nodes of later passes (``fuse::``, ``recompute::``) group with their origin too."""
    role, sep, rest = name.partition("::")
    if not sep or not role or "/" in role or role == "onnx":
        return None
    return role, (rest.rsplit("/", 1)[0] if "/" in rest else None)


def metadata_of(proto: onnx.ModelProto) -> dict[str, str]:
    """A model's metadata_props as a dict (the last entry wins for a repeated key)."""
    return {p.key: p.value for p in proto.metadata_props}


class HasMetadata(Protocol):
    """What holds roles: a Model (graphforge.graph), whose metadata becomes metadata_props."""

    metadata: dict[str, str]


def get_json(model: HasMetadata, key: str, default):
    text = model.metadata.get(key)
    return default if text is None else json.loads(text)


def set_json(model: HasMetadata, key: str, value) -> None:
    model.metadata[key] = json.dumps(value, sort_keys=isinstance(value, dict))
