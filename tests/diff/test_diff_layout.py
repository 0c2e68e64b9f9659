"""The page's layout: Graphviz dot where it is installed, networkx's multipartite layout where
it is not (simulated here by hiding the ``dot`` binary)."""

from __future__ import annotations

import itertools
import random

import networkx as nx
import pytest
from _diff_fixtures import STATUS_A, STATUS_B, parse

from graphforge.diff import diff_models
from graphforge.diff import layout as layout_module
from graphforge.diff.html import diff_data
from graphforge.diff.layout import Box, layout


@pytest.fixture
def no_dot(monkeypatch):
    """As on a machine without Graphviz: ``dot`` is not on PATH."""
    real_which = layout_module.shutil.which
    monkeypatch.setattr(
        layout_module.shutil, "which", lambda name, *a, **k: None if name == "dot" else real_which(name)
    )
    assert layout_module.dot_version() is None


def _overlap(a: Box, b: Box) -> bool:
    return abs(a.x - b.x) * 2 < a.width + b.width and abs(a.y - b.y) * 2 < a.height + b.height


def test_without_dot_the_layout_is_networkx_multipartite(no_dot):
    rng = random.Random(3)
    dag = nx.gnp_random_graph(40, 0.08, seed=3, directed=True)
    edges = [(f"n{u}", f"n{v}") for u, v in dag.edges if u < v]  # acyclic
    edges += [("n5", "n4"), ("n4", "n5")]  # and one cycle, collapsed into one row
    boxes = [Box(f"n{i}", rng.uniform(60, 180), 34.0) for i in range(40)]
    found = layout(boxes, edges)
    assert found.engine == "networkx" and "networkx (multipartite" in found.note and "dot" in found.note
    assert set(found.boxes) == {b.id for b in boxes} and len(found.edges) == len(edges)
    placed = list(found.boxes.values())
    assert not [(a.id, b.id) for a, b in itertools.combinations(placed, 2) if _overlap(a, b)]
    for box in placed:  # inside the drawing
        assert box.width / 2 <= box.x <= found.width - box.width / 2
        assert box.height / 2 <= box.y <= found.height - box.height / 2
    for s, t in edges:  # rows follow the topological generations: every edge points down
        if {s, t} != {"n4", "n5"}:
            assert found.boxes[s].y < found.boxes[t].y, (s, t)
    assert found.boxes["n4"].y == found.boxes["n5"].y


def test_the_page_is_drawn_with_networkx_when_dot_is_missing(no_dot):
    data = diff_data("a → b", diff_models(parse(STATUS_A), parse(STATUS_B)))
    for side in data["sides"]:
        assert side["engine"] == "networkx" and side["note"].startswith("laid out by networkx")
        assert {n["status"] for n in side["nodes"]} >= {"same", "changed"}


@pytest.mark.skipif(layout_module.dot_version() is None, reason="Graphviz dot is not installed here")
def test_with_dot_the_layout_is_graphviz():
    found = layout([Box("a", 80, 34), Box("b", 80, 34)], [("a", "b")])
    assert found.engine == "dot" and found.boxes["a"].y < found.boxes["b"].y


def test_the_changes_list_names_changes_the_drawing_cannot_show():
    """A change only inside a function body (or a subgraph) leaves the drawn main graph
    unchanged: the page's list names it, with where it is."""
    from _diff_fixtures import FUNCTION_MODEL

    before = parse(FUNCTION_MODEL)
    after = parse(FUNCTION_MODEL.replace("b = Relu(c)", "b = LeakyRelu<alpha = 0.2>(c)"))
    data = diff_data("f", diff_models(before, after))
    assert {n["status"] for side in data["sides"] for n in side["nodes"]} == {"same"}
    (entry,) = data["elsewhere"]
    assert entry["where"] == "function local::twice" and entry["status"] == "changed"
    assert entry["label"] == "Relu #1 → LeakyRelu #1" and entry["detail"]["fields"] == ["op_type", "attributes"]
