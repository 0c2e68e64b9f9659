"""Layered graph layout: Graphviz ``dot`` through the ``graphviz`` package, else networkx's
``multipartite_layout`` over the topological generations (where ``dot`` is missing, fails, or
the drawing is too large for it); both give boxes and edge paths in pixels."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field

import networkx as nx

#: dot takes seconds above this many boxes; bigger drawings use the fallback
MAX_DOT_NODES = 1200
_DPI = 72.0
_ROW_GAP = 70.0
_COLUMN_GAP = 24.0


@dataclass
class Box:
    id: str
    width: float  # pixels
    height: float
    x: float = 0.0  # centre
    y: float = 0.0


@dataclass
class Layout:
    boxes: dict[str, Box]
    edges: list[tuple[str, str, str]]  # (source id, target id, SVG path)
    width: float
    height: float
    engine: str  # "dot" or "networkx"
    note: str = ""
    warnings: list[str] = field(default_factory=list)


def dot_version() -> str | None:
    """Graphviz's version when both the Python binding and the ``dot`` binary are there."""
    try:
        import graphviz
    except ImportError:
        return None
    if shutil.which("dot") is None:
        return None
    try:
        return ".".join(map(str, graphviz.version()))
    except Exception:
        return None


def layout(boxes: list[Box], edges: list[tuple[str, str]]) -> Layout:
    if not boxes:
        return Layout({}, [], 0.0, 0.0, "none")
    why = None
    version = dot_version()
    if version is None:
        why = "Graphviz 'dot' is not installed (apt-get install graphviz; pip install graphviz)"
    elif len(boxes) > MAX_DOT_NODES:
        why = f"{len(boxes)} boxes is more than dot lays out quickly ({MAX_DOT_NODES})"
    else:
        try:
            found = dot_layout(boxes, edges)
            found.note = f"laid out by Graphviz dot {version}"
            return found
        except Exception as exc:  # a dot crash or timeout must not lose the page
            why = f"Graphviz dot failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    found = layered_layout(boxes, edges)
    found.note = f"laid out by networkx (multipartite layout of the topological generations): {why}"
    return found


def dot_layout(boxes: list[Box], edges: list[tuple[str, str]]) -> Layout:
    import graphviz

    lines = [
        "digraph G {",
        '  graph [rankdir=TB, nodesep=0.25, ranksep=0.45, splines=true, outputorder="edgesfirst"];',
        '  node [shape=box, fixedsize=true, label=""];',
    ]
    for box in boxes:
        lines.append(f'  "{box.id}" [width={box.width / _DPI:.3f}, height={box.height / _DPI:.3f}];')
    lines += [f'  "{s}" -> "{t}";' for s, t in edges]
    lines.append("}")
    plain = graphviz.pipe("dot", "plain", "\n".join(lines).encode(), quiet=True).decode()
    by_id = {b.id: b for b in boxes}
    height = 0.0
    width = 0.0
    placed: dict[str, Box] = {}
    paths: list[tuple[str, str, str]] = []
    raw_edges: list[tuple[str, str, list[float]]] = []
    for line in plain.splitlines():
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "graph":
            width, height = float(parts[2]) * _DPI, float(parts[3]) * _DPI
        elif parts[0] == "node":
            name = parts[1].strip('"')
            box = by_id[name]
            placed[name] = Box(name, box.width, box.height, float(parts[2]) * _DPI, float(parts[3]) * _DPI)
        elif parts[0] == "edge":
            tail, head, count = parts[1].strip('"'), parts[2].strip('"'), int(parts[3])
            raw_edges.append((tail, head, [float(v) * _DPI for v in parts[4 : 4 + 2 * count]]))
    for box in placed.values():  # dot's y grows upwards, SVG's downwards
        box.y = height - box.y
    for tail, head, coords in raw_edges:
        points = [(coords[i], height - coords[i + 1]) for i in range(0, len(coords), 2)]
        d = f"M{points[0][0]:.1f},{points[0][1]:.1f}"
        for k in range(1, len(points) - 2, 3):
            (x1, y1), (x2, y2), (x3, y3) = points[k : k + 3]
            d += f" C{x1:.1f},{y1:.1f} {x2:.1f},{y2:.1f} {x3:.1f},{y3:.1f}"
        paths.append((tail, head, d))
    return Layout(placed, paths, width, height, "dot")


def layered_layout(boxes: list[Box], edges: list[tuple[str, str]]) -> Layout:
    """networkx's multipartite layout, one row per topological generation (cycles collapsed
    first), boxes in their given order within a row; its grid scaled so no two boxes overlap."""
    g = nx.DiGraph()
    g.add_nodes_from(b.id for b in boxes)
    g.add_edges_from(edges)
    condensed = nx.condensation(g)
    order = {b.id: k for k, b in enumerate(boxes)}
    rows: dict[int, list[str]] = {}
    for level, generation in enumerate(nx.topological_generations(condensed)):
        members = [m for component in generation for m in condensed.nodes[component]["members"]]
        rows[level] = sorted(members, key=order.__getitem__)
    pos = nx.multipartite_layout(g, subset_key=rows, align="horizontal")
    unit = _grid_unit(pos, rows)
    by_id = {b.id: b for b in boxes}
    widest = max(b.width for b in boxes)
    tallest = max(b.height for b in boxes)
    sx = (widest + _COLUMN_GAP) / unit  # neighbours in a row are one grid unit apart
    sy = (tallest + _ROW_GAP) / unit
    left = min(float(pos[i][0]) for i in by_id) * sx - widest / 2 - _COLUMN_GAP
    top = min(float(pos[i][1]) for i in by_id) * sy - tallest / 2 - _ROW_GAP / 2
    placed = {
        i: Box(i, b.width, b.height, float(pos[i][0]) * sx - left, float(pos[i][1]) * sy - top)
        for i, b in by_id.items()
    }
    width = max(b.x + widest / 2 for b in placed.values()) + _COLUMN_GAP
    height = max(b.y + tallest / 2 for b in placed.values()) + _ROW_GAP / 2
    paths = []
    for s, t in edges:
        a, b = placed[s], placed[t]
        y1 = a.y + a.height / 2 if b.y > a.y else a.y - a.height / 2
        y2 = b.y - b.height / 2 if b.y > a.y else b.y + b.height / 2
        paths.append((s, t, f"M{a.x:.1f},{y1:.1f} L{b.x:.1f},{y2:.1f}"))
    return Layout(placed, paths, width, height, "networkx")


def _grid_unit(pos: dict, rows: dict[int, list[str]]) -> float:
    """The distance multipartite_layout puts between neighbouring rows (and neighbours in a
    row): its grid is rescaled to fit a unit box, so it is measured, not assumed."""
    if len(rows) >= 2:
        return abs(float(pos[rows[1][0]][1]) - float(pos[rows[0][0]][1])) or 1.0
    row = rows.get(0, [])
    if len(row) >= 2:
        return abs(float(pos[row[1]][0]) - float(pos[row[0]][0])) or 1.0
    return 1.0
