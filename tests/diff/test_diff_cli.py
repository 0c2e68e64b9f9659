"""``graphforge diff`` run as a real process: exit codes as diff(1), one-line errors, every mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import models
import numpy as np
import pytest
from _diff_fixtures import STATUS_A, STATUS_B, parse
from _tracebacks import assert_no_traceback

import graphforge

GRAPHFORGE = Path(sys.executable).parent / "graphforge"


def cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["GRAPHFORGE_PROVIDERS"] = "cpu"
    return subprocess.run(
        [str(GRAPHFORGE), "diff", *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def exits(proc: subprocess.CompletedProcess, status: int) -> subprocess.CompletedProcess:
    assert proc.returncode == status, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert_no_traceback(proc.stdout + proc.stderr)
    return proc


def one_line_error(proc: subprocess.CompletedProcess, fragment: str) -> str:
    exits(proc, 2)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{proc.stderr}"
    assert lines[0].startswith("error: ") and fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def pair(tmp_path) -> tuple[Path, Path]:
    a = graphforge.save(parse(STATUS_A), tmp_path / "a.onnx")
    b = graphforge.save(parse(STATUS_B), tmp_path / "b.onnx")
    return a, b


def test_exit_0_when_identical_1_when_different(tmp_path, pair):
    a, b = pair
    same = exits(cli(a, a, cwd=tmp_path), 0)
    assert "verdict: identical" in same.stdout
    different = exits(cli(a, b, cwd=tmp_path), 1)
    out = different.stdout
    assert "verdict: different" in out and "+1 added" in out and "-1 removed" in out and "~2 changed" in out
    assert "attribute alpha: 0.1 → 0.2" in out and "- Neg 'neg'" in out and "+ Sigmoid 'sig'" in out


def test_brief_prints_the_summary_only(tmp_path, pair):
    proc = exits(cli(*pair, "--brief", cwd=tmp_path), 1)
    assert "verdict: different" in proc.stdout and "ops: Neg 1→0 (-1), Sigmoid 0→1 (+1)" in proc.stdout
    assert "attribute alpha" not in proc.stdout


def test_json_prints_the_documented_report(tmp_path, pair):
    proc = exits(cli(*pair, "--json", cwd=tmp_path), 1)
    report = json.loads(proc.stdout)
    assert report["schema"] == "graphforge.diff" and report["version"] == 1
    assert report["a"] == str(pair[0]) and not report["identical"]
    assert [n["name"] for n in report["graph"]["removed"]] == ["neg"]


@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "not onnx",
        "empty",
        "folder vs file",
        "one model",
        "no arguments",
        "pipeline with two",
        "bad pipeline",
        "invalid model",
        "bad --dim",
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, pair, case):
    a, _ = pair
    junk = tmp_path / "junk.onnx"
    junk.write_text("this is not a model\n")
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    folder = tmp_path / "dumps"
    folder.mkdir()
    invalid = graphforge.save(_invalid(), tmp_path / "invalid.onnx")
    args, fragment = {
        "missing": ((a, tmp_path / "nope.onnx"), "nope.onnx: no such file"),
        "not onnx": ((junk, a), "junk.onnx: not an ONNX model"),
        "empty": ((a, empty), "empty.onnx: not an ONNX model"),
        "folder vs file": ((folder, a), "cannot diff the folder"),
        "one model": ((a,), "needs a second model"),
        "no arguments": ((), "diff needs two models"),
        "pipeline with two": ((a, a, "--pipeline", "dce"), "takes one model"),
        "bad pipeline": ((a, "--pipeline", "no_such_pass"), "no_such_pass"),
        "invalid model": ((a, invalid), "invalid.onnx: not a valid ONNX model: Nodes in a graph must be"),
        "bad --dim": ((a, a, "--numeric", "--dim", "N"), "--dim N: expected NAME=N"),
    }[case]
    one_line_error(cli(*args, cwd=tmp_path), fragment)


def _invalid():
    """STATUS_A with a node reading a name nothing defines: the checker refuses it."""
    model = parse(STATUS_A)
    model.graph.node[1].input[0] = "nowhere"
    return model


def test_allow_invalid_diffs_it_and_warns(tmp_path, pair):
    a, _ = pair
    invalid = graphforge.save(_invalid(), tmp_path / "invalid.onnx")
    text = exits(cli(a, invalid, "--allow-invalid", cwd=tmp_path), 1).stdout
    assert f"warning: b ({invalid}) is not a valid ONNX model: Nodes in a graph must be" in text
    assert "'nowhere' (undefined)" in text
    report = json.loads(exits(cli(a, invalid, "--allow-invalid", "--json", cwd=tmp_path), 1).stdout)
    assert report["valid"] is False and report["problems"]["a"] is None and "nowhere" in report["problems"]["b"]


def test_dump_folders_allow_a_failed_pass_input_and_say_it_is_invalid(tmp_path, pair):
    """What a failed pass leaves behind may be invalid: the folder diff still runs, and says so."""
    folder = tmp_path / "dumps"
    folder.mkdir()
    graphforge.save(parse(STATUS_A), folder / "000_input.onnx")
    graphforge.save(_invalid(), folder / "001_cse.failed-input.onnx")
    proc = exits(cli(folder, cwd=tmp_path), 1)
    assert "different (B invalid)" in proc.stdout
    assert "is not a valid ONNX model" in proc.stdout
    report = json.loads(exits(cli(folder, "--json", cwd=tmp_path), 1).stdout)
    assert report["steps"][0]["diff"]["valid"] is False


def test_a_folder_without_dumps_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    one_line_error(cli(tmp_path / "empty", cwd=tmp_path), "no numbered dump files")


def test_pipeline_shows_what_the_passes_do(tmp_path):
    model = graphforge.save(models.dead_and_duplicate(), tmp_path / "m.onnx")
    proc = exits(cli("--pipeline", "cse, dce", model, cwd=tmp_path), 1)
    assert "after 'cse, dce'" in proc.stdout
    assert "- Relu #1" in proc.stdout and "- Neg #3" in proc.stdout
    exits(cli("--pipeline", "topo_sort", model, cwd=tmp_path), 0)


def test_dump_folders_pass_by_pass(tmp_path, mlp_path):
    pipeline = "identity_elimination, cse, loss(kind=cross_entropy, output=y), autodiff"
    for name, spec in (("one", pipeline), ("two", pipeline.replace("cross_entropy", "mse"))):
        graphforge.compile(mlp_path, spec, dump_dir=tmp_path / name)
    steps = exits(cli(tmp_path / "one", "--json", cwd=tmp_path), 1)
    report = json.loads(steps.stdout)
    assert report["mode"] == "steps" and report["b"] is None
    pairs = [(s["a"]["name"], s["b"]["name"], s["identical"]) for s in report["steps"]]
    assert pairs == [
        ("input", "identity_elimination", True),
        ("identity_elimination", "cse", True),
        ("cse", "loss", False),
        ("loss", "autodiff", False),
    ]
    grad_groups = report["steps"][3]["diff"]["graph"]["groups"]
    assert grad_groups and {g["role"] for g in grad_groups} == {"grad"}

    both = exits(cli(tmp_path / "one", tmp_path / "two", cwd=tmp_path), 1)
    rows = [line for line in both.stdout.splitlines() if line.startswith("│")]
    verdicts = [row.split("│")[4].strip() for row in rows if row.split("│")[1].strip()]
    assert verdicts == ["identical", "identical", "identical", "different", "different"]
    assert "003_loss.onnx → 003_loss.onnx" in both.stdout  # details of the differing pairs
    exits(cli(tmp_path / "one", tmp_path / "one", "--brief", cwd=tmp_path), 0)


def test_dump_folders_of_pipelines_one_pass_apart_pair_by_pass(tmp_path):
    """B runs one pass more, in the middle: the passes after it still meet their counterparts
    (by number they would not: A's 002_cse would face B's 002_fold_constants)."""
    model = models.dead_and_duplicate()
    graphforge.compile(model, "identity_elimination, cse, dce", dump_dir=tmp_path / "one")
    graphforge.compile(model, "identity_elimination, fold_constants, cse, dce", dump_dir=tmp_path / "two")
    report = json.loads(exits(cli(tmp_path / "one", tmp_path / "two", "--json", cwd=tmp_path), 1).stdout)
    pairs = [
        (s["a"] and s["a"]["path"].rsplit("/", 1)[1], s["b"] and s["b"]["path"].rsplit("/", 1)[1])
        for s in report["steps"]
    ]
    assert pairs == [
        ("000_input.onnx", "000_input.onnx"),
        ("001_identity_elimination.onnx", "001_identity_elimination.onnx"),
        (None, "002_fold_constants.onnx"),
        ("002_cse.onnx", "003_cse.onnx"),
        ("003_dce.onnx", "004_dce.onnx"),
    ]
    assert report["only_a"] == [] and report["only_b"] == ["002_fold_constants.onnx"]
    assert [s["identical"] for s in report["steps"]][:3] == [True, True, None]  # no diff without a pair
    text = exits(cli(tmp_path / "one", tmp_path / "two", cwd=tmp_path), 1).stdout
    assert f"only in {tmp_path / 'two'}: 002_fold_constants.onnx" in text


def test_numeric_with_an_inputs_file(tmp_path, mlp_path):
    model = graphforge.load(mlp_path)
    changed = tmp_path / "changed.onnx"
    model.graph.initializer[5].raw_data = (np.frombuffer(model.graph.initializer[5].raw_data, np.float32) + 1).tobytes()
    graphforge.save(model, changed)
    npz = tmp_path / "x.npz"
    np.savez(npz, x=np.ones((3, 16), np.float32))
    proc = exits(cli(mlp_path, changed, "--inputs", npz, "--json", cwd=tmp_path), 1)
    numeric = json.loads(proc.stdout)["numeric"]
    assert numeric["inputs"] == {"x": {"dtype": "float32", "shape": [3, 16], "generated": False}}
    assert numeric["first_divergence"]["node"]["name"] == "/4/Gemm"
    text = exits(cli(mlp_path, changed, "--numeric", cwd=tmp_path), 1).stdout
    assert "numeric: 1 of 5 matched tensors differ; first: 'y' (Gemm '/4/Gemm')" in text
    one_line_error(cli(mlp_path, changed, "--inputs", tmp_path / "none.npz", cwd=tmp_path), "no such inputs file")


def test_seed_and_dim_set_the_generated_inputs(tmp_path, mlp_path):
    batch = graphforge.load(mlp_path).graph.input[0].type.tensor_type.shape.dim[0].dim_param
    proc = exits(cli(mlp_path, mlp_path, "--numeric", "--seed", "5", "--dim", f"{batch}=3", "--json", cwd=tmp_path), 0)
    numeric = json.loads(proc.stdout)["numeric"]
    assert numeric["seed"] == 5 and numeric["dims"] == {batch: 3} and numeric["inputs"]["x"]["shape"] == [3, 16]
    one_line_error(cli(mlp_path, mlp_path, "--dim", "seq=3", cwd=tmp_path), "no input of either model has a dimension")


def test_html_page_is_written_and_self_contained(tmp_path, pair):
    page = tmp_path / "page.html"
    proc = exits(cli(*pair, "--html", page, "--brief", cwd=tmp_path), 1)
    assert f"wrote {page}" in proc.stdout
    html = page.read_text()
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "") and "https://" not in html
    assert "<script src" not in html and "<link" not in html
    data = json.loads(html.split('<script type="application/json" id="gf-data">')[1].split("</script>")[0])
    statuses = {n["status"] for side in data["diffs"][0]["sides"] for n in side["nodes"]}
    assert {"added", "removed", "changed", "same"} <= statuses
