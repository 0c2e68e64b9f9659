"""The ``graphforge`` command.

Every failure a user can cause ends as one line on stderr and exit status 2, with no
traceback and no output file (outputs are written atomically, after the work succeeded).
"""

from __future__ import annotations

import sys
import textwrap
from collections import Counter
from inspect import cleandoc
from pathlib import Path
from typing import Annotated

import click
import numpy as np
import onnx
import typer
from rich.console import Console
from rich.table import Table

import graphforge
from graphforge.errors import GraphforgeError
from graphforge.pass_manager import CompileResult, PassManager
from graphforge.pipeline import default_registry, parse_pipeline

app = typer.Typer(
    name="graphforge",
    help="Compile ordinary ONNX models into training programs that run on stock onnxruntime.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Piped output (CI logs, make demo under tee) gets a wide fixed width instead of 80 columns.
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


class UsageFailure(Exception):
    """Raised inside commands for a bad argument; printed as one line, exit 2."""


def _version(value: bool) -> None:
    if value:
        out.print(f"graphforge {graphforge.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    pass


@app.command("compile")
def compile_command(
    model: Annotated[Path, typer.Argument(help="The input .onnx model.")],
    pipeline: Annotated[str, typer.Option("--pipeline", "-p", help='Passes, e.g. "dce, cse, fold_constants".')],
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the compiled model.")],
    dump_dir: Annotated[
        Path | None,
        typer.Option(help="Write the model after every pass here, numbered (000_input.onnx, 001_dce.onnx, ...)."),
    ] = None,
    dump_on_change: Annotated[
        bool, typer.Option(help="With --dump-dir, dump only passes that changed the model.")
    ] = False,
    bisect_limit: Annotated[
        int | None, typer.Option(help="Run only the first N pass applications (to bisect a miscompile).")
    ] = None,
    verify: Annotated[
        bool, typer.Option(help="Check the model (ONNX checker + strict shape inference) after every pass.")
    ] = True,
    verify_with_ort: Annotated[bool, typer.Option(help="Also build an onnxruntime session after every pass.")] = False,
    external_data: Annotated[
        bool | None, typer.Option(help="Force (or forbid) writing tensors to OUTPUT.data; default: only over 2 GiB.")
    ] = None,
) -> None:
    """Run a pipeline of passes over MODEL and write the result to OUTPUT."""
    passes = parse_pipeline(pipeline)
    if dump_on_change and dump_dir is None:
        raise UsageFailure("--dump-on-change needs --dump-dir")
    manager = PassManager(
        passes,
        verify=verify,
        verify_with_ort=verify_with_ort,
        dump_dir=dump_dir,
        dump_on_change=dump_on_change,
        bisect_limit=bisect_limit,
    )
    result = manager.run(model)
    graphforge.save(result.model, output, external_data=external_data)
    print_report(result, out)
    out.print(f"wrote [bold]{output}[/]")


def print_report(result: CompileResult, console: Console) -> None:
    """The per-pass table: time, node counts and what changed per op type."""
    table = Table(title="passes", title_justify="left")
    for column, justify in [
        ("#", "right"),
        ("pass", "left"),
        ("changed", "left"),
        ("ms", "right"),
        ("verify ms", "right"),
        ("nodes", "right"),
        ("op delta", "left"),
    ]:
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for r in result.records:
        name = r.spec if r.iteration == 1 else f"{r.spec} (iteration {r.iteration})"
        if not r.ran:
            table.add_row(str(r.index), name, "[dim]skipped (bisect limit)[/]", "", "", "", "")
            continue
        delta = ", ".join(f"{op} {n:+d}" for op, n in r.delta.items())
        table.add_row(
            str(r.index),
            name,
            "yes" if r.changed else "no",
            f"{r.seconds * 1e3:.1f}",
            f"{r.verify_seconds * 1e3:.1f}",
            f"{r.nodes_before} → {r.nodes_after}",
            delta,
        )
    console.print(table)


@app.command()
def inspect(model: Annotated[Path, typer.Argument(help="The .onnx model to describe.")]) -> None:
    """Describe MODEL: inputs, outputs, parameters and their size, op histogram, opsets."""
    proto = graphforge.load(model)
    graph = proto.graph
    out.print(
        f"[bold]{model}[/]  IR {proto.ir_version}, producer {proto.producer_name or '?'} {proto.producer_version}"
    )
    out.print("opsets: " + ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in proto.opset_import))
    init_names = {t.name for t in graph.initializer}
    io = Table(title="inputs and outputs", title_justify="left")
    for column in ("kind", "name", "dtype", "shape"):
        io.add_column(column)
    for kind, values in (("input", [v for v in graph.input if v.name not in init_names]), ("output", graph.output)):
        for v in values:
            io.add_row(kind, v.name, *_type_and_shape(v.type))
    out.print(io)

    params = Table(title="parameters (floating-point initializers)", title_justify="left")
    for column, justify in (("name", "left"), ("dtype", "left"), ("shape", "left"), ("elements", "right")):
        params.add_column(column, justify=justify)  # type: ignore[arg-type]
    total_elems = total_bytes = 0
    for t in graph.initializer:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
        if not np.issubdtype(dtype, np.floating):
            continue
        count = int(np.prod(t.dims, dtype=np.int64))
        total_elems += count
        total_bytes += count * dtype.itemsize
        params.add_row(t.name, str(dtype), str(list(t.dims)), f"{count:,}")
    out.print(params)
    out.print(f"{total_elems:,} parameters, {total_bytes / 2**20:.2f} MiB")

    histogram = Counter(n.op_type if not n.domain else f"{n.domain}::{n.op_type}" for n in graph.node)
    ops = Table(title=f"ops ({len(graph.node)} nodes)", title_justify="left")
    ops.add_column("op")
    ops.add_column("count", justify="right")
    for op, count in histogram.most_common():
        ops.add_row(op, str(count))
    out.print(ops)
    for warning in tied_initializer_warnings(proto):
        err.print(f"[yellow]warning:[/] {warning}")


def tied_initializer_warnings(proto: onnx.ModelProto) -> list[str]:
    """Initializers reached through Identity nodes under another name.

    The TorchScript exporter merges initializers with equal values (fresh LayerNorm weights
    are all ones) and re-exposes them through Identity: training would silently tie them.
    """
    init_names = {t.name for t in proto.graph.initializer}
    aliases: dict[str, list[str]] = {}
    for node in proto.graph.node:
        if node.op_type == "Identity" and node.input and node.input[0] in init_names:
            aliases.setdefault(node.input[0], []).extend(node.output)
    return [
        f"initializer {name!r} is also read as {', '.join(map(repr, names))} through Identity: "
        "these parameters are tied (the exporter may have merged equal initial values)"
        for name, names in aliases.items()
    ]


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
    return dtype, "[" + ", ".join(dims) + "]"


@app.command("passes")
def list_passes() -> None:
    """List every registered pass with its parameters and documentation."""
    for cls in default_registry():
        params = ", ".join(p.describe() for p in cls.parameters())
        out.print(f"[bold cyan]{cls.name}[/]" + (f"({params})" if params else ""))
        out.print(textwrap.indent(cleandoc(cls.__doc__ or ""), "    "), soft_wrap=True, highlight=False)
        out.print()


def main() -> None:
    """Entry point: run the app, turning every expected failure into one line and exit 2."""
    try:
        status = app(standalone_mode=False)
    except (GraphforgeError, UsageFailure) as exc:
        err.print(f"[red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except click.exceptions.Abort:
        err.print("[red]aborted[/]")
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    sys.exit(status if isinstance(status, int) else 0)
