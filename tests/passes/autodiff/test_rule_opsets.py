"""Every rule handles the opsets docs/ops.md claims for it: each table row is rebuilt at the
lowest opset its rule claims where the row's forward node is valid (its schema, inputs and
attributes exist there), and the backward graph the rule emits must pass onnx's full checker
at that opset (no op from a newer opset, no input form it lacks)."""

from __future__ import annotations

import dataclasses
import re

import onnx
import pytest
from gradcheck import DOUBLE, FLOAT, build_model
from graphforge.passes import Autodiff
from graphforge.passes.autodiff import RULES
from op_cases import CASES

import graphforge


def _forward_valid(case, opset: int) -> bool:
    """Whether the row's node (and its `after` nodes) exists in this form at ``opset`` (a node
    of the model's own functions, graphforge's markers, exists at any)."""
    own = [] if case.domain else [(case.op, case.inputs, case.attrs)]
    for op, inputs, attrs in [*own, *case.after]:
        try:
            schema = onnx.defs.get_schema(op, opset)
        except onnx.defs.SchemaError:
            return False
        if len(inputs) > len(schema.inputs) and not any(
            i.option == onnx.defs.OpSchema.FormalParameterOption.Variadic for i in schema.inputs
        ):
            return False
        if any(name not in schema.attributes for name in attrs):
            return False
    return _dtype(case, opset) is not None


def _dtype(case, opset: int):
    """A float type onnxruntime runs the row's forward node in at ``opset`` (None: neither)."""
    for dtype in (DOUBLE, FLOAT):
        try:
            build_model(dataclasses.replace(case, opset=opset), dtype)
        except Exception:
            continue
        return dtype
    return None


def _lowest_opset(case) -> int | None:
    rule = RULES.get(case.op, case.domain)
    top = rule.until if rule.until is not None else case.opset
    return next((o for o in range(rule.since, max(top, case.opset) + 1) if _forward_valid(case, o)), None)


#: rows whose rule emits an op its lowest opset lacks (none now; the mechanism stays for a known gap)
KNOWN_INVALID: dict[str, str] = {}
ROWS = [
    pytest.param(c, marks=pytest.mark.xfail(reason=KNOWN_INVALID[c.op], strict=True)) if c.op in KNOWN_INVALID else c
    for c in CASES
]


@pytest.mark.parametrize("case", ROWS, ids=[c.label() for c in CASES])
def test_backward_graph_is_valid_at_the_lowest_opset_the_rule_claims(case):
    opset = _lowest_opset(case)
    assert opset is not None, (
        f"{case.label()}: no opset from {RULES.get(case.op, case.domain).since} where the row is valid"
    )
    model, _, wrt = build_model(dataclasses.replace(case, opset=opset), _dtype(case, opset))
    try:
        result = graphforge.compile(model, [Autodiff(inputs=tuple(wrt))])
    except graphforge.PipelineError as exc:
        # a rule may refuse a form it cannot express at this opset, if it says which opset it needs
        needed = re.search(r"opset (\d+)\+|before opset (\d+)", str(exc))
        assert needed and int(needed.group(1) or needed.group(2)) > opset, str(exc)
        assert "not a valid ONNX model" not in str(exc)
        return
    onnx.checker.check_model(result.model, full_check=True)
    assert {o.version for o in result.model.opset_import if o.domain in ("", "ai.onnx")} == {opset}
