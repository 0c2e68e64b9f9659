"""A LoRA program's adapters kept apart from its base: onnxruntime's ``.onnx_adapter`` beside an
inference model that reads them as inputs, and PEFT's folder (passes/lora_peft.py).

Both start from the unmerged inference model (``export_inference_model(merge_adapters=False)``),
which holds the trained A and B under the lora pass's names and records the adapters.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from graphforge.errors import GraphforgeError
from graphforge.program import LoraAdapter
from graphforge.tempfiles import move_into_place, temp_file_beside

#: the file onnxruntime's adapter format is written to, beside the model (``model.onnx_adapter``)
ADAPTER_SUFFIX = ".onnx_adapter"


def adapter_values(model: onnx.ModelProto, adapters: Sequence[LoraAdapter]) -> dict[str, np.ndarray]:
    """Each adapter's A and B, by the lora pass's names, as ``model`` holds them."""
    stored = {t.name: t for t in model.graph.initializer}
    missing = [n for a in adapters for n in (a.a, a.b) if n not in stored]
    if missing:
        raise GraphforgeError(f"the inference model has no adapter weight {missing[0]!r}: was it pruned away?")
    return {n: numpy_helper.to_array(stored[n]) for a in adapters for n in (a.a, a.b)}


def with_adapter_inputs(model: onnx.ModelProto, adapters: Sequence[LoraAdapter]) -> onnx.ModelProto:
    """``model`` (changed in place) with each adapter's A and B a graph input of its own name,
    whose default (its initializer) is zeros: without an adapter fed, the base model's outputs."""
    names = {n for a in adapters for n in (a.a, a.b)}
    for i, t in enumerate(model.graph.initializer):
        if t.name in names:
            zeros = np.zeros(tuple(t.dims), helper.tensor_dtype_to_np_dtype(t.data_type))
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(zeros, t.name))
            model.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return model


def write_onnx_adapter(path: Path, values: dict[str, np.ndarray]) -> Path:
    """onnxruntime's adapter file of ``values`` (by input name), written through its own
    ``AdapterFormat``, whole or not at all."""
    adapter = ort.AdapterFormat()
    adapter.set_adapter_version(1)
    adapter.set_model_version(1)
    adapter.set_parameters({n: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v)) for n, v in values.items()})
    with temp_file_beside(path) as tmp:
        adapter.export_adapter(str(tmp))
        move_into_place(tmp, path)
    return path


def adapter_path(model_path: Path) -> Path:
    """Where the adapters of the model written to ``model_path`` go: ``model.onnx_adapter``."""
    return model_path.with_suffix(ADAPTER_SUFFIX)
