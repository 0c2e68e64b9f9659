"""The gradient rules, one module per op family. Importing this package fills RULES;
the list below is explicit so which rules exist never depends on import order elsewhere."""

from graphforge.passes.autodiff.rules import elementwise, linalg, loss, nn, reduce, shape  # noqa: F401
