"""Passes: the Pass protocol, the facts a pass requires, refuses and ensures, and an explicit
registry of passes by name.

The shipped passes' registry lives with them (``graphforge.passes.REGISTRY``), and the
PassManager that runs a pipeline above both (``graphforge/pass_manager.py``): passes import
this module, so it names none of them. Pipeline text is read by ``graphforge/pass_spec.py``.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import keyword
import math
import numbers
import operator
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from graphforge import roles
from graphforge.errors import PipelineSpecError
from graphforge.graph import Model
from graphforge.pass_spec import ParameterValueError, format_value, parse_passes, type_name


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
    STAGES = ("pipeline stages", roles.STAGES, "put `pipeline(stages=..., microbatches=...)` in the pipeline")
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

    def spec(self, *, full: bool = False) -> str:
        """This pass written back as pipeline text: the parameters that differ from their
        defaults, or with ``full`` every one that holds something (not none, not empty)."""
        args = [
            f"{p.name}={format_value(getattr(self, p.name))}"
            for p in self.parameters()
            if (getattr(self, p.name) not in (None, (), [], "") if full else getattr(self, p.name) != p.default)
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
        default = "" if self.required else f" = {format_value(self.default)}"
        return f"{self.name}: {type_name(self.type)}{default}"


# --------------------------------------------------------------------------- parameter ranges


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
            f"got {format_value(value)}"
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
        return parse_passes(text, self.get)
