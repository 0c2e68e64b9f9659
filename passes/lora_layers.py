"""The lora pass's linear layers (passes/lora.py): which nodes of a model are linear layers,
what torch module each is, and which of them PEFT's ``target_modules`` rules choose.

A module's name is what PEFT and a user know it by (``model.layers.0.self_attn.q_proj``); the
exports do not always say it. A parameter an exporter keeps has its torch name
(``….q_proj.weight``); a weight TorchScript's constant folding transposed is ``onnx::MatMul_<n>``,
and only its node's name tells the module, as the scope of the *call* (``/model/layers.0/…/
q_proj/MatMul``). A scope is the module path where each module is called by its parent, but
not where a model calls a grandchild directly (OPT's ``self.model.decoder(...)`` is scoped
``/decoder/…``, its parameters named ``model.decoder.…``): the named parameters that nodes of
a scope read (a bias, a norm's weight) map scopes to module paths (``torchscript_modules``).
The dynamo exporter's optimizer folds weights into ``val_<n>`` constants and names its nodes
``node_linear_<n>``: the module is in the nodes' metadata, recorded at import
(``graphforge.ir.TORCH_MODULES``).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import onnx_graphsurgeon as gs

from graphforge import roles
from graphforge.errors import PassError
from graphforge.ir import is_parameter

#: PEFT's word for every linear layer but the output head
ALL_LINEAR = "all-linear"
#: what may stand between an output head's product and a graph output: a reshape, a cast, a
#: bias or scale (an elementwise op with a constant), so that the head is found in every export form
_HEAD_LAYOUT_OPS = {"Reshape", "Transpose", "Identity", "Squeeze", "Unsqueeze", "Flatten", "Cast"}
_HEAD_CONSTANT_OPS = {"Add", "Sub", "Mul", "Div"}
_STANDARD = (None, "", "ai.onnx")


@dataclass(frozen=True)
class LinearLayer:
    """A linear layer of the graph: ``node`` (MatMul or Gemm) multiplies its input by the
    initializer ``weight``, stored [in, out] where ``fan_in_fan_out`` (PEFT's word: a
    TorchScript export's folded ``onnx::MatMul_…``, GPT-2's Conv1D) and [out, in] otherwise
    (torch's Linear, read through a Transpose or a Gemm's transB); ``module``: its name."""

    node: gs.Node
    weight: gs.Constant
    fan_in_fan_out: bool
    module: str

    @property
    def features(self) -> tuple[int, int]:
        """(in, out)."""
        rows, cols = (int(d) for d in self.weight.shape)
        return (rows, cols) if self.fan_in_fan_out else (cols, rows)

    @property
    def keys(self) -> tuple[str, ...]:
        """The names targets match: the module's, and its weight's."""
        return tuple(dict.fromkeys((self.module, self.weight.name)))


# --------------------------------------------------------------------------- finding linear layers


def linear_layers(graph: gs.Graph, recorded: Mapping[str, str]) -> list[LinearLayer]:
    """The main graph's linear layers in graph order, each with its module name (the lora
    pass's cases 1 and 2); ``recorded``: a layer's first output -> its module, as a dynamo
    export's node metadata says (``graphforge.ir.TORCH_MODULES``)."""
    modules = torchscript_modules(graph)
    found = []
    for node in graph.nodes:
        if node.domain not in _STANDARD or (node.name or "").startswith(roles.LORA_PREFIX) or len(node.inputs) < 2:
            continue
        weight, fan_in_fan_out = _weight_of(node)
        if weight is not None:
            name = recorded.get(node.outputs[0].name) or _module_name(node, weight, modules)
            found.append(LinearLayer(node, weight, fan_in_fan_out, name))
    return _unambiguous(found)


def _weight_of(node: gs.Node) -> tuple[gs.Constant | None, bool]:
    """The 2-D initializer ``node`` multiplies its input by, and whether it is stored [in, out]."""
    x, w = node.inputs[0], node.inputs[1]
    if isinstance(x, gs.Constant):
        return None, False
    if node.op == "Gemm":
        plain = int(node.attrs.get("transA", 0)) == 0 and float(node.attrs.get("alpha", 1.0)) == 1.0
        return (w, not int(node.attrs.get("transB", 0))) if plain and _is_matrix(w) else (None, False)
    if node.op != "MatMul":
        return None, False
    if _is_matrix(w):
        return w, True
    producer = w.inputs[0] if isinstance(w, gs.Variable) and len(w.inputs) == 1 else None
    if producer is not None and producer.op == "Transpose" and producer.domain in _STANDARD:
        source = producer.inputs[0]
        if _is_matrix(source) and [int(p) for p in producer.attrs.get("perm", [1, 0])] == [1, 0]:
            return source, False
    return None, False


def _is_matrix(t: gs.Tensor) -> bool:
    return is_parameter(t) and t.shape is not None and len(t.shape) == 2


def _module_name(node: gs.Node, weight: gs.Constant, modules: Mapping[str, str]) -> str:
    """From the weight's torch name, else the node's TorchScript scope as a module path, else
    the weight's name."""
    if weight.name.endswith(".weight") and len(weight.name) > len(".weight"):
        return weight.name[: -len(".weight")]
    scope = torchscript_scope(node.name)
    return weight.name if scope is None else module_path(scope, modules)


def torchscript_scope(node_name: str | None) -> str | None:
    """The scope TorchScript's exporter names a node with, dotted: ``/model/layers.0/q_proj/MatMul``
    gives ``model.layers.0.q_proj``; None for a name of another form."""
    parts = (node_name or "").split("/")
    if len(parts) < 3 or parts[0] or not all(parts[1:-1]):
        return None
    return ".".join(parts[1:-1])


def torchscript_modules(graph: gs.Graph) -> dict[str, str]:
    """Scope -> module path, where a node of the scope reads a parameter named in that module
    (``<module>.bias``: the same last name, another path): what the scope of a module that its
    grandparent calls directly stands for."""
    found: dict[str, str] = {}
    for node in graph.nodes:
        scope = torchscript_scope(node.name)
        if scope is None or scope in found:
            continue
        for t in node.inputs:
            owner = t.name.rsplit(".", 1)[0] if isinstance(t, gs.Constant) and "." in t.name else None
            if owner and owner.rsplit(".", 1)[-1] == scope.rsplit(".", 1)[-1]:
                found[scope] = owner
                break
    return found


def module_path(scope: str, modules: Mapping[str, str]) -> str:
    """``scope``'s module path: its own where ``modules`` has it, else with the longest scope
    prefix that a known pair rewrites (``decoder`` → ``model.decoder``, learnt from
    ``decoder.layers.0.fc1`` ↔ ``model.decoder.layers.0.fc1``), else the scope as it is."""
    if scope in modules:
        return modules[scope]
    best: tuple[int, str, str] | None = None
    for known, path in modules.items():
        rewrite = _prefix_rewrite(known, path)
        applies = rewrite is not None and (scope == rewrite[0] or scope.startswith(rewrite[0] + "."))
        if applies and (best is None or len(rewrite[0]) > best[0]):
            best = (len(rewrite[0]), *rewrite)
    return scope if best is None else best[2] + scope[best[0] :]


def _prefix_rewrite(scope: str, path: str) -> tuple[str, str] | None:
    """The scope prefix and the path prefix where ``scope`` and ``path`` part, up to their
    first common name: ("decoder", "model.decoder") for ``decoder.layers.0.fc1`` and
    ``model.decoder.layers.0.fc1``; None where they are equal or share no ending."""
    a, b = scope.split("."), path.split(".")
    common = 0
    while common < min(len(a), len(b)) and a[-1 - common] == b[-1 - common]:
        common += 1
    if common == 0 or common == len(a) == len(b):
        return None
    return ".".join(a[: len(a) - common + 1]), ".".join(b[: len(b) - common + 1])


def _unambiguous(layers: list[LinearLayer]) -> list[LinearLayer]:
    """Case 2's last rule: a module name that stands for two weights names neither."""
    weights: dict[str, set[str]] = {}
    for layer in layers:
        weights.setdefault(layer.module, set()).add(layer.weight.name)
    return [layer if len(weights[layer.module]) == 1 else replace(layer, module=layer.weight.name) for layer in layers]


# --------------------------------------------------------------------------- choosing them


def select(
    layers: Sequence[LinearLayer], targets: str | Sequence[str], exclude: str | Sequence[str], graph: gs.Graph
) -> list[LinearLayer]:
    """Case 3: the layers ``targets`` choose and ``exclude`` does not, as PEFT matches modules."""
    if not layers:
        raise PassError("the model has no linear layer (a MatMul or Gemm by a 2-D floating-point initializer)")
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        heads = {id(layer.node) for layer in layers if is_output_head(layer.node, graph)}
        chosen = [layer for layer in layers if id(layer.node) not in heads]
        if not chosen:
            raise PassError("targets=all-linear leaves no layer: the model's only linear layers are its output head")
    else:
        chosen = _matching(layers, targets, "targets")
    if exclude:
        removed = {id(layer.node) for layer in _matching(layers, exclude, "exclude")}
        chosen = [layer for layer in chosen if id(layer.node) not in removed]
        if not chosen:
            raise PassError(f"exclude={_shown(exclude)} removes every layer targets={_shown(targets)} chose")
    return chosen


def _matching(layers: Sequence[LinearLayer], patterns: str | Sequence[str], what: str) -> list[LinearLayer]:
    """The layers ``patterns`` match; a pattern that matches none is an error naming the closest names."""
    items = [patterns] if isinstance(patterns, str) else list(patterns)
    matched: dict[int, LinearLayer] = {}
    for item in items:
        hits = [layer for layer in layers if _matches(patterns, item, layer.keys)]
        if not hits:
            raise PassError(
                f"{what} pattern {item!r} matches no linear layer; the closest names: {_closest(item, layers)}"
            )
        matched.update((id(layer.node), layer) for layer in hits)
    return [layer for layer in layers if id(layer.node) in matched]


def _matches(patterns: str | Sequence[str], item: str, keys: Sequence[str]) -> bool:
    if isinstance(patterns, str):  # a regular expression, matched whole (PEFT's re.fullmatch)
        return any(re.fullmatch(item, key) for key in keys)
    return any(key == item or key.endswith("." + item) for key in keys)


def _closest(item: str, layers: Sequence[LinearLayer]) -> str:
    names = list(dict.fromkeys(n for layer in layers for key in layer.keys for n in (key, key.rsplit(".", 1)[-1])))
    close = difflib.get_close_matches(item, names, n=5, cutoff=0.4)
    return ", ".join(close or names[:5]) + ("" if close or len(names) <= 5 else ", …")


def is_output_head(node: gs.Node, graph: gs.Graph) -> bool:
    """Case 3's output head: ``node``'s product reaches a graph output through layout ops and
    elementwise ops with a constant alone, each the only reader of what it reads."""
    outputs = {id(t) for t in graph.outputs}
    t = node.outputs[0]
    while id(t) not in outputs:
        readers = list(t.outputs)
        if len(readers) != 1 or readers[0].domain not in _STANDARD:
            return False
        reader = readers[0]
        others = [x for x in reader.inputs if x is not t]
        if reader.op in _HEAD_CONSTANT_OPS:
            if not all(isinstance(x, gs.Constant) for x in others):
                return False
        elif reader.op not in _HEAD_LAYOUT_OPS:
            return False
        t = reader.outputs[0]
    return True


def _shown(patterns) -> str:
    return repr(patterns) if isinstance(patterns, str) else "[" + ", ".join(patterns) + "]"
