"""The ``graphforge`` command.

Every failure a user can cause ends as one line on stderr and exit status 2, with no
traceback and no output file (outputs are written atomically, after the work succeeded).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Annotated

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import graphforge
from graphforge import golden, train
from graphforge.analysis.cost import parse_dims
from graphforge.diff.command import run_diff
from graphforge.distributed.schedules import make_schedule
from graphforge.distributed.simulate import Costs, simulate, timeline
from graphforge.errors import GraphforgeError
from graphforge.generate import Generator
from graphforge.generate.generator import POSITIONS
from graphforge.inspection.host_syncs import host_sync_lines
from graphforge.inspection.memory import memory_tables
from graphforge.inspection.summary import print_summary, tied_initializer_warnings
from graphforge.ondevice import artifacts as ondevice_artifacts
from graphforge.pass_manager import CompileResult, PassManager, default_registry, parse_pipeline
from graphforge.planning.configs import default_hardware, plan_config, write_planned
from graphforge.planning.report import best_fit, predicted, refusals, run_note, splits_table

app = typer.Typer(
    name="graphforge",
    help="Compile ordinary ONNX models into training programs that run on stock onnxruntime.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # click's plain help: rich's panels cut long flag names at 80 columns (--allow-config-ch…)
    # and label every flag <bool>, as if it took a value
    rich_markup_mode=None,
)


class _StdoutUntilClosed(io.TextIOBase):
    """The current sys.stdout, until whoever reads it closes it (``graphforge train ... | head``):
    from then on what is printed goes nowhere, so a closed output stops the printing, not the
    work (a run still trains and saves its checkpoints). Says so once on stderr."""

    def __init__(self) -> None:
        self.reader_gone = False

    def write(self, text: str) -> int:
        if not self.reader_gone:
            try:
                sys.stdout.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self.reader_gone:
            try:
                sys.stdout.flush()
            except BrokenPipeError:
                self._gone()

    def _gone(self) -> None:
        self.reader_gone = True
        with contextlib.suppress(OSError, ValueError):  # the interpreter flushes stdout at exit: somewhere to write
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print("graphforge: the output was closed; going on without printing", file=sys.stderr)

    def isatty(self) -> bool:
        return sys.stdout.isatty()

    def fileno(self) -> int:
        return sys.stdout.fileno()

    @property
    def encoding(self) -> str:
        return getattr(sys.stdout, "encoding", None) or "utf-8"


# Piped output (CI logs, make demo under tee) gets a wide fixed width instead of 80 columns.
out = Console(file=_StdoutUntilClosed(), width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


class UsageFailure(Exception):
    """Raised inside commands for a bad argument; printed as one line, exit 2."""


# Recent typer (0.29 here) vendors click as typer._click, with its own exception classes; older typer
# raises click's. Catch both, so a usage error never ends in a traceback.
_CLICK_ERRORS: tuple[type[Exception], ...] = tuple(
    {click.ClickException, getattr(typer, "TyperException", click.ClickException)}
)
_ABORTS: tuple[type[BaseException], ...] = tuple({click.exceptions.Abort, typer.Abort})


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
        bool, typer.Option(help="With --dump-dir, dump only the input and the passes that changed the model.")
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
    out.print(f"wrote [bold]{escape(str(output))}[/]")


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
        name = escape(r.spec if r.iteration == 1 else f"{r.spec} (iteration {r.iteration})")
        if not r.ran:
            table.add_row(str(r.index), name, "[dim]skipped (bisect limit)[/]", "", "", "", "")
            continue
        delta = escape(", ".join(f"{op} {n:+d}" for op, n in r.delta.items()))
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
    for r in result.records:
        if r.ran and r.note:
            console.print(f"{escape(r.spec)}: {escape(r.note)}", highlight=False, soft_wrap=True)


@app.command()
def inspect(
    model: Annotated[Path, typer.Argument(help="The .onnx model to describe.")],
    memory: Annotated[
        bool,
        typer.Option(
            "--memory",
            help="Predict the peak memory of a training step (a program) or an inference run, and its parts.",
        ),
    ] = False,
    host_syncs: Annotated[
        bool,
        typer.Option(
            "--host-syncs",
            help="List the nodes of each session of the model's run (a training step's segments) that wait for the "
            "host on a GPU, as the runner makes the session for the --dim sizes (specialized).",
        ),
    ] = False,
    dim: Annotated[
        list[str] | None,
        typer.Option(
            "--dim",
            metavar="NAME=SIZE",
            help="With --memory or --host-syncs: a symbolic dim's size, NAME=SIZE (repeatable).",
        ),
    ] = None,
    processes: Annotated[
        int | None,
        typer.Option(
            "--processes",
            min=1,
            help="For a program compiled with the zero pass: which elements of which parameters each of this many "
            "processes owns (updates, and keeps optimizer states for).",
        ),
    ] = None,
    two_buffers: Annotated[
        bool,
        typer.Option(
            "--two-buffers",
            help="With --memory or --host-syncs: as Module(in_place=False) runs it (undoable steps).",
        ),
    ] = False,
) -> None:
    """Describe MODEL: inputs, outputs, parameters and their size, op histogram, opsets."""
    proto = graphforge.load(model, load_external_data=False)  # dims and types are all it shows
    if host_syncs:
        for line in host_sync_lines(proto, parse_dims(dim or []), in_place=not two_buffers):
            out.print(escape(line), highlight=False, soft_wrap=True)
    elif memory:
        for part in memory_tables(proto, parse_dims(dim or []), in_place=not two_buffers):
            out.print(part, highlight=False, soft_wrap=True)
    else:
        print_summary(proto, str(model), out, processes=processes)
        for warning in tied_initializer_warnings(proto):
            err.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)


@app.command("passes")
def list_passes() -> None:
    """List every registered pass with its parameters and documentation."""
    for cls in default_registry():
        params = ", ".join(p.describe() for p in cls.parameters())
        out.print(
            f"[bold cyan]{cls.name}[/]" + escape(f"({params})" if params else ""), soft_wrap=True, highlight=False
        )
        out.print(textwrap.indent(cls.description(), "    "), soft_wrap=True, highlight=False, markup=False)
        out.print()


# --------------------------------------------------------------------------- graphforge golden

golden_app = typer.Typer(
    name="golden",
    help="Golden models: compile the shipped models through their pipelines and compare with the recorded expectations.",
    no_args_is_help=True,
)
app.add_typer(golden_app)

GoldenFolder = Annotated[Path, typer.Argument(help="The golden folder (model folders with golden.json).")]
GoldenModels = Annotated[list[str] | None, typer.Option("--model", "-m", help="Only this model (repeat for several).")]
GoldenPipelines = Annotated[
    list[str] | None,
    typer.Option("--pipeline", "-p", help="Only this pipeline id, or test_data (repeat for several)."),
]


def _print_golden(report) -> None:
    out.print(report.to_text(), markup=False, highlight=False, soft_wrap=True)
    if not report.ok:
        raise typer.Exit(1)


@golden_app.command("check")
def golden_check(
    folder: GoldenFolder = Path("golden_models"),
    model: GoldenModels = None,
    pipeline: GoldenPipelines = None,
) -> None:
    """Compare every model and pipeline with its expectations: exit 1 with what changed, 0 when all pass."""
    _quiet_onnxruntime()
    _print_golden(golden.check(folder, models=model, pipelines=pipeline))


@golden_app.command("update")
def golden_update(
    folder: GoldenFolder = Path("golden_models"),
    model: GoldenModels = None,
    pipeline: GoldenPipelines = None,
    force: Annotated[bool, typer.Option(help="Rewrite expectations that still pass, too.")] = False,
) -> None:
    """Record what the pipelines produce now where it differs from the expectations, printing the diff."""
    _quiet_onnxruntime()
    _print_golden(golden.update(folder, models=model, pipelines=pipeline, force=force))


def _quiet_onnxruntime() -> None:
    """onnxruntime's default logger prints optimizer warnings from sessions passes create
    (fold_constants), which would bury the report."""
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)


# --------------------------------------------------------------------------- graphforge diff


@app.command("diff")
def diff_command(
    a: Annotated[Path | None, typer.Argument(help="Model A, or a dump folder (compile --dump-dir).")] = None,
    b: Annotated[Path | None, typer.Argument(help="Model B, or a second dump folder.")] = None,
    pipeline: Annotated[
        str | None,
        typer.Option("--pipeline", "-p", help="Diff the one model given against what this pipeline makes of it."),
    ] = None,
    brief: Annotated[bool, typer.Option("--brief", help="Print the summary only.")] = False,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the JSON report (schema: docs/diff-json.md).")
    ] = False,
    html_out: Annotated[
        Path | None, typer.Option("--html", help="Also write a self-contained page drawing both graphs here.")
    ] = None,
    numeric: Annotated[
        bool, typer.Option("--numeric", help="Run both models on the same inputs and compare every matched tensor.")
    ] = False,
    inputs: Annotated[
        Path | None, typer.Option("--inputs", help="Inputs for --numeric: an .npz of input name -> array.")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the inputs --numeric generates.")] = 0,
    dim: Annotated[
        list[str] | None,
        typer.Option(
            "--dim",
            metavar="NAME=N",
            help="Size of a symbolic dimension in the inputs --numeric generates, NAME=N (repeatable; default 8).",
        ),
    ] = None,
    allow_invalid: Annotated[
        bool,
        typer.Option(
            "--allow-invalid",
            help="Diff a model the ONNX checker rejects (reported as a warning); dump folders always allow it.",
        ),
    ] = False,
    context: Annotated[int, typer.Option(help="In the page of a large graph, hops drawn around each change.")] = 2,
) -> None:
    """Compare two models by structure: what was added, removed or changed (exit 0 same, 1 different).

    Also: two dump folders pass by pass, one dump folder step by step, or --pipeline SPEC MODEL.
    """
    _quiet_onnxruntime()
    status = run_diff(
        a,
        b,
        pipeline=pipeline,
        brief=brief,
        json_out=json_out,
        html_out=html_out,
        numeric=numeric,
        inputs=inputs,
        seed=seed,
        dims=dim or [],
        allow_invalid=allow_invalid,
        context=context,
        console=out,
    )
    if status:
        raise typer.Exit(status)


# --------------------------------------------------------------------------- graphforge train / export


@app.command("train")
def train_command(
    config: Annotated[Path, typer.Argument(help="The training config (TOML; keys: graphforge/train/config.py).")],
    steps: Annotated[
        int | None, typer.Option("--steps", min=1, help="Train this many steps (instead of train.steps / epochs).")
    ] = None,
    resume: Annotated[
        bool | None,
        typer.Option(
            "--resume/--no-resume",
            help="Resume from the latest checkpoint in the output folder (default: checkpoint.resume, true); "
            "--no-resume refuses a folder that already holds checkpoints.",
        ),
    ] = None,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Output folder (default: the config's out, else runs/<config name>).")
    ] = None,
    allow_config_change: Annotated[
        bool,
        typer.Option(
            "--allow-config-change",
            help="Resume even though the data order or LR-schedule settings (data.batch_size, shuffle, seed, "
            "drop_last, train.accumulate, train.lr, schedule.*) differ from the checkpoint's; the run goes on "
            "with the new ones.",
        ),
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors; no progress bar.")] = False,
) -> None:
    """Train as CONFIG says, writing the program, checkpoints, a JSONL log and TensorBoard scalars.

    Ctrl-C saves a checkpoint and exits with status 130; the same command then resumes. A
    loss that is not finite stops the run with status 3, after saving the last finite state.
    """
    _quiet_onnxruntime()
    try:
        train.run(
            config,
            steps=steps,
            resume=resume,
            out=out_dir,
            allow_config_change=allow_config_change or None,
            quiet=quiet,
            console=out,
        )
    except train.NonFiniteLoss as exc:
        err.print(f"[red]error:[/] {escape(_from_this_rank(str(exc)))}", highlight=False, soft_wrap=True)
        raise typer.Exit(train.NonFiniteLoss.EXIT_STATUS) from None
    except train.Interrupted as exc:
        err.print(f"[yellow]{escape(str(exc))}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    except KeyboardInterrupt:  # while starting (compiling, loading), or a second Ctrl-C while saving
        err.print("[yellow]interrupted; no checkpoint written[/]", highlight=False)
        raise typer.Exit(130) from None


@app.command("export")
def export_command(
    program: Annotated[Path, typer.Argument(help="The training program (graphforge train writes OUT/program.onnx).")],
    output_file: Annotated[
        Path, typer.Option("--out", "-o", help="Where to write the inference model (--adapters peft: the folder).")
    ],
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            help="Trained values: a checkpoint file, or a folder (its latest checkpoint; a run folder works)."
        ),
    ] = None,
    output: Annotated[
        list[str] | None,
        typer.Option("--output", help="A model output to keep (repeat; default: the forward outputs)."),
    ] = None,
    dtype: Annotated[
        str,
        typer.Option(
            "--dtype",
            help="float32, or float16 / bfloat16: compute in that type where mixed precision would, weights stored in it.",
        ),
    ] = "float32",
    adapters: Annotated[
        str,
        typer.Option(
            "--adapters",
            help="A LoRA program's adapters: merge (into the base weights; beside a quantized base), onnx (OUT reads them as inputs, "
            "their values in OUT's .onnx_adapter) or peft (PEFT's folder OUT).",
        ),
    ] = "merge",
    base_model: Annotated[
        str | None,
        typer.Option("--base-model", help="--adapters peft: the base model's name, for adapter_config.json."),
    ] = None,
) -> None:
    """Write the inference model of PROGRAM with a checkpoint's trained values, and compare their sizes."""
    if adapters == "peft":
        _export_peft(program, output_file, checkpoint, base_model)
        return
    report = train.export(program, output_file, checkpoint=checkpoint, outputs=output, dtype=dtype, adapters=adapters)
    table = Table(title="size", title_justify="left")
    for column, justify in (("", "left"), ("program", "right"), ("exported", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for row in report.rows():
        table.add_row(*row)
    out.print(table)
    values = (
        f"the values of {escape(str(report.checkpoint))} (step {report.step})"
        if report.checkpoint is not None
        else "the program's own values (no --checkpoint)"
    )
    out.print(
        f"wrote [bold]{escape(str(report.path))}[/] (outputs: {escape(', '.join(report.outputs))}) with {values}",
        highlight=False,
        soft_wrap=True,
    )
    if report.adapters == "kept":
        out.print("its adapters stay beside the quantized base weights (merging would undo the quantization)")
    if report.adapter_file is not None:
        out.print(
            f"and its adapters' values in [bold]{escape(str(report.adapter_file))}[/] "
            "(onnxruntime: RunOptions.add_active_adapter; without it, the base model)",
            highlight=False,
            soft_wrap=True,
        )


def _export_peft(program: Path, folder: Path, checkpoint: Path | None, base_model: str | None) -> None:
    report = train.export_peft(program, folder, checkpoint=checkpoint, base_model=base_model)
    values = f"step {report.step}" if report.checkpoint is not None else "the program's own values"
    out.print(
        f"wrote [bold]{escape(str(report.folder))}[/]: {len(report.modules)} adapters "
        f"({report.parameters:,} parameters, {values}) in {' and '.join(p.name for p in report.files)}",
        highlight=False,
        soft_wrap=True,
    )


# --------------------------------------------------------------------------- graphforge generate


@app.command("generate")
def generate_command(
    model: Annotated[
        Path,
        typer.Argument(help="An inference model: input_ids -> logits, with cache inputs (past_key_values.N.*) or not."),
    ],
    tokenizer: Annotated[
        Path,
        typer.Option(
            "--tokenizer", help="Its tokenizer.json, or the folder holding it (tokenizer_config.json names EOS)."
        ),
    ],
    prompt: Annotated[str, typer.Option("--prompt", help="The text to go on from.")],
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", min=1, help="Generate at most this many tokens.")
    ] = 64,
    temperature: Annotated[
        float | None,
        typer.Option("--temperature", min=0, help="Sample at this temperature (0: greedy; default greedy)."),
    ] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", min=1, help="Sample from the K most likely tokens.")] = None,
    top_p: Annotated[
        float | None, typer.Option("--top-p", help="Sample from the fewest tokens whose probability reaches P.")
    ] = None,
    seed: Annotated[
        int | None, typer.Option("--seed", help="Seed of the sampling (the same seed, the same text).")
    ] = None,
    stop: Annotated[
        list[str] | None, typer.Option("--stop", help="Stop at this text, left out of the output (repeatable).")
    ] = None,
    adapter: Annotated[
        Path | None, typer.Option("--adapter", help="An onnxruntime .onnx_adapter file to run the model with.")
    ] = None,
    max_positions: Annotated[
        int | None,
        typer.Option("--max-positions", min=1, help="The model's positions, where its graph has no position table."),
    ] = None,
    device: Annotated[
        str | None, typer.Option("--device", help="cpu, cuda or cuda:N (default: the best here).")
    ] = None,
    threads: Annotated[int | None, typer.Option("--threads", min=0, help="onnxruntime's intra-op threads.")] = None,
    cache: Annotated[
        bool,
        typer.Option("--cache/--no-cache", help="Give a model without cache inputs a KV cache (the kv_cache pass)."),
    ] = True,
) -> None:
    """Generate text after PROMPT with MODEL, printed as the tokens come.

    Greedy unless --temperature, --top-k or --top-p is given. A model without cache inputs is
    given a KV cache by the kv_cache pass, in memory; where the pass does not recognize its
    attention, the whole prefix runs again for every token (a line on stderr says why).
    """
    _quiet_onnxruntime()
    generator = Generator(
        model, tokenizer, adapter=adapter, device=device, threads=threads, max_positions=max_positions, cache=cache
    )
    if generator.note:
        err.print(f"[yellow]note:[/] {escape(generator.note)}", highlight=False, soft_wrap=True)
    stream = generator.stream(
        prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        stop=stop or (),
    )  # fmt: skip
    try:
        for piece in stream:
            out.file.write(piece)
            out.file.flush()
    except KeyboardInterrupt:
        out.file.write("\n")
        err.print("[yellow]interrupted[/]", highlight=False)
        raise typer.Exit(130) from None
    out.file.write("\n")
    if stream.stop_reason == POSITIONS:
        err.print(
            f"[yellow]note:[/] stopped after {len(stream.ids)} tokens: the model's {generator.max_positions} "
            "positions are used up",
            highlight=False,
        )


@app.command("artifacts")
def artifacts_command(
    model: Annotated[
        Path,
        typer.Argument(help="A forward model (with -p), or a training program (graphforge train's OUT/program.onnx)."),
    ],
    output_dir: Annotated[Path, typer.Option("--out", "-o", help="The artifact folder to write (made if missing).")],
    pipeline: Annotated[
        str | None,
        typer.Option("--pipeline", "-p", help="Compile MODEL with this pipeline (its optimizer made to accumulate)."),
    ] = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option(help="The state to start from: a checkpoint file, or a run folder (its latest checkpoint)."),
    ] = None,
    output: Annotated[
        list[str] | None,
        typer.Option(
            "--output",
            help="An output the training and eval models return after the loss (repeat; default: the forward outputs).",
        ),
    ] = None,
    loss_only: Annotated[
        bool, typer.Option("--loss-only", help="The training and eval models return the loss alone.")
    ] = False,
    prefix: Annotated[str, typer.Option("--prefix", help="Put before each file's name.")] = "",
    freeze: Annotated[
        list[str] | None,
        typer.Option(
            "--freeze",
            help="Freeze the weights this glob names (repeat; with -p: the freeze pass first, as "
            "onnxruntime-training's frozen_params).",
        ),
    ] = None,
    frozen_constants: Annotated[
        bool,
        typer.Option(
            "--frozen-constants",
            help="Keep the frozen weights constants of the models (onnxruntime folds and prepacks them), "
            "not inputs read from the checkpoint.",
        ),
    ] = False,
) -> None:
    """Write on-device training artifacts (training, eval and optimizer models, the whole step,
    an inference model, the checkpoint and manifest.json) for onnxruntime in any language:
    graphforge's JavaScript runtime (js/) on onnxruntime-node and onnxruntime-web, or
    graphforge.ondevice in Python."""
    manifest, how = ondevice_artifacts.artifacts_from(
        model,
        output_dir,
        pipeline=pipeline,
        checkpoint=train.find_checkpoint(checkpoint) if checkpoint is not None else None,
        outputs=output,
        loss_only=loss_only,
        prefix=prefix,
        freeze=freeze or (),
        frozen_constants=frozen_constants,
    )
    out.print(f"[bold]artifacts[/] {escape(how)} → {escape(str(output_dir))}", highlight=False, soft_wrap=True)
    table = Table()
    for column in ("model", "file", "inputs", "outputs"):
        table.add_column(column)
    for key, entry in manifest.models.items():
        table.add_row(key, entry.file, str(len(entry.inputs)), str(len(entry.outputs)))
    out.print(table)
    accumulates = "accumulates gradients until lazyResetGrad" if manifest.accumulates else "does not accumulate"
    out.print(
        f"wrote {len(manifest.models) + 2} files into [bold]{escape(str(output_dir))}[/]: the training model "
        f"{accumulates}; {manifest.optimizer}, default lr {manifest.default_lr:g}; state: {len(manifest.state)} tensors",
        highlight=False,
        soft_wrap=True,
    )


# graphforge plan's machine: each option replaces a default of planning.configs.default_hardware
PlanFlops = Annotated[
    float | None,
    typer.Option(
        "--flops",
        min=1,
        help="Sustained FLOP/s of one process on training programs (default: this machine's cores shared "
        "among the processes, at a rate measured here for onnxruntime on the CPU).",
    ),
]
PlanMemoryBandwidth = Annotated[
    float | None,
    typer.Option(
        "--memory-bandwidth",
        min=1,
        help="Bytes/s a process's kernels stream through its memory (default: this machine's, shared among "
        "the processes, as measured here for onnxruntime's elementwise kernels).",
    ),
]
PlanBandwidth = Annotated[
    float | None,
    typer.Option("--bandwidth", min=1, help="Bytes/s a process moves on a link (default: gloo on loopback here)."),
]
PlanLatency = Annotated[
    float | None,
    typer.Option("--latency", min=0, help="Seconds per collective or message (default: gloo on loopback here)."),
]
PlanOverhead = Annotated[
    float | None,
    typer.Option("--overhead", min=0, help="Seconds each onnxruntime run costs besides its kernels (default: CPU)."),
]
PlanNodeProcesses = Annotated[
    int,
    typer.Option(
        "--node-processes",
        min=0,
        help="Processes per node, whose groups take the node's own link (--node-bandwidth, --node-latency); "
        "0: all on one link.",
    ),
]
PlanNodeBandwidth = Annotated[
    float | None, typer.Option("--node-bandwidth", min=1, help="Bytes/s on the node's own link (NVLink, say).")
]
PlanNodeLatency = Annotated[
    float | None, typer.Option("--node-latency", min=0, help="Seconds per message on the node's own link.")
]


@app.command("plan")
def plan_command(
    config: Annotated[Path, typer.Argument(help="The training config (TOML) whose split to plan.")],
    processes: Annotated[int, typer.Option("--processes", min=1, help="Processes the run will have (N).")],
    memory: Annotated[
        str, typer.Option("--memory-per-process", help="Memory each process may hold, e.g. 16GiB, 512MiB, 80GB.")
    ],
    flops: PlanFlops = None,
    memory_bandwidth: PlanMemoryBandwidth = None,
    bandwidth: PlanBandwidth = None,
    latency: PlanLatency = None,
    overhead: PlanOverhead = None,
    node_processes: PlanNodeProcesses = 0,
    node_bandwidth: PlanNodeBandwidth = None,
    node_latency: PlanNodeLatency = None,
    dims: Annotated[
        list[str] | None,
        typer.Option("--dims", help="Sizes of symbolic dims other than the batch (seq=64); default: data.train's."),
    ] = None,
    top: Annotated[int, typer.Option("--top", min=1, help="Splits to show.")] = 5,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write the config with the best split that fits here.")
    ] = None,
) -> None:
    """Predict the step time and memory of each data × tensor × pipeline split of N processes
    for CONFIG (compiling each split's program, running nothing), show the best, and write the
    config with the fastest one that fits (-o) for graphforge train under torchrun."""
    hardware = default_hardware(
        processes, _parse_bytes(memory), flops=flops, memory_bandwidth=memory_bandwidth, bandwidth=bandwidth,
        latency=latency, overhead=overhead, node_processes=node_processes, node_bandwidth=node_bandwidth,
        node_latency=node_latency,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a block left whole for some T: the table says what each split holds
        planned = plan_config(config, processes, hardware, parse_dims(dims or []))
    out.print(splits_table(planned, predicted(planned)[:top], config.name))
    for label, text in refusals(planned):
        err.print(f"[yellow]{label}:[/] {escape(text)}", highlight=False, soft_wrap=True)
    best = best_fit(planned)
    if output is not None:
        write_planned(planned, best.split, output, run_note(planned, best, output))
        out.print(f"wrote [bold]{escape(str(output))}[/] ({best.split})", highlight=False)


def _parse_bytes(text: str) -> int:
    """``16GiB``, ``512MiB``, ``80GB``, ``1e9`` -> bytes."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9}
    units |= {"TB": 10**12, "B": 1}
    number, scale = text.strip(), 1
    unit = next((u for u in units if number.upper().endswith(u)), None)
    if unit is not None:
        number, scale = number[: -len(unit)].strip(), units[unit]
    try:
        value = float(number) * scale
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UsageFailure(f"--memory-per-process {text!r}: write a size, e.g. 16GiB, 512MiB or 80GB")
    return int(value)


@app.command("schedule")
def schedule_command(
    name: Annotated[str, typer.Argument(help="The pipeline schedule: gpipe or 1f1b.")],
    stages: Annotated[int, typer.Option("--stages", min=1, help="Pipeline stages (processes).")],
    microbatches: Annotated[int, typer.Option("--microbatches", min=1, help="Micro-batches per step.")],
    costs: Annotated[
        str,
        typer.Option(
            help="Forward:backward time per stage, e.g. 1:2 for every stage or 1:2,1.5:3 one per stage "
            "(any unit: milliseconds, FLOPs)."
        ),
    ] = "1:2",
    comm: Annotated[float, typer.Option("--comm", min=0, help="Time from a send to its arrival.")] = 0.0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the figures as JSON (bubble, peak_stash, ...).")
    ] = False,
) -> None:
    """Simulate a pipeline schedule: its timeline, makespan, bubble and the activations each stage stashes."""
    import json

    schedule = make_schedule(name, stages, microbatches)
    simulation = simulate(schedule, _stage_costs(costs, stages, comm))
    if as_json:
        figures = {
            "schedule": name.lower(),
            **simulation.as_dict(),
            "ideal_bubble": (stages - 1) / (microbatches + stages - 1),
        }
        out.print_json(json.dumps(figures))
        return
    out.print(timeline(simulation), highlight=False, soft_wrap=True)
    table = Table(title=f"{name} · {stages} stages × {microbatches} micro-batches", title_justify="left")
    for column in ("stage", "busy", "idle", "peak stash"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    for s in range(stages):
        idle = simulation.idle[s]
        table.add_row(str(s), f"{simulation.busy[s]:g}", f"{idle:.1%}", str(simulation.peak_stash[s]))
    out.print(table)
    ideal = (stages - 1) / (microbatches + stages - 1)
    out.print(
        f"makespan {simulation.makespan:g}, bubble {simulation.bubble:.1%} "
        f"((p-1)/(m+p-1) = {ideal:.1%} for balanced stages)",
        highlight=False,
    )


def _stage_costs(text: str, stages: int, comm: float) -> Costs:
    pairs = [p.strip() for p in text.split(",") if p.strip()]
    if len(pairs) not in (1, stages):
        raise UsageFailure(f"--costs has {len(pairs)} entries; give one for every stage or one per stage ({stages})")
    forward, backward = [], []
    for pair in pairs:
        f, sep, b = pair.partition(":")
        try:
            values = float(f), float(b)
        except ValueError:
            values = None
        if not sep or values is None or min(values) < 0:
            raise UsageFailure(f"--costs entry {pair!r}: write forward:backward, two numbers ≥ 0 (e.g. 1:2)")
        forward.append(values[0])
        backward.append(values[1])
    if len(pairs) == 1:
        forward, backward = forward * stages, backward * stages
    return Costs(forward, backward, comm)


def _from_this_rank(message: str) -> str:
    """One of several processes (torchrun) says which it is, unless the message does."""
    ranks = os.environ.get("WORLD_SIZE", "1")
    if ranks.isdigit() and int(ranks) > 1 and not message.startswith("rank "):
        return f"rank {os.environ.get('RANK', '?')}: {message}"
    return message


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A pass's warning (a UserWarning) as one line, like the errors; others as Python shows them."""
    if issubclass(category, UserWarning):
        err.print(f"[yellow]warning:[/] {escape(str(message))}", highlight=False, soft_wrap=True)
    else:
        _python_show_warning(message, category, filename, lineno, file, line)


_python_show_warning = warnings.showwarning


def main() -> None:
    """Entry point: run the app, turning every expected failure into one line and exit 2."""
    warnings.showwarning = _show_warning
    try:
        status = app(standalone_mode=False)
    except (GraphforgeError, UsageFailure) as exc:
        err.print(f"[red]error:[/] {escape(_from_this_rank(str(exc)))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except _ABORTS:
        err.print("[red]aborted[/]")
        sys.exit(130)
    except _CLICK_ERRORS as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `graphforge`: the help text
            exc.show()
        else:
            ctx = getattr(exc, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            err.print(f"[red]error:[/] {escape(exc.format_message())}{hint}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    sys.exit(status if isinstance(status, int) else 0)
