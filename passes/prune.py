"""Inference export: keep only the forward path to chosen outputs of a (training) program."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

import onnx_graphsurgeon as gs
from graphforge.passes.dce import DeadCodeElimination
from graphforge.passes.fold_constants import FoldConstants
from graphforge.passes.identity_elimination import IdentityElimination

from graphforge import roles
from graphforge.analysis.size import ModelSize
from graphforge.errors import PassError
from graphforge.graph import Model
from graphforge.ir import every_graph, fingerprint, inline_marker_calls
from graphforge.ort_compat import resolve_provider
from graphforge.pass_infra import Pass, PassResult
from graphforge.placement.precision import LOW_TYPES, convert, kernel_check, program_policy, remove_casts
from graphforge.program import ProgramRoles
from graphforge.shapes import infer_shapes

#: metadata keys that stay in a pruned model (everything else under "graphforge." describes training)
_KEPT_WHILE_TRUE = (roles.LOSS, roles.LABELS)


@dataclass(frozen=True)
class Prune(Pass):
    """Keep only what the chosen outputs need: a training program becomes an inference model.

    Works on a training program (``loss, autodiff, <optimizer>``), trained or not, on a
    model after ``loss`` or ``autodiff`` only, and on a plain forward model.

    1. The graph outputs become ``outputs``, in that order (an unknown name is an error
       that lists the model's outputs); every node none of them needs goes: the loss,
       gradient and optimizer nodes, unless a requested output needs them.
    2. Graph inputs the kept graph does not read go (labels, lr, step, optimizer states,
       gradient accumulators, lazy_reset_grad), except those named in ``keep_inputs``.
    3. Parameters and buffers the optimizer made graph inputs become plain initializers
       again, with the values they hold; ``parameters_as_inputs=true`` instead keeps (or
       makes) every parameter and buffer still read an overridable input, for a runtime
       that binds the current training values.
    4. With ``inference=true`` (the default), Dropout runs in inference mode (its
       ``training_mode`` input is dropped; the then-identity node is removed) and
       BatchNormalization uses its running statistics (``training_mode`` 0, one output).
       A kept node that reads BatchNorm's updated statistics is an error.
    5. Cleanup reuses ``identity_elimination``, ``fold_constants`` (parameters are never
       folded: their names stay and the file does not grow) and ``dce``.
    6. The graphforge.* metadata, which describes training, goes; the loss and labels roles
       stay while that output and that input do, the lora pass's adapters while the model
       still holds them (``lora_merge`` folds them), and ``graphforge.exported_from`` records
       the optimizer of a program that had one.
    7. graphforge's marker functions (``graphforge.AllReduce``, an Identity on one process)
       are inlined where a kept output still needs a call, and go; ``keep_markers=true``
       keeps them, for a runtime that runs what they stand for (a tensor-parallel member's
       eval model, summed across its group where the forward marks it).
    8. The casts of ``mixed_precision`` go: the model computes in float32, as its trained
       float32 weights allow. ``dtype=float16`` (or bfloat16) instead exports it computing
       in that type by the rules mixed_precision trains with (graphforge.placement.precision; kernels
       checked on ``provider``), its weights stored in that type; inputs and outputs keep
       their types.
    9. The forward nodes ``fuse`` rewrote into forms tuned to the CPU's kernels (a small-image
       Conv stacked into one tall image) are put back as the user wrote them.
    10. The optional outputs nothing reads go: a Dropout's mask, and the indices autodiff has
       MaxPool write for its gradient (onnxruntime's CPU MaxPool runs a slower kernel when it
       writes them: 35.8 against 6.5 ms on 16×64×64×64, 3×3 stride 2, 2 threads).
    Input, output and parameter names never change; dynamic dims stay dynamic. The
    result's note says how much smaller the model became.
    """

    name = "prune"
    outputs: tuple[str, ...] = ()
    keep_inputs: tuple[str, ...] = ()
    inference: bool = True
    parameters_as_inputs: bool = False
    keep_markers: bool = False
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    provider: Literal["auto", "cpu", "cuda"] = "auto"

    def __post_init__(self):
        for field_name in ("outputs", "keep_inputs"):
            value = getattr(self, field_name)
            names = (value,) if isinstance(value, str) else tuple(value)
            repeated = sorted({n for n in names if names.count(n) > 1})
            if repeated:
                raise ValueError(f"{field_name} names {', '.join(map(repr, repeated))} more than once")
            object.__setattr__(self, field_name, names)
        if self.dtype not in ("float32", *LOW_TYPES):
            raise ValueError(f"dtype={self.dtype!r}: use float32, {', '.join(LOW_TYPES)}")
        if self.dtype != "float32" and self.parameters_as_inputs:
            raise ValueError(
                "dtype=float16/bfloat16 stores the weights in that type: it cannot keep them as inputs too"
            )

    def run(self, model: Model) -> PassResult:
        graph = model.graph
        before = ModelSize.of(model)
        unchanged = (fingerprint(graph), dict(model.metadata), list(model.initializer_inputs))
        outputs, keep = self._requested_outputs(graph), self._kept_inputs(graph)  # checked before any change
        graph.outputs = outputs
        _put_back_fused(model)  # case 9
        DeadCodeElimination().run(model)  # case 1
        _drop_unused_domains(graph)
        if not self.keep_markers:
            _inline_markers(graph)  # case 7
        converted = set_inference_mode(graph) if self.inference else 0  # case 4
        converted += remove_casts(graph, roles.AMP_PREFIX)  # case 8
        IdentityElimination().run(model)  # case 5
        FoldConstants().run(model)
        DeadCodeElimination().run(model)
        _drop_unread_optional_outputs(graph)  # case 10
        if self.dtype != "float32":
            model = self._lowered(model)
            graph = model.graph
        _drop_unread_inputs(graph, keep)  # case 2
        _set_overridable(model, self.parameters_as_inputs)  # case 3
        _strip_training_roles(model)  # case 6
        after = ModelSize.of(model)
        changed = converted > 0 or unchanged != (fingerprint(graph), model.metadata, model.initializer_inputs)
        return PassResult(model, changed, note=after.compared_with(before))

    def _lowered(self, model: Model) -> Model:
        """Case 8: the model computing in ``dtype`` as mixed_precision would train it, its
        weights stored in that type under their own names where nothing reads them in float32."""
        try:
            provider = resolve_provider(self.provider)
        except ValueError as exc:
            raise PassError(str(exc)) from None
        model = infer_shapes(model, in_place=True)
        graph = model.graph
        convert(graph, LOW_TYPES[self.dtype], program_policy(), kernel_check(provider, graph.opset or 13))
        DeadCodeElimination().run(model)
        tensors = graph.tensors()
        for t in list(tensors.values()):
            if isinstance(t, gs.Constant) and t.name.startswith(roles.AMP_PREFIX):
                original = t.name[len(roles.AMP_PREFIX) :].rsplit("/", 1)[0]
                if original not in tensors:
                    t.name = original
        return model

    def _requested_outputs(self, graph: gs.Graph) -> list[gs.Tensor]:
        by_name = {t.name: t for t in graph.outputs}
        if not self.outputs:
            raise PassError(
                f"name the outputs to keep with outputs=NAME or outputs=[A, B] (outputs: {', '.join(by_name)})"
            )
        unknown = [n for n in self.outputs if n not in by_name]
        if unknown:
            raise PassError(
                f"the model has no output {', '.join(map(repr, unknown))}; its outputs are: " + ", ".join(by_name)
            )
        return [by_name[n] for n in self.outputs]

    def _kept_inputs(self, graph: gs.Graph) -> set[str]:
        names = [t.name for t in graph.inputs]
        unknown = [n for n in self.keep_inputs if n not in names]
        if unknown:
            raise PassError(
                f"keep_inputs names {', '.join(map(repr, unknown))}, which the model does not take as an input; "
                f"its inputs are: {', '.join(names)}"
            )
        return set(self.keep_inputs)


def _put_back_fused(model: Model) -> None:
    """Case 9: the forward nodes of each match the fuse pass rewrote are written again, onto the
    tensors they read, the root writing its outputs once more; the nodes that stood in for them
    are left unread, for dead-code elimination. An inner node whose output is still computed
    (something outside the match read it) is not written twice."""
    restore = roles.get_json(model, roles.FUSION, {}).get("restore", {})
    if not restore:
        return
    graph = model.graph
    tensors = graph.tensors()
    position = {id(n): i for i, n in enumerate(graph.nodes)}
    put_back: dict[int, list[gs.Node]] = {}
    for records in restore.values():
        records = records if isinstance(records, list) else [records]  # one node: fused by an earlier graphforge
        root = records[-1]
        outs = [tensors.get(name) for name in root["outputs"]]
        if any(t is None or len(t.inputs) != 1 for t in outs):
            continue  # not in this model any more (an output none of the kept ones needs)
        made: dict[str, gs.Tensor] = {}
        inner = [r for r in records[:-1] if not _still_computed(r, tensors)]
        for record in inner:
            made.update((n, gs.Variable(n)) for n in record["outputs"] if n)
        missing = [n for r in (*inner, root) for n in r["inputs"] if n and n not in tensors and n not in made]
        if missing:
            raise PassError(
                f"the fuse pass's record puts back {root['op']} {root['name']!r}, whose inputs "
                f"{', '.join(map(repr, dict.fromkeys(missing)))} the model no longer has: was the program edited after fuse?"
            )
        producers = [t.inputs[0] for t in outs]
        last = max(producers, key=lambda n: position[id(n)])  # the put-back nodes go where the root was
        for t, producer in zip(outs, producers, strict=True):
            producer.outputs.remove(t)
        known = {**tensors, **made} if made else tensors
        put_back[id(last)] = [
            gs.Node(
                r["op"],
                name=r["name"],
                domain=r["domain"],
                attrs=dict(r["attrs"]),  # [name, value] pairs
                inputs=[known[n] if n else gs.Variable.empty() for n in r["inputs"]],
                outputs=outs if r is root else [known[n] if n else gs.Variable.empty() for n in r["outputs"]],
            )
            for r in (*inner, root)
        ]
    # after the nodes' inputs, before the root's readers
    graph.nodes = [x for n in graph.nodes for x in (*put_back.get(id(n), ()), n)]


def _still_computed(record: dict, tensors: dict[str, gs.Tensor]) -> bool:
    first = tensors.get(record["outputs"][0])
    return first is not None and bool(first.inputs)


#: op -> the index from which its outputs are optional and cost work to write when unread
#: (BatchNormalization's are optional too, but training mode must write all three)
_DROPPABLE_OUTPUTS = {"MaxPool": 1, "Dropout": 1}


def _drop_unread_optional_outputs(graph: gs.Graph) -> None:
    """Case 10: the trailing outputs of _DROPPABLE_OUTPUTS' ops that no node (in any graph or
    function) reads and no graph returns."""
    graphs = list(every_graph(graph))
    read = {t.name for g in graphs for t in (*g.outputs, *(i for n in g.nodes for i in n.inputs))}
    for g in graphs:
        for node in g.nodes:
            first = _DROPPABLE_OUTPUTS.get(node.op) if node.domain in (None, "", "ai.onnx") else None
            while first is not None and len(node.outputs) > first and node.outputs[-1].name not in read:
                node.outputs.pop()


def _drop_unused_domains(graph: gs.Graph) -> None:
    """Opset imports of domains no node (nor local function) uses any more: a fused op's,
    once its node is put back."""
    if graph.import_domains is None:
        return
    used = {n.domain or "" for g in every_graph(graph) for n in g.nodes} | {f.domain for f in graph.functions}
    graph.import_domains = [d for d in graph.import_domains if d.domain in ("", "ai.onnx") or d.domain in used]


def _inline_markers(graph: gs.Graph) -> None:
    """Case 7: marker calls become Identity nodes, the marker functions and their domain go."""
    inline_marker_calls(graph)
    if graph.import_domains is not None:
        graph.import_domains = [d for d in graph.import_domains if d.domain != roles.MARKER_DOMAIN]


# --------------------------------------------------------------------------- case 4: inference mode


def set_inference_mode(graph: gs.Graph) -> int:
    """Put every Dropout and BatchNormalization (subgraphs and functions included) in
    inference mode; returns how many nodes changed."""
    changed = 0
    for g in every_graph(graph):
        for node in g.nodes:
            if node.op == "Dropout" and node.domain in (None, "", "ai.onnx"):
                changed += _dropout_inference(node)
            elif node.op == "BatchNormalization" and node.domain in (None, "", "ai.onnx"):
                changed += _batch_norm_inference(node, {id(t) for t in g.outputs})
    return changed


def _dropout_inference(node: gs.Node) -> bool:
    """Opset 12+: without a training_mode input, Dropout is the identity (and its mask all ones)."""
    changed = False
    while len(node.inputs) > 2:
        node.inputs.pop()
        changed = True
    if node.attrs.get("is_test") == 0:  # opset 6 and before
        node.attrs["is_test"] = 1
        changed = True
    return changed


def _batch_norm_inference(node: gs.Node, graph_outputs: set[int]) -> bool:
    """Use the running statistics (inputs 3 and 4): training_mode 0 and only output Y.
    Before opset 14 training mode is asking for more than one output."""
    extra = [t for t in node.outputs[1:] if not t.is_empty()]
    training = bool(node.attrs.get("training_mode", 0)) or bool(extra) or node.attrs.get("is_test") == 0
    if not training:
        return False
    readers = [t.name for t in extra if t.outputs or id(t) in graph_outputs]
    if readers:
        raise PassError(
            f"cannot put BatchNormalization in inference mode: the kept graph reads its training-mode "
            f"statistics {', '.join(readers)}; prune to outputs that do not need them, or set inference=false",
            node=node.name,
            op_type=node.op,
        )
    node.attrs.pop("training_mode", None)
    if "is_test" in node.attrs:
        node.attrs["is_test"] = 1
    while len(node.outputs) > 1:
        node.outputs.pop()
    return True


# --------------------------------------------------------------------------- cases 2, 3, 6


def trained_tensors(model: Model) -> list[str]:
    """Parameters and buffers of a program: the initializers training updates, in the
    order the metadata lists them (parameters first)."""
    program_roles = ProgramRoles.of_model(model)
    names = list(program_roles.parameters)
    names += [c.input for c in program_roles.carried if c.init == "initializer" and c.input not in names]
    return names


def _set_overridable(model: Model, overridable: bool) -> None:
    """Case 3: parameters and buffers become plain initializers, or all overridable inputs;
    other initializer inputs (the source model's own) stay as they were. Names that are no
    longer initializers leave the list."""
    initializers = {
        t.name for g in every_graph(model.graph) for t in g.tensors().values() if isinstance(t, gs.Constant)
    }
    trained = trained_tensors(model)
    names = [n for n in model.initializer_inputs if n not in trained]
    if overridable:
        names += trained
    model.initializer_inputs = [n for n in names if n in initializers]


def _drop_unread_inputs(graph: gs.Graph, keep: set[str]) -> None:
    """Case 2: graph inputs no node (subgraphs included) reads and no output passes on."""
    read = {t.name for g in every_graph(graph) for node in g.nodes for t in node.inputs}
    read |= {t.name for t in graph.outputs}
    graph.inputs = [t for t in graph.inputs if t.name in read or t.name in keep]


def _strip_training_roles(model: Model) -> None:
    """Case 6: drop the graphforge.* metadata, keeping the roles still true of the result."""
    metadata = model.metadata
    if not any(key.startswith("graphforge.") and key != roles.EXPORTED_FROM for key in metadata):
        return
    optimizer = roles.get_json(model, roles.OPTIMIZER, None)
    present = {t.name for t in model.graph.inputs} | {t.name for t in model.graph.outputs}
    kept = {key: metadata[key] for key in _KEPT_WHILE_TRUE if metadata.get(key) in present}
    adapters = ProgramRoles.of_model(model).lora
    if adapters and {n for a in adapters for n in (a.a, a.b)} <= set(model.graph.tensors()):
        kept[roles.LORA] = metadata[roles.LORA]
    if roles.EXPORTED_FROM in metadata:
        kept[roles.EXPORTED_FROM] = metadata[roles.EXPORTED_FROM]
    for key in [k for k in metadata if k.startswith("graphforge.")]:
        del metadata[key]
    metadata.update(kept)
    if optimizer is not None:
        metadata[roles.EXPORTED_FROM] = json.dumps({"optimizer": optimizer}, sort_keys=True)


# --------------------------------------------------------------------------- the size report
