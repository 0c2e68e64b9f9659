"""Roles recorded in a model's metadata_props, so one .onnx file is a complete artifact.

Passes write and read roles only through these functions; the keys are part of the file
format users may inspect (``graphforge inspect``, Netron's properties panel).
"""

from __future__ import annotations

import json

from graphforge.graph import Model

LOSS = "graphforge.loss"  # name of the scalar loss output
LABELS = "graphforge.labels"  # name of the labels input the loss pass added
PARAMETERS = "graphforge.parameters"  # JSON list of trainable parameter names
GRADIENTS = "graphforge.gradients"  # JSON object: parameter (or input) name -> gradient output name
OPTIMIZER = "graphforge.optimizer"  # JSON: {"kind": ..., "hyperparameters": {...}}
STATE = "graphforge.state"  # JSON list: every tensor carried from step to step (see passes/optimizers.py)
LR = "graphforge.lr"  # name of the learning-rate input
DEFAULT_LR = "graphforge.default_lr"  # the learning rate the pipeline asked for
STEP = "graphforge.step"  # name of the step-count input (steps done before this one)
RESET_GRAD = "graphforge.lazy_reset_grad"  # name of the accumulate-or-overwrite flag input
EXPORTED_FROM = "graphforge.exported_from"  # JSON: what an inference model was pruned from (passes/prune.py)

#: name prefixes of what graphforge's passes generate (loss, backward, optimizer nodes and
#: constants): never a user's parameter, and what prune removes
GENERATED_PREFIXES = ("loss::", "grad::", "optim::")

#: suffix of a gradient output: the gradient of parameter P is the graph output P_grad
GRAD_SUFFIX = "_grad"


def grad_name(tensor_name: str) -> str:
    return tensor_name + GRAD_SUFFIX


def get_json(model: Model, key: str, default):
    text = model.metadata.get(key)
    return default if text is None else json.loads(text)


def set_json(model: Model, key: str, value) -> None:
    model.metadata[key] = json.dumps(value, sort_keys=isinstance(value, dict))
