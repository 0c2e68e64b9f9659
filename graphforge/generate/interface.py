"""How a model decodes, read from its inputs and outputs (never from the name of the model).

Two interfaces are recognized:

1. **A plain forward**: ``input_ids`` [batch, seq] (+ ``attention_mask`` [batch, seq])
   (+ ``position_ids`` [batch, seq]) → logits [batch, seq, vocab] (or [batch, vocab, seq], the
   layout cross-entropy reads). Generation runs the whole prefix again for each new token.
2. **A model with cache inputs**, in the optimum/transformers ONNX convention the ``kv_cache``
   pass writes too: inputs ``past_key_values.{i}.key`` / ``.value`` [batch, kv_heads, past,
   head_dim] and outputs ``present.{i}.key`` / ``.value`` (past + new), beside ``input_ids``, an
   ``attention_mask`` covering past and new tokens and ``position_ids`` offset by the past.

The logits are the output named ``logits``, else the one floating-point output of rank 3
that is not a ``present`` output. Where the graph reads a position-embedding table (a Gather
from a 2-D initializer whose indices do not depend on the token ids' values), its rows are
the model's positions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import onnx

from graphforge.errors import GenerationError

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
LOGITS = "logits"
PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
PRESENT = re.compile(r"^present\.(\d+)\.(key|value)$")
_INTEGERS = {onnx.TensorProto.INT64, onnx.TensorProto.INT32}
_FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
#: ops whose outputs hold only their input's shape, not its values
_SHAPE_ONLY = {"Shape", "Size"}


@dataclass(frozen=True)
class CacheLayer:
    """One layer's cache: the past it reads and the present it writes, and the past's
    [kv_heads, head_dim] and element type (an onnx.TensorProto data type)."""

    past_key: str
    past_value: str
    present_key: str
    present_value: str
    kv_heads: int
    head_dim: int
    elem_type: int


@dataclass(frozen=True)
class Decoding:
    """What generation feeds a model and what it reads back."""

    input_ids: str
    attention_mask: str | None
    position_ids: str | None
    logits: str
    #: logits [batch, seq, vocab] (True) or [batch, vocab, seq] (False)
    vocab_last: bool
    #: the logits' vocabulary where the model's shapes say it, else None (learnt at the first run)
    vocabulary: int | None
    #: the cache's layers, in order; empty for a plain forward
    cache: tuple[CacheLayer, ...]
    #: rows of the position-embedding table, and its name, where the graph has one
    table_positions: int | None
    position_table: str | None
    #: the id input's element type
    ids_type: int

    @property
    def has_cache(self) -> bool:
        return bool(self.cache)


def read_decoding(model: onnx.ModelProto, where: str) -> Decoding:
    """The Decoding of ``model`` (named ``where`` in errors). Inputs with defaults (an
    initializer of the same name: an adapter's parameters) are the model's own business."""
    graph = model.graph
    initialized = {t.name for t in graph.initializer}
    inputs = {i.name: i for i in graph.input if i.name not in initialized}
    ids = _ids_input(inputs, where)
    logits, vocab_last, vocabulary = _logits(graph, where)
    cache = _cache(inputs, {o.name: o for o in graph.output}, where)
    known = {ids, ATTENTION_MASK, POSITION_IDS} | {n for layer in cache for n in (layer.past_key, layer.past_value)}
    unknown = sorted(set(inputs) - known)
    if unknown:
        raise GenerationError(
            f"{where} needs inputs generation does not feed: {', '.join(unknown)} (it feeds {INPUT_IDS}, "
            f"{ATTENTION_MASK}, {POSITION_IDS} and past_key_values.N.key/value)"
        )
    rows, table = position_table(model, ids)
    return Decoding(
        input_ids=ids,
        attention_mask=ATTENTION_MASK if ATTENTION_MASK in inputs else None,
        position_ids=POSITION_IDS if POSITION_IDS in inputs else None,
        logits=logits,
        vocab_last=vocab_last,
        vocabulary=vocabulary,
        cache=cache,
        table_positions=rows,
        position_table=table,
        ids_type=inputs[ids].type.tensor_type.elem_type,
    )


def _dims(value: onnx.ValueInfoProto) -> list[int | str | None]:
    """A value's dims: a size, a symbol, or None where neither is given."""
    shape = value.type.tensor_type.shape
    return [d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in shape.dim]


def _ids_input(inputs: dict[str, onnx.ValueInfoProto], where: str) -> str:
    """``input_ids``, else the one integer input of rank 2 that the convention names otherwise."""
    if INPUT_IDS in inputs:
        return INPUT_IDS
    others = [
        name
        for name, value in inputs.items()
        if name not in (ATTENTION_MASK, POSITION_IDS)
        and not PAST.match(name)
        and value.type.tensor_type.elem_type in _INTEGERS
        and len(_dims(value)) == 2
    ]
    if len(others) != 1:
        names = ", ".join(inputs) or "none"
        raise GenerationError(
            f"{where} has no token-id input: no {INPUT_IDS!r}, and {len(others)} integer [batch, seq] inputs "
            f"besides the mask and positions (its inputs: {names})"
        )
    return others[0]


def _logits(graph: onnx.GraphProto, where: str) -> tuple[str, bool, int | None]:
    """The logits output, whether the vocabulary lies last, and its size where known."""
    outputs = {o.name: o for o in graph.output}
    if LOGITS in outputs:
        chosen = outputs[LOGITS]
    else:
        floats = [
            o
            for o in graph.output
            if o.type.tensor_type.elem_type in _FLOATS and len(_dims(o)) == 3 and not PRESENT.match(o.name)
        ]
        if len(floats) != 1:
            raise GenerationError(
                f"{where} has no logits-like output: no {LOGITS!r}, and {len(floats)} floating-point outputs of "
                f"rank 3 [batch, seq, vocab] (its outputs: {', '.join(outputs) or 'none'})"
            )
        chosen = floats[0]
    dims = _dims(chosen)
    if len(dims) != 3:
        raise GenerationError(f"{where}: output {chosen.name!r} has rank {len(dims)}; logits are [batch, seq, vocab]")
    middle, last = dims[1], dims[2]
    if isinstance(middle, int) and not isinstance(last, int):  # [batch, vocab, seq]
        return chosen.name, False, middle
    return chosen.name, True, last if isinstance(last, int) else None


def _cache(
    inputs: dict[str, onnx.ValueInfoProto], outputs: dict[str, onnx.ValueInfoProto], where: str
) -> tuple[CacheLayer, ...]:
    """The cache's layers, each with its past inputs and present outputs; a half of a pair
    missing is refused, naming it."""
    layers = sorted({int(m.group(1)) for name in inputs if (m := PAST.match(name))})
    found = []
    for i in layers:
        names = {
            "past_key": f"past_key_values.{i}.key",
            "past_value": f"past_key_values.{i}.value",
            "present_key": f"present.{i}.key",
            "present_value": f"present.{i}.value",
        }
        missing = [n for key, n in names.items() if n not in (inputs if key.startswith("past") else outputs)]
        if missing:
            raise GenerationError(f"{where} has cache inputs for layer {i} but lacks {', '.join(missing)}")
        dims = _dims(inputs[names["past_key"]])
        if len(dims) != 4 or not isinstance(dims[1], int) or not isinstance(dims[3], int):
            raise GenerationError(
                f"{where}: input {names['past_key']!r} has dims {dims}; a cache input is "
                "[batch, kv_heads, past, head_dim] with kv_heads and head_dim known"
            )
        elem = inputs[names["past_key"]].type.tensor_type.elem_type
        found.append(CacheLayer(**names, kv_heads=dims[1], head_dim=dims[3], elem_type=elem))
    if layers != list(range(len(layers))):
        raise GenerationError(f"{where}: its cache layers are numbered {layers}, not 0 to {len(layers) - 1}")
    return tuple(found)


def position_table(model: onnx.ModelProto, ids: str) -> tuple[int | None, str | None]:
    """The rows of the position-embedding table and its name: a Gather (on axis 0) from a 2-D
    initializer whose indices do not depend on the values of ``ids`` (the token embedding's
    do; positions come from a ``position_ids`` input, or from a Range over the ids' shape).
    Where several such tables exist, the fewest rows; (None, None) where there is none."""
    graph = model.graph
    tables = {t.name: list(t.dims) for t in graph.initializer if len(t.dims) == 2}
    on_ids = {ids}
    for node in graph.node:  # topological, as ONNX orders a graph's nodes
        if node.op_type not in _SHAPE_ONLY and any(name in on_ids for name in node.input):
            on_ids.update(node.output)
    found = []
    for node in graph.node:
        if node.op_type != "Gather" or len(node.input) < 2 or node.input[0] not in tables:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if axis == 0 and node.input[1] not in on_ids:
            found.append((tables[node.input[0]][0], node.input[0]))
    return min(found) if found else (None, None)
