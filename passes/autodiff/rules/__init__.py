"""The gradient rules, one module per op family. Importing this package fills RULES;
the list below is explicit so which rules exist never depends on import order elsewhere."""

from graphforge.passes.autodiff.rules import (  # noqa: F401
    algebra,
    cnn_norm,
    composite,
    control_flow,
    conv,
    elementwise,
    indexing,
    linalg,
    loss,
    nn,
    parallel,
    pool,
    pooling_extra,
    quantize,
    recurrent,
    reduce,
    shape,
    spatial,
    special,
)
