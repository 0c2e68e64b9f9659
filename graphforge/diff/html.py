"""The diff as one self-contained HTML page: both graphs drawn side by side, added, removed
and changed nodes in their own colours, details on click. No network: CSS, JS and data inline.

Large graphs stay usable: when a side has more than FULL_GRAPH_NODES nodes, only the
changed nodes and their neighbourhood (``context`` hops) are drawn; every other connected
run of nodes becomes one dashed box ("⋯ 1,234 nodes") that says what it holds.

Only the main graph is drawn; the "Changes" list also names the changes inside subgraphs
and function bodies, with where they are, and shows their details on click.
"""

from __future__ import annotations

import html
import json
from collections import Counter
from pathlib import Path
from typing import Any

import networkx as nx

from graphforge.diff.layout import Box, layout
from graphforge.diff.result import GraphDiff, ModelDiff
from graphforge.diff.text import verdict
from graphforge.diff.view import GraphView
from graphforge.errors import ModelSaveError
from graphforge.tempfiles import write_atomically

#: a side with at most this many nodes is drawn whole
FULL_GRAPH_NODES = 250
#: at most this many real nodes are drawn per side (the rest is collapsed)
MAX_DRAWN_NODES = 400
_CHAR_PX = 6.6
_BOX_HEIGHT = 34.0


def write_html(
    path: str | Path, diffs: list[tuple[str, ModelDiff]], *, title: str = "graphforge diff", context: int = 2
) -> Path:
    """Write the page for one diff, or several (a dump folder's steps) chosen from a list."""
    page = render_html(diffs, title=title, context=context)
    path = Path(path)
    try:
        write_atomically(path, page.encode("utf-8"))
    except OSError as exc:
        raise ModelSaveError(f"{path}: cannot write the page ({exc.strerror or exc})") from None
    return path


def render_html(diffs: list[tuple[str, ModelDiff]], *, title: str = "graphforge diff", context: int = 2) -> str:
    data = {"title": title, "diffs": [diff_data(name, d, context=context) for name, d in diffs]}
    blob = json.dumps(data, ensure_ascii=False, separators=(",", ":")).replace("</", "<\\/")
    return (
        _PAGE.replace("__TITLE__", html.escape(title))
        .replace("__CSS__", _CSS)
        .replace("__JS__", _JS)
        .replace("__DATA__", blob)
    )


def diff_data(name: str, diff: ModelDiff, *, context: int = 2) -> dict[str, Any]:
    g = diff.graph
    assert g.views is not None
    statuses_a, statuses_b = node_statuses(g)
    details = _details(g)
    sides = []
    for side, view, statuses in (("a", g.views[0], statuses_a), ("b", g.views[1], statuses_b)):
        sides.append(side_drawing(side, view, statuses, context=context))
    return {
        "title": name,
        "labels": [diff.a_label, diff.b_label],
        "verdict": verdict(diff)[0],
        "identical": diff.identical,
        "summary": diff.to_text(brief=True),
        "text": diff.to_text(),
        "sides": sides,
        "details": details,
        "elsewhere": elsewhere(diff),
    }


def elsewhere(diff: ModelDiff) -> list[dict[str, Any]]:
    """The changes the drawing of the main graph cannot show: nodes added, removed or changed
    inside subgraphs (If branches, Loop and Scan bodies) and function bodies, and functions
    added, removed or changed, each with where it is and what the panel shows on click."""
    found: list[dict[str, Any]] = []
    for g in diff.all_graphs():
        if g is diff.graph:
            continue
        for n in g.removed:
            found.append({"where": g.path, "status": "removed", "label": n.label, "detail": n.to_json()})
        for n in g.added:
            found.append({"where": g.path, "status": "added", "label": n.label, "detail": n.to_json()})
        for c in g.changed:
            label = c.a.label if c.a.label == c.b.label else f"{c.a.label} → {c.b.label}"
            found.append({"where": g.path, "status": "changed", "label": label, "detail": c.to_json()})
        for kind, changes in (("input", g.inputs), ("output", g.outputs), ("initializer", g.initializers)):
            for v in changes:
                name = (v.a or v.b or {}).get("name", "")
                found.append({"where": g.path, "status": v.status, "label": f"{kind} {name!r}", "detail": v.to_json()})
    for f in diff.functions:
        if f.status != "changed" or [x for x in f.fields if x != "body"]:
            detail = {k: v for k, v in f.to_json().items() if k != "graph"}
            where = f"function {f.domain}::{f.name}" if f.domain else f"function {f.name}"
            found.append({"where": where, "status": f.status, "label": "signature", "detail": detail})
    return found


def node_statuses(g: GraphDiff) -> tuple[dict[int, str], dict[int, str]]:
    """Per node index: "added"/"removed", "changed" or "same", for each side."""
    va, vb = g.views  # type: ignore[misc]
    changed_a = {c.a.index for c in g.changed}
    changed_b = {c.b.index for c in g.changed}
    b2a = {b: a for a, b in g.node_pairs.items()}
    a = {
        i: "removed" if i not in g.node_pairs else "changed" if i in changed_a else "same" for i in range(len(va.nodes))
    }
    b = {i: "added" if i not in b2a else "changed" if i in changed_b else "same" for i in range(len(vb.nodes))}
    return a, b


def _digraph(view: GraphView) -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(range(len(view.nodes)))
    for node in view.nodes:
        for t in (*node.inputs, *node.implicit):
            produced = view.producer.get(t) if t else None
            if produced is not None and produced[0] != node.index:
                g.add_edge(produced[0], node.index)
    return g


def shown_nodes(view: GraphView, statuses: dict[int, str], dag: nx.DiGraph, context: int) -> set[int]:
    """All nodes of a small graph; else the changed ones and ``context`` hops around them,
    cut to MAX_DRAWN_NODES in topological order (fewer hops first)."""
    if len(view.nodes) <= FULL_GRAPH_NODES:
        return set(range(len(view.nodes)))
    focus = [i for i in view.order if statuses[i] != "same"]
    rank = {i: k for k, i in enumerate(view.order)}
    distance = {i: 0 for i in focus}
    frontier = list(focus)
    undirected = dag.to_undirected(as_view=True)
    for hop in range(1, context + 1):
        nxt = []
        for i in frontier:
            for j in undirected.neighbors(i):
                if j not in distance:
                    distance[j] = hop
                    nxt.append(j)
        frontier = nxt
    chosen = sorted(distance, key=lambda i: (distance[i], rank[i]))[:MAX_DRAWN_NODES]
    return set(chosen)


def side_drawing(side: str, view: GraphView, statuses: dict[int, str], *, context: int) -> dict[str, Any]:
    dag = _digraph(view)
    shown = shown_nodes(view, statuses, dag, context)
    hidden = [i for i in view.order if i not in shown]
    group_of = _collapse(dag, shown, hidden)
    boxes: list[Box] = []
    nodes: list[dict[str, Any]] = []
    for i in view.order:
        if i not in shown:
            continue
        node = view.nodes[i]
        label, sub = node.op_label, _short(node.name)
        box = Box(f"{side}{i}", max(70.0, _CHAR_PX * max(len(label), len(sub)) + 16), _BOX_HEIGHT)
        boxes.append(box)
        nodes.append({"id": box.id, "label": label, "sub": sub, "status": statuses[i]})
    members: dict[int, list[int]] = {}
    for i in hidden:
        members.setdefault(group_of[i], []).append(i)
    for k, group in sorted(members.items()):
        ops = Counter(view.nodes[i].op_label for i in group)
        changes = Counter(statuses[i] for i in group if statuses[i] != "same")
        label = f"⋯ {len(group):,} node{'s' if len(group) != 1 else ''}"
        sub = ", ".join(f"{op} {n}" for op, n in ops.most_common(3))
        box = Box(f"{side}c{k}", max(90.0, _CHAR_PX * max(len(label), len(sub)) + 16), _BOX_HEIGHT)
        boxes.append(box)
        nodes.append(
            {
                "id": box.id,
                "label": label,
                "sub": sub,
                "status": "collapsed",
                "hasChanges": bool(changes),
                "count": len(group),
                "ops": dict(ops.most_common()),
                "changes": dict(sorted(changes.items())),
                "members": [view.nodes[i].name or f"{view.nodes[i].op}#{i}" for i in group[:30]],
            }
        )

    def box_id(i: int) -> str:
        return f"{side}{i}" if i in shown else f"{side}c{group_of[i]}"

    edges = sorted({(box_id(u), box_id(v)) for u, v in dag.edges if box_id(u) != box_id(v)})
    drawn = layout(boxes, edges)
    for item in nodes:
        box = drawn.boxes[item["id"]]
        item.update(x=round(box.x, 1), y=round(box.y, 1), w=round(box.width, 1), h=round(box.height, 1))
    return {
        "side": side,
        "width": round(drawn.width, 1),
        "height": round(drawn.height, 1),
        "engine": drawn.engine,
        "note": drawn.note,
        "total": len(view.nodes),
        "drawn": len(shown),
        "nodes": nodes,
        "edges": [{"s": s, "t": t, "d": d} for s, t, d in drawn.edges],
    }


def _collapse(dag: nx.DiGraph, shown: set[int], hidden: list[int]) -> dict[int, int]:
    """Hidden node -> group number, by where the node lies: upstream of what is drawn,
    downstream, both (between two drawn parts), or beside it. One box each keeps the page
    readable (connected runs gave GPT-2 dozens of one-Constant boxes) and the drawing acyclic."""
    if not hidden:
        return {}
    up: set[int] = set()
    down: set[int] = set()
    for into, step in ((up, dag.predecessors), (down, dag.successors)):
        stack = list(shown)
        while stack:
            i = stack.pop()
            for j in step(i):
                if j not in into and j not in shown:
                    into.add(j)
                    stack.append(j)
    where = {i: (i in up) + 2 * (i in down) for i in hidden}
    order = sorted(set(where.values()), key=[1, 3, 2, 0].index)  # upstream, between, downstream, beside
    return {i: order.index(w) for i, w in where.items()}


def _short(name: str, limit: int = 36) -> str:
    return name if len(name) <= limit else "…" + name[-(limit - 1) :]


def _details(g: GraphDiff) -> dict[str, Any]:
    """Per drawn node id: what the panel shows on click."""
    va, vb = g.views  # type: ignore[misc]
    changes = {}
    for c in g.changed:
        entry = c.to_json()
        changes[("a", c.a.index)] = entry
        changes[("b", c.b.index)] = entry
    b2a = {b: a for a, b in g.node_pairs.items()}
    details: dict[str, Any] = {}
    for side, view, pairs in (("a", va, g.node_pairs), ("b", vb, b2a)):
        other = "b" if side == "a" else "a"
        for node in view.nodes:
            pair = pairs.get(node.index)
            details[f"{side}{node.index}"] = {
                "name": node.name,
                "op": node.op_label,
                "inputs": list(node.inputs),
                "outputs": list(node.outputs),
                "attributes": {k: _clip(v) for k, v in node.attrs.items()},
                "pair": None if pair is None else f"{other}{pair}",
                "change": changes.get((side, node.index)),
            }
    return details


def _clip(value: Any) -> Any:
    text = json.dumps(value, ensure_ascii=False)
    return value if len(text) <= 300 else text[:297] + "…"


_CSS = r"""
:root { --added:#2f9e44; --added-bg:#d3f9d8; --removed:#e03131; --removed-bg:#ffe3e3;
        --changed:#f08c00; --changed-bg:#fff3bf; --same:#868e96; --same-bg:#f8f9fa; }
* { box-sizing: border-box; }
body { margin:0; font:13px/1.4 system-ui, sans-serif; color:#212529; background:#fff; }
header { padding:8px 14px; border-bottom:1px solid #dee2e6; display:flex; gap:16px; align-items:center; flex-wrap:wrap; }
header h1 { font-size:16px; margin:0; }
.verdict { font-weight:600; }
.legend span { display:inline-block; padding:1px 8px; margin-right:6px; border:1.5px solid; border-radius:4px; }
.legend .added { background:var(--added-bg); border-color:var(--added); }
.legend .removed { background:var(--removed-bg); border-color:var(--removed); }
.legend .changed { background:var(--changed-bg); border-color:var(--changed); }
.legend .same { background:var(--same-bg); border-color:var(--same); }
.legend .collapsed { border-style:dashed; border-color:var(--same); }
main { display:grid; grid-template-columns: 1fr 1fr 340px; height: calc(100vh - 50px); }
.pane { position:relative; border-right:1px solid #dee2e6; overflow:hidden; display:flex; flex-direction:column; }
.pane h2 { font-size:13px; margin:0; padding:6px 10px; background:#f1f3f5; border-bottom:1px solid #dee2e6;
           white-space:nowrap; overflow:hidden; text-overflow:ellipsis; }
.pane .note { font-size:11px; color:#495057; padding:2px 10px; border-bottom:1px solid #f1f3f5; }
.pane svg { flex:1; width:100%; cursor:grab; background:#fff; }
.edge { fill:none; stroke:#adb5bd; stroke-width:1.2; }
.node rect { stroke-width:1.5; rx:5; ry:5; }
.node text { font-size:11px; text-anchor:middle; pointer-events:none; }
.node text.sub { font-size:9px; fill:#495057; }
.node { cursor:pointer; }
.node.same rect { fill:var(--same-bg); stroke:var(--same); }
.node.added rect { fill:var(--added-bg); stroke:var(--added); stroke-width:2.5; }
.node.removed rect { fill:var(--removed-bg); stroke:var(--removed); stroke-width:2.5; }
.node.changed rect { fill:var(--changed-bg); stroke:var(--changed); stroke-width:2.5; }
.node.collapsed rect { fill:#fff; stroke:var(--same); stroke-dasharray:5 3; }
.node.collapsed.has-changes rect { stroke:var(--changed); }
.node.selected rect { stroke:#1c7ed6; stroke-width:4; }
aside { overflow:auto; padding:8px 12px; }
aside h3 { font-size:13px; margin:10px 0 4px; }
aside pre { white-space:pre-wrap; word-break:break-all; font-size:11px; background:#f8f9fa; padding:6px; margin:0; }
aside ul { padding-left:16px; margin:4px 0; }
aside li { cursor:pointer; }
aside li.added { color:var(--added); } aside li.removed { color:var(--removed); } aside li.changed { color:#b35c00; }
aside li.elsewhere { font-style:italic; }
aside .note { font-size:11px; color:#495057; margin:2px 0 6px; }
aside a.back { font-size:11px; }
select { max-width:420px; }
"""

_JS = r"""
(function () {
  const data = JSON.parse(document.getElementById('gf-data').textContent);
  const NS = 'http://www.w3.org/2000/svg';
  const main = document.getElementById('main');
  const picker = document.getElementById('picker');
  let current = null;
  function el(tag, attrs, parent) {
    const e = document.createElementNS(NS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function text(tag, content, cls) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    e.textContent = content;
    return e;
  }
  function drawSide(side, label, diff, pane) {
    pane.innerHTML = '';
    pane.appendChild(text('h2', (side.side === 'a' ? 'A: ' : 'B: ') + label));
    pane.appendChild(text('div', side.note + ' · ' + side.drawn + ' of ' + side.total + ' nodes drawn', 'note'));
    const svg = el('svg', {'data-side': side.side}, pane);
    const w = Math.max(side.width, 10), h = Math.max(side.height, 10);
    const view = {x: -10, y: -10, w: w + 20, h: h + 20};
    const setView = () => svg.setAttribute('viewBox', view.x + ' ' + view.y + ' ' + view.w + ' ' + view.h);
    setView();
    const defs = el('defs', {}, svg);
    const marker = el('marker', {id: 'arrow-' + side.side, viewBox: '0 0 10 10', refX: 9, refY: 5,
                                 markerWidth: 6, markerHeight: 6, orient: 'auto'}, defs);
    el('path', {d: 'M0,0 L10,5 L0,10 z', fill: '#adb5bd'}, marker);
    const edges = el('g', {'class': 'edges'}, svg);
    for (const e of side.edges) el('path', {'class': 'edge', d: e.d, 'marker-end': 'url(#arrow-' + side.side + ')'}, edges);
    const nodes = el('g', {'class': 'nodes'}, svg);
    for (const n of side.nodes) {
      const cls = 'node ' + n.status + (n.hasChanges ? ' has-changes' : '');
      const g = el('g', {'class': cls, id: n.id, transform: 'translate(' + (n.x - n.w / 2) + ',' + (n.y - n.h / 2) + ')'}, nodes);
      el('rect', {width: n.w, height: n.h}, g);
      const t1 = el('text', {x: n.w / 2, y: 14}, g); t1.textContent = n.label;
      const t2 = el('text', {x: n.w / 2, y: 27, 'class': 'sub'}, g); t2.textContent = n.sub;
      g.addEventListener('click', (ev) => { ev.stopPropagation(); select(n.id, false); });
    }
    // pan and zoom
    let drag = null;
    svg.addEventListener('mousedown', (ev) => { drag = {x: ev.clientX, y: ev.clientY, vx: view.x, vy: view.y}; });
    window.addEventListener('mouseup', () => { drag = null; });
    svg.addEventListener('mousemove', (ev) => {
      if (!drag) return;
      const s = view.w / svg.clientWidth;
      view.x = drag.vx - (ev.clientX - drag.x) * s; view.y = drag.vy - (ev.clientY - drag.y) * s; setView();
    });
    svg.addEventListener('wheel', (ev) => {
      ev.preventDefault();
      const f = ev.deltaY > 0 ? 1.15 : 1 / 1.15;
      const r = svg.getBoundingClientRect();
      const px = view.x + (ev.clientX - r.left) / r.width * view.w, py = view.y + (ev.clientY - r.top) / r.height * view.h;
      view.x = px - (px - view.x) * f; view.y = py - (py - view.y) * f; view.w *= f; view.h *= f; setView();
    }, {passive: false});
    svg.centerOn = (n) => { view.x = n.x - view.w / 2; view.y = n.y - view.h / 2; setView(); };
    svg.nodesById = Object.fromEntries(side.nodes.map((n) => [n.id, n]));
    return svg;
  }
  function back(panel) {
    const link = text('a', '← all changes', 'back');
    link.href = '#';
    link.addEventListener('click', (ev) => { ev.preventDefault(); showList(); });
    panel.appendChild(link);
  }
  function select(id, center) {
    document.querySelectorAll('.node.selected').forEach((e) => e.classList.remove('selected'));
    const info = current.details[id];
    const box = document.getElementById(id);
    if (box) box.classList.add('selected');
    const panel = document.getElementById('panel');
    panel.innerHTML = '';
    back(panel);
    const side = id[0];
    let shown = info;
    if (!info) {
      const svg = document.querySelector('svg[data-side="' + side + '"]');
      shown = svg.nodesById[id];
    }
    panel.appendChild(text('h3', (side === 'a' ? 'A' : 'B') + ': ' + (shown.op || shown.label) + ' ' + (shown.name || '')));
    panel.appendChild(text('pre', JSON.stringify(shown, null, 1)));
    if (info && info.pair) {
      const other = document.getElementById(info.pair);
      if (other) other.classList.add('selected');
      const svg = document.querySelector('svg[data-side="' + info.pair[0] + '"]');
      if (svg && svg.nodesById[info.pair]) svg.centerOn(svg.nodesById[info.pair]);
    }
    if (center) {
      const svg = document.querySelector('svg[data-side="' + side + '"]');
      if (svg && svg.nodesById[id]) svg.centerOn(svg.nodesById[id]);
    }
    panel.setAttribute('data-showing', id);
  }
  function showElsewhere(k) {
    document.querySelectorAll('.node.selected').forEach((e) => e.classList.remove('selected'));
    const entry = current.elsewhere[k];
    const panel = document.getElementById('panel');
    panel.innerHTML = '';
    back(panel);
    panel.appendChild(text('h3', entry.status + ' in ' + entry.where + ': ' + entry.label));
    panel.appendChild(text('div', 'not drawn: the drawing shows the main graph only', 'note'));
    panel.appendChild(text('pre', JSON.stringify(entry.detail, null, 1)));
    panel.setAttribute('data-showing', 'elsewhere-' + k);
  }
  function showList() {
    document.querySelectorAll('.node.selected').forEach((e) => e.classList.remove('selected'));
    const panel = document.getElementById('panel');
    panel.innerHTML = '';
    panel.appendChild(text('h3', 'Changes (click one)'));
    const list = document.createElement('ul');
    for (const side of current.sides) {
      for (const n of side.nodes) {
        if (n.status === 'same' || n.status === 'collapsed') continue;
        const li = text('li', (side.side === 'a' ? 'A ' : 'B ') + n.status + ': ' + n.label + ' ' + n.sub, n.status);
        li.addEventListener('click', () => select(n.id, true));
        list.appendChild(li);
      }
    }
    current.elsewhere.forEach((entry, k) => {
      const li = text('li', entry.status + ' in ' + entry.where + ': ' + entry.label, entry.status + ' elsewhere');
      li.addEventListener('click', () => showElsewhere(k));
      list.appendChild(li);
    });
    if (!list.children.length) list.appendChild(text('li', 'none', 'none'));
    panel.appendChild(list);
    panel.appendChild(text('h3', 'Report'));
    panel.appendChild(text('pre', current.text));
    panel.setAttribute('data-showing', 'list');
  }
  function render(k) {
    current = data.diffs[k];
    document.getElementById('verdict').textContent = current.verdict;
    drawSide(current.sides[0], current.labels[0], current, document.getElementById('pane-a'));
    drawSide(current.sides[1], current.labels[1], current, document.getElementById('pane-b'));
    showList();
    document.body.setAttribute('data-rendered', String(k));
  }
  if (data.diffs.length > 1) {
    data.diffs.forEach((d, k) => {
      const o = document.createElement('option');
      o.value = k; o.textContent = (d.identical ? '= ' : '≠ ') + d.title;
      picker.appendChild(o);
    });
    picker.addEventListener('change', () => render(Number(picker.value)));
    const first = data.diffs.findIndex((d) => !d.identical);
    picker.value = String(Math.max(first, 0));
    render(Math.max(first, 0));
  } else {
    picker.style.display = 'none';
    render(0);
  }
})();
"""

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>__CSS__</style></head>
<body>
<header><h1>__TITLE__</h1><select id="picker"></select><span class="verdict" id="verdict"></span>
<span class="legend"><span class="added">added</span><span class="removed">removed</span><span class="changed">changed</span><span class="same">same</span><span class="collapsed">collapsed</span></span></header>
<main id="main"><section class="pane" id="pane-a"></section><section class="pane" id="pane-b"></section><aside id="panel"></aside></main>
<script type="application/json" id="gf-data">__DATA__</script>
<script>__JS__</script>
</body></html>
"""
