"""The PassManager: records, verification, dumps, bisection, fixed points and failures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import models
import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

import graphforge
from graphforge import (
    GraphforgeError,
    InvalidModelError,
    Model,
    ModelSaveError,
    Pass,
    PassError,
    PassManager,
    PassResult,
    PipelineError,
    parse_pipeline,
)
from graphforge.ir import op_histogram
from graphforge.pass_manager import MAX_FIXED_POINT_ITERATIONS

FULL_PIPELINE = "identity_elimination, fold_constants, cse, dce, topo_sort"


# --------------------------------------------------------------------------- test passes


@dataclass(frozen=True)
class RemoveOneIdentity(Pass):
    """Bypass the first internal Identity node; one per run, so it needs a fixed point."""

    name = "remove_one_identity"
    repeat_to_fixed_point: ClassVar[bool] = True

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        for node in graph.nodes:
            source, result = node.inputs[0] if node.inputs else None, node.outputs[0]
            if node.op != "Identity" or any(t is result for t in graph.outputs):
                continue
            for consumer in list(result.outputs):
                for i, tensor in enumerate(consumer.inputs):
                    if tensor is result:
                        consumer.inputs[i] = source
            node.outputs.clear()
            graph.cleanup()
            return PassResult(model, True)
        return PassResult(model, False)


@dataclass(frozen=True)
class ClaimsChange(Pass):
    """Says it changed the model every time, so only the iteration cap stops it."""

    name = "claims_change"
    repeat_to_fixed_point: ClassVar[bool] = True

    def run(self, model: Model) -> PassResult:
        return PassResult(model, True)


@dataclass(frozen=True)
class Explode(Pass):
    """Raises an unexpected exception."""

    name = "explode"
    message: str = "kaboom"

    def run(self, model: Model) -> PassResult:
        raise RuntimeError(self.message)


@dataclass(frozen=True)
class MutateThenRefuse(Pass):
    """Half-rewrites the graph, then refuses with a PassError naming a node."""

    name = "mutate_then_refuse"

    def run(self, model: Model) -> PassResult:
        model.graph.nodes.clear()
        model.graph.outputs.clear()
        raise PassError("cannot handle this", node="relu_1", op_type="Relu")


@dataclass(frozen=True)
class DropNeg(Pass):
    """Removes Neg nodes everywhere, subgraphs included: their readers read the Neg's input."""

    name = "drop_neg"

    def run(self, model):
        for graph in [model.graph, *model.graph.subgraphs(recursive=True)]:
            for node in [n for n in graph.nodes if n.op == "Neg"]:
                source, out = node.inputs[0], node.outputs[0]
                for reader in list(out.outputs):
                    reader.inputs = [source if t is out else t for t in reader.inputs]
                node.outputs.clear()
                graph.nodes.remove(node)
        return PassResult(model, True)


@dataclass(frozen=True)
class ReturnsNothing(Pass):
    name = "returns_nothing"

    def run(self, model: Model):
        return None


@dataclass(frozen=True)
class AddUnknownOp(Pass):
    """Leaves an invalid graph: a node whose op no opset defines."""

    name = "add_unknown_op"

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        x = graph.inputs[0]
        graph.nodes.append(gs.Node("NoSuchOp", name="bogus", inputs=[x], outputs=[gs.Variable("bogus_out")]))
        return PassResult(model, True)


@dataclass(frozen=True)
class Unexportable(Pass):
    """Leaves a graph onnx-graphsurgeon cannot export (an attribute of no ONNX type)."""

    name = "unexportable"

    def run(self, model: Model) -> PassResult:
        model.graph.nodes[0].attrs["weird"] = object()
        return PassResult(model, True)


@dataclass(frozen=True)
class RenameConstants(Pass):
    """Renames every initializer, as a pass that namespaces what it makes might."""

    name = "rename_constants"

    def run(self, model: Model) -> PassResult:
        for tensor in model.graph.tensors().values():
            if isinstance(tensor, gs.Constant):
                tensor.name = f"renamed/{tensor.name}"
        return PassResult(model, True)


@dataclass(frozen=True)
class RenameAndExportItself(Pass):
    """Renames every initializer, then exports the graph with onnx-graphsurgeon itself (which
    renames the TensorProto each constant is read from), as a pass handing its graph to a
    helper might."""

    name = "rename_and_export_itself"

    def run(self, model: Model) -> PassResult:
        RenameConstants().run(model)
        gs.export_onnx(model.graph, do_type_check=False)
        return PassResult(model, True)


@dataclass(frozen=True)
class Spy(Pass):
    """Counts its runs."""

    name = "spy"
    runs: ClassVar[list[int]] = []

    def run(self, model: Model) -> PassResult:
        self.runs.append(len(model.graph.nodes))
        return PassResult(model, False)


def passes(text: str) -> list[Pass]:
    return parse_pipeline(text)


def summary(result) -> list[tuple]:
    return [
        (r.index, r.position, r.name, r.spec, r.iteration, r.ran, r.changed, r.nodes_before, r.nodes_after, r.delta)
        for r in result.records
    ]


def ops(proto: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in proto.graph.node]


def same_model(a: onnx.ModelProto, b: onnx.ModelProto) -> bool:
    return a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


# --------------------------------------------------------------------------- records


def test_records_count_nodes_and_op_deltas():
    result = PassManager(passes("dce, cse, topo_sort")).run(models.dead_and_duplicate())
    assert summary(result) == [
        (1, 1, "dce", "dce", 1, True, True, 4, 3, {"Neg": -1}),
        (2, 2, "cse", "cse", 1, True, True, 3, 2, {"Relu": -1}),
        (3, 3, "topo_sort", "topo_sort", 1, True, False, 2, 2, {}),
    ]
    assert ops(result.model) == ["Relu", "Add"]
    assert [o.name for o in result.model.graph.output] == ["y"]
    for record in result.records:
        assert record.seconds > 0
        assert (record.verify_seconds > 0) == record.changed, "only a changed model is verified again"
        assert record.dumped_to is None
    assert result.seconds == pytest.approx(sum(r.seconds + r.verify_seconds for r in result.records))


def test_records_show_the_spec_with_parameters():
    result = PassManager(passes("dce(remove_unused_inputs=true)")).run(models.dead_and_duplicate())
    assert result.records[0].name == "dce"
    assert result.records[0].spec == "dce(remove_unused_inputs=true)"


def test_the_compiled_model_computes_what_the_input_did():
    source = models.dead_and_duplicate()
    result = graphforge.compile(source, FULL_PIPELINE, verify_with_ort=True)
    onnx.checker.check_model(result.model, full_check=True)
    models.assert_same_outputs(source, result.model, dims={"N": 5})


@pytest.mark.parametrize("form", ["path", "bytes", "proto", "model"])
def test_every_source_form_gives_the_same_result_and_stays_untouched(tmp_path, form):
    proto = models.dead_and_duplicate()
    original = proto.SerializeToString()
    path = graphforge.save(proto, tmp_path / "in.onnx")
    model = Model.from_proto(proto)
    source = {"path": path, "bytes": path.read_bytes(), "proto": proto, "model": model}[form]
    result = PassManager(passes("dce, cse")).run(source)
    assert ops(result.model) == ["Relu", "Add"]
    assert proto.SerializeToString() == original, "the caller's ModelProto is untouched"
    assert [n.op for n in model.graph.nodes] == ["Relu", "Relu", "Add", "Neg"], "the caller's Model is untouched"


@pytest.mark.parametrize(
    "before, after",
    [("", ""), ("dce", "cse"), ("topo_sort", None)],
    ids=["renamed by the last pass", "renamed between two passes", "nothing changed (no renaming)"],
)
def test_a_model_proto_is_read_in_place_and_never_changed_or_handed_back(before, after):
    # the PassManager reads a caller's ModelProto without copying it (its weights), so neither
    # an export (onnx-graphsurgeon renames the TensorProto it writes from) nor a pipeline that
    # changes nothing may touch it, and the result is always a model of its own
    proto = models.tied_initializer()
    original = proto.SerializeToString()
    renames = after is not None

    def some(text: str) -> list[Pass]:
        return passes(text) if text else []

    pipeline = some(before) + ([RenameConstants(), *some(after)] if renames else [])
    result = PassManager(pipeline, verify=True).run(proto)
    assert proto.SerializeToString() == original
    assert result.model is not proto
    assert all(t.name.startswith("renamed/") == renames for t in result.model.graph.initializer)
    models.assert_same_outputs(proto, result.model, dims={"N": 3})


#: a weight large enough to be read in place (W, 8 KiB), a small one, and a Constant node
WEIGHTED = """
<ir_version: 8, opset_import: ["" : 17]>
weighted (float[N, 64] x) => (float[N, 32] y)
<float[32] b = {BIAS}>
{
    t = MatMul(x, W)
    two = Constant <value = float[1] {2.0}> ()
    four = Mul(two, two)
    u = Mul(t, four)
    y = Add(u, b)
}
"""


@pytest.mark.parametrize(
    "pipeline",
    [lambda: passes("fold_constants, dce"), lambda: [RenameAndExportItself(), *passes("cse")]],
    ids=["fold_constants, dce", "rename_and_export_itself, cse"],
)
def test_a_model_proto_read_in_place_survives_exports_other_than_the_model_s_own(pipeline):
    # fold_constants hands the graph to onnx-graphsurgeon's folding, whose export names the
    # Constant node's tensor; a pass may rename a weight and export the graph itself
    proto = onnx.parser.parse_model(WEIGHTED.replace("BIAS", ", ".join(str(i / 32) for i in range(32))))
    weight = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    proto.graph.initializer.append(onnx.numpy_helper.from_array(weight, "W"))
    original = proto.SerializeToString()
    result = PassManager(pipeline()).run(proto)
    assert proto.SerializeToString() == original
    models.assert_same_outputs(proto, result.model, dims={"N": 3})


def test_compile_accepts_text_or_pass_objects():
    from_text = graphforge.compile(models.dead_and_duplicate(), "dce, cse")
    from_objects = graphforge.compile(models.dead_and_duplicate(), passes("dce, cse"))
    from_manager = PassManager.from_pipeline("dce, cse").run(models.dead_and_duplicate())
    assert same_model(from_text.model, from_objects.model)
    assert same_model(from_text.model, from_manager.model)


def test_an_empty_pass_list_returns_the_input():
    source = models.dead_and_duplicate()
    result = PassManager([]).run(source)
    assert result.records == []
    assert same_model(result.model, source)


def test_model_metadata_survives_the_pipeline():
    source = models.dead_and_duplicate()
    source.metadata_props.add(key="graphforge.role", value="forward")
    source.doc_string = "a model"
    result = graphforge.compile(source, "dce, cse")
    assert {p.key: p.value for p in result.model.metadata_props} == {"graphforge.role": "forward"}
    assert result.model.doc_string == "a model"


def test_op_histogram_counts_subgraph_nodes():
    model = models.parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        with_if (bool cond, float[4] x) => (float[4] y) {
            y = If(cond) <
                then_branch = then_g () => (float[4] t) { t = Relu(x) },
                else_branch = else_g () => (float[4] e) { n = Neg(x)  e = Relu(n) }
            >
        }
        """
    )
    assert op_histogram(model) == {"If": 1, "Neg": 1, "Relu": 2}
    result = graphforge.compile(model, [DropNeg()])  # the records count what the histogram counts
    assert (result.records[0].nodes_before, result.records[0].nodes_after) == (4, 3)
    assert result.records[0].delta == {"Neg": -1}


# --------------------------------------------------------------------------- dumps


def test_dump_dir_holds_the_input_and_every_application(tmp_path):
    dump = tmp_path / "dumps" / "nested"  # created, parents included
    result = PassManager(passes("dce, cse, topo_sort"), dump_dir=dump).run(models.dead_and_duplicate())
    names = sorted(p.name for p in dump.iterdir())
    assert names == ["000_input.onnx", "001_dce.onnx", "002_cse.onnx", "003_topo_sort.onnx"]
    assert [r.dumped_to for r in result.records] == [str(dump / n) for n in names[1:]]
    counts = [len(graphforge.load(dump / n).graph.node) for n in names]
    assert counts == [4, 3, 2, 2]
    for name in names:
        onnx.checker.check_model(str(dump / name), full_check=True)
    assert same_model(graphforge.load(dump / "003_topo_sort.onnx"), graphforge.load(dump / "002_cse.onnx"))


def test_dump_on_change_writes_only_the_applications_that_changed(tmp_path):
    dump = tmp_path / "dumps"
    source = models.parse(models.DEAD_AND_DUPLICATE.replace("y = Add(a, b)", "y = Add(a, b)\n u2 = Neg(x)"))
    result = PassManager(
        passes("topo_sort, dce, identity_elimination, cse, dce"), dump_dir=dump, dump_on_change=True
    ).run(source)
    assert [r.changed for r in result.records] == [False, True, False, True, False]
    # the input too: the first change is compared with it
    assert sorted(p.name for p in dump.iterdir()) == ["000_input.onnx", "002_dce.onnx", "004_cse.onnx"]
    assert same_model(graphforge.load(dump / "000_input.onnx"), source)
    assert [r.dumped_to is not None for r in result.records] == [False, True, False, True, False]


def test_an_invalid_input_creates_no_dump_folder(tmp_path):
    dump = tmp_path / "dumps"
    with pytest.raises(InvalidModelError, match="the input model"):
        PassManager(passes("dce"), dump_dir=dump).run(models.invalid_model())
    assert not dump.exists()


def test_dump_dir_that_cannot_be_created_is_a_graphforge_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ModelSaveError, match=r"cannot create the dump folder"):
        PassManager(passes("dce"), dump_dir=blocker / "dumps").run(models.dead_and_duplicate())


# --------------------------------------------------------------------------- bisection


@pytest.mark.parametrize("limit", [0, 1, 2, 3, 4])
def test_bisect_limit_runs_only_the_first_n_applications(tmp_path, limit):
    text = ["identity_elimination", "dce", "cse"]
    source = models.parse(models.DEAD_AND_DUPLICATE.replace("a = Relu(x)", "i = Identity(x)\n a = Relu(i)"))
    dump = tmp_path / "dumps"
    result = PassManager(passes(", ".join(text)), bisect_limit=limit, dump_dir=dump).run(source)
    ran = min(limit, 3)
    assert [r.ran for r in result.records] == [True] * ran + [False] * (3 - ran)
    assert [r.index for r in result.records] == [1, 2, 3]
    skipped = result.records[ran:]
    assert all(not r.changed and r.seconds == 0 and r.dumped_to is None for r in skipped)
    expected = PassManager(passes(", ".join(text[:ran])) if ran else []).run(source)
    assert same_model(result.model, expected.model)
    assert len(list(dump.iterdir())) == 1 + ran


def test_bisect_limit_must_not_be_negative():
    with pytest.raises(GraphforgeError, match=r"^bisect limit must be 0 or more, got -1$"):
        PassManager(passes("dce"), bisect_limit=-1)


# --------------------------------------------------------------------------- fixed points


def test_a_fixed_point_pass_repeats_until_nothing_changes(tmp_path):
    source = models.identity_chain()
    dump = tmp_path / "dumps"
    result = PassManager([RemoveOneIdentity(), *passes("dce")], dump_dir=dump).run(source)
    assert [(r.index, r.position, r.iteration, r.changed, r.nodes_after) for r in result.records] == [
        (1, 1, 1, True, 3),
        (2, 1, 2, True, 2),
        (3, 1, 3, True, 1),
        (4, 1, 4, False, 1),
        (5, 2, 1, False, 1),
    ]
    assert all(r.delta == {"Identity": -1} for r in result.records[:3])
    assert ops(result.model) == ["Relu"]
    models.assert_same_outputs(source, result.model)
    assert sorted(p.name for p in dump.iterdir()) == [
        "000_input.onnx",
        "001_remove_one_identity.onnx",
        "002_remove_one_identity.onnx",
        "003_remove_one_identity.onnx",
        "004_remove_one_identity.onnx",
        "005_dce.onnx",
    ]


def test_a_pass_without_fixed_point_runs_once():
    @dataclass(frozen=True)
    class RemoveOnce(RemoveOneIdentity):
        name = "remove_once"
        repeat_to_fixed_point: ClassVar[bool] = False

    result = PassManager([RemoveOnce()]).run(models.identity_chain())
    assert [(r.iteration, r.changed) for r in result.records] == [(1, True)]
    assert ops(result.model).count("Identity") == 2


def test_a_fixed_point_stops_at_the_iteration_cap():
    result = PassManager([ClaimsChange(), *passes("dce")]).run(models.identity_chain())
    assert len(result.records) == MAX_FIXED_POINT_ITERATIONS + 1
    assert [r.iteration for r in result.records[:-1]] == list(range(1, MAX_FIXED_POINT_ITERATIONS + 1))
    assert result.records[-1].name == "dce" and result.records[-1].position == 2


def test_bisect_limit_counts_fixed_point_iterations():
    result = PassManager([RemoveOneIdentity(), *passes("dce")], bisect_limit=2).run(models.identity_chain())
    assert [(r.index, r.name, r.iteration, r.ran) for r in result.records] == [
        (1, "remove_one_identity", 1, True),
        (2, "remove_one_identity", 2, True),
        (3, "remove_one_identity", 3, False),
        (4, "dce", 1, False),
    ]
    assert ops(result.model).count("Identity") == 1


# --------------------------------------------------------------------------- failures


def test_a_raising_pass_names_position_and_pass_and_leaves_its_input_in_the_dump(tmp_path):
    source = models.dead_and_duplicate()
    original = source.SerializeToString()
    dump = tmp_path / "dumps"
    manager = PassManager([*passes("dce"), Explode(), *passes("cse")], dump_dir=dump)
    with pytest.raises(PipelineError) as info:
        manager.run(source)
    error = info.value
    failed_input = dump / "002_explode.failed-input.onnx"
    assert str(error) == (
        f"pass 2 (explode) failed: internal error RuntimeError: kaboom [its input model is in {failed_input}]"
    )
    assert (error.position, error.pass_name, error.dumped_to) == (2, "explode", str(failed_input))
    assert isinstance(error.__cause__, RuntimeError)
    assert sorted(p.name for p in dump.iterdir()) == ["000_input.onnx", "001_dce.onnx", failed_input.name]
    assert failed_input.read_bytes() == (dump / "001_dce.onnx").read_bytes(), "the dump is the failing pass's input"
    assert source.SerializeToString() == original


def test_a_refusing_pass_that_half_rewrote_the_graph_dumps_its_untouched_input(tmp_path):
    dump = tmp_path / "dumps"
    manager = PassManager([MutateThenRefuse(), *passes("dce")], dump_dir=dump)
    with pytest.raises(PipelineError) as info:
        manager.run(models.dead_and_duplicate())
    failed_input = dump / "001_mutate_then_refuse.failed-input.onnx"
    assert str(info.value) == (
        "pass 1 (mutate_then_refuse) failed: cannot handle this (node 'relu_1', op Relu)"
        f" [its input model is in {failed_input}]"
    )
    assert failed_input.read_bytes() == (dump / "000_input.onnx").read_bytes()
    assert len(graphforge.load(failed_input).graph.node) == 4


@pytest.mark.parametrize(
    ("node", "op_type", "message"),
    [
        ("relu_1", "Relu", "refused (node 'relu_1', op Relu)"),
        ("relu_1", None, "refused (node 'relu_1')"),
        (None, "Relu", "refused (op Relu)"),
        (None, None, "refused"),
    ],
)
def test_pass_error_names_the_node_and_op_it_has(node, op_type, message):
    error = PassError("refused", node=node, op_type=op_type)
    assert str(error) == message
    assert (error.node, error.op_type) == (node, op_type)
    assert isinstance(error, GraphforgeError)


def test_a_failing_pass_without_a_dump_dir_names_no_file():
    with pytest.raises(PipelineError) as info:
        PassManager([*passes("dce, cse"), Explode(message="bad things")]).run(models.dead_and_duplicate())
    assert str(info.value) == "pass 3 (explode(message='bad things')) failed: internal error RuntimeError: bad things"
    assert info.value.dumped_to is None and info.value.position == 3


def test_a_pass_returning_something_else_than_a_pass_result_fails_cleanly():
    with pytest.raises(PipelineError) as info:
        PassManager([ReturnsNothing()]).run(models.dead_and_duplicate())
    assert str(info.value) == (
        "pass 1 (returns_nothing) failed: internal error TypeError: "
        "run() must return PassResult(model, changed), got NoneType"
    )


def test_a_pass_leaving_an_invalid_graph_fails_verification(tmp_path):
    dump = tmp_path / "dumps"
    with pytest.raises(PipelineError) as info:
        PassManager([*passes("dce"), AddUnknownOp()], dump_dir=dump).run(models.dead_and_duplicate())
    message = str(info.value)
    assert message.startswith("the output of pass 2 (add_unknown_op) is not a valid ONNX model: ")
    assert "NoSuchOp" in message
    assert message.endswith(f" [its input model is in {dump / '002_add_unknown_op.failed-input.onnx'}]")
    assert "\n" not in message
    assert (info.value.position, info.value.pass_name) == (2, "add_unknown_op")
    assert isinstance(info.value.__cause__, InvalidModelError)
    assert sorted(p.name for p in dump.iterdir()) == [
        "000_input.onnx",
        "001_dce.onnx",
        "002_add_unknown_op.failed-input.onnx",
        "002_add_unknown_op.invalid-output.onnx",
    ]
    assert "NoSuchOp" in ops(graphforge.load(dump / "002_add_unknown_op.invalid-output.onnx"))


def test_verify_false_lets_an_invalid_result_through():
    result = PassManager([AddUnknownOp()], verify=False).run(models.dead_and_duplicate())
    assert "NoSuchOp" in ops(result.model)
    assert result.records[0].changed


def test_a_pass_leaving_an_unexportable_graph_fails_cleanly(tmp_path):
    dump = tmp_path / "dumps"
    with pytest.raises(PipelineError) as info:
        PassManager([Unexportable()], dump_dir=dump).run(models.dead_and_duplicate())
    assert str(info.value).startswith("pass 1 (unexportable) failed: its output cannot be exported to ONNX (")
    assert info.value.dumped_to == str(dump / "001_unexportable.failed-input.onnx")


def test_an_invalid_input_model_fails_before_any_pass_runs(tmp_path):
    Spy.runs.clear()
    dump = tmp_path / "dumps"
    with pytest.raises(InvalidModelError) as info:
        PassManager([Spy()], dump_dir=dump).run(models.invalid_model())
    assert str(info.value).startswith("the input model is not a valid ONNX model: ")
    assert Spy.runs == []
    assert not dump.exists() or list(dump.iterdir()) == []
    # without verification the pass does run
    PassManager([Spy()], verify=False).run(models.invalid_model())
    assert Spy.runs == [1]


def test_verify_with_ort_also_checks_the_input():
    result = PassManager(passes("dce"), verify_with_ort=True).run(models.dead_and_duplicate())
    assert result.records[0].changed


# --------------------------------------------------------------------------- exported models


@pytest.mark.parametrize("fixture", ["mlp_path", "transformer_path", "external_data_path"])
def test_exported_models_compile_to_the_same_function(request, fixture):
    path = request.getfixturevalue(fixture)
    result = graphforge.compile(path, FULL_PIPELINE)
    assert [r.name for r in result.records] == FULL_PIPELINE.split(", ")
    models.assert_same_outputs(path, result.model, dims={"batch": 3, "seq": 7})
    models.assert_same_outputs(path, result.model, seeds=(2,), dims={"batch": 1, "seq": 4})
    inputs = {
        i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in result.model.graph.input
    }
    source = graphforge.load(path)
    assert inputs == {
        i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in source.graph.input
    }, "dynamic dims stay dynamic"


def test_the_transformer_shrinks_and_keeps_its_parameters(transformer_path):
    source = graphforge.load(transformer_path)
    result = graphforge.compile(source, FULL_PIPELINE, verify_with_ort=True)
    assert any(r.changed for r in result.records)
    assert len(result.model.graph.node) < len(source.graph.node)
    params = {t.name for t in source.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    assert params <= {t.name for t in result.model.graph.initializer}, "parameters are never folded away"
    feeds = models.random_inputs(source, dims={"batch": 2, "seq": 5})
    (logits,) = models.run(result.model, feeds).values()
    assert logits.shape == (2, 5, 64) and np.isfinite(logits).all()


def test_compiled_exports_match_pytorch(mlp_path, transformer_path):
    torch = pytest.importorskip("torch")
    for path, module, dims in [
        (mlp_path, models.mlp_module(), {"batch": 5}),
        (transformer_path, models.gpt2_module(), {"batch": 2, "seq": 6}),
    ]:
        compiled = graphforge.compile(path, FULL_PIPELINE).model
        feeds = models.random_inputs(compiled, seed=3, dims=dims)
        (actual,) = models.run(compiled, feeds).values()
        with torch.no_grad():
            expected = module(*(torch.from_numpy(v) for v in feeds.values())).numpy()
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
