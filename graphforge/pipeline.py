"""Passes: the Pass protocol, an explicit registry, and the textual pipeline parser.

The shipped passes' registry lives with them (``graphforge.passes.REGISTRY``), and the
PassManager that runs a pipeline above both (``graphforge/pass_manager.py``): passes import
this module, so it names none of them.

A pipeline is written the same way in Python and on the command line::

    "dce, cse, fold_constants, autodiff, adamw(lr=3e-4, weight_decay=0.01)"

``PassRegistry.parse`` reads it with Python's own expression parser (``ast``): a pass is a bare name or a
call with keyword arguments; bare words in values are strings, ``true``/``false`` are
booleans, ``[a, b]`` is a list. Values are converted to the types the pass declares.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import keyword
import math
import numbers
import operator
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from graphforge import roles
from graphforge.errors import PipelineSpecError
from graphforge.graph import Model


class Fact(enum.Enum):
    """What a model already is, as its recorded roles say: what passes require of the model
    they get, refuse to find in it, and ensure of the model they return. The PassManager
    checks all three, so a pass states them instead of checking them itself.

    Each value: (what it is, the metadata key that records it, what to do when it is missing)."""

    LOSS = ("a loss", roles.LOSS, "add one with the loss pass, e.g. loss(kind=cross_entropy, output=logits)")
    GRADIENTS = ("the gradients", roles.GRADIENTS, "put `autodiff` before it in the pipeline")
    OPTIMIZER = (
        "an optimizer step",
        roles.OPTIMIZER,
        "put an optimizer pass (sgd, adam, adamw, lamb) before it in the pipeline",
    )
    ALLREDUCE = (
        "the gradients' allreduce",
        roles.ALLREDUCE,
        "put `allreduce` after the optimizer pass in the pipeline",
    )
    MIXED_PRECISION = (
        "mixed precision",
        roles.MIXED_PRECISION,
        "put `mixed_precision(dtype=float16)` after the optimizer pass in the pipeline",
    )
    PIPELINE = ("pipeline stages", roles.PIPELINE, "put `pipeline(stages=..., microbatches=...)` in the pipeline")
    GRADIENT_BOUNDARY = (
        "a gradient boundary",
        roles.GRADIENT_BOUNDARY,
        "put an optimizer pass (sgd, adam, adamw, lamb) before it in the pipeline (a program compiled "
        "before graphforge recorded the boundary needs compiling again)",
    )

    def __init__(self, what: str, key: str, hint: str):
        self.what = what
        self.key = key
        self.hint = hint

    def holds(self, model: Model) -> bool:
        return self.key in model.metadata


def facts_of(metadata: Mapping[str, str]) -> set[Fact]:
    """The facts a model's metadata records."""
    return {fact for fact in Fact if fact.key in metadata}


def unmet_requirement(passes: Sequence[Pass], facts: set[Fact]) -> tuple[int, Pass, Fact] | None:
    """The first (position, pass, fact) where a pass requires a fact that neither the input
    (``facts``) nor an earlier pass provides, so a pipeline in the wrong order is refused
    before any pass runs; None when every requirement can be met."""
    available = set(facts)
    for position, pass_ in enumerate(passes, start=1):
        for fact in pass_.requires:
            if fact not in available:
                return position, pass_, fact
        available |= set(pass_.ensures)
    return None


@dataclass(frozen=True)
class PassResult:
    """What a pass returns: the model it produced, whether it changed anything, and an
    optional one-line note for the report (e.g. how much smaller the model became)."""

    model: Model
    changed: bool
    note: str = ""


class Pass:
    """Base of every pass. Subclasses are dataclasses whose fields are their parameters.

    A subclass sets ``name`` (the word used in pipelines), writes a docstring (shown by
    ``graphforge passes``) and implements :meth:`run`. It may mutate ``model`` in place and
    return it; the PassManager keeps the input safe, verifies and times the result. A pass
    that can expose more work for itself sets ``repeat_to_fixed_point``.

    Its conditions are declared, and the PassManager checks them: ``requires`` (facts the
    model must have: the optimizer needs the gradients), ``refuses`` (facts it must not have
    yet: a second optimizer), ``ensures`` (facts its result has).
    """

    name: ClassVar[str]
    repeat_to_fixed_point: ClassVar[bool] = False
    requires: ClassVar[tuple[Fact, ...]] = ()
    refuses: ClassVar[tuple[Fact, ...]] = ()
    ensures: ClassVar[tuple[Fact, ...]] = ()

    def run(self, model: Model) -> PassResult:
        raise NotImplementedError

    @classmethod
    def parameters(cls) -> list[Parameter]:
        hints = typing.get_type_hints(cls)
        return [
            Parameter(f.name, hints[f.name], _default_of(f))
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            if f.init
        ]

    @classmethod
    def description(cls) -> str:
        """The class docstring, dedented; empty when the pass has none (not dataclass's
        generated ``Name(field: type = default)`` text)."""
        doc = cls.__doc__ or ""
        try:
            generated = cls.__name__ + str(inspect.signature(cls)).replace(" -> None", "")
        except (TypeError, ValueError):
            generated = None
        return "" if doc == generated else inspect.cleandoc(doc)

    @classmethod
    def summary(cls) -> str:
        doc = cls.description()
        return doc.splitlines()[0] if doc else ""

    def spec(self) -> str:
        """This pass written back as pipeline text."""
        args = [
            f"{p.name}={_format_value(getattr(self, p.name))}"
            for p in self.parameters()
            if getattr(self, p.name) != p.default
        ]
        return f"{self.name}({', '.join(args)})" if args else self.name


_REQUIRED = object()


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return _REQUIRED


@dataclass(frozen=True)
class Parameter:
    name: str
    type: Any
    default: Any

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED

    def describe(self) -> str:
        default = "" if self.required else f" = {_format_value(self.default)}"
        return f"{self.name}: {_type_name(self.type)}{default}"


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(_format_value(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (tuple, list):
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_format_value(v) for v in value) + "]"
    if isinstance(value, str) and not _reads_back_as_bare_word(value):
        return repr(value)  # quoted, so that spec() text parses back to the same string
    return str(value)


def _reads_back_as_bare_word(text: str) -> bool:
    """Whether ``text`` written unquoted parses back as this same string (see ``_literal``)."""
    # ASCII only: Python NFKC-normalizes non-ASCII identifiers, so "ﬁ" would read back as "fi"
    parts = text.split(".")
    return (
        text.isascii()
        and text.lower() not in ("true", "false", "none")
        and all(part.isidentifier() and not keyword.iskeyword(part) for part in parts)
    )


# --------------------------------------------------------------------------- parameter ranges


class ParameterValueError(ValueError):
    """A pass parameter outside its valid range; the message names the pass, the parameter,
    the value and what is expected, as the parser's type errors do."""


def check_number(
    pass_: Pass,
    parameter: str,
    *,
    at_least: float | None = None,
    above: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
) -> None:
    """Refuse a numeric parameter that is not a finite number within the bounds given
    (``at_least``/``at_most`` inclusive, ``above``/``below`` exclusive); None passes (an
    optional parameter left unset). Call it from the pass's ``__post_init__``."""
    value = getattr(pass_, parameter)
    if value is None:
        return
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    bounds = ((at_least, operator.ge), (above, operator.gt), (below, operator.lt), (at_most, operator.le))
    ok = ok and all(bound is None or holds(value, bound) for bound, holds in bounds)
    if not ok:
        raise ParameterValueError(
            f"pass {pass_.name!r} parameter {parameter!r}: expected {_range_text(at_least, above, below, at_most)}, "
            f"got {_format_value(value)}"
        )


def _range_text(at_least, above, below, at_most) -> str:
    """'a finite number ≥ 0', 'a number in [0, 1)', ..."""
    low = f"[{at_least:g}" if at_least is not None else f"({above:g}" if above is not None else None
    high = f"{at_most:g}]" if at_most is not None else f"{below:g})" if below is not None else None
    if low and high:
        return f"a number in {low}, {high}"
    if low:
        return f"a finite number {'≥' if at_least is not None else '>'} {low[1:]}"
    if high:
        return f"a finite number {'≤' if at_most is not None else '<'} {high[:-1]}"
    return "a finite number"


# --------------------------------------------------------------------------- registry


class PassRegistry:
    """An explicit name → pass-class table; registering a name twice is an error."""

    def __init__(self, passes: Iterable[type[Pass]] = ()):
        self._passes: dict[str, type[Pass]] = {}
        for cls in passes:
            self.register(cls)

    def register(self, cls: type[Pass]) -> type[Pass]:
        if not (isinstance(cls, type) and issubclass(cls, Pass)):
            raise TypeError(f"{cls!r} is not a Pass subclass")
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not (name.isascii() and name.isidentifier()) or keyword.iskeyword(name):
            raise TypeError(f"pass {cls.__name__} needs a class attribute name that a pipeline can spell, got {name!r}")
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"pass {cls.__name__} must be a dataclass (its fields are its parameters)")
        if cls.name in self._passes:
            raise ValueError(
                f"pass name {cls.name!r} is registered twice ({self._passes[cls.name].__name__}, {cls.__name__})"
            )
        self._passes[cls.name] = cls
        return cls

    def get(self, name: str) -> type[Pass]:
        try:
            return self._passes[name]
        except KeyError:
            raise PipelineSpecError(f"unknown pass {name!r}; valid passes: {', '.join(sorted(self._passes))}") from None

    def __iter__(self) -> Iterator[type[Pass]]:
        return iter(sorted(self._passes.values(), key=lambda c: c.name))

    def __contains__(self, name: str) -> bool:
        return name in self._passes

    def parse(self, text: str) -> list[Pass]:
        """Pipeline text as instances of this registry's passes; every mistake names what and
        where. (``graphforge.parse_pipeline`` is this on the shipped passes' registry.)"""
        return _parse_pipeline(text, self)


# --------------------------------------------------------------------------- parsing


def _parse_pipeline(text: str, registry: PassRegistry) -> list[Pass]:
    if not text.strip():
        raise PipelineSpecError("the pipeline is empty")
    try:
        tree = ast.parse(f"[{text}]", mode="eval")
    except SyntaxError as exc:
        col = max((exc.offset or 1) - 2, 0)
        raise PipelineSpecError(f"pipeline syntax error at column {col + 1}: {text!r}") from None
    if not isinstance(tree.body, ast.List):  # e.g. "dce] + [cse" parses as an expression
        raise PipelineSpecError(f"expected a comma-separated list of passes, got: {text!r}")
    return [_build_pass(item, registry, text) for item in tree.body.elts]


def _build_pass(item: ast.expr, registry: PassRegistry, text: str) -> Pass:
    if isinstance(item, ast.Name):
        name, keywords = item.id, []
    elif isinstance(item, ast.Call) and isinstance(item.func, ast.Name):
        name, keywords = item.func.id, item.keywords
        if item.args:
            raise PipelineSpecError(f"pass {name!r}: write parameters as name=value (got a positional value)")
    else:
        raise PipelineSpecError(
            f"expected a pass name or name(param=value, ...) at: {ast.get_source_segment(f'[{text}]', item)!r}"
        )
    cls = registry.get(name)
    params = {p.name: p for p in cls.parameters()}
    kwargs: dict[str, Any] = {}
    for kw in keywords:
        if kw.arg is None:  # name(**value)
            raise PipelineSpecError(f"pass {name!r}: write parameters as name=value")
        if kw.arg not in params:
            valid = ", ".join(p.describe() for p in params.values()) or "none"
            raise PipelineSpecError(f"pass {name!r} has no parameter {kw.arg!r}; its parameters: {valid}")
        if kw.arg in kwargs:  # ast accepts f(a=1, a=2); only compiling it would refuse
            raise PipelineSpecError(f"pass {name!r}: parameter {kw.arg!r} given twice")
        raw = _literal(kw.value, name, kw.arg)
        kwargs[kw.arg] = convert_value(raw, params[kw.arg].type, where=f"pass {name!r} parameter {kw.arg!r}")
    missing = [p.name for p in params.values() if p.required and p.name not in kwargs]
    if missing:
        raise PipelineSpecError(f"pass {name!r} needs parameter(s) {', '.join(missing)}")
    try:
        return cls(**kwargs)
    except ParameterValueError as exc:  # already names the pass
        raise PipelineSpecError(str(exc)) from None
    except (ValueError, TypeError) as exc:
        raise PipelineSpecError(f"pass {name!r}: {exc}") from None


def _literal(node: ast.expr, pass_name: str, param: str) -> Any:
    """A value as written: numbers, strings, bare words (as strings), true/false/none, lists."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        lowered = node.id.lower()
        return {"true": True, "false": False, "none": None}.get(lowered, node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        inner = _literal(node.operand, pass_name, param)
        if isinstance(inner, int | float) and not isinstance(inner, bool):
            return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e, pass_name, param) for e in node.elts]
    if isinstance(node, ast.Attribute):
        # dotted names such as a tensor "h.0.attn" are strings too
        return ast.unparse(node)
    raise PipelineSpecError(f"pass {pass_name!r} parameter {param!r}: cannot read value {ast.unparse(node)!r}")


def convert_value(value: Any, tp: Any, *, where: str) -> Any:
    """Convert a written value to the declared type, or say what was expected."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return convert_value(value, option, where=where)
            except PipelineSpecError:
                continue
    elif origin is Literal:
        if value in typing.get_args(tp):
            return value
        if value is None and "none" in typing.get_args(tp):  # a bare none, where "none" is a choice
            return "none"
    elif origin in (tuple, list):
        (item_type, *_) = typing.get_args(tp)
        items = value if isinstance(value, list) else [value]
        converted = [convert_value(v, item_type, where=where) for v in items]
        return tuple(converted) if origin is tuple else converted
    elif tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
    raise PipelineSpecError(f"{where}: expected {_type_name(tp)}, got {_format_value(value)!r}")
