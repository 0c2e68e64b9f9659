"""``graphforge diff``: what the command does, kept out of cli.py (which only declares it).

Exit status as diff(1): 0 when the models are identical, 1 when they differ, 2 on an error
(raised here as a GraphforgeError; the CLI prints it as one line).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from graphforge.diff.engine import diff_models
from graphforge.diff.folders import Step, consecutive, folders_json, only_in, pair_folders
from graphforge.diff.html import write_html
from graphforge.diff.result import ModelDiff
from graphforge.diff.source import Side, open_side
from graphforge.diff.text import RICH_STYLES, Line, detail_lines, summary_lines, verdict
from graphforge.errors import GraphforgeError
from graphforge.pass_manager import PassManager, parse_pipeline


class DiffUsageError(GraphforgeError):
    """The arguments do not name something the diff command can compare."""


def run_diff(
    a: Path | None,
    b: Path | None,
    *,
    pipeline: str | None,
    brief: bool,
    json_out: bool,
    html_out: Path | None,
    numeric: bool,
    inputs: Path | None,
    context: int,
    console: Console,
    seed: int = 0,
    dims: list[str] | None = None,
    allow_invalid: bool = False,
) -> int:
    """Run the command; returns the exit status (0 identical, 1 different)."""
    if a is None:
        raise DiffUsageError("diff needs two models (A B), two dump folders, one dump folder, or --pipeline SPEC MODEL")
    if context < 0:
        raise DiffUsageError(f"--context must be 0 or more, got {context}")
    sizes = parse_dims(dims or [])
    options = {"numeric": numeric, "inputs": inputs, "seed": seed, "dims": sizes, "allow_invalid": allow_invalid}
    if pipeline is not None:
        if b is not None:
            raise DiffUsageError("--pipeline SPEC takes one model: graphforge diff --pipeline SPEC MODEL")
        diff = pipeline_diff(a, pipeline, **options)
        return _report_one(diff, brief, json_out, html_out, context, console)
    if a.is_dir() or (b is not None and b.is_dir()):
        if b is None:
            steps, mode = consecutive(a), "steps"
        elif a.is_dir() and b.is_dir():
            steps, mode = pair_folders(a, b), "pairs"
        else:
            folder, other = (a, b) if a.is_dir() else (b, a)
            raise DiffUsageError(
                f"cannot diff the folder {folder} against the file {other}: give two models or two dump folders"
            )
        # a dump folder holds what failed passes left behind: diff it, report it invalid
        options["allow_invalid"] = True
        for step in steps:
            if step.a is not None and step.b is not None:
                step.diff = diff_models(step.a.path, step.b.path, **options)
        return _report_steps(mode, a, b, steps, brief, json_out, html_out, context, console)
    if b is None:
        raise DiffUsageError(f"diff needs a second model to compare {a} with (or --pipeline SPEC, or a dump folder)")
    diff = diff_models(a, b, **options)
    return _report_one(diff, brief, json_out, html_out, context, console)


def parse_dims(specs: list[str]) -> dict[str, int]:
    """``["batch=8", "seq=16"]`` as {"batch": 8, "seq": 16}."""
    sizes: dict[str, int] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        name = name.strip()
        try:
            size = int(value)
        except ValueError:
            size = 0
        if not sep or not name or size < 1:
            raise DiffUsageError(f"--dim {spec}: expected NAME=N with N a whole number of at least 1 (--dim batch=8)")
        sizes[name] = size
    return sizes


def pipeline_diff(model: Path, pipeline: str, **options) -> ModelDiff:
    """MODEL against what the pipeline makes of it, compiled in memory."""
    before = open_side(model)
    result = PassManager(parse_pipeline(pipeline)).run(model)
    after = Side(result.model, f"{model} after {pipeline!r}")
    return diff_models(before, after, **options)


def rich_line(line: Line) -> Text:
    return Text.assemble(*[(text, RICH_STYLES.get(style, "")) for text, style in line])


def _print_lines(console: Console, lines: list[Line]) -> None:
    for line in lines:
        console.print(rich_line(line), highlight=False, soft_wrap=True)


def _report_one(
    diff: ModelDiff, brief: bool, json_out: bool, html_out: Path | None, context: int, console: Console
) -> int:
    if html_out is not None:
        write_html(html_out, [(f"{diff.a_label} → {diff.b_label}", diff)], context=context)
    if json_out:
        sys.stdout.write(json.dumps(diff.to_json(), indent=2, ensure_ascii=False) + "\n")
    else:
        _print_lines(console, summary_lines(diff))
        details = [] if brief else detail_lines(diff)
        if details:
            console.print(Rule(style="dim"))
            _print_lines(console, details)
        if html_out is not None:
            console.print(Text.assemble(("wrote ", "dim"), (str(html_out), "bold")), highlight=False, soft_wrap=True)
    return 0 if diff.identical else 1


def _report_steps(
    mode: str,
    a: Path,
    b: Path | None,
    steps: list[Step],
    brief: bool,
    json_out: bool,
    html_out: Path | None,
    context: int,
    console: Console,
) -> int:
    same = all(s.identical for s in steps)
    if html_out is not None:
        diffs = [(s.title, s.diff) for s in steps if s.diff is not None]
        if not diffs:
            raise DiffUsageError(f"no pair of dump files to draw: the folders {a} and {b} share no pass")
        write_html(
            html_out, diffs, title=f"graphforge diff: {a}" + (f" vs {b}" if b else " pass by pass"), context=context
        )
    if json_out:
        sys.stdout.write(json.dumps(folders_json(mode, a, b, steps), indent=2, ensure_ascii=False) + "\n")
        return 0 if same else 1
    title = f"{a} pass by pass" if mode == "steps" else f"{a} vs {b}"
    table = Table(title=title, title_justify="left")
    for column, justify in (
        ("#", "right"),
        ("A", "left"),
        ("B", "left"),
        ("verdict", "left"),
        ("nodes", "left"),
        ("op delta", "left"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for k, step in enumerate(steps, start=1):
        a_name = step.a.path.name if step.a is not None else "(none)"
        b_name = step.b.path.name if step.b is not None else "(none)"
        if step.diff is None:
            table.add_row(str(k), a_name, b_name, Text("only in " + ("A" if step.b is None else "B"), "red"), "", "")
            continue
        text, style = verdict(step.diff)
        invalid = [side.upper() for side, problem in step.diff.problems.items() if problem is not None]
        if invalid:
            text += f" ({' and '.join(invalid)} invalid)"
        s = step.diff.summary()
        nodes = f"+{s['nodes_added']} -{s['nodes_removed']} ~{s['nodes_changed']}"
        delta = ", ".join(f"{c.op} {c.b - c.a:+d}" for c in step.diff.histogram)
        table.add_row(str(k), a_name, b_name, Text(text, RICH_STYLES[style]), nodes, delta)
    console.print(table)
    for side, folder in (("a", a), ("b", b)):
        alone = only_in(steps, side)
        if alone and mode == "pairs":
            console.print(
                Text.assemble((f"only in {folder}: ", "red"), (", ".join(alone), "")), highlight=False, soft_wrap=True
            )
    if not brief:
        for k, step in enumerate(steps, start=1):
            if step.diff is None or step.diff.identical:
                continue
            console.print(Rule(f"{k}: {step.title}", style="dim"))
            _print_lines(console, summary_lines(step.diff)[2:] + detail_lines(step.diff))
    if html_out is not None:
        console.print(Text.assemble(("wrote ", "dim"), (str(html_out), "bold")), highlight=False, soft_wrap=True)
    return 0 if same else 1
