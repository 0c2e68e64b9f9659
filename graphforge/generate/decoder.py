"""Running a model one token at a time: the logits after a prompt, then after each token
chosen, through the interface the model has (interface.py): the whole prefix again for a plain
forward, or the new tokens alone with the cache carried from run to run.

Both run with OrtValues (run_with_ort_values, which applies the run options' active adapter;
an IOBinding would not): a cache's presents stay where the session wrote them (on the device)
and are fed back as the next run's past as they are; the logits come back to the host.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import helper

from graphforge.errors import GenerationError, one_line
from graphforge.generate.interface import Decoding


class Decoder:
    """The logits of the next token, run after run, for one sequence (batch 1)."""

    def __init__(self, session: ort.InferenceSession, decoding: Decoding, run_options: ort.RunOptions, where: str):
        self._session = session
        self._decoding = decoding
        self._run_options = run_options
        self._where = where
        self._ids_dtype = helper.tensor_dtype_to_np_dtype(decoding.ids_type)
        self._ids: list[int] = []
        self._past: dict[str, ort.OrtValue | np.ndarray] = {}

    @property
    def length(self) -> int:
        """How many tokens the model has seen."""
        return len(self._ids)

    def start(self, prompt: list[int]) -> np.ndarray:
        """The logits [vocab] after ``prompt`` (an empty cache first, where the model has one)."""
        self._ids = []
        self._past = {
            name: np.zeros((1, layer.kv_heads, 0, layer.head_dim), helper.tensor_dtype_to_np_dtype(layer.elem_type))
            for layer in self._decoding.cache
            for name in (layer.past_key, layer.past_value)
        }
        return self._run(list(prompt))

    def next(self, token: int) -> np.ndarray:
        """The logits [vocab] after one more token."""
        return self._run([token])

    def _run(self, new: list[int]) -> np.ndarray:
        d = self._decoding
        past = len(self._ids) if d.has_cache else 0
        self._ids += new
        fed = new if d.has_cache else self._ids
        feeds = {d.input_ids: np.array([fed], self._ids_dtype)}
        if d.attention_mask is not None:
            feeds[d.attention_mask] = np.ones((1, len(self._ids)), self._ids_dtype)
        if d.position_ids is not None:
            feeds[d.position_ids] = np.arange(past, len(self._ids), dtype=self._ids_dtype)[None]
        values = {name: ort.OrtValue.ortvalue_from_numpy(value) for name, value in feeds.items()}
        values |= {
            n: v if isinstance(v, ort.OrtValue) else ort.OrtValue.ortvalue_from_numpy(v) for n, v in self._past.items()
        }
        presents = [name for layer in d.cache for name in (layer.present_key, layer.present_value)]
        try:
            outputs = self._session.run_with_ort_values([d.logits, *presents], values, self._run_options)
        except Exception as exc:  # onnxruntime's own error types
            raise GenerationError(f"onnxruntime failed running {self._where}: {one_line(exc)}") from None
        self._past = dict(zip(self._past, outputs[1:], strict=True))
        logits = outputs[0].numpy()
        return logits[0, -1] if d.vocab_last else logits[0, :, -1]
