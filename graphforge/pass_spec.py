"""Pipeline text: reading ``dce, cse, adamw(lr=3e-4, weight_decay=0.01)`` into passes, and
spelling parameter values so that they read back the same.

A pipeline is written the same way in Python and on the command line. It is read with
Python's own expression parser (``ast``): a pass is a bare name or a call with keyword
arguments; bare words in values are strings, ``true``/``false``/``none`` are booleans and
None, ``[a, b]`` is a list. Values are converted to the types the pass declares.

This module knows passes only as what a registry's ``get`` returns (a class with
``parameters()``), so the Pass protocol (``graphforge/pass_infra.py``) sits above it.
"""

from __future__ import annotations

import ast
import keyword
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

from graphforge.errors import PipelineSpecError


class ParameterValueError(ValueError):
    """A pass parameter outside its valid range; the message names the pass, the parameter,
    the value and what is expected, as the parser's type errors do."""


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(format_value(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin in (tuple, list):
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
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


# --------------------------------------------------------------------------- parsing


def parse_passes(text: str, lookup: Callable[[str], Any]) -> list:
    """The passes ``text`` names, made with their parameters; ``lookup`` gives a pass's class
    from its name (``PassRegistry.get``). Every mistake names what and where."""
    if not text.strip():
        raise PipelineSpecError("the pipeline is empty")
    try:
        tree = ast.parse(f"[{text}]", mode="eval")
    except SyntaxError as exc:
        col = max((exc.offset or 1) - 2, 0)
        what = _unbalanced(text) or f"at column {col + 1} ({exc.msg})"
        raise PipelineSpecError(f"pipeline syntax error {what}: {text!r}") from None
    if not isinstance(tree.body, ast.List):  # e.g. "dce] + [cse" parses as an expression
        raise PipelineSpecError(f"expected a comma-separated list of passes, got: {text!r}")
    return [_build_pass(item, lookup, text) for item in tree.body.elts]


def pass_texts(text: str) -> list[str]:
    """Each pass of pipeline ``text`` as it is written there (``text`` parses: ``parse_passes``)."""
    source = f"[{text}]"
    tree = ast.parse(source, mode="eval")
    return [ast.get_source_segment(source, item) for item in tree.body.elts]


def with_values(pass_text: str, values: dict[str, str]) -> str:
    """``pass_text`` (one pass as written: ``adamw`` or ``adamw(lr=1e-3)``) with the parameters
    in ``values`` (name -> value text) set: a value written there is replaced where it stands,
    others are added after the last; everything else keeps its spelling."""
    item = ast.parse(pass_text, mode="eval").body
    if isinstance(item, ast.Name):
        return f"{pass_text}({', '.join(f'{k}={v}' for k, v in values.items())})" if values else pass_text
    lines = pass_text.splitlines(keepends=True)
    starts = [sum(len(line) for line in lines[:i]) for i in range(len(lines))]

    def offset(line: int, column: int) -> int:  # ast counts columns in UTF-8 bytes
        return starts[line - 1] + len(lines[line - 1].encode()[:column].decode())

    edits, added = [], dict(values)
    for kw in item.keywords:
        if kw.arg in added:
            edits.append(
                (
                    offset(kw.value.lineno, kw.value.col_offset),
                    offset(kw.value.end_lineno, kw.value.end_col_offset),
                    added.pop(kw.arg),
                )
            )
    close = offset(item.end_lineno, item.end_col_offset) - 1  # the closing parenthesis
    if added:
        tail = ", ".join(f"{k}={v}" for k, v in added.items())
        edits.append((close, close, f", {tail}" if item.keywords else tail))
    for start, end, value in sorted(edits, reverse=True):
        pass_text = pass_text[:start] + value + pass_text[end:]
    return pass_text


_CLOSING = {"(": ")", "[": "]"}


def _unbalanced(text: str) -> str | None:
    """Where the brackets of ``text`` do not pair up, said in words (Python's own message
    speaks of the list brackets the parser wraps the text in), or None."""
    opened: list[tuple[str, int]] = []
    quote = None
    for column, char in enumerate(text, start=1):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in _CLOSING:
            opened.append((char, column))
        elif char in ")]":
            if not opened:
                return f"at column {column} ({char!r} closes nothing)"
            if _CLOSING[opened[-1][0]] != char:
                return f"at column {column} ({char!r} does not close the {opened[-1][0]!r} opened at column {opened[-1][1]})"
            opened.pop()
    if opened:
        char, column = opened[-1]
        return f"at column {column} (the {char!r} opened there is never closed: a {_CLOSING[char]!r} is missing)"
    return None


def _build_pass(item: ast.expr, lookup: Callable[[str], Any], text: str):
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
    cls = lookup(name)
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
    raise PipelineSpecError(f"{where}: expected {type_name(tp)}, got {format_value(value)!r}")
