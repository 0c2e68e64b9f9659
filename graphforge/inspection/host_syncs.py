"""``graphforge inspect --host-syncs``: the nodes of each session of a model's run that wait
for the host on a GPU, as the runner makes the session for a batch's dims (specialized)."""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from graphforge.analysis.host_sync import HostSync, host_syncs
from graphforge.graph import Model
from graphforge.passes.specialize import input_dims, specialized
from graphforge.placement.lean import lean_model
from graphforge.placement.step import step_models
from graphforge.program import ProgramRoles


@dataclass(frozen=True)
class SessionSyncs:
    """One session's nodes, and those that sync with the host, before and after specialization."""

    label: str
    nodes: int
    syncs: list[HostSync]
    general_nodes: int
    general_syncs: list[HostSync]


def session_syncs(proto: onnx.ModelProto, dims: dict[str, int], *, in_place: bool = True) -> list[SessionSyncs]:
    """Each session of ``proto``'s run (a training program's train_step as a Module runs it,
    any other model's inference run), specialized to ``dims``."""
    roles = ProgramRoles.of_proto(proto)
    if roles.is_training_program:
        models = step_models(proto, roles, in_place=in_place)
    else:
        models = {"inference": lean_model(proto)}
    found = []
    for label, model in models.items():
        general = host_syncs(Model.from_proto(model).graph)
        special = specialized(model, dims)
        found.append(
            SessionSyncs(
                label,
                len(special.graph.node),
                host_syncs(Model.from_proto(special).graph),
                len(model.graph.node),
                general,
            )
        )
    return found


def host_sync_lines(proto: onnx.ModelProto, dims: dict[str, int], *, in_place: bool = True) -> list[str]:
    """What ``inspect --host-syncs`` prints."""
    at = ", ".join(f"{k}={v}" for k, v in sorted(dims.items())) or "no dims given"
    lines = [f"host syncs of each session at {at}, as the runner makes it (specialized to those dims):"]
    unbound = sorted(input_dims(proto) - set(dims))
    if unbound:
        lines.append(f"  symbolic dims left unbound (name them with --dim NAME=SIZE): {', '.join(unbound)}")
    for s in session_syncs(proto, dims, in_place=in_place):
        now = f"{len(s.syncs)} node(s) sync with the host" if s.syncs else "no node syncs with the host"
        lines.append(
            f"  {s.label}: {s.nodes:,} nodes, {now} (unspecialized: {s.general_nodes:,} nodes, {len(s.general_syncs)} sync)"
        )
        lines += [f"    {sync.describe()}" for sync in s.syncs]
    return lines
