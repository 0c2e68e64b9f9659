"""Graph diff: match two ONNX models by structure and report what differs (text, JSON, HTML).

diff = graphforge.diff.diff_models("before.onnx", "after.onnx")
diff.identical, diff.structurally_identical
print(diff.to_text())          # summary + details
diff.to_json()                 # the schema of docs/diff-json.md
graphforge.diff.assert_models_equal(a, b)   # in tests: AssertionError with the report
"""

from __future__ import annotations

from graphforge.diff.engine import diff_models
from graphforge.diff.result import SCHEMA, SCHEMA_VERSION, GraphDiff, ModelDiff
from graphforge.model_io import ModelSource
from graphforge.roles import node_origin as origin_of


def assert_models_equal(
    a: ModelSource, b: ModelSource, *, structural: bool = False, allow_invalid: bool = False
) -> ModelDiff:
    """Raise AssertionError with the text report unless the models are identical (or, with
    ``structural=True``, identical up to names, initializer values and model-level fields).
    An invalid model raises InvalidModelError unless ``allow_invalid``."""
    diff = diff_models(a, b, allow_invalid=allow_invalid)
    ok = diff.structurally_identical if structural else diff.identical
    if not ok:
        what = "structurally identical" if structural else "identical"
        raise AssertionError(f"models are not {what}:\n{diff.to_text()}")
    return diff


__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "GraphDiff",
    "ModelDiff",
    "assert_models_equal",
    "diff_models",
    "origin_of",
]
