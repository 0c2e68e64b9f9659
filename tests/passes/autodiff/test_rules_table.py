"""Every registered gradient rule, checked against central differences (float64 where
onnxruntime has double kernels, else float32), with static and with symbolic dims."""

from __future__ import annotations

import pytest
from gradcheck import check, no_gradient_model
from graphforge.passes import Autodiff
from graphforge.passes.autodiff import RULES
from op_cases import CASES, NONDIFFERENTIABLE_CASES

import graphforge

DIFFERENTIABLE = sorted(r.op_type for r in RULES if r.differentiable)


def test_every_rule_has_a_row():
    # a row's `after` nodes are checked with it (DequantizeLinear after QuantizeLinear)
    covered = {c.op for c in CASES} | {op for c in CASES for op, _, _ in c.after}
    missing = [op for op in DIFFERENTIABLE if op not in covered]
    assert not missing, f"gradient rules without a table row in tests/passes/autodiff/op_cases.py: {missing}"


def test_every_nondifferentiable_op_has_a_row():
    covered = {c.op for c in NONDIFFERENTIABLE_CASES}
    missing = [r.op_type for r in RULES if not r.differentiable and r.op_type not in covered]
    assert not missing, f"non-differentiable ops without a row: {missing}"


def test_coverage_is_at_least_100_op_types():
    assert len(RULES) >= 100, f"{len(RULES)} op types have rules"


@pytest.mark.parametrize("case", CASES, ids=[c.label() for c in CASES])
def test_gradient_matches_central_differences(case):
    check(case)


@pytest.mark.parametrize("case", [c for c in CASES if c.symbolic], ids=[c.label() for c in CASES if c.symbolic])
def test_gradient_with_symbolic_dims(case):
    check(case, symbolic=True)


@pytest.mark.parametrize("case", NONDIFFERENTIABLE_CASES, ids=[c.label() for c in NONDIFFERENTIABLE_CASES])
def test_nondifferentiable_op_passes_no_gradient(case):
    model, wrt = no_gradient_model(case)
    with pytest.raises(graphforge.PipelineError, match="depends on none of"):
        graphforge.compile(model, [Autodiff(inputs=tuple(wrt))])
