"""The freeze pass: freeze a forward model's backbone (its weights by name, or all that compute a tensor)."""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass

import networkx as nx
import numpy as np
import onnx_graphsurgeon as gs

from graphforge import roles
from graphforge.dag import outer_inputs, to_digraph
from graphforge.errors import PassError
from graphforge.graph import Model
from graphforge.ir import is_parameter
from graphforge.pass_infra import Fact, Pass, PassResult
from graphforge.pass_spec import ParameterValueError
from graphforge.program import FrozenWeight, ProgramRoles


@dataclass(frozen=True)
class Freeze(Pass):
    """Freeze weights of a forward model, as transfer learning freezes a backbone: they stay
    constants of every session, with no gradient, and the backward stops at the first layer
    that trains.

    1. The weights are the model's floating-point initializers (not the constants
       graphforge's passes made: a loss's smoothing, an adapter's scale).
    2. ``names``: globs (``features.*``) a weight's name matches; ``regex``: a regular
       expression a weight's name matches whole (``features[.]([0-9]|1[0-3])[.].*``);
       ``before``: tensors (or nodes, standing for their outputs) whose whole computation is
       frozen: every weight a node computing them reads (a weight named there is frozen
       itself). A weight any of the three selects is frozen; ``keep``: globs of weights that
       train even so.
    3. A glob, regular expression or ``before`` name that selects no weight is an error that
       names it and the closest names; so is selecting every weight (nothing would train).
    4. Roles: the frozen weights are recorded frozen (``graphforge.frozen``, by "freeze"),
       beside those frozen before; autodiff reads the role: they get no gradient (unless named
       in its ``trainable`` without a wildcard), so no optimizer state, and no input gradient
       is computed below the first weight that trains. The graph itself is left as it was.
    It comes before autodiff: after it, the pass is refused (the gradients are made already).
    """

    name = "freeze"
    refuses = (Fact.GRADIENTS,)
    names: tuple[str, ...] = ()
    regex: str = ""
    before: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()

    def __post_init__(self):
        for what in ("names", "before", "keep"):
            value = getattr(self, what)
            if isinstance(value, str) or any(not isinstance(v, str) or not v for v in value):
                raise ParameterValueError(f"pass 'freeze' parameter {what!r}: expected a list of names, got {value!r}")
        try:
            re.compile(self.regex)
        except re.error as exc:
            raise ParameterValueError(
                f"pass 'freeze' parameter 'regex': {self.regex!r} is no regular expression ({exc})"
            ) from None

    def run(self, model: Model) -> PassResult:
        if not (self.names or self.regex or self.before):
            raise PassError("give names=[...], regex=... or before=[...]: the weights to freeze")
        graph = model.graph
        weights = _weights(graph)
        chosen = self._by_name(weights) | self._before(graph, weights)
        chosen -= {w for w in chosen if any(fnmatch.fnmatchcase(w, p) for p in self.keep)}
        existing = ProgramRoles.of_model(model).frozen
        if not set(weights) - chosen - set(existing):
            raise PassError(f"freeze selects every one of the model's {len(weights)} weights: nothing would train")
        frozen = {name: f.to_json() for name, f in existing.items()}
        added = [w for w in weights if w in chosen and w not in frozen]
        frozen.update({w: FrozenWeight(w, "freeze").to_json() for w in added})
        roles.set_json(model, roles.FROZEN, frozen)
        size = sum(int(np.prod(weights[w])) for w in added)
        left = len(weights) - len(frozen)
        return PassResult(model, bool(added), f"froze {len(added)} weights ({size:,} values); {left} may train")

    def _by_name(self, weights: dict) -> set[str]:
        """Case 2's ``names`` and ``regex``, case 3's refusal of one selecting nothing."""
        chosen: set[str] = set()
        for pattern in self.names:
            hits = {w for w in weights if fnmatch.fnmatchcase(w, pattern)}
            if not hits:
                raise PassError(f"names pattern {pattern!r} matches no weight{_closest(pattern, weights)}")
            chosen |= hits
        if self.regex:
            hits = {w for w in weights if re.fullmatch(self.regex, w)}
            if not hits:
                raise PassError(f"regex {self.regex!r} matches no weight's whole name{_closest(self.regex, weights)}")
            chosen |= hits
        return chosen

    def _before(self, graph: gs.Graph, weights: dict) -> set[str]:
        """Case 2's ``before``: the weights read by every node an output named there depends on."""
        if not self.before:
            return set()
        tensors = graph.tensors()
        nodes = {n.name: i for i, n in enumerate(graph.nodes) if n.name}
        producer = {id(t): i for i, n in enumerate(graph.nodes) for t in n.outputs}
        dag = to_digraph(graph)
        chosen: set[str] = set()
        for name in self.before:
            if name in tensors:
                starts = [producer[id(tensors[name])]] if id(tensors[name]) in producer else []
                chosen |= {name} & set(weights)
            elif name in nodes:
                starts = [nodes[name]]
            else:
                raise PassError(
                    f"before names {name!r}, no tensor or node of the model{_closest(name, [*tensors, *nodes])}"
                )
            found = _read_weights((graph.nodes[i] for s in starts for i in (s, *nx.ancestors(dag, s))), weights)
            if not found and name not in weights:
                raise PassError(f"no weight computes {name!r} (before names it): nothing to freeze there")
            chosen |= found
        return chosen


def _weights(graph: gs.Graph) -> dict[str, tuple[int, ...]]:
    """Case 1: name -> shape of each weight, in the graph's order."""
    return {
        t.name: tuple(t.shape)
        for t in graph.tensors().values()
        if is_parameter(t) and not t.name.startswith(roles.PASS_CONSTANT_PREFIXES)
    }


def _read_weights(nodes: Iterable[gs.Node], weights: dict) -> set[str]:
    """The weights ``nodes`` read, their subgraphs' reads of outer weights included."""
    return {t.name for n in nodes for t in (*n.inputs, *outer_inputs(n, constants=True)) if t.name in weights}


def _closest(name: str, candidates) -> str:
    near = difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.5)
    return f" (closest: {', '.join(near)})" if near else ""
