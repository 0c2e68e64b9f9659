"""The pass infrastructure: the Pass base, the registry, the pipeline parser, value conversion,
and the packaging of ``passes/`` as ``graphforge.passes``."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphforge import GraphforgeError, Pass, PassRegistry, PassResult, PipelineSpecError, parse_pipeline
from graphforge.pass_manager import default_registry
from graphforge.pass_spec import convert_value

REPO = Path(__file__).resolve().parent.parent
#: passes that must always ship; more are added as graphforge grows
CORE_PASSES = {"cse", "dce", "fold_constants", "identity_elimination", "topo_sort"}


# --------------------------------------------------------------------------- test passes


@dataclass(frozen=True)
class Knobs(Pass):
    """Every parameter type the parser converts.

    A second paragraph that ``summary`` leaves out.
    """

    name = "knobs"
    count: int = 1
    rate: float = 0.5
    flag: bool = False
    label: str = "x"
    sizes: list[int] = field(default_factory=list)
    names: tuple[str, ...] = ()
    mode: Literal["fast", "exact"] = "fast"
    limit: int | None = None

    def run(self, model):
        return PassResult(model, False)


@dataclass(frozen=True)
class NeedsTarget(Pass):
    """A pass with a required parameter and a check in __post_init__."""

    name = "needs_target"
    target: str
    ratio: float = 0.5

    def __post_init__(self):
        if not 0 <= self.ratio <= 1:
            raise ValueError(f"ratio must be within [0, 1], got {self.ratio}")

    def run(self, model):
        return PassResult(model, False)


@dataclass(frozen=True)
class Plain(Pass):
    name = "plain"

    def run(self, model):
        return PassResult(model, False)


@pytest.fixture
def registry() -> PassRegistry:
    return PassRegistry([Knobs, NeedsTarget, Plain])


@pytest.fixture
def full_registry() -> PassRegistry:
    return PassRegistry([*default_registry(), Knobs, NeedsTarget, Plain])


def parse_one(text: str, registry: PassRegistry) -> Pass:
    (result,) = parse_pipeline(text, registry)
    return result


def spec_error(text: str, registry: PassRegistry | None = None) -> str:
    with pytest.raises(PipelineSpecError) as info:
        parse_pipeline(text, registry)
    assert isinstance(info.value, GraphforgeError)
    message = str(info.value)
    assert "\n" not in message, "errors are one line"
    return message


# --------------------------------------------------------------------------- parsing: values


def test_bare_names_build_default_instances_in_order():
    passes = parse_pipeline("dce, cse,fold_constants , topo_sort")
    registry = default_registry()
    assert [type(p) for p in passes] == [registry.get(n) for n in ("dce", "cse", "fold_constants", "topo_sort")]
    assert passes[0] == registry.get("dce")()
    assert [p.name for p in passes] == ["dce", "cse", "fold_constants", "topo_sort"]


def test_the_same_pass_can_appear_twice_and_text_may_span_lines():
    passes = parse_pipeline("dce,\n  cse ,\n dce(remove_unused_inputs=true),")
    assert [p.spec() for p in passes] == ["dce", "cse", "dce(remove_unused_inputs=true)"]


def test_call_with_every_value_type(registry):
    knobs = parse_one(
        "knobs(count=3, rate=2, flag=true, label=hello, sizes=[1, 2, 3], names=[a, b.c], mode=exact, limit=7)",
        registry,
    )
    assert knobs == Knobs(
        count=3, rate=2.0, flag=True, label="hello", sizes=[1, 2, 3], names=("a", "b.c"), mode="exact", limit=7
    )
    assert isinstance(knobs.rate, float), "an int written for a float parameter becomes a float"
    assert isinstance(knobs.names, tuple) and isinstance(knobs.sizes, list)


def test_empty_call_is_the_default_instance(registry):
    assert parse_one("knobs()", registry) == Knobs()


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        ("count=-3", {"count": -3}),
        ("count=+4", {"count": 4}),
        ("rate=-1.5e-3", {"rate": -0.0015}),
        ("rate=3e-4", {"rate": 3e-4}),
        ("rate=0", {"rate": 0.0}),
        ("sizes=[-1, 0, 2]", {"sizes": [-1, 0, 2]}),
    ],
)
def test_numbers_including_negative(registry, written, expected):
    assert parse_one(f"knobs({written})", registry) == Knobs(**expected)


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        ("flag=true", True),
        ("flag=false", False),
        ("flag=True", True),
        ("flag=FALSE", False),
    ],
)
def test_booleans(registry, written, expected):
    assert parse_one(f"knobs({written})", registry).flag is expected


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        ("label=logits", "logits"),  # a bare word is a string
        ("label=h.attn.out", "h.attn.out"),  # dotted names (tensor names) too
        ('label="a b, c(d)"', "a b, c(d)"),  # quoted: spaces, commas, parentheses
        ("label='single'", "single"),
        ('label="true"', "true"),  # quoted keeps a word that would read as a boolean
        ('label=""', ""),
        ("label=3", "3"),  # a number for a string parameter is its text
        ("label=-2.5", "-2.5"),
    ],
)
def test_strings(registry, written, expected):
    assert parse_one(f"knobs({written})", registry).label == expected


def test_literal_and_optional_parameters(registry):
    assert parse_one("knobs(mode=exact)", registry).mode == "exact"
    assert parse_one("knobs(mode='fast')", registry).mode == "fast"
    assert parse_one("knobs(limit=none)", registry).limit is None
    assert parse_one("knobs(limit=None)", registry).limit is None
    assert parse_one("knobs(limit=12)", registry).limit == 12


def test_a_single_value_for_a_list_parameter_is_a_one_item_list(registry):
    assert parse_one("knobs(sizes=4, names=x)", registry) == Knobs(sizes=[4], names=("x",))


def test_builtin_parameters_convert():
    (dce,) = parse_pipeline("dce(remove_unused_inputs=true)")
    assert dce.remove_unused_inputs is True
    (fold,) = parse_pipeline("fold_constants(size_limit_mb=4, fold_parameters=true)")
    assert fold.size_limit_mb == 4.0 and isinstance(fold.size_limit_mb, float)
    assert fold.fold_parameters is True
    # "none" is one of loss_scale's words: written bare it reads as none, and means that word
    (amp,) = parse_pipeline("mixed_precision(provider=cpu, loss_scale=none)")
    assert amp.loss_scale == "none"
    assert parse_pipeline(amp.spec()) == [amp]


# --------------------------------------------------------------------------- parsing: errors


def test_unknown_pass_lists_every_valid_pass():
    message = spec_error("dce, nope, cse")
    shipped = sorted(cls.name for cls in default_registry())
    assert message == f"unknown pass 'nope'; valid passes: {', '.join(shipped)}"
    assert set(shipped) >= CORE_PASSES


def test_unknown_pass_in_a_custom_registry_lists_that_registry(registry):
    assert spec_error("dce", registry) == "unknown pass 'dce'; valid passes: knobs, needs_target, plain"


def test_unknown_parameter_lists_valid_parameters():
    message = spec_error("dce(remove_unused=true)")
    assert message == "pass 'dce' has no parameter 'remove_unused'; its parameters: remove_unused_inputs: bool = false"
    message = spec_error("fold_constants(limit=3)")
    assert message.endswith("its parameters: fold_parameters: bool = false, size_limit_mb: float = 16.0")


def test_unknown_parameter_of_a_pass_without_parameters(registry):
    assert spec_error("plain(x=1)", registry) == "pass 'plain' has no parameter 'x'; its parameters: none"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("dce(remove_unused_inputs=3)", "pass 'dce' parameter 'remove_unused_inputs': expected bool, got '3'"),
        ("dce(remove_unused_inputs=yes)", "pass 'dce' parameter 'remove_unused_inputs': expected bool, got 'yes'"),
        (
            "fold_constants(size_limit_mb=big)",
            "pass 'fold_constants' parameter 'size_limit_mb': expected float, got 'big'",
        ),
        (
            "fold_constants(size_limit_mb=true)",
            "pass 'fold_constants' parameter 'size_limit_mb': expected float, got 'true'",
        ),
        ("knobs(count=1.5)", "pass 'knobs' parameter 'count': expected int, got '1.5'"),
        ("knobs(count=true)", "pass 'knobs' parameter 'count': expected int, got 'true'"),
        ("knobs(mode=slow)", "pass 'knobs' parameter 'mode': expected fast | exact, got 'slow'"),
        ("knobs(limit=lots)", "pass 'knobs' parameter 'limit': expected int | none, got 'lots'"),
        ("knobs(sizes=[1, a])", "pass 'knobs' parameter 'sizes': expected int, got 'a'"),
        ("knobs(label=[a, b])", "pass 'knobs' parameter 'label': expected str, got '[a, b]'"),
        ("knobs(label=true)", "pass 'knobs' parameter 'label': expected str, got 'true'"),
    ],
)
def test_wrong_value_type(full_registry, text, message):
    assert spec_error(text, full_registry) == message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("dce(true)", "pass 'dce': write parameters as name=value (got a positional value)"),
        ("dce(**opts)", "pass 'dce': write parameters as name=value"),
        (
            "dce(remove_unused_inputs=not_a_call())",
            "pass 'dce' parameter 'remove_unused_inputs': cannot read value 'not_a_call()'",
        ),
        (
            "fold_constants(size_limit_mb=1+2)",
            "pass 'fold_constants' parameter 'size_limit_mb': cannot read value '1 + 2'",
        ),
        ("fold_constants(size_limit_mb=-x)", "pass 'fold_constants' parameter 'size_limit_mb': cannot read value '-x'"),
        ("1", "expected a pass name or name(param=value, ...) at: '1'"),
        ("dce.cse", "expected a pass name or name(param=value, ...) at: 'dce.cse'"),
        ("'dce'", "expected a pass name or name(param=value, ...) at: \"'dce'\""),
        ("dce] + [cse", "expected a comma-separated list of passes, got: 'dce] + [cse'"),
        ("dce for dce in x", "expected a comma-separated list of passes, got: 'dce for dce in x'"),
    ],
)
def test_malformed_pass(text, message):
    assert spec_error(text) == message


@pytest.mark.parametrize("text", ["dce(", "dce,,cse", "dce cse", "dce(remove_unused_inputs=)", "dce)"])
def test_syntax_error_names_the_text(text):
    message = spec_error(text)
    assert message.startswith("pipeline syntax error at column ")
    assert message.endswith(f": {text!r}")


def test_syntax_error_column_points_into_the_text():
    assert spec_error("dce, cse cse") == (
        "pipeline syntax error at column 6 (invalid syntax. Perhaps you forgot a comma?): 'dce, cse cse'"
    )


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (
            "loss(kind=mse, output=y), autodiff, adamw(lr=3e-4",
            "at column 42 (the '(' opened there is never closed: a ')' is missing)",
        ),
        ("dce(", "at column 4 (the '(' opened there is never closed: a ')' is missing)"),
        ("dce)", "at column 4 (')' closes nothing)"),
        ("adamw(lr=[1, 2), cse", "at column 15 (')' does not close the '[' opened at column 10)"),
        ("x(a=')'", "at column 2 (the '(' opened there is never closed: a ')' is missing)"),
    ],
)
def test_syntax_error_says_which_bracket(text, where):
    assert spec_error(text) == f"pipeline syntax error {where}: {text!r}"


@pytest.mark.parametrize("text", ["", "   ", "\n\t"])
def test_empty_pipeline(text):
    assert spec_error(text) == "the pipeline is empty"


def test_missing_required_parameter(registry):
    assert spec_error("needs_target", registry) == "pass 'needs_target' needs parameter(s) target"
    assert spec_error("needs_target(ratio=0.1)", registry) == "pass 'needs_target' needs parameter(s) target"
    assert parse_one("needs_target(target=logits)", registry) == NeedsTarget(target="logits")


def test_a_parameter_given_twice(full_registry):
    # regression: ast.parse accepts f(a=1, a=2), and the last value silently won
    message = spec_error("dce(remove_unused_inputs=true, remove_unused_inputs=false)")
    assert message == "pass 'dce': parameter 'remove_unused_inputs' given twice"
    assert spec_error("knobs(count=1, rate=2, count=1)", full_registry) == "pass 'knobs': parameter 'count' given twice"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "fold_constants(size_limit_mb=1e400)",  # was an internal OverflowError
            "pass 'fold_constants' parameter 'size_limit_mb': expected a finite number ≥ 0, got inf",
        ),
        (
            "fold_constants(size_limit_mb=-5)",
            "pass 'fold_constants' parameter 'size_limit_mb': expected a finite number ≥ 0, got -5.0",
        ),
        ("adamw(lr=-1)", "pass 'adamw' parameter 'lr': expected a finite number ≥ 0, got -1.0"),
        ("sgd(lr=1e999)", "pass 'sgd' parameter 'lr': expected a finite number ≥ 0, got inf"),
        ("adam(weight_decay=-0.1)", "pass 'adam' parameter 'weight_decay': expected a finite number ≥ 0, got -0.1"),
        ("lamb(clip_grad_norm=0)", "pass 'lamb' parameter 'clip_grad_norm': expected a finite number > 0, got 0.0"),
        ("adamw(beta1=-0.9)", "pass 'adamw' parameter 'beta1': expected a number in [0, 1), got -0.9"),
        ("adam(beta2=1)", "pass 'adam' parameter 'beta2': expected a number in [0, 1), got 1.0"),
        ("lamb(beta1=1.5)", "pass 'lamb' parameter 'beta1': expected a number in [0, 1), got 1.5"),
        ("adamw(eps=0)", "pass 'adamw' parameter 'eps': expected a finite number > 0, got 0.0"),
        ("adam(eps=-1e-8)", "pass 'adam' parameter 'eps': expected a finite number > 0, got -1e-08"),
        ("sgd(momentum=-0.9)", "pass 'sgd' parameter 'momentum': expected a finite number ≥ 0, got -0.9"),
        ("sgd(dampening=2)", "pass 'sgd' parameter 'dampening': expected a number in [0, 1], got 2.0"),
    ],
)
def test_value_out_of_range(text, message):
    assert spec_error(text) == message


def test_range_checks_apply_to_pass_objects_too():
    """The check is the pass's own (``__post_init__``): the Python API gets the same message."""
    from graphforge.passes import AdamW, FoldConstants

    with pytest.raises(ValueError, match=r"^pass 'adamw' parameter 'lr': expected a finite number ≥ 0, got nan$"):
        AdamW(lr=float("nan"))
    with pytest.raises(ValueError, match=r"^pass 'fold_constants' parameter 'size_limit_mb': expected a finite"):
        FoldConstants(size_limit_mb=float("inf"))
    # the edges of each range are valid
    for text in ("adamw(lr=0, beta1=0, beta2=0, weight_decay=0, eps=1e-30)", "sgd(momentum=0, dampening=1)",
                 "fold_constants(size_limit_mb=0)", "lamb(clip_grad_norm=1e-9)"):  # fmt: skip
        parse_pipeline(text)


def test_a_pass_rejecting_its_values_becomes_a_spec_error(registry):
    message = spec_error("needs_target(target=y, ratio=2)", registry)
    assert message == "pass 'needs_target': ratio must be within [0, 1], got 2.0"


def test_convert_value_directly():
    assert convert_value(2, float, where="w") == 2.0
    assert convert_value([1, 2], tuple[int, ...], where="w") == (1, 2)
    assert convert_value(None, int | None, where="w") is None
    assert convert_value("a", Literal["a", "b"], where="w") == "a"
    with pytest.raises(PipelineSpecError, match=r"^here: expected int, got 'x'$"):
        convert_value([1, "x"], list[int], where="here")
    with pytest.raises(PipelineSpecError, match=r"^here: expected float \| none, got 'x'$"):
        convert_value("x", float | None, where="here")


# --------------------------------------------------------------------------- the registry


def test_registry_refuses_a_duplicate_name():
    @dataclass(frozen=True)
    class OtherKnobs(Pass):
        name = "knobs"

    registry = PassRegistry([Knobs])
    with pytest.raises(ValueError, match=r"^pass name 'knobs' is registered twice \(Knobs, OtherKnobs\)$"):
        registry.register(OtherKnobs)
    assert registry.get("knobs") is Knobs, "the first registration stays"
    with pytest.raises(ValueError, match="registered twice"):
        PassRegistry([Knobs, Knobs])


def test_registry_refuses_a_pass_that_is_not_a_dataclass():
    class NotADataclass(Pass):
        name = "not_a_dataclass"

    with pytest.raises(TypeError, match=r"^pass NotADataclass must be a dataclass \(its fields are its parameters\)$"):
        PassRegistry([NotADataclass])


def test_registry_refuses_what_is_not_a_pass():
    @dataclass(frozen=True)
    class NotAPass:
        name = "not_a_pass"

    with pytest.raises(TypeError, match="is not a Pass subclass"):
        PassRegistry().register(NotAPass)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="is not a Pass subclass"):
        PassRegistry().register(Knobs())  # type: ignore[arg-type]


@pytest.mark.parametrize("bad_name", [None, "", "two words", "drop-debug", "class", 3])
def test_registry_refuses_a_name_a_pipeline_cannot_spell(bad_name):
    attrs = {} if bad_name is None else {"name": bad_name}
    cls = dataclass(frozen=True)(type("Nameless", (Pass,), attrs))
    with pytest.raises(TypeError, match="needs a class attribute name that a pipeline can spell"):
        PassRegistry([cls])


def test_registry_lookup_and_iteration(registry):
    assert "knobs" in registry and "dce" not in registry
    assert registry.get("plain") is Plain
    assert [cls.name for cls in registry] == ["knobs", "needs_target", "plain"]
    empty = PassRegistry()
    assert list(empty) == []
    assert spec_error("dce", empty) == "unknown pass 'dce'; valid passes: "


def test_default_registry_holds_every_shipped_pass():
    from graphforge.passes import REGISTRY

    registry = default_registry()
    assert registry is REGISTRY
    names = [cls.name for cls in registry]
    assert names == sorted(set(names)) and set(names) >= CORE_PASSES
    for cls in registry:
        assert cls.summary(), f"{cls.name} needs a docstring: `graphforge passes` shows it"
        assert cls.__module__.startswith("graphforge.passes."), cls.__module__


# --------------------------------------------------------------------------- Pass: parameters, spec


def test_parameters_describe_their_types_and_defaults():
    described = [p.describe() for p in Knobs.parameters()]
    assert described == [
        "count: int = 1",
        "rate: float = 0.5",
        "flag: bool = false",
        "label: str = x",
        "sizes: list[int] = []",
        "names: list[str] = []",
        "mode: fast | exact = fast",
        "limit: int | none = none",
    ]
    (target, ratio) = NeedsTarget.parameters()
    assert target.required and target.describe() == "target: str"
    assert not ratio.required


def test_summary_is_the_first_docstring_line():
    assert Knobs.summary() == "Every parameter type the parser converts."
    assert Plain.summary() == "" and Plain.description() == "", "not dataclass's generated 'Plain()'"
    assert (
        Knobs.description()
        == "Every parameter type the parser converts.\n\nA second paragraph that ``summary`` leaves out."
    )


def test_base_run_is_abstract():
    with pytest.raises(NotImplementedError):
        Pass().run(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("instance", "spec"),
    [
        (Knobs(), "knobs"),
        (Knobs(count=-2, flag=True), "knobs(count=-2, flag=true)"),
        (Knobs(rate=3e-4, names=("a", "b.c")), "knobs(rate=0.0003, names=[a, b.c])"),
        (Knobs(label="a b"), "knobs(label='a b')"),
        (Knobs(label="true"), "knobs(label='true')"),
        (Knobs(label="none"), "knobs(label='none')"),
        (Knobs(label="h.0.attn"), "knobs(label='h.0.attn')"),
        (Knobs(label="3"), "knobs(label='3')"),
        (Knobs(label=""), "knobs(label='')"),
        (Knobs(label="for"), "knobs(label='for')"),
        (Knobs(names=("x y", "z")), "knobs(names=['x y', z])"),
        (Knobs(limit=5, mode="exact"), "knobs(mode=exact, limit=5)"),
        (NeedsTarget(target="logits"), "needs_target(target=logits)"),
    ],
)
def test_spec_writes_non_default_values_and_parses_back(registry, instance, spec):
    assert instance.spec() == spec
    assert parse_one(spec, registry) == instance


def test_every_builtin_pass_spec_round_trips():
    for cls in default_registry():
        instance = cls()
        assert instance.spec() == cls.name
        assert parse_pipeline(instance.spec()) == [instance]
    changed = parse_pipeline("fold_constants(size_limit_mb=4, fold_parameters=true), dce(remove_unused_inputs=true)")
    text = ", ".join(p.spec() for p in changed)
    assert text == "fold_constants(fold_parameters=true, size_limit_mb=4.0), dce(remove_unused_inputs=true)"
    assert parse_pipeline(text) == changed


_labels = st.text(max_size=12) | st.from_regex(
    r"[A-Za-z_][A-Za-z0-9_]{0,6}(\.[A-Za-z_][A-Za-z0-9_]{0,4}){0,2}", fullmatch=True
)


@settings(max_examples=150, deadline=None)
@given(
    count=st.integers(-(2**40), 2**40),
    rate=st.floats(allow_nan=False, allow_infinity=False),
    flag=st.booleans(),
    label=_labels,
    sizes=st.lists(st.integers(-100, 100), max_size=4),
    names=st.lists(_labels, max_size=3).map(tuple),
    mode=st.sampled_from(["fast", "exact"]),
    limit=st.none() | st.integers(-5, 5),
)
def test_spec_round_trips_for_any_values(count, rate, flag, label, sizes, names, mode, limit):
    instance = Knobs(count, rate, flag, label, sizes, names, mode, limit)
    registry = PassRegistry([Knobs])
    assert parse_pipeline(instance.spec(), registry) == [instance]
    assert parse_pipeline(f"{instance.spec()}, {instance.spec()}", registry) == [instance, instance]


# --------------------------------------------------------------------------- packaging of passes/


def _pass_modules() -> list[str]:
    root = REPO / "passes"
    names = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(("graphforge", "passes", *parts)))
    return names


def test_every_module_under_passes_imports_as_graphforge_passes():
    modules = _pass_modules()
    assert "graphforge.passes" in modules and "graphforge.passes.dce" in modules
    for name in modules:
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve().is_relative_to(REPO / "passes"), (name, module.__file__)


def _packages_on_disk() -> set[str]:
    found = set()
    for prefix, root in (("graphforge", REPO / "graphforge"), ("graphforge.passes", REPO / "passes")):
        for init in root.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            found.add(".".join((prefix, *init.parent.relative_to(root).parts)))
    return found


def test_pyproject_lists_every_package():
    """An editable install finds subpackages through the parent's path; the wheel ships only
    the listed packages. So compare the list with the folders."""
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"]["graphforge.passes"] == "passes"
    missing = _packages_on_disk() - set(config["packages"])
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {sorted(missing)}"
    folders_without_init = [
        str(d.relative_to(REPO))
        for d in (REPO / "passes").rglob("*")
        if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py")) and not (d / "__init__.py").exists()
    ]
    assert not folders_without_init, f"folders with modules but no __init__.py: {folders_without_init}"


def test_graphforge_passes_imports_outside_the_repo(tmp_path):
    """The installed mapping, not the working directory, puts passes/ at graphforge.passes."""
    code = (
        "import graphforge.passes as p, pathlib; "
        "print(pathlib.Path(p.__file__).resolve()); print(','.join(c.name for c in p.REGISTRY))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    location, names = proc.stdout.split()
    assert Path(location) == (REPO / "passes" / "__init__.py").resolve()
    assert names.split(",") == [cls.name for cls in default_registry()]
