"""Golden models: the shipped models compiled through their pipelines, compared with recorded expectations.

``check(folder)`` compares, ``update(folder)`` records; both return a Report whose
``to_text()`` is what ``graphforge golden check|update`` prints. See ``layout`` for the
folder's files and ``runner`` for what a case runs.
"""

from graphforge.golden.compare import Problem
from graphforge.golden.fingerprint import fingerprint, op_histogram, summarize
from graphforge.golden.layout import (
    Expectation,
    GoldenError,
    Tolerance,
    Value,
    read_expectation,
    write_expectation,
)
from graphforge.golden.suite import STAGES, CaseResult, Report, check, update

__all__ = [
    "STAGES",
    "CaseResult",
    "Expectation",
    "GoldenError",
    "Problem",
    "Report",
    "Tolerance",
    "Value",
    "check",
    "fingerprint",
    "op_histogram",
    "read_expectation",
    "summarize",
    "update",
    "write_expectation",
]
