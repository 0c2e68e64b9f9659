"""What a PyTorch export records about training beyond its ops, as autodiff honours it.

1. Padding rows: torch gives row p of an ``nn.Embedding(padding_idx=p)`` no gradient from its
   lookups, and the exported Gather does not say p. Where the model records it
   (``graphforge.ir.TORCH_PADDING_ROWS``: the dynamo exporter's node metadata, or
   ``export_for_training``), a driver hook zeroes the lookup's incoming gradient at the
   positions that looked up p. What else reads the weight (a tied output layer) still
   gives row p its gradient, as in torch.
2. Where a PyTorch export cannot tell (TorchScript's writes no node metadata), the lookups of
   trained parameters are named in one warning.
3. Frozen parameters: those torch does not train (``requires_grad=False``,
   ``graphforge.ir.TORCH_FROZEN``) are left out unless named in ``trainable``, with one warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import onnx_graphsurgeon as gs
from graphforge.passes.autodiff.driver import Hook

from graphforge.graph import Model
from graphforge.ir import TORCH_FROZEN, TORCH_KINDS, TORCH_PADDING_ROWS, recorded_json

#: the producer name torch.onnx writes (both exporters)
_TORCH_PRODUCER = "pytorch"


def padding_hooks(model: Model) -> dict[int, Hook]:
    """Case 1: id(lookup node) -> the hook giving its padding row no gradient."""
    rows = recorded_json(model.metadata, TORCH_PADDING_ROWS, dict, {})
    hooks: dict[int, Hook] = {}
    for node in model.graph.nodes if rows else ():
        row = rows.get(node.outputs[0].name) if _is_lookup(node) else None
        if isinstance(row, int) and not isinstance(row, bool):
            hooks[id(node)] = _without_row(row)
    return hooks


def _is_lookup(node: gs.Node) -> bool:
    return node.op == "Gather" and node.domain in (None, "", "ai.onnx") and int(node.attrs.get("axis", 0)) == 0


def _without_row(row: int) -> Hook:
    def hook(ctx, dys: list) -> list:
        dy, ids = dys[0], ctx.x(1)
        if dy is None:
            return dys
        is_padding = ctx.op("Equal", ids.cast(np.int64), ctx.const(np.int64(row)))
        rank = ctx.rank(ids)
        trailing = list(range(rank, ctx.rank(ctx.x(0)) - 1 + rank))  # a lookup's row dims
        return [ctx.where(is_padding.unsqueeze(trailing), 0.0, dy), *dys[1:]]

    return hook


def warn_of_unknown_padding(model: Model, parameters: Sequence[gs.Tensor], pass_name: str) -> None:
    """Case 2: a PyTorch export that records nothing of torch's (no ``TORCH_KINDS``) cannot
    say which lookups skip a padding row."""
    if model.graph.producer_name != _TORCH_PRODUCER or TORCH_KINDS in model.metadata:
        return
    trained = {id(t) for t in parameters}
    looked_up = sorted({n.inputs[0].name for n in model.graph.nodes if _is_lookup(n) and id(n.inputs[0]) in trained})
    if looked_up:
        warnings.warn(
            f"{pass_name}: this export does not say whether the embedding lookups of {', '.join(looked_up)} skip a "
            "padding row (nn.Embedding(padding_idx=...)), so every row looked up gets a gradient, where torch gives "
            "the padding row none; export with torch.onnx.export(dynamo=True) or graphforge.torch.export_for_training "
            "to have it honoured",
            stacklevel=4,  # the caller of run()
        )


def frozen_parameters(model: Model) -> set[str]:
    """Case 3: the parameters torch does not train, as the model records them."""
    frozen = recorded_json(model.metadata, TORCH_FROZEN, list, [])
    return {name for name in frozen if isinstance(name, str)}


def warn_of_frozen(left_out: Sequence[str], pass_name: str) -> None:
    if left_out:
        shown = ", ".join(left_out[:5]) + (f" and {len(left_out) - 5} more" if len(left_out) > 5 else "")
        warnings.warn(
            f"{pass_name}: {len(left_out)} parameter(s) torch does not train (requires_grad=False) stay frozen: "
            f"{shown}; name them in trainable=[...] to train them",
            stacklevel=5,  # the caller of run()
        )
