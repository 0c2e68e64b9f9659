"""Runs cut after each collective a program's marker calls stand for.

A tensor-parallel member's program reads, in the middle of its forward and its backward, the
sum over its group of a value each member computes (``graphforge.TensorParallelReduce``: an
Identity on one process). onnxruntime cannot stop a session for a collective, so a run of
such a model is cut (graphforge.placement.cut) after each of those calls: part k ends with
the call's output, which the group then sums in place before part k + 1 reads it. The parts
run through the runner's one executor, each a session of its own (specialized to the
batch's dims, capture-ready where the runner is), and the cut is made once per model and
set of outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import onnx
import onnxruntime as ort

from graphforge import roles
from graphforge.errors import GraphforgeError
from graphforge.placement.cut import Segment, cut
from graphforge.placement.lean import lean_model
from graphforge.runtime.runner import Hook, Runner, SegmentRun

#: cuts kept for models specialized to a batch's dims (then the cut of the model for any dims)
MAX_CUTS = 16


class Collectives(Protocol):
    """What reduces the marked values across a group (graphforge.distributed.TensorParallel)."""

    #: the marker ops (in graphforge's domain) whose calls' outputs are reduced across the
    #: group -> how ("sum", or "max": the vocabulary-parallel softmax's maximum)
    ops: Mapping[str, str]

    def hook(self, reduced: Sequence[Sequence[str]], how: Mapping[str, str]) -> Hook:
        """The hook for one execution of parts cut after ``reduced[k]`` (part k's marker
        outputs): it reduces each across the group (``how[name]``), in place, before a later
        part reads it."""


class Chains:
    """The runs of a runner's models, each cut after its marker calls of ``collectives.ops``."""

    def __init__(self, runner: Runner, collectives: Collectives):
        self.runner, self.collectives = runner, collectives
        self._cuts: dict[Any, tuple[list[Segment], list[list[str]], dict[str, str]]] = {}

    def runs(
        self,
        key: Any,
        model: Callable[[], onnx.ModelProto],
        where: str,
        keep: Sequence[str],
        fetch: Sequence[str],
        sends: Sequence[str] = (),
        into: Mapping[str, ort.OrtValue] | None = None,
        dims: Mapping[str, int] | None = None,
        *,
        static: bool = True,
    ) -> tuple[list[SegmentRun], Hook | None]:
        """One run of ``model()`` computing ``keep``: its parts, fetching ``fetch`` to the host
        and sending ``sends`` on (written into ``into``'s buffers where given), and the hook
        that sums between them (None where the model has no marker call: one part)."""
        signature = tuple(sorted((dims or {}).items()))
        if signature and (key, tuple(keep), signature) not in self._cuts and len(self._cuts) >= MAX_CUTS:
            signature, dims = (), None  # yet other dims: the parts for any dims
        entry = self._cuts.get((key, tuple(keep), signature))
        if entry is None:
            whole = model()
            # specialized before the cut: a part's inputs then have fixed shapes, which dims
            # named after the batch's could not give it (an activation flattened to [batch * seq, d]),
            # so that every part runs against fixed buffers (captured on CUDA)
            if dims:
                whole = self.runner.specialize(whole, dims, where)
            lean = lean_model(whole, keep, bound=self.runner.carried)
            how = marker_outputs(lean, self.collectives.ops)
            reduced = [[n] for n in how]
            entry = self._cuts[(key, tuple(keep), signature)] = (cut(lean, reduced), reduced, how)
        segments, reduced, how = entry
        into = into or {}
        runs = []
        for segment in segments:
            bound = self.runner.session(
                ("chain", key, tuple(keep), signature, segment.index),
                lambda segment=segment: segment.model,
                f"{where}, part {segment.index + 1} of {len(segments)}",
                profile=True,
                static=static,  # (specialized already, with the whole model: fixed shapes)
            )
            made = set(segment.outputs)
            runs.append(
                SegmentRun(
                    bound,
                    [n for n in fetch if n in made],
                    [*segment.sends, *(n for n in sends if n in made)],
                    {n: v for n, v in into.items() if n in made},
                )
            )
        return runs, (self.collectives.hook(reduced, how) if reduced else None)


class GroupMember:
    """What makes a holder of a runner (a Module, a pipeline stage) a member of a
    tensor-parallel group: ``attach_collectives``, after which its runs are cut after the
    program's marker calls and reduced across the group (its ``_chains``)."""

    runner: Runner
    _chains: Chains | None = None

    def attach_collectives(self, collectives: Collectives) -> None:
        """Join the group ``collectives`` reduces across (graphforge.distributed.TensorParallel):
        from now on every run of a model with marker calls is cut after them."""
        if self._chains is not None:
            raise GraphforgeError(f"this {type(self).__name__} is already a member of a tensor-parallel group")
        self._chains = Chains(self.runner, collectives)

    @property
    def collectives(self) -> Collectives | None:
        """The group this member's runs reduce across (``attach_collectives``), or None."""
        return self._chains.collectives if self._chains is not None else None


def marker_outputs(model: onnx.ModelProto, ops: Mapping[str, str]) -> dict[str, str]:
    """The outputs of ``model``'s calls of graphforge's marker ``ops`` (in its topological
    node order) -> what ``ops`` says of their op."""
    return {
        n.output[0]: ops[n.op_type] for n in model.graph.node if n.op_type in ops and n.domain == roles.MARKER_DOMAIN
    }
