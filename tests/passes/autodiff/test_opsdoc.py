"""docs/ops.md is generated from the gradient registry; it must match what the registry holds now."""

from __future__ import annotations

from graphforge.passes.autodiff import RULES, opsdoc
from graphforge.passes.autodiff.registry import Rule, RuleRegistry

DOC = opsdoc.DEFAULT_OUTPUT


def test_docs_ops_md_is_up_to_date():
    assert DOC.exists(), f"{DOC} is missing; run {opsdoc.COMMAND}"
    assert DOC.read_text() == opsdoc.render(), f"{DOC} is out of date; run {opsdoc.COMMAND}"


def test_every_registered_op_has_a_row_with_a_family():
    text = opsdoc.render()
    for rule in RULES:
        kind = "differentiable" if rule.differentiable else "non-differentiable"
        row = (
            f"| {rule.op_type} | {rule.domain or 'ai.onnx'} | {opsdoc.opsets(rule)} | {opsdoc.family(rule)} | {kind} |"
        )
        assert row in text
        assert opsdoc.family(rule) != "?", f"{rule.op_type}: registered without a module"


def test_render_of_a_small_registry():
    registry = RuleRegistry()
    registry.add(Rule("Foo", lambda ctx, dys: dys, since=13, until=17, module="graphforge.passes.autodiff.rules.toy"))
    registry.add(Rule("Bar", None, module="graphforge.passes.autodiff.rules.toy", domain="com.example"))
    text = opsdoc.render(registry)
    assert "2 op types: 1 differentiable, 1 non-differentiable" in text
    assert "| toy | 2 | 1 |" in text
    assert "| Foo | ai.onnx | 13–17 | toy | differentiable |" in text
    assert "| Bar | com.example | 9+ | toy | non-differentiable |" in text  # no rule claims below OLDEST_OPSET
    assert text.index("| Bar |") < text.index("| Foo |")


def test_check_mode(tmp_path, capsys):
    out = tmp_path / "ops.md"
    assert opsdoc.main(["--output", str(out), "--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    assert opsdoc.main(["--output", str(out)]) == 0
    assert opsdoc.main(["--output", str(out), "--check"]) == 0
    assert out.read_text() == opsdoc.render()
