"""Comparing what a pipeline produces now with its recorded expectation: one Problem per
field that changed, each saying what was expected and what came instead."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx

from graphforge.diff import diff_models
from graphforge.diff.source import open_side
from graphforge.golden.fingerprint import node_labels
from graphforge.golden.layout import Expectation, Tolerance, Value, skeleton

#: at most this many lines of the fallback structural diff
DIFF_LINES = 40


@dataclass(frozen=True)
class Problem:
    """One difference: ``field`` is what differs (op_histogram, fingerprint, inputs,
    outputs, metadata, pipeline, dtype, shape, value, ...), ``subject`` what it belongs to
    (``output 'loss' (test_data_set_0)``), ``message`` expected versus got."""

    field: str
    message: str
    subject: str = ""

    def __str__(self) -> str:
        return f"{self.subject} {self.field}: {self.message}" if self.subject else f"{self.field}: {self.message}"


def _shape_text(shape) -> str:
    if shape is None:
        return "(rank unknown)"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _signature_problems(field: str, expected: list[dict], actual: list[dict]) -> list[Problem]:
    kind = field.removesuffix("s")
    before = {s["name"]: s for s in expected}
    after = {s["name"]: s for s in actual}
    problems = []
    for name, sig in before.items():
        if name not in after:
            problems.append(Problem(field, f"{kind} {name!r} ({sig['dtype']} {_shape_text(sig['shape'])}) is gone"))
        elif (sig["dtype"], sig["shape"]) != (after[name]["dtype"], after[name]["shape"]):
            now = after[name]
            problems.append(
                Problem(
                    field,
                    f"{kind} {name!r}: expected {sig['dtype']} {_shape_text(sig['shape'])}, "
                    f"got {now['dtype']} {_shape_text(now['shape'])}",
                )
            )
    for name, sig in after.items():
        if name not in before:
            problems.append(Problem(field, f"new {kind} {name!r} ({sig['dtype']} {_shape_text(sig['shape'])})"))
    common_before = [n for n in before if n in after]
    common_after = [n for n in after if n in before]
    if not problems and common_before != common_after:
        problems.append(Problem(field, f"order changed: expected {common_before}, got {common_after}"))
    return problems


def _brief(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _metadata_problems(expected: dict[str, str], actual: dict[str, str]) -> list[Problem]:
    problems = []
    for key in sorted(set(expected) | set(actual)):
        if key not in actual:
            problems.append(Problem("metadata", f"{key} is gone (was {_brief(expected[key])})"))
        elif key not in expected:
            problems.append(Problem("metadata", f"new {key} = {_brief(actual[key])}"))
        elif expected[key] != actual[key]:
            problems.append(Problem("metadata", _json_change(key, expected[key], actual[key])))
    return problems


def _json_change(key: str, before: str, after: str) -> str:
    """A metadata change; for JSON lists and objects, only the entries that differ."""
    try:
        old, new = json.loads(before), json.loads(after)
    except ValueError:
        old = new = None
    if isinstance(old, list) and isinstance(new, list):
        gone, added = [x for x in old if x not in new], [x for x in new if x not in old]
        if gone or added:
            return f"{key}: removed {_brief(json.dumps(gone))}, added {_brief(json.dumps(added))}"
    if isinstance(old, dict) and isinstance(new, dict):
        changed = {k: [old.get(k), new.get(k)] for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}
        return f"{key}: [expected, got] per key {_brief(json.dumps(changed))}"
    return f"{key}: expected {_brief(before)}, got {_brief(after)}"


def _histogram_problem(expected: dict[str, int], actual: dict[str, int]) -> Problem | None:
    changes = [
        f"{op} {expected.get(op, 0)} → {actual.get(op, 0)} ({actual.get(op, 0) - expected.get(op, 0):+d})"
        for op in sorted(set(expected) | set(actual))
        if expected.get(op, 0) != actual.get(op, 0)
    ]
    if not changes:
        return None
    total = f"{sum(expected.values())} → {sum(actual.values())} nodes"
    return Problem("op_histogram", f"{total}: " + ", ".join(changes))


def structure_problems(expected: dict, actual: dict) -> list[Problem]:
    """Differences between two ``fingerprint.summarize`` records."""
    problems = []
    problems += _signature_problems("inputs", expected["inputs"], actual["inputs"])
    problems += _signature_problems("outputs", expected["outputs"], actual["outputs"])
    problems += _metadata_problems(expected["metadata"], actual["metadata"])
    histogram = _histogram_problem(expected["op_histogram"], actual["op_histogram"])
    problems += [histogram] if histogram else []
    if expected["fingerprint"] != actual["fingerprint"]:
        hint = "" if problems else " (same op counts and I/O: the wiring, an attribute or a constant changed)"
        problems.append(
            Problem("fingerprint", f"expected {expected['fingerprint']}, got {actual['fingerprint']}{hint}")
        )
    return problems


# --------------------------------------------------------------------------- values


def _format_number(x) -> str:
    return str(x)  # NumPy scalars print their shortest round-trip form (0.22780834 for a float32)


def value_problems(expected: Value, actual: np.ndarray, tolerance: Tolerance) -> list[Problem]:
    """dtype and shape must be exact; floating-point values within ``tolerance`` (NaN equals
    NaN, an infinity only the same infinity); every other dtype exactly."""
    subject = expected.describe()
    want = expected.array
    if want.dtype != actual.dtype:
        return [Problem("dtype", f"expected {want.dtype.name}, got {actual.dtype.name}", subject)]
    if want.shape != actual.shape:
        return [Problem("shape", f"expected {list(want.shape)}, got {list(actual.shape)}", subject)]
    if want.size == 0:
        return []
    if want.dtype.kind in "fc":
        with np.errstate(all="ignore"):
            close = np.isclose(actual, want, rtol=tolerance.rtol, atol=tolerance.atol, equal_nan=True)
            gap = np.abs(actual.astype(np.complex128 if want.dtype.kind == "c" else np.float64) - want)
        gap = np.where(np.isnan(gap), np.inf, gap)
        bad = ~close
        rule = f"outside {tolerance}"
    else:
        bad = actual != want
        gap = bad.astype(np.float64)
        rule = "differ (compared exactly)"
    count = int(np.count_nonzero(bad))
    if not count:
        return []
    worst = np.unravel_index(int(np.argmax(np.where(bad, gap, -1.0))), want.shape)
    message = (
        f"{count:,} of {want.size:,} elements {rule}; worst at {list(map(int, worst))}: "
        f"expected {_format_number(want[worst])}, got {_format_number(actual[worst])}"
    )
    if want.dtype.kind in "fc":
        message += f" (|diff| {float(gap[worst]):.3g}, max |expected| {float(np.max(np.abs(want))):.3g})"
    return [Problem("value", message, subject)]


def values_problems(
    expected: list[Value], actual: list[Value], tolerance: Callable[[Value], Tolerance]
) -> list[Problem]:
    now = {v.key: v for v in actual}
    before = {v.key for v in expected}
    problems = []
    for value in expected:
        if value.key not in now:
            problems.append(Problem("missing value", "recorded, but not produced any more", value.describe()))
            continue
        problems += value_problems(value, now[value.key].array, tolerance(value))
    problems += [
        Problem("new value", "produced, but not recorded", v.describe()) for v in actual if v.key not in before
    ]
    return problems


def expectation_problems(
    expected: Expectation, actual: Expectation, tolerance: Callable[[Value], Tolerance]
) -> list[Problem]:
    """Everything that differs between a recorded expectation and what the pipeline gives now."""
    problems = []
    if expected.pipeline_text != actual.pipeline_text:
        problems.append(
            Problem(
                "pipeline",
                f"golden.json runs {actual.pipeline_text!r}, "
                f"the expectations were recorded for {expected.pipeline_text!r}",
            )
        )
    if expected.stages != actual.stages:
        problems.append(Problem("stages", f"expected {list(expected.stages)}, got {list(actual.stages)}"))
    problems += structure_problems(expected.structure, actual.structure)
    problems += values_problems(expected.values, actual.values, tolerance)
    return problems


# --------------------------------------------------------------------------- structural diff text


def structural_diff(
    expected: onnx.ModelProto | None, actual: onnx.ModelProto | None, *, labels: tuple[str, str] = ("recorded", "now")
) -> str | None:
    """What changed in the graph, as text: the diff engine's (graphforge.diff), or the op
    signatures (op type with attributes) that were added or removed should the engine fail."""
    if expected is None or actual is None:
        return None
    now = skeleton(actual)
    try:
        # an invalid compiled graph already failed the pipeline's verification: here only what changed matters
        result = diff_models(*_labelled(expected, now, labels), allow_invalid=True)
        return None if result.structurally_identical else result.to_text().rstrip()
    except Exception as exc:  # the diff engine is a helper here: never let it hide the check's own report
        note = f"(graphforge.diff failed: {type(exc).__name__}: {exc}; showing op signatures instead)\n"
        return note + (_label_diff(expected, now) or "no op signature changed")


def _labelled(a: onnx.ModelProto, b: onnx.ModelProto, labels: tuple[str, str]) -> tuple:
    """The two models named for the diff's header."""
    return open_side(a, labels[0]), open_side(b, labels[1])


def _label_diff(expected: onnx.ModelProto, actual: onnx.ModelProto) -> str | None:
    before, after = node_labels(expected), node_labels(actual)
    lines = [f"- {label}  ×{n}" for label, n in sorted((before - after).items())]
    lines += [f"+ {label}  ×{n}" for label, n in sorted((after - before).items())]
    if not lines:
        return None
    if len(lines) > DIFF_LINES:
        lines = [*lines[:DIFF_LINES], f"… and {len(lines) - DIFF_LINES} more"]
    return "nodes by op and attributes (- recorded, + now):\n" + "\n".join(lines)
