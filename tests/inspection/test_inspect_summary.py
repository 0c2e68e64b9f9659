"""What ``graphforge inspect`` prints of a model (graphforge.inspection.summary), table by
table, against values worked out by hand."""

from __future__ import annotations

import io

import onnx
import pytest
from onnx import helper
from rich.console import Console

from graphforge.errors import GraphforgeError
from graphforge.inspection.summary import ROLE_WIDTH, frozen_line, lora_line, roles_line, shards_table, stages_table
from graphforge.program import ProgramRoles, StagesRole


def _rendered(renderable) -> str:
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def _rows(text: str) -> list[list[str]]:
    lines = [line.replace("┃", "│") for line in text.splitlines()]
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in lines if line.count("│") >= 2]


def test_the_stages_table_shows_each_stages_share_and_sizes():
    """Shares of forward + update FLOPs (2, 2, 1 of 5 MFLOP), sizes in binary units,
    the last stage "(the rest)", and "?" where the pass reported nothing for a stage."""
    role = StagesRole(
        stages=3,
        microbatches=4,
        schedule="1f1b",
        cuts=("h1", "h[2]"),
        partial_norms=(),
        parameters=(("a", "b"), ("c",)),
        costs={
            "flops": [2e6, 1e6, 1e6],
            "update_flops": [0.0, 1e6, 0.0],
            "parameter_bytes": [2048, 1536, 512],
            "state_bytes": [4096, 3072, 1024],
            "stash_bytes": [1024, 3 * 2**20],
        },
    )
    text = _rendered(stages_table(role))
    assert text.startswith("pipeline: 3 stages × 4 micro-batches, 1f1b")
    assert _rows(text)[1:] == [
        ["0", "h1", "2", "40%", "2.0 KiB", "4.0 KiB", "1.0 KiB"],
        ["1", "h[2]", "1", "40%", "1.5 KiB", "3.0 KiB", "3.0 MiB"],  # a tensor's name, not markup
        ["2", "(the rest)", "?", "20%", "512 B", "1.0 KiB", "?"],
    ]


def test_the_roles_line_cuts_long_values_and_keeps_brackets():
    value = "x" * (ROLE_WIDTH + 1)
    line = roles_line({"graphforge.loss": "[loss]", "graphforge.state": value, "producer": "ignored"})
    assert _rendered(line).strip() == f"roles: loss=[loss], state={'x' * (ROLE_WIDTH - 1)}…"
    assert roles_line({"producer": "no role"}) is None


def test_shards_need_a_program_compiled_with_the_zero_pass():
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])],
    )
    roles = ProgramRoles.of_proto(helper.make_model(graph))
    with pytest.raises(
        GraphforgeError, match=r"^plain\.onnx: --processes needs a program compiled with the zero pass$"
    ):
        shards_table(roles, 2, "plain.onnx")


def test_the_frozen_and_lora_lines_count_what_the_roles_record():
    """tanh_mlp's w1 [4, 8] and b1 [8] frozen: 40 float32s, 160 B; then lora on w2 (rank 2,
    alpha 3: scale 1.5) freezes the rest too."""
    import models

    import graphforge

    program = graphforge.compile(models.tanh_mlp(), "loss(kind=mse, output=y), autodiff(frozen=[w1, b1])").model
    assert frozen_line(program.graph, ProgramRoles.read(program)) == "frozen: 2 weights, 160 B (2 by autodiff)"
    assert lora_line(ProgramRoles.read(program)) is None
    lora = graphforge.compile(models.tanh_mlp(), "lora(r=2, alpha=3, targets=[w2]), loss(kind=mse, output=y), autodiff")
    program_roles = ProgramRoles.read(lora.model)
    assert frozen_line(lora.model.graph, program_roles) == "frozen: 4 weights, 268 B (4 by lora)"  # 67 float32s
    assert lora_line(program_roles) == "lora: 1 adapter of rank 2, scale 1.5"
    plain = graphforge.compile(models.tanh_mlp(), "loss(kind=mse, output=y), autodiff").model
    assert frozen_line(plain.graph, ProgramRoles.read(plain)) is None
