"""The ``graphforge`` command, run as a real process so exit codes and streams are the real ones,
and the documentation's CLI examples (the tour, the guides), run as written so the docs never rot."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import models
import numpy as np
import onnx
import pytest
from _pages import page_block
from _tracebacks import assert_no_traceback
from onnx import helper

import graphforge
from graphforge.analysis.size import human_bytes
from graphforge.pass_infra import PassRegistry
from graphforge.pass_manager import default_registry
from graphforge.program import ProgramRoles

REPO = Path(__file__).resolve().parent.parent
#: the console script installed beside the interpreter running the tests
GRAPHFORGE = Path(sys.executable).parent / "graphforge"
FULL_PIPELINE = "identity_elimination, fold_constants, cse, dce, topo_sort"

#: runs graphforge.cli.main after registering test passes: a pass that fails on purpose
#: (its message holds rich markup characters, which must come out verbatim) and one
#: whose parameters and docstring hold brackets
WITH_TEST_PASSES = textwrap.dedent(
    '''
    import sys
    from dataclasses import dataclass
    from graphforge import Pass
    from graphforge.cli import main
    from graphforge.passes import REGISTRY

    @dataclass(frozen=True)
    class Explode(Pass):
        """Always fails."""
        name = "explode"
        def run(self, model):
            raise RuntimeError("kaboom [/] [bold]not bold[/bold]")

    @dataclass(frozen=True)
    class Brackets(Pass):
        """Docs with [bold]markup[/bold] and [1, 2] kept verbatim."""
        name = "brackets"
        names: list[str] = ()
        def run(self, model):
            raise NotImplementedError

    REGISTRY.register(Explode)
    REGISTRY.register(Brackets)
    sys.argv[0] = "graphforge"
    main()
    '''
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["GRAPHFORGE_PROVIDERS"] = "cpu"
    return env


def graphforge_cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(GRAPHFORGE), *map(str, args)], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300
    )


def graphforge_with_test_passes(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WITH_TEST_PASSES, *map(str, args)],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert_no_traceback(proc.stdout + proc.stderr)
    return proc


def failed(proc: subprocess.CompletedProcess, fragment: str) -> str:
    """Exit 2, exactly one non-empty stderr line that names the problem, no traceback."""
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert_no_traceback(proc.stdout + proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{proc.stderr}"
    (line,) = lines
    assert line.startswith("error: "), line
    assert fragment in line, f"{fragment!r} not in {line!r}"
    return line


def table_rows(text: str) -> list[list[str]]:
    """Cells of every rich table row in ``text``."""
    lines = [line.replace("┃", "│") for line in text.splitlines()]
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in lines if line.count("│") >= 2]


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.fixture
def small_model(tmp_path) -> Path:
    """DEAD_AND_DUPLICATE saved in its own folder: dce removes Neg, cse one Relu."""
    folder = tmp_path / "in"
    folder.mkdir()
    return graphforge.save(models.dead_and_duplicate(), folder / "small.onnx")


# --------------------------------------------------------------------------- compile


@pytest.mark.parametrize("fixture", ["mlp_path", "transformer_path", "external_data_path"])
def test_compile_dumps_every_pass_and_computes_the_same_function(request, tmp_path, fixture):
    source = request.getfixturevalue(fixture)
    output, dump = tmp_path / "compiled.onnx", tmp_path / "dumps"
    proc = ok(
        graphforge_cli(
            "compile", source, "-p", FULL_PIPELINE, "-o", output, "--dump-dir", dump, "--verify-with-ort", cwd=tmp_path
        )
    )
    passes = FULL_PIPELINE.split(", ")
    assert sorted(p.name for p in dump.iterdir()) == [
        "000_input.onnx",
        *(f"{i:03d}_{name}.onnx" for i, name in enumerate(passes, start=1)),
    ]
    for dumped in dump.iterdir():
        onnx.checker.check_model(graphforge.load(dumped), full_check=True)
    rows = table_rows(proc.stdout)
    assert [row[1] for row in rows[1:]] == passes, proc.stdout
    assert f"wrote {output}" in proc.stdout
    assert not output.with_name(output.name + ".data").exists(), "small models are written in one file"
    models.assert_same_outputs(source, output, dims={"batch": 3, "seq": 6})
    assert models.node_count(output) == models.node_count(dump / "005_topo_sort.onnx")


def test_compile_reports_changes_per_pass(tmp_path, small_model):
    proc = ok(
        graphforge_cli("compile", small_model, "-p", "dce, cse, topo_sort", "-o", tmp_path / "o.onnx", cwd=tmp_path)
    )
    rows = table_rows(proc.stdout)
    assert rows[0] == ["#", "pass", "changed", "ms", "verify ms", "nodes", "op delta"]
    assert [(r[0], r[1], r[2], r[5], r[6]) for r in rows[1:]] == [
        ("1", "dce", "yes", "4 → 3", "Neg -1"),
        ("2", "cse", "yes", "3 → 2", "Relu -1"),
        ("3", "topo_sort", "no", "2 → 2", ""),
    ]
    assert all(float(r[3]) >= 0 for r in rows[1:])


def test_compile_with_external_data_out(tmp_path, external_data_path):
    output = tmp_path / "compiled.onnx"
    ok(graphforge_cli("compile", external_data_path, "-p", "dce", "-o", output, "--external-data", cwd=tmp_path))
    assert output.with_name("compiled.onnx.data").is_file()
    models.assert_same_outputs(external_data_path, output)


def test_compile_dump_on_change(tmp_path, small_model):
    dump = tmp_path / "dumps"
    ok(
        graphforge_cli(
            "compile",
            small_model,
            "-p",
            "topo_sort, dce, cse, dce",
            "-o",
            tmp_path / "o.onnx",
            "--dump-dir",
            dump,
            "--dump-on-change",
            cwd=tmp_path,
        )
    )
    assert sorted(p.name for p in dump.iterdir()) == ["000_input.onnx", "002_dce.onnx", "003_cse.onnx"]
    assert graphforge.load(dump / "000_input.onnx") == graphforge.load(small_model)


def test_compile_bisect_limit(tmp_path, small_model):
    dump, output = tmp_path / "dumps", tmp_path / "o.onnx"
    proc = ok(
        graphforge_cli(
            "compile", small_model, "-p", "dce, cse, topo_sort", "-o", output, "--dump-dir", dump, "--bisect-limit", "1",
            cwd=tmp_path,
        )
    )  # fmt: skip
    rows = table_rows(proc.stdout)
    assert [(r[1], r[2]) for r in rows[1:]] == [
        ("dce", "yes"),
        ("cse", "skipped (bisect limit)"),
        ("topo_sort", "skipped (bisect limit)"),
    ]
    assert sorted(p.name for p in dump.iterdir()) == ["000_input.onnx", "001_dce.onnx"]
    assert [n.op_type for n in graphforge.load(output).graph.node] == ["Relu", "Relu", "Add"]


def test_compile_without_verification_runs_an_invalid_model(tmp_path):
    source = tmp_path / "invalid.onnx"
    source.write_bytes(models.invalid_model().SerializeToString())
    ok(graphforge_cli("compile", source, "-p", "dce", "-o", tmp_path / "o.onnx", "--no-verify", cwd=tmp_path))
    assert (tmp_path / "o.onnx").is_file()


# --------------------------------------------------------------------------- errors


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# name → (arguments, given the work folder and a valid model; the fragment stderr must hold)
ERROR_CASES = {
    "missing file": (
        lambda d, m: ["compile", d / "missing.onnx", "-p", "dce", "-o", d / "out.onnx"],
        "missing.onnx: no such file",
    ),
    "a folder as the model": (lambda d, m: ["compile", d, "-p", "dce", "-o", d / "out.onnx"], "is a folder"),
    "text that is not ONNX": (
        lambda d, m: [
            "compile",
            _write(d / "notes.onnx", b"hello, I am not a model\n"),
            "-p",
            "dce",
            "-o",
            d / "out.onnx",
        ],
        "notes.onnx: not an ONNX model",
    ),
    "a truncated model": (
        lambda d, m: ["compile", _write(d / "cut.onnx", m.read_bytes()[:57]), "-p", "dce", "-o", d / "out.onnx"],
        "cut.onnx: not an ONNX model",
    ),
    "an invalid graph": (
        lambda d, m: [
            "compile",
            _write(d / "invalid.onnx", models.invalid_model().SerializeToString()),
            "-p",
            "dce",
            "-o",
            d / "out.onnx",
        ],
        "the input model is not a valid ONNX model: ",
    ),
    "an invalid graph with --dump-dir": (  # the dump folder is not even created
        lambda d, m: [
            "compile",
            _write(d / "invalid.onnx", models.invalid_model().SerializeToString()),
            "-p",
            "dce",
            "-o",
            d / "out.onnx",
            "--dump-dir",
            d / "dumps",
        ],
        "the input model is not a valid ONNX model: ",
    ),
    "an unknown pass": (
        lambda d, m: ["compile", m, "-p", "dce, nope", "-o", d / "out.onnx"],
        "unknown pass 'nope'; valid passes: ",
    ),
    "an unknown parameter": (
        lambda d, m: ["compile", m, "-p", "dce(bogus=1)", "-o", d / "out.onnx"],
        "pass 'dce' has no parameter 'bogus'; its parameters: remove_unused_inputs: bool = false",
    ),
    "a bad value type": (
        lambda d, m: ["compile", m, "-p", "dce(remove_unused_inputs=3)", "-o", d / "out.onnx"],
        "pass 'dce' parameter 'remove_unused_inputs': expected bool, got '3'",
    ),
    "a parameter given twice": (
        lambda d, m: [
            "compile",
            m,
            "-p",
            "dce(remove_unused_inputs=true, remove_unused_inputs=false)",
            "-o",
            d / "out.onnx",
        ],
        "pass 'dce': parameter 'remove_unused_inputs' given twice",
    ),
    "a value out of range": (
        lambda d, m: ["compile", m, "-p", "fold_constants(size_limit_mb=-5)", "-o", d / "out.onnx"],
        "pass 'fold_constants' parameter 'size_limit_mb': expected a finite number ≥ 0, got -5.0",
    ),
    "a pipeline syntax error": (
        lambda d, m: ["compile", m, "-p", "dce(", "-o", d / "out.onnx"],
        "pipeline syntax error at column",
    ),
    "an empty pipeline": (lambda d, m: ["compile", m, "-p", " ", "-o", d / "out.onnx"], "the pipeline is empty"),
    "--dump-on-change without --dump-dir": (
        lambda d, m: ["compile", m, "-p", "dce", "-o", d / "out.onnx", "--dump-on-change"],
        "--dump-on-change needs --dump-dir",
    ),
    "an output folder that does not exist": (
        lambda d, m: ["compile", m, "-p", "dce", "-o", d / "nowhere" / "out.onnx"],
        "does not exist",
    ),
    "a negative bisect limit": (
        lambda d, m: ["compile", m, "-p", "dce", "-o", d / "out.onnx", "--bisect-limit", "-1"],
        "bisect limit must be 0 or more, got -1",
    ),
    "a dump folder that is a file": (
        lambda d, m: ["compile", m, "-p", "dce", "-o", d / "out.onnx", "--dump-dir", _write(d / "f", b"")],
        "cannot create the dump folder",
    ),
    "a missing --pipeline": (
        lambda d, m: ["compile", m, "-o", d / "out.onnx"],
        "Missing option '--pipeline'",
    ),
    "a bisect limit that is not a number": (
        lambda d, m: ["compile", m, "-p", "dce", "-o", d / "out.onnx", "--bisect-limit", "some"],
        "'--bisect-limit'",
    ),
    "an unknown option": (
        lambda d, m: ["compile", m, "-p", "dce", "-o", d / "out.onnx", "--frobnicate"],
        "--frobnicate",
    ),
    "an unknown command": (lambda d, m: ["frobnicate"], "frobnicate"),
    "inspect of a missing file": (lambda d, m: ["inspect", d / "missing.onnx"], "missing.onnx: no such file"),
}


@pytest.mark.parametrize("case", ERROR_CASES)
def test_bad_input_is_one_line_exit_2_and_no_output(tmp_path, small_model, case):
    arguments, fragment = ERROR_CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    args = arguments(work, small_model)
    before = files_under(work)
    failed(graphforge_cli(*args, cwd=work), fragment)
    created = files_under(work) - before
    assert not created, f"left behind: {created}"
    assert not (work / "out.onnx").exists()


def test_a_pass_failing_mid_pipeline_writes_no_output_and_keeps_an_old_one(tmp_path, small_model):
    output, dump = tmp_path / "out.onnx", tmp_path / "dumps"
    output.write_bytes(b"the previous output")
    proc = graphforge_with_test_passes(
        "compile", small_model, "-p", "dce, explode, cse", "-o", output, "--dump-dir", dump, cwd=tmp_path
    )
    failed_input = dump / "002_explode.failed-input.onnx"
    line = failed(proc, "pass 2 (explode) failed: ")
    assert line == (
        "error: pass 2 (explode) failed: internal error RuntimeError: kaboom [/] [bold]not bold[/bold]"
        f" [its input model is in {failed_input}]"
    )
    assert output.read_bytes() == b"the previous output"
    assert failed_input.read_bytes() == (dump / "001_dce.onnx").read_bytes()


def test_a_builtin_pass_refusing_a_model_fails_cleanly(tmp_path):
    """topo_sort refuses a cycle; the checker would too, so verification is off."""
    source = tmp_path / "cyclic.onnx"
    source.write_bytes(models.cyclic_model().SerializeToString())
    output = tmp_path / "out.onnx"
    proc = graphforge_cli("compile", source, "-p", "cse, topo_sort", "-o", output, "--no-verify", cwd=tmp_path)
    failed(proc, "pass 2 (topo_sort) failed: the graph has a cycle")
    assert not output.exists()


def test_no_arguments_prints_help_and_exits_2(tmp_path):
    proc = graphforge_cli(cwd=tmp_path)
    assert proc.returncode == 2
    assert_no_traceback(proc.stdout + proc.stderr)
    assert "Usage" in proc.stdout + proc.stderr
    for command in ("compile", "inspect", "passes"):
        assert command in proc.stdout + proc.stderr


# --------------------------------------------------------------------------- inspect, passes, --version


def test_inspect_describes_the_mlp(tmp_path, mlp_path):
    proc = ok(graphforge_cli("inspect", mlp_path, cwd=tmp_path))
    assert proc.stderr.strip() == "", "no tied-initializer warning: the export jittered its biases"
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"{mlp_path}  IR ") and "producer pytorch" in lines[0]
    assert "opsets: ai.onnx 17" in lines
    rows = table_rows(proc.stdout)
    assert ["input", "x", "float32", "[batch, 16]"] in rows
    assert ["output", "y", "float32", "[batch, 4]"] in rows
    n_in, h1, h2, n_out = models.MLP_SIZES
    params = {
        "0.weight": [h1, n_in],
        "0.bias": [h1],
        "2.weight": [h2, h1],
        "2.bias": [h2],
        "4.weight": [n_out, h2],
        "4.bias": [n_out],
    }
    for name, shape in params.items():
        count = 1
        for d in shape:
            count *= d
        assert [name, "float32", str(shape), f"{count:,}"] in rows
    assert "1,732 parameters, 0.01 MiB" in lines
    assert "ops (5 nodes)" in proc.stdout
    assert ["Gemm", "3"] in rows and ["Relu", "2"] in rows


def test_inspect_warns_about_tied_initializers(tmp_path):
    path = graphforge.save(models.tied_initializer(), tmp_path / "tied.onnx")
    proc = ok(graphforge_cli("inspect", path, cwd=tmp_path))
    warnings = [line for line in proc.stderr.splitlines() if line.strip()]
    assert warnings == [
        "warning: initializer 'w' is also read as 'w_alias' through Identity: these parameters are tied "
        "(the exporter may have merged equal initial values)"
    ]
    rows = table_rows(proc.stdout)
    assert ["w", "float32", "[4]", "4"] in rows
    assert ["Identity", "1"] in rows


def test_inspect_an_external_data_model(tmp_path, external_data_path):
    proc = ok(graphforge_cli("inspect", external_data_path, cwd=tmp_path))
    rows = table_rows(proc.stdout)
    assert ["W", "float32", "[16, 32]", "512"] in rows
    assert "544 parameters, 0.00 MiB" in proc.stdout


def test_inspect_reads_no_external_data(tmp_path):
    """It shows dims and types only: the weights file is not read (nor needed)."""
    source = models.external_data_model(tmp_path / "model")
    (tmp_path / "model" / "model.onnx.data").unlink()
    proc = ok(graphforge_cli("inspect", source, cwd=tmp_path))
    assert ["W", "float32", "[16, 32]", "512"] in table_rows(proc.stdout)


def test_inspect_counts_ops_in_subgraphs_and_functions_as_compile_does(tmp_path):
    model = models.parse("""
        <ir_version: 10, opset_import: ["" : 18, "local" : 1]>
        g (bool c, float[2] x) => (float[2] y, float[2] z) {
          y = local.f(x)
          z = If(c) <then_branch = t () => (float[2] o) { o = Relu(x) },
                     else_branch = e () => (float[2] o2) { n = Neg(x)  o2 = Relu(n) }>
        }
        <domain: "local", opset_import: ["" : 18]>
        f (a) => (b) {
          r = Relu(a)
          one = Constant <value_int = 1> ()
          positive = Cast <to = 9> (one)
          b = If(positive) <then_branch = ft () => (float[2] o3) { o3 = Neg(r) },
                            else_branch = fe () => (float[2] o4) { o4 = Identity(r) }>
        }
    """)
    path = graphforge.save(model, tmp_path / "nested.onnx")
    proc = ok(graphforge_cli("inspect", path, cwd=tmp_path))
    rows = table_rows(proc.stdout)
    assert "ops (11 nodes)" in proc.stdout
    for row in (["Relu", "3"], ["Neg", "2"], ["If", "2"], ["local::f", "1"], ["Identity", "1"]):
        assert row in rows, proc.stdout


def test_inspect_warns_about_tied_floating_point_initializers_only(tmp_path):
    """An integer initializer read under another name (a shape, say) is no parameter."""
    model = models.parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 2, 2] y) <int64[3] shape = {-1, 2, 2}> {
          alias = Identity(shape)
          y = Reshape(x, alias)
        }
    """)
    path = graphforge.save(model, tmp_path / "shape.onnx")
    proc = ok(graphforge_cli("inspect", path, cwd=tmp_path))
    assert proc.stderr.strip() == ""


def test_inspect_counts_every_floating_point_initializer(tmp_path):
    """bfloat16 and float16 weights are parameters (NumPy calls bfloat16 no float); int64 is not."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "mixed",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N"])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N"])],
        [
            helper.make_tensor("w_bf16", onnx.TensorProto.BFLOAT16, [2, 3], [0.5] * 6),
            helper.make_tensor("w_f16", onnx.TensorProto.FLOAT16, [4], [1.0] * 4),
            helper.make_tensor("index", onnx.TensorProto.INT64, [2], [0, 1]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "mixed.onnx"
    path.write_bytes(model.SerializeToString())
    proc = ok(graphforge_cli("inspect", path, cwd=tmp_path))
    rows = table_rows(proc.stdout)
    assert ["w_bf16", "bfloat16", "[2, 3]", "6"] in rows
    assert ["w_f16", "float16", "[4]", "4"] in rows
    assert not any(row[0] == "index" for row in rows)
    assert "10 parameters, 0.00 MiB" in proc.stdout.splitlines()


def test_inspect_shows_a_pipeline_programs_stages(tmp_path):
    """Each stage's parameters and their bytes, counted here from the initializers; its optimizer
    states and gradient accumulators (AdamW's two moments and one accumulator: three times as
    many); its share of the FLOPs, all stages' adding to 100%."""
    optimizer = "adamw(lr=1e-2, accumulate=true)"
    pipeline = f"loss(kind=cross_entropy, output=logits), autodiff, {optimizer}, pipeline(stages=2, microbatches=4)"
    program = graphforge.compile(REPO / "examples" / "digits" / "model.onnx", pipeline).model
    path = graphforge.save(program, tmp_path / "staged.onnx")
    proc = ok(graphforge_cli("inspect", path, cwd=tmp_path))
    assert "pipeline: 2 stages × 4 micro-batches, 1f1b" in proc.stdout
    sizes = {t.name: 4 * int(np.prod(t.dims)) for t in program.graph.initializer}
    stages = ProgramRoles.of_proto(program).stages
    rows = [row for row in table_rows(proc.stdout) if len(row) == 7 and row[0].isdigit()]
    assert [row[:3] for row in rows] == [["0", stages.cuts[0], "2"], ["1", "(the rest)", "2"]]
    for row, names in zip(rows, stages.parameters, strict=True):
        assert row[4:6] == [human_bytes(sum(sizes[n] for n in names)), human_bytes(3 * sum(sizes[n] for n in names))]
    assert sum(int(row[3].rstrip("%")) for row in rows) in (99, 100, 101)  # each share rounded


def test_passes_lists_every_registered_pass_with_its_parameters(tmp_path):
    proc = ok(graphforge_cli("passes", cwd=tmp_path))
    lines = proc.stdout.splitlines()
    for cls in default_registry():
        params = ", ".join(p.describe() for p in cls.parameters())
        heading = cls.name + (f"({params})" if params else "")
        assert heading in lines, f"{heading!r} missing from `graphforge passes`"
        assert "    " + cls.summary() in lines, cls.name
    assert "dce(remove_unused_inputs: bool = false)" in lines


def test_passes_prints_brackets_verbatim(tmp_path):
    proc = ok(graphforge_with_test_passes("passes", cwd=tmp_path))
    lines = proc.stdout.splitlines()
    assert "brackets(names: list[str] = [])" in lines
    assert "    Docs with [bold]markup[/bold] and [1, 2] kept verbatim." in lines


def test_version(tmp_path):
    proc = ok(graphforge_cli("--version", cwd=tmp_path))
    assert proc.stdout.strip() == f"graphforge {version('graphforge')}" == f"graphforge {graphforge.__version__}"


# --------------------------------------------------------------------------- the documentation's pages

TOUR = "docs/getting-started/tour.md"
PASS_GUIDE = "docs/guides/writing-a-pass.md"


@pytest.fixture
def page_workspace(tmp_path) -> Path:
    """A fresh folder that looks like a checkout to the pages' relative paths; outputs stay in it."""
    (tmp_path / "golden_models").symlink_to(REPO / "golden_models")
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    return tmp_path


def test_the_tour_runs_as_written(page_workspace):
    """The tour's CLI block, the gradients guide's, the diff guide's, then the tour's Python API
    block, in a fresh folder (as a reader would)."""
    sh_blocks = [
        page_block(TOUR, "sh", "graphforge passes"),  # the CLI block
        page_block("docs/guides/gradients.md", "sh", "autodiff", "graphforge compile"),
    ]
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", sh_blocks[0]],
        cwd=page_workspace,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    ok(proc)
    out = page_workspace / "out"
    pipeline = re.search(r'-p "([^"]+)"', sh_blocks[0]).group(1)
    assert sorted(p.name for p in (out / "dumps").iterdir()) == [
        "000_input.onnx",
        *(f"{i:03d}_{name.strip()}.onnx" for i, name in enumerate(pipeline.split(","), start=1)),
    ]
    models.assert_same_outputs(REPO / "golden_models/demo_mlp/model.onnx", out / "demo.onnx")

    ok(subprocess.run(["bash", "-euo", "pipefail", "-c", sh_blocks[1]], cwd=page_workspace, env=_env(),
                      capture_output=True, text=True, timeout=300))  # fmt: skip
    grad_outputs = [o.name for o in onnx.load(out / "demo_grad.onnx").graph.output]
    assert grad_outputs == ["logits", "loss", "fc1.weight_grad", "fc1.bias_grad", "fc2.weight_grad", "fc2.bias_grad"]

    # the diff block compiles what it compares (as the CLI block does), then compares the
    # shipped model with it: each diff exits 1 (different, as diff(1))
    diff_block = page_block("docs/guides/diff.md", "sh", "graphforge diff")
    lines = [line for line in diff_block.replace("\\\n", " ").splitlines() if line.strip()]
    at = next(i for i, line in enumerate(lines) if line.startswith("A="))
    ok(subprocess.run(["bash", "-euc", "\n".join(lines[:at])], cwd=page_workspace, env=_env(),
                      capture_output=True, text=True, timeout=300))  # fmt: skip
    setup, commands = lines[at], lines[at + 1 :]
    for command in commands:
        proc = subprocess.run(["bash", "-uc", f"{setup}\n{command}"], cwd=page_workspace, env=_env(),
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 1 and proc.stdout, (command, proc.stderr)
        assert_no_traceback(proc.stderr)
    assert (out / "diff.html").is_file()

    api_block = page_block(TOUR, "python", "graphforge.compile(")
    proc = ok(
        subprocess.run(
            [sys.executable, "-c", api_block],
            cwd=page_workspace,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    )
    printed = proc.stdout.splitlines()
    assert [line.split()[:2] for line in printed] == [["1", "fold_constants"], ["2", "cse"], ["3", "dce"]]
    # its own file: the diff block above compares the CLI block's out/demo.onnx
    models.assert_same_outputs(REPO / "golden_models/demo_mlp/model.onnx", out / "demo_api.onnx")


def test_the_tours_api_block_runs_in_a_fresh_folder(page_workspace):
    """Without the CLI block before it: nothing has made out/ yet."""
    api_block = page_block(TOUR, "python", "graphforge.compile(")
    assert not (page_workspace / "out").exists()
    ok(subprocess.run([sys.executable, "-c", api_block], cwd=page_workspace, env=_env(), capture_output=True,
                      text=True, timeout=300))  # fmt: skip
    models.assert_same_outputs(REPO / "golden_models/demo_mlp/model.onnx", page_workspace / "out" / "demo_api.onnx")


def test_the_pass_guides_example_registers_and_runs():
    """Writing a pass: the class block, then the block that registers it beside the built-in passes."""
    block = page_block(PASS_GUIDE, "python", "class DropDebugOutputs")
    registering = page_block(PASS_GUIDE, "python", "PassRegistry(")
    namespace: dict = {"__name__": "page_example"}
    for code in (block, registering):
        exec(compile(code, PASS_GUIDE, "exec", dont_inherit=True), namespace)
    drop, registry = namespace["DropDebugOutputs"], namespace["registry"]
    assert isinstance(registry, PassRegistry) and {"drop_debug_outputs", "dce", "autodiff"} <= {
        c.name for c in registry
    }
    assert [p.spec() for p in namespace["manager"].passes] == ["drop_debug_outputs(prefix='dbg/')", "dce"]
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(drop)
    x, y, debug = (helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, ["N", 4]) for n in ("x", "y", "debug/h"))
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["h"]),
            helper.make_node("Neg", ["h"], ["y"]),
            helper.make_node("Abs", ["h"], ["debug/h"]),
        ],
        "debug_outputs",
        [x],
        [y, debug],
    )
    source = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    source.ir_version = 8
    manager = graphforge.PassManager.from_pipeline("drop_debug_outputs, dce", registry)
    result = manager.run(source)
    assert [o.name for o in result.model.graph.output] == ["y"]
    assert [n.op_type for n in result.model.graph.node] == ["Relu", "Neg"]
    assert [(r.spec, r.changed, r.delta) for r in result.records] == [
        ("drop_debug_outputs", True, {}),
        ("dce", True, {"Abs": -1}),
    ]
    assert drop().spec() == "drop_debug_outputs"
    assert drop(prefix="debug/").spec() == "drop_debug_outputs"
    assert graphforge.parse_pipeline(drop(prefix="x/").spec(), registry) == [drop(prefix="x/")]


def test_the_tours_pipeline_text_parses():
    """'Pipelines are text ("dce, cse, fold_constants(size_limit_mb=4)")'"""
    passes = graphforge.parse_pipeline("dce, cse, fold_constants(size_limit_mb=4)")
    assert [p.spec() for p in passes] == ["dce", "cse", "fold_constants(size_limit_mb=4.0)"]


def test_the_under_the_hood_block_runs_as_written(page_workspace):
    """Roles, a cut at the gradient boundary, and the runner's executor with a hook."""
    block = page_block("docs/reference/under-the-hood.md", "python", "ProgramRoles.read")
    for folder in ("examples", "data"):
        (page_workspace / folder).symlink_to(REPO / folder)
    proc = ok(subprocess.run([sys.executable, "-c", block], cwd=page_workspace, env=_env(), capture_output=True,
                             text=True, timeout=300))  # fmt: skip
    roles_line, hook_line, result_line = proc.stdout.splitlines()
    assert roles_line == "['images', 'labels'] ('logits',) optim::boundary/fc1.weight"
    assert re.fullmatch(r"segment 0 sends \d+ tensors; largest gradient norm \d+\.\d{3}", hook_line)
    assert re.fullmatch(r"loss \d+\.\d{3}; updated 4 parameters", result_line)


def test_the_tours_pass_objects_are_reachable_from_import_graphforge(tmp_path):
    code = "import graphforge; print(graphforge.passes.FoldConstants(size_limit_mb=4).spec())"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "fold_constants(size_limit_mb=4)"


def test_the_memory_guides_commands_run_as_written(tmp_path):
    """The Memory guide's commands: the in-place step predicted below the two-buffer one; then
    the Static shapes guide's recomputation commands."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    block = page_block("docs/guides/memory.md", "sh", "inspect out/digits_program.onnx --memory")
    recompute = page_block("docs/guides/static-shapes.md", "sh", "recompute(budget")
    (tmp_path / "out").mkdir()
    proc = ok(subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=_env(),
                             capture_output=True, text=True, timeout=300))  # fmt: skip
    peaks = re.findall(r"memory of a training step \(([^)]*)\): peak ([\d.]+) KiB", proc.stdout)
    assert [mode for mode, _ in peaks] == ["parameters and optimizer states in place", "two buffers per carried tensor"]
    assert float(peaks[0][1]) < float(peaks[1][1])
    for part in ("parameters", "optimizer states", "gradients", "saved activations", "temporaries"):
        assert part in proc.stdout
    wrong = subprocess.run([str(tmp_path / ".venv/bin/graphforge"), "inspect", "out/digits_program.onnx", "--memory",
                            "--dim", "batch=x"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert wrong.returncode == 2 and "dims entry 'batch=x': write name=size" in wrong.stderr
    assert_no_traceback(wrong.stderr)
    (tmp_path / "golden_models").symlink_to(REPO / "golden_models")
    proc = ok(subprocess.run(["bash", "-euo", "pipefail", "-c", recompute], cwd=tmp_path, env=_env(),
                             capture_output=True, text=True, timeout=300))  # fmt: skip
    program = onnx.load(tmp_path / "out/gpt2_recompute.onnx")
    assert any(n.name.startswith("recompute::") for n in program.graph.node)
    # the tour shows a gain: the note's saved bytes fall, and so do the predicted peak and activations
    kept = re.search(r"saved activations ([\d,]+) → ([\d,]+) bytes", proc.stdout)
    assert kept and int(kept[2].replace(",", "")) < 0.75 * int(kept[1].replace(",", ""))
    peaks = [float(p) for p in re.findall(r"memory of a training step \(.*\): peak ([\d.]+) MiB", proc.stdout)]
    saved = [float(p) for p in re.findall(r"^│ saved activations │\s+([\d.]+) MiB", proc.stdout, re.M)]
    assert len(peaks) == len(saved) == 2 and peaks[1] < 0.9 * peaks[0] and saved[1] < 0.9 * saved[0], proc.stdout


def test_the_host_syncs_block_runs_as_written(tmp_path):
    """The Static shapes guide's command: at the batch's dims no session waits for the host;
    without them the loss's shape computation still does, and the unbound dim is named."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    (tmp_path / "out").mkdir()
    pipeline = "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-2)"  # the Memory guide's program
    ok(graphforge_cli("compile", "examples/digits/model.onnx", "-p", pipeline, "-o", "out/digits_program.onnx",
                      cwd=tmp_path))  # fmt: skip
    block = page_block("docs/guides/static-shapes.md", "sh", "--host-syncs")
    proc = ok(subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=_env(), capture_output=True,
                             text=True, timeout=300))  # fmt: skip
    sessions = re.findall(r"^  (forward/backward|update): [\d,]+ nodes, (.*) \(unspecialized", proc.stdout, re.M)
    assert sessions == [("forward/backward", "no node syncs with the host"), ("update", "no node syncs with the host")]
    unbound = graphforge_cli("inspect", "out/digits_program.onnx", "--host-syncs", cwd=tmp_path)
    assert unbound.returncode == 0, unbound.stderr
    assert "symbolic dims left unbound (name them with --dim NAME=SIZE): batch" in unbound.stdout
    # the loss's gradient takes the batch's shape at run time: the Shape, and what reads it on the host
    assert "forward/backward: 44 nodes, 2 node(s) sync with the host" in unbound.stdout
    assert "a shape computed on the host at run time" in unbound.stdout


def test_compile_prints_a_pass_warning_as_one_line(tmp_path):
    """A pass's UserWarning reaches a CLI user as one 'warning:' line, not Python's
    file:line form with the source line under it."""
    model = models.parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y, float[4] z) <float[4] w = {1, 2, 3, 4}, float[4] head = {1, 1, 1, 1}> {
          y = Mul(x, w)
          z = Neg(head)
        }
    """)
    path = graphforge.save(model, tmp_path / "m.onnx")
    pipeline = "loss(kind=mse, output=y), autodiff(keep_outputs=false)"
    proc = ok(graphforge_cli("compile", path, "-p", pipeline, "-o", tmp_path / "p.onnx", cwd=tmp_path))
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        "warning: autodiff: the loss does not depend on 1 parameter(s), which get no gradient: head"
    ]


# --------------------------------------------------------------------------- help


def _commands():
    import typer.main

    from graphforge.cli import app

    group = typer.main.get_command(app)
    return group, sorted(group.commands)


@pytest.mark.parametrize("name", _commands()[1])
def test_help_at_80_columns_names_every_flag_whole(name):
    """A narrow terminal wraps the help, never cuts a flag's name (rich's panels cut
    --allow-config-change to --allow-config-ch…), and a flag that takes no value shows none
    (they showed <bool>, and --memory true was then refused)."""
    group, _ = _commands()
    command = group.commands[name]
    text = io.StringIO()
    with contextlib.redirect_stdout(text), pytest.raises(SystemExit) as done:
        group.main([name, "--help"], prog_name="graphforge", terminal_width=80, max_content_width=80)
    assert done.value.code == 0
    help_text = text.getvalue()
    assert "…" not in help_text and "<bool>" not in help_text, help_text
    assert max(len(line) for line in help_text.splitlines()) <= 80, help_text
    for param in command.params:
        for flag in [*param.opts, *param.secondary_opts]:
            if flag.startswith("-"):
                assert re.search(rf"(^|[\s,/]){re.escape(flag)}(\s|,|$)", help_text, re.M), (flag, help_text)
