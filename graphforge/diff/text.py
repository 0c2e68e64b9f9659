"""The diff as text: a summary, then the details. Lines are lists of (text, style) segments,
so the same lines print plain, with ANSI colours, or through rich in the CLI.

What it renders are graphforge.diff.result's types (a ModelDiff, its GraphDiffs, NodeGroups,
NumericReport); it reads their fields and imports nothing of result.py, whose
``ModelDiff.to_text`` calls ``render_text``: one arrow, result -> text."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

Line = list[tuple[str, str]]

#: styles -> ANSI SGR codes (rich gets the style names mapped in RICH_STYLES)
ANSI = {
    "added": "32",
    "removed": "31",
    "changed": "33",
    "bold": "1",
    "dim": "2",
    "title": "1;36",
    "same": "32;1",
    "different": "31;1",
    "": "",
}
RICH_STYLES = {
    "added": "green",
    "removed": "red",
    "changed": "yellow",
    "bold": "bold",
    "dim": "dim",
    "title": "bold cyan",
    "same": "bold green",
    "different": "bold red",
    "": "",
}
#: entries listed one per line before "... and N more"
LIST_LIMIT = 40
RENAMES_SHOWN = 10
NUMERIC_SHOWN = 15


def render_text(diff, *, color: bool = False, brief: bool = False) -> str:
    lines = summary_lines(diff) + ([] if brief else detail_lines(diff))
    return "\n".join(_plain(line, color) for line in lines) + "\n"


def _plain(line: Line, color: bool) -> str:
    if not color:
        return "".join(text for text, _ in line)
    return "".join(f"\x1b[{ANSI[style]}m{text}\x1b[0m" if ANSI.get(style) else text for text, style in line)


def verdict(diff) -> tuple[str, str]:
    if diff.identical:
        return "identical", "same"
    if diff.structurally_identical:
        return "structurally identical (names, values or model fields differ)", "changed"
    return "different", "different"


def summary_lines(diff) -> list[Line]:
    s = diff.summary()
    text, style = verdict(diff)
    lines: list[Line] = [
        [("a: ", "dim"), (diff.a_label, "bold")],
        [("b: ", "dim"), (diff.b_label, "bold")],
        [("verdict: ", "dim"), (text, style)],
    ]
    for side, label in (("a", diff.a_label), ("b", diff.b_label)):
        problem = diff.problems.get(side)
        if problem is not None:
            lines.append(
                [("warning: ", "changed"), (f"{side} ({label}) is not a valid ONNX model: ", "changed"), (problem, "")]
            )
    nodes: Line = [("nodes: ", "dim")]
    nodes += [(f"+{s['nodes_added']} added", "added" if s["nodes_added"] else "dim"), (", ", "")]
    nodes += [(f"-{s['nodes_removed']} removed", "removed" if s["nodes_removed"] else "dim"), (", ", "")]
    nodes += [(f"~{s['nodes_changed']} changed", "changed" if s["nodes_changed"] else "dim"), (", ", "")]
    nodes += [(f"{s['nodes_matched']} matched", "dim")]
    lines.append(nodes)
    counts = [
        (s["renamed"], "renamed"),
        (s["inputs_changed"], "inputs changed"),
        (s["outputs_changed"], "outputs changed"),
        (s["initializers_changed"], "initializers changed"),
        (s["functions_changed"], "functions changed"),
        (s["model_fields_changed"], "model fields changed"),
    ]
    shown = [f"{n} {what}" for n, what in counts if n]
    if shown:
        lines.append([("also: ", "dim"), (", ".join(shown), "changed")])
    if diff.histogram:
        ops = ", ".join(f"{c.op} {c.a}→{c.b} ({c.b - c.a:+d})" for c in diff.histogram)
        lines.append([("ops: ", "dim"), (ops, "")])
    if diff.numeric is not None:
        lines.append(_numeric_headline(diff.numeric))
    return lines


def _numeric_headline(report) -> Line:
    first = report.first_divergence
    diverging = sum(t.diverges for t in report.tensors)
    if first is None and report.warnings:
        return [
            ("numeric: ", "dim"),
            (f"all {len(report.tensors)} matched tensors agree at these inputs, ", "changed"),
            (f"but {len(report.warnings)} changed initializer(s) never showed (see warnings)", "changed"),
        ]
    if first is None:
        return [("numeric: ", "dim"), (f"all {len(report.tensors)} matched tensors agree", "same")]
    return [
        ("numeric: ", "dim"),
        (f"{diverging} of {len(report.tensors)} matched tensors differ; first: ", "different"),
        (f"{first.a!r}", "bold"),
        (f" ({first.node.label}) {_numeric_detail(first)}", ""),
    ]


def detail_lines(diff) -> list[Line]:
    lines: list[Line] = []
    if diff.model:
        lines.append([("model", "title")])
        for f in diff.model:
            what = f"{f.field} {f.key}" if f.key is not None else f.field
            lines.append([("  ~ ", "changed"), (f"{what}: {_show(f.a)} → {_show(f.b)}", "")])
    for g in diff.all_graphs():
        lines += graph_lines(g)
    for f in diff.functions:
        if f.status != "changed":
            style = "added" if f.status == "added" else "removed"
            sign = "+" if f.status == "added" else "-"
            lines.append(
                [(f"{sign} function {f.domain}::{f.name}" if f.domain else f"{sign} function {f.name}", style)]
            )
        elif f.fields:
            lines.append([(f"~ function {f.name}: ", "changed"), (", ".join(f.fields), "")])
            for name, values in f.detail.items():
                lines.append([(f"    {name}: {_show(values['a'])} → {_show(values['b'])}", "")])
    if diff.numeric is not None:
        lines += numeric_lines(diff.numeric)
    return lines


def graph_lines(g) -> list[Line]:
    if g.identical:
        return []
    title = f"graph {g.path}" if g.path == "main" else f"subgraph {g.path}"
    if g.path.startswith("function "):
        title = g.path
    names = f" ({g.a_name!r} → {g.b_name!r})" if g.a_name != g.b_name else f" ({g.a_name!r})" if g.a_name else ""
    lines: list[Line] = [
        [(title, "title"), (names, "dim"), (f"  {g.nodes_a} → {g.nodes_b} nodes, {g.matched} matched", "dim")]
    ]
    for kind, changes in (("input", g.inputs), ("output", g.outputs)):
        for c in changes:
            lines.append(_value_line(kind, c.status, c.a, c.b, c.fields))
    for c in g.initializers:
        lines.append(_initializer_line(c.status, c.a, c.b, c.fields, c.values))
    for c in g.changed:
        head: Line = [("  ~ ", "changed"), (c.a.label, "bold")]
        if c.b.name != c.a.name or c.b.op_type != c.a.op_type:
            head.append((f" (now {c.b.label})", ""))
        head.append((": " + ", ".join(c.fields), "dim"))
        lines.append(head)
        for attr in c.attributes:
            lines.append(
                [
                    (f"      attribute {attr.name}: ", ""),
                    (_show(attr.a), "removed"),
                    (" → ", ""),
                    (_show(attr.b), "added"),
                ]
            )
        for w in c.inputs:
            lines.append(
                [(f"      input {w.slot}: ", ""), (_source(w.a), "removed"), (" → ", ""), (_source(w.b), "added")]
            )
        if c.outputs is not None:
            lines.append([(f"      outputs: {c.outputs[0]} → {c.outputs[1]}", "")])
        for path in c.subgraphs:
            lines.append([(f"      subgraph {path} differs (below)", "dim")])
    grouped_a = {n.index for grp in g.groups for n in grp.a}
    grouped_b = {n.index for grp in g.groups for n in grp.b}
    lines += _node_list("-", "removed", [n for n in g.removed if n.index not in grouped_a])
    lines += _node_list("+", "added", [n for n in g.added if n.index not in grouped_b])
    for group in g.groups:
        lines.append(_group_line(group))
    if g.renamed:
        kinds = Counter(r.kind for r in g.renamed)
        lines.append([("  renamed: ", "dim"), (", ".join(f"{n} {k}s" for k, n in kinds.items()), "")])
        for r in g.renamed[:RENAMES_SHOWN]:
            lines.append([(f"      {r.kind} {r.a!r} → {r.b!r}", "dim")])
        if len(g.renamed) > RENAMES_SHOWN:
            lines.append([(f"      … and {len(g.renamed) - RENAMES_SHOWN} more (--json lists them all)", "dim")])
    return lines


def _node_list(sign: str, style: str, nodes: list) -> list[Line]:
    lines: list[Line] = [[(f"  {sign} ", style), (n.label, style)] for n in nodes[:LIST_LIMIT]]
    if len(nodes) > LIST_LIMIT:
        lines.append([(f"  {sign} … and {len(nodes) - LIST_LIMIT} more ({_ops(nodes[LIST_LIMIT:])})", style)])
    return lines


def _group_line(group) -> Line:
    if group.kind == "origin":
        anchor = group.anchor_b or group.anchor_a
        if anchor is not None:
            head = f"{group.role}:: nodes for {anchor.label}"
        else:
            head = f"{group.role}:: nodes" + (f" for {group.origin!r}" if group.origin else "")
    else:
        first = (group.a or group.b)[0]
        head = f"region at {first.label}"
    line: Line = [("  ⇄ ", "changed"), (head, "bold"), (": ", "")]
    if group.a:
        line.append((f"-{len(group.a)} ({_ops(group.a)})", "removed"))
    if group.a and group.b:
        line.append((" → ", ""))
    if group.b:
        line.append((f"+{len(group.b)} ({_ops(group.b)})", "added"))
    return line


def _ops(nodes: list) -> str:
    counts = Counter(n.op_type for n in nodes)
    return ", ".join(op if k == 1 else f"{op} ×{k}" for op, k in sorted(counts.items(), key=lambda x: (-x[1], x[0])))


def _value_line(kind: str, status: str, a, b, fields) -> Line:
    if status == "added":
        return [(f"  + {kind} {b['name']!r} {_type(b)}", "added")]
    if status == "removed":
        return [(f"  - {kind} {a['name']!r} {_type(a)}", "removed")]
    parts = []
    for f in fields:
        if f == "source":
            parts.append("now produced elsewhere")
        else:
            parts.append(f"{f} {_show(a[f])} → {_show(b[f])}")
    return [(f"  ~ {kind} {a['name']!r}: ", "changed"), ("; ".join(parts), "")]


def _initializer_line(status: str, a, b, fields, values) -> Line:
    if status == "added":
        return [(f"  + initializer {b['name']!r} {_type(b)}", "added")]
    if status == "removed":
        return [(f"  - initializer {a['name']!r} {_type(a)}", "removed")]
    parts = [f"{f} {_show(a[f])} → {_show(b[f])}" for f in fields if f != "values"]
    if "values" in fields:
        if values is None:
            parts.append("values differ")
        elif values.max_abs is None or values.max_rel is None:  # strings: no distance
            parts.append(f"values differ in {values.differing} of {values.elements} elements")
        else:
            parts.append(
                f"values differ in {values.differing} of {values.elements} elements: "
                f"max abs {_num(values.max_abs)}, max rel {_num(values.max_rel)}"
            )
    return [(f"  ~ initializer {a['name']!r}: ", "changed"), ("; ".join(parts), "")]


def _type(value: dict[str, Any]) -> str:
    shape = value.get("shape")
    dims = "?" if shape is None else "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"
    return f"{value.get('dtype') or '?'} {dims}"


def _source(source: dict[str, Any] | None) -> str:
    if source is None:
        return "(none)"
    if source["from"] == "none":
        return "(omitted)"
    if source["from"] == "node":
        node = source["node"]
        who = node["name"] or f"#{node['index']}"
        return f"{source['tensor']!r} (output {source['output']} of {node['op_type']} {who!r})"
    return f"{source['tensor']!r} ({source['from']})"


def _show(value: Any) -> str:
    if isinstance(value, str):
        return repr(value) if len(value) <= 80 else repr(value[:77] + "...")
    if value is None:
        return "(absent)"
    text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    return text if len(text) <= 100 else text[:97] + "..."


def _num(value: float) -> str:
    return f"{value:.6g}"


def _numeric_detail(t) -> str:
    if t.status == "shape":
        return f"shape {t.shape_a} → {t.shape_b}"
    if t.status in ("dtype", "missing"):
        return t.status
    assert t.stats is not None
    counted = f"{t.stats.differing} of {t.stats.elements} elements differ"
    if t.stats.max_abs is None or t.stats.max_rel is None:
        return counted
    return f"max abs {_num(t.stats.max_abs)}, max rel {_num(t.stats.max_rel)}, {counted}"


def numeric_lines(report) -> list[Line]:
    generated = [name for name, info in report.inputs.items() if info.get("generated")]
    lines: list[Line] = [
        [("numeric", "title"), (f"  rtol {report.rtol:g}, atol {report.atol:g}; seed {report.seed}", "dim")],
    ]
    if generated:
        sizes = ", ".join(f"{name}={size}" for name, size in report.dims.items())
        lines.append([(f"  generated inputs: {', '.join(generated)}" + (f" ({sizes})" if sizes else ""), "dim")])
    for warning in report.warnings:
        lines.append([("  warning: ", "changed"), (warning, "")])
    shown = [t for t in report.tensors if t.diverges][:NUMERIC_SHOWN]
    for t in shown:
        name = t.a if t.a == t.b else f"{t.a} / {t.b}"
        lines.append([("  ≠ ", "different"), (name, "bold"), (f" ({t.node.label}): {_numeric_detail(t)}", "")])
    rest = sum(t.diverges for t in report.tensors) - len(shown)
    if rest > 0:
        lines.append([(f"  … and {rest} more diverging tensors (in topological order; --json lists all)", "dim")])
    if not shown:
        lines.append([(f"  all {len(report.tensors)} matched tensors agree", "same")])
    return lines
