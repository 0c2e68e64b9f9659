"""Passes checked through the diff engine: what each one added and removed, as a histogram of
op types, and nothing else; a failure prints the diff report, which names the node and field.

(tests/passes/ checks each pass against its own oracle; these assert its whole footprint.)
"""

from __future__ import annotations

from collections import Counter

import onnx
import pytest
from _diff_fixtures import STATUS_A, copy, parse

import graphforge
from graphforge.diff import assert_models_equal, diff_models, origin_of
from graphforge.diff.result import ModelDiff

LOSS = "loss(kind=cross_entropy, output=y)"


def delta(diff: ModelDiff) -> dict[str, int]:
    return {c.op: c.b - c.a for c in diff.histogram}


def grouped(diff: ModelDiff, side: str) -> dict[str | None, int]:
    """How many of the unmatched nodes of ``side`` each origin role's groups hold."""
    counts: Counter[str | None] = Counter()
    for group in diff.graph.groups:
        counts[group.role] += len(group.a if side == "a" else group.b)
    return dict(counts)


def explained(diff: ModelDiff, message: str = "") -> str:
    return f"{message}\n{diff.to_text()}"


@pytest.fixture(scope="module")
def programs(mlp_path) -> dict[str, onnx.ModelProto]:
    """The MLP after each stage of a training pipeline, one pass at a time."""
    stages = {"forward": graphforge.load(mlp_path)}
    stages["loss"] = graphforge.compile(stages["forward"], LOSS).model
    stages["autodiff"] = graphforge.compile(stages["loss"], "autodiff").model
    stages["sgd"] = graphforge.compile(stages["autodiff"], "sgd(lr=0.1)").model
    stages["pruned"] = graphforge.compile(stages["sgd"], "prune(outputs=y)").model
    return stages


def test_topo_sort_only_reorders():
    """A shuffled graph and its sort differ in node order alone: every node matched to the
    same node, nothing added, removed or changed (order is not part of the structure)."""
    ordered = parse(STATUS_A)
    shuffled = copy(ordered)
    nodes = list(reversed(ordered.graph.node))
    del shuffled.graph.node[:]
    shuffled.graph.node.extend(nodes)  # copies them
    result = graphforge.compile(shuffled, "topo_sort", verify=False)  # the shuffled input fails the checker
    diff = diff_models(shuffled, result.model, allow_invalid=True)
    assert diff.identical, explained(diff)
    assert diff.problems["a"] is not None and diff.problems["b"] is None  # sorted: valid now
    g = diff.graph
    after = result.model.graph.node
    assert g.matched == len(nodes) and all(nodes[a].name == after[b].name for a, b in g.node_pairs.items())
    assert any(a != b for a, b in g.node_pairs.items())  # the order did change


@pytest.mark.parametrize("spec", ["topo_sort", "dce", "identity_elimination", "cse", "fold_constants"])
def test_passes_with_nothing_to_do_leave_the_mlp_identical(mlp_path, spec):
    """Must-not-fire: an exported MLP has no dead node, no duplicate, no foldable constant."""
    assert_models_equal(mlp_path, graphforge.compile(mlp_path, spec).model)


def test_loss_adds_its_nodes_an_input_and_an_output(programs):
    diff = diff_models(programs["forward"], programs["loss"])
    g = diff.graph
    assert delta(diff) == {"LogSoftmax": 1, "NegativeLogLikelihoodLoss": 1, "Identity": 1}, explained(diff)
    assert not g.removed and not g.changed, explained(diff)
    assert grouped(diff, "b") == {"loss": 3}  # every new node named loss::
    assert [(c.status, c.b["name"]) for c in g.inputs] == [("added", "labels")]
    assert [(c.status, c.b["name"]) for c in g.outputs] == [("added", "loss")]
    assert {f.key for f in diff.model} == {"graphforge.loss", "graphforge.labels"}


def test_an_optimizer_adds_one_update_per_parameter_and_touches_nothing(programs):
    diff = diff_models(programs["autodiff"], programs["sgd"])
    g = diff.graph
    parameters = [
        p for p in programs["autodiff"].graph.initializer if f"{p.name}_grad" in _outputs(programs["autodiff"])
    ]
    assert not g.removed and not g.changed and all(d > 0 for d in delta(diff).values()), explained(diff)
    assert delta(diff)["Sub"] == len(parameters) == 6  # P - lr * grad, once per parameter
    assert grouped(diff, "b") == {"optim": len(g.added)}  # every new node named optim::
    added_outputs = {c.b["name"] for c in g.outputs if c.status == "added"}
    assert {f"{p.name}_next" for p in parameters} <= added_outputs
    assert {c.b["name"] for c in g.inputs if c.status == "added"} == {"lr", "step"}
    recorded = graphforge.compile(programs["autodiff"], "sgd(lr=0.1)").records[0].delta
    assert delta(diff) == {op: n for op, n in recorded.items() if n}  # the pass manager's own count


def test_prune_removes_every_training_node_and_gives_the_forward_graph_back(programs):
    diff = diff_models(programs["sgd"], programs["pruned"])
    g = diff.graph
    assert not g.added and not g.changed, explained(diff)
    assert all(origin_of(n.name) is not None for n in g.removed), [n.name for n in g.removed if not origin_of(n.name)]
    assert set(grouped(diff, "a")) == {"loss", "grad", "optim"} and sum(grouped(diff, "a").values()) == len(g.removed)
    trained = diff_models(programs["forward"], programs["sgd"])
    assert delta(diff) == {op: -n for op, n in delta(trained).items()}  # exactly what the pipeline added
    back = diff_models(programs["forward"], programs["pruned"])
    assert back.structurally_identical, explained(back)


def _outputs(model: onnx.ModelProto) -> set[str]:
    return {o.name for o in model.graph.output}
