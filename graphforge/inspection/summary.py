"""``graphforge inspect MODEL``: a model's inputs and outputs, parameters, roles and ops, a
pipeline program's stages, a ZeRO program's shards on N processes, and the initializers an
exporter tied."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from graphforge import roles
from graphforge.analysis.size import human_bytes
from graphforge.errors import GraphforgeError
from graphforge.ir import FLOAT_TYPES, op_histogram
from graphforge.placement.buckets import shard_layout
from graphforge.program import ProgramRoles, StagesRole

#: a role's value longer than this is cut (with …) on the roles line
ROLE_WIDTH = 60


def print_summary(proto: onnx.ModelProto, name: str, console: Console, *, processes: int | None = None) -> None:
    """What ``graphforge inspect`` prints of ``proto`` (read from ``name``) on ``console``:
    its header and opsets, inputs and outputs, parameters, roles, a pipeline's stages,
    with ``processes`` the zero pass's shards on that many, and its ops."""
    console.print(
        f"[bold]{escape(name)}[/]  IR {proto.ir_version}, "
        + escape(f"producer {proto.producer_name or '?'} {proto.producer_version}")
    )
    console.print(
        "opsets: " + ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in proto.opset_import), markup=False
    )
    console.print(io_table(proto.graph))
    program_roles = ProgramRoles.of_proto(proto)
    params, total = parameters_table(proto.graph, program_roles)
    console.print(params)
    console.print(total)
    for line in (frozen_line(proto.graph, program_roles), lora_line(program_roles), quantized_line(program_roles)):
        if line:
            console.print(line, highlight=False, markup=False)
    line = roles_line(program_roles.metadata)
    if line:
        console.print(line, highlight=False)
    if program_roles.stages is not None:
        console.print(stages_table(program_roles.stages))
    if processes:
        console.print(shards_table(program_roles, processes, name))
    console.print(ops_table(proto))


def io_table(graph: onnx.GraphProto) -> Table:
    """The graph's inputs (initializers left out) and outputs: name, dtype and shape."""
    init_names = {t.name for t in graph.initializer}
    table = Table(title="inputs and outputs", title_justify="left")
    for column in ("kind", "name", "dtype", "shape"):
        table.add_column(column)
    for kind, values in (("input", [v for v in graph.input if v.name not in init_names]), ("output", graph.output)):
        for v in values:
            table.add_row(kind, escape(v.name), *_type_and_shape(v.type))
    return table


def parameters_table(graph: onnx.GraphProto, program_roles: ProgramRoles) -> tuple[Table, str]:
    """The parameters (the ones a compiled program records, else every floating-point
    initializer) with their dtype, shape and elements; and the line that totals them."""
    recorded = program_roles.parameters if roles.PARAMETERS in program_roles.metadata else None
    title = "parameters" if recorded is not None else "parameters (floating-point initializers)"
    table = Table(title=title, title_justify="left")
    for column, justify in (("name", "left"), ("dtype", "left"), ("shape", "left"), ("elements", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    total_elems = total_bytes = 0
    for t in graph.initializer:
        # by ONNX type, not NumPy's: bfloat16 and float8 are no np.floating, yet are parameters
        if t.data_type not in FLOAT_TYPES or (recorded is not None and t.name not in recorded):
            continue
        count = int(np.prod(t.dims, dtype=np.int64))
        total_elems += count
        total_bytes += _bytes(t)
        table.add_row(escape(t.name), str(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)),
                      escape(str(list(t.dims))), f"{count:,}")  # fmt: skip
    return table, f"{total_elems:,} parameters, {total_bytes / 2**20:.2f} MiB"


def frozen_line(graph: onnx.GraphProto, program_roles: ProgramRoles) -> str | None:
    """The weights the program records frozen (read, never trained): how many, their size,
    and what froze them; None where it records none."""
    frozen = program_roles.frozen
    if not frozen:
        return None
    size = sum(_bytes(t) for t in graph.initializer if t.name in frozen)
    by = Counter(f.by for f in frozen.values())
    how = ", ".join(f"{count:,} by {what}" for what, count in sorted(by.items()))
    return f"frozen: {len(frozen):,} weights, {human_bytes(size)} ({how})"


def lora_line(program_roles: ProgramRoles) -> str | None:
    """The lora pass's adapters: how many, of which ranks and scales; None without any."""
    adapters = program_roles.lora
    if not adapters:
        return None
    ranks = ", ".join(str(r) for r in sorted({a.r for a in adapters}))
    scales = ", ".join(f"{s:g}" for s in sorted({a.scale for a in adapters}))
    return f"lora: {len(adapters)} adapter{'s' * (len(adapters) != 1)} of rank {ranks}, scale {scales}"


def _bytes(t: onnx.TensorProto) -> int:
    """An initializer's size, as its type stores it (float4 two to a byte)."""
    count = int(np.prod(t.dims, dtype=np.int64))
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return count * itemsize // (2 if t.data_type == onnx.TensorProto.FLOAT4E2M1 else 1)


def roles_line(metadata: dict[str, str]) -> str | None:
    """The graphforge roles a program records, each value cut to ROLE_WIDTH (rich markup);
    None for a model without any."""
    recorded = {k: v for k, v in metadata.items() if k.startswith("graphforge.")}
    if not recorded:
        return None
    return "roles: " + ", ".join(f"{k.removeprefix('graphforge.')}={_brief(v)}" for k, v in sorted(recorded.items()))


def stages_table(role: StagesRole) -> Table:
    """The pipeline pass's stages: where each ends, its parameters, and what it costs."""
    costs = role.costs
    flops = [f + u for f, u in zip(costs.get("flops", []), costs.get("update_flops", []), strict=False)]
    total = sum(flops) or 1.0
    table = Table(
        title=f"pipeline: {role.stages} stages × {role.microbatches} micro-batches, {role.schedule}",
        title_justify="left",
    )
    for column, justify in (
        ("stage", "right"),
        ("ends with", "left"),
        ("parameters", "right"),
        ("FLOPs share", "right"),
        ("parameters' size", "right"),
        ("states, accumulators", "right"),
        ("stash per micro-batch", "right"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for s in range(role.stages):
        table.add_row(
            str(s),
            escape(role.cuts[s]) if s < len(role.cuts) else "(the rest)",
            str(len(role.parameters[s])) if s < len(role.parameters) else "?",
            f"{flops[s] / total:.0%}" if s < len(flops) else "?",
            *(_stage_bytes(costs, key, s) for key in ("parameter_bytes", "state_bytes", "stash_bytes")),
        )
    return table


def _stage_bytes(costs: Mapping[str, Any], key: str, stage: int) -> str:
    values = costs.get(key, [])
    return human_bytes(values[stage]) if stage < len(values) else "?"


def shards_table(program_roles: ProgramRoles, processes: int, name: str) -> Table:
    """The zero pass's shards on ``processes`` processes: the pieces of parameters each owns.
    A program without the zero pass is an error naming ``name``."""
    reduction = program_roles.allreduce
    if reduction is None or not reduction.zero:
        raise GraphforgeError(f"{name}: --processes needs a program compiled with the zero pass")
    sizes = {p: int(np.prod(program_roles.carried_spec(p).shape)) for b in reduction.buckets for p in b}
    table = Table(
        title=f"zero stage {reduction.zero}: shards on {processes} processes ({len(reduction.buckets)} buckets)",
        title_justify="left",
    )
    for column, justify in (("process", "right"), ("bucket", "right"), ("parameter", "left"), ("elements", "left")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for rank, pieces in enumerate(shard_layout(reduction.buckets, sizes, processes)):
        for bucket, parameter, start, stop in pieces:
            whole = "" if (start, stop) == (0, sizes[parameter]) else f" of {sizes[parameter]:,}"
            table.add_row(str(rank), str(bucket), escape(parameter), f"{start:,}..{stop:,}{whole}")
    return table


def ops_table(proto: onnx.ModelProto) -> Table:
    """The op histogram, most common first."""
    # the golden summaries' count: subgraphs and local functions included, domain::op outside ai.onnx
    histogram = Counter(op_histogram(proto))
    table = Table(title=f"ops ({histogram.total()} nodes)", title_justify="left")
    table.add_column("op")
    table.add_column("count", justify="right")
    for op, count in histogram.most_common():
        table.add_row(escape(op), str(count))
    return table


def tied_initializer_warnings(proto: onnx.ModelProto) -> list[str]:
    """Floating-point initializers reached through Identity nodes under another name.

    The TorchScript exporter merges initializers with equal values (fresh LayerNorm weights
    are all ones) and re-exposes them through Identity: training would silently tie them.
    """
    init_names = {t.name for t in proto.graph.initializer if t.data_type in FLOAT_TYPES}  # parameters only
    aliases: dict[str, list[str]] = {}
    for node in proto.graph.node:
        if node.op_type == "Identity" and node.input and node.input[0] in init_names:
            aliases.setdefault(node.input[0], []).extend(node.output)
    return [
        f"initializer {name!r} is also read as {', '.join(map(repr, names))} through Identity: "
        "these parameters are tied (the exporter may have merged equal initial values)"
        for name, names in aliases.items()
    ]


def _brief(value: str, limit: int = ROLE_WIDTH) -> str:
    return escape(value if len(value) <= limit else value[: limit - 1] + "…")


def _type_and_shape(type_proto: onnx.TypeProto) -> tuple[str, str]:
    if not type_proto.HasField("tensor_type"):
        return type_proto.WhichOneof("value") or "?", ""
    tt = type_proto.tensor_type
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name if tt.elem_type else "?"
    if not tt.HasField("shape"):
        return dtype, "unknown"
    dims = [
        d.dim_param if d.HasField("dim_param") else str(d.dim_value) if d.HasField("dim_value") else "?"
        for d in tt.shape.dim
    ]
    return dtype, escape("[" + ", ".join(dims) + "]")


def quantized_line(program_roles: ProgramRoles) -> str | None:
    """The quantize_frozen pass's weights: how many (the first names), to which bits in which
    blocks; None without any."""
    quantized = program_roles.quantized
    if not quantized:
        return None
    names = ", ".join(list(quantized)[:3]) + (", …" if len(quantized) > 3 else "")
    kinds = ", ".join(sorted({f"int{q.bits} in blocks of {q.block}" for q in quantized.values()}))
    return f"quantized: {len(quantized):,} weight{'s' * (len(quantized) != 1)} ({names}) to {kinds}"
