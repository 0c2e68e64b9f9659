"""The autodiff pass: append the backward graph of the loss, in standard ONNX ops."""

from __future__ import annotations

import fnmatch
import json
import re
import warnings
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs
from graphforge.passes.autodiff import torch_records
from graphforge.passes.autodiff.driver import (
    GRAD_PREFIX,
    build_gradients,
    build_subgraph_gradients,
    node_inputs,
    seed_name,
)
from graphforge.passes.autodiff.registry import RULES

from graphforge import roles
from graphforge.errors import PassError
from graphforge.graph import Model
from graphforge.ir import TORCH_FOLDED, TORCH_TRAINING_BATCHNORMS, gc_paused, is_parameter, recorded_torch_kinds
from graphforge.pass_infra import Fact, Pass, PassResult
from graphforge.program import FrozenWeight, ProgramRoles
from graphforge.shapes import infer_shapes


@dataclass(frozen=True)
class Autodiff(Pass):
    """Build the gradient of the scalar loss with respect to the trainable parameters.

    1. The loss is the graph output named by ``loss`` (default ``loss``, as the loss pass
       writes it); it must hold one element, or the pass refuses.
    2. Parameters are the floating-point initializers whose names match a ``trainable``
       glob and no ``frozen`` glob (default: all of them), except
       a. the constants graphforge's own passes created (the loss pass's smoothing factor, the
          lora pass's scales);
       b. in a model torch.onnx's dynamo exporter wrote, the initializers torch.export calls
          buffers or constants (``TORCH_KINDS``, from the exporter's value metadata), and the
          unmarked ones named as that exporter names the constants it lifts (``val_<n>``:
          the 16.0 of ``x / 16.0``). Unmarked initializers with other names stay parameters:
          the exporter's rewrites (a Conv folded with a BatchNorm) keep the name, drop the mark;
       c. initializers through which no gradient flows to the loss: read only at inputs
          whose gradient rule gives none (BatchNormalization's running mean and variance,
          Dropout's ratio) or through integer values. The rules decide, so no op list is
          kept here. They are left out silently, unless named in ``trainable`` without a
          wildcard;
       d. initializers read only at the inputs a rule calls settings (Clip's bounds, Pad's
          value: numbers in torch), unless named in ``trainable`` without a wildcard: then
          they train where the rule gives them a gradient;
       e. parameters torch does not train (``requires_grad=False``), where the model records
          them (``export_for_training`` does), unless named in ``trainable`` without a
          wildcard; one warning names them.
       ``inputs`` names graph inputs to differentiate as well (their gradients are ``<input>_grad`` too).
    3. The gradient of parameter ``P`` becomes the graph output ``P_grad``; the original
       outputs stay (``keep_outputs=false`` keeps only the loss and the gradients).
    4. Parameters the loss does not depend on at all get no output and are listed in a
       warning; a loss that depends on none of them is an error.
    5. Roles (loss, parameters, gradients) are recorded in the model's metadata.
    6. In a model torch.onnx's dynamo exporter wrote, a BatchNormalization that torch ran in
       training mode (the exporter writes it in inference mode; its node metadata says so) is
       put in training mode, with a warning; parameters the exporter's optimizer folded away
       are named in a warning (case 2b cannot train them).
    7. An embedding lookup whose padding row torch gives no gradient (``nn.Embedding(padding_idx=p)``),
       where the model records it, gives that row none; a PyTorch export that cannot tell is
       warned about (passes/autodiff/torch_records.py).
    8. The weights left out by ``trainable``/``frozen`` (case 2), by torch (case 2e), or
       frozen before (the lora pass's base weights, unless named in ``trainable`` without a
       wildcard; a weight the dynamo exporter folded into a constant, case 2b, included) are
       recorded frozen (``graphforge.frozen``, with what froze each): they get
       no gradient and stay initializers (no longer inputs where the model listed them among
       its inputs too: constants, which onnxruntime may prepack), and everything after reads
       the role.
    Only standard ai.onnx operators are emitted.
    """

    name = "autodiff"
    ensures = (Fact.LOSS, Fact.GRADIENTS)
    loss: str = "loss"
    trainable: tuple[str, ...] = ("*",)
    frozen: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    keep_outputs: bool = True

    def run(self, model: Model) -> PassResult:
        with gc_paused():  # shape inference's import, the driver and cleanup walk the whole graph
            return self._run(model)

    def _run(self, model: Model) -> PassResult:
        _train_batchnorms_torch_trained(model, self.name)
        # equal dims of one name: the driver's unbroadcasts are then static (its case 5)
        model = infer_shapes(model, in_place=True, relate=True)
        graph = model.graph
        targets = self._targets(graph)
        what = self._what(targets)
        already = {name: f.by for name, f in ProgramRoles.of_model(model).frozen.items()}
        torch_frozen = torch_records.frozen_parameters(model)
        params, frozen = self._parameters(graph, recorded_torch_kinds(model.metadata), torch_frozen, already)
        if not already:  # else a role said what trains: the folded weights are frozen (the lora pass's base)
            _warn_of_folded_parameters(model.metadata, self.name)
        torch_records.warn_of_unknown_padding(model, params, self.name)
        extra_inputs = self._inputs(graph)
        wrt = params + extra_inputs
        if not wrt:
            raise PassError(
                f"no trainable parameters match trainable={list(self.trainable)} frozen={list(self.frozen)}"
            )
        grads = self._build(graph, targets, wrt, torch_records.padding_hooks(model))
        if not grads:
            raise PassError(f"{what} depend{'s' * (len(targets) == 1)} on none of the {len(wrt)} trainable tensors")
        without = [t for t in wrt if id(t) not in grads]
        if without:
            what = self._what(targets, named=False)
            feeding = set().union(*(_feeding(t) for t, _ in targets))
            unused = [t.name for t in without if id(t) not in feeding]  # case 4
            named = self._named()
            blocked = [t.name for t in without if id(t) in feeding and t.name in named]  # case 2c, asked for
            params = [t for t in params if id(t) in grads or id(t) not in feeding]
            if unused:
                warnings.warn(
                    f"{self.name}: {what} do{'es' * (len(targets) == 1)} not depend on {len(unused)} parameter(s), "
                    "which get no gradient: " + ", ".join(unused),
                    stacklevel=3,  # the caller of run()
                )
            if blocked:
                warnings.warn(
                    f"{self.name}: no gradient reaches {', '.join(blocked)} (named in trainable): {what} read"
                    f"{'s' * (len(targets) == 1)} it only where no gradient flows (e.g. BatchNormalization's running "
                    "statistics, Dropout's ratio)",
                    stacklevel=3,
                )

        outputs = list(graph.outputs) if self.keep_outputs else [t for t, _ in targets]
        for t, _ in reversed(targets):
            if t not in outputs:
                outputs.insert(0, t)
        gradient_names = {}
        taken = set(graph.tensors())
        for t in wrt:
            if id(t) not in grads:
                continue
            name = roles.grad_name(t.name)
            if name in taken and graph.tensors()[name] is not grads[id(t)]:
                raise PassError(
                    f"cannot name the gradient of {t.name!r} {name!r}: the model already has a tensor with that name"
                )
            outputs.append(_named_output(graph, grads[id(t)], name, t, outputs))
            gradient_names[t.name] = name
        graph.outputs = outputs
        graph.cleanup()

        roles.set_json(model, roles.PARAMETERS, [t.name for t in params])
        _record_frozen(model, frozen)
        roles.set_json(model, roles.GRADIENTS, gradient_names)
        self._record(model, targets)
        return PassResult(model, True)

    # The loss and its seed; VectorJacobian replaces these four with outputs seeded by inputs.

    def _targets(self, graph: gs.Graph) -> list[tuple[gs.Tensor, gs.Tensor | None]]:
        return [(self._loss_tensor(graph), None)]

    def _what(self, targets, *, named: bool = True) -> str:
        return f"the loss {targets[0][0].name!r}" if named else "the loss"

    def _build(self, graph: gs.Graph, targets, wrt: list[gs.Tensor], hooks: dict) -> dict[int, gs.Tensor]:
        return build_gradients(graph, targets[0][0], wrt, hooks=hooks)

    def _record(self, model: Model, targets) -> None:
        model.metadata[roles.LOSS] = targets[0][0].name
        model.metadata[roles.LOSS_SEED] = seed_name(targets[0][0])

    def _loss_tensor(self, graph: gs.Graph) -> gs.Tensor:
        loss = next((t for t in graph.outputs if t.name == self.loss), None)
        if loss is None:
            outputs = ", ".join(t.name for t in graph.outputs)
            raise PassError(
                f"the model has no output {self.loss!r} to use as the loss (outputs: {outputs}); "
                "add one with the loss pass, e.g. loss(kind=cross_entropy, output=logits)"
            )
        shape = loss.shape
        if shape is None or not all(isinstance(d, int | np.integer) and d == 1 for d in shape):
            raise PassError(f"the loss {loss.name!r} must be a scalar (one element), but its shape is {shape}")
        return loss

    def _parameters(
        self, graph: gs.Graph, torch_kinds: dict[str, str], torch_frozen: set[str], already: dict[str, str]
    ) -> tuple[list[gs.Tensor], dict[str, str]]:
        """The parameters to differentiate, and the weights left frozen (case 8): name -> by what."""
        seen: dict[str, gs.Tensor] = {}
        frozen: dict[str, str] = {}
        named = self._named()
        for node in graph.nodes:
            for t in node_inputs(node):  # what If/Loop/Scan bodies read counts too
                if t.name in seen or t.name in frozen or not is_parameter(t):
                    continue
                generated = t.name.startswith(roles.PASS_CONSTANT_PREFIXES)  # case 2a
                setting = t.name not in named and _only_a_setting(t)  # case 2d
                if generated or setting:
                    continue
                if not _torch_parameter(t.name, torch_kinds):  # case 2b: frozen still, where frozen before
                    if t.name in already:
                        frozen[t.name] = already[t.name]
                    continue
                by = self._frozen_by(t.name, named, torch_frozen, already)
                if by is None:
                    seen[t.name] = t
                else:
                    frozen[t.name] = by
        torch_records.warn_of_frozen([n for n, by in frozen.items() if by == "torch"], self.name)  # case 2e
        return list(seen.values()), frozen

    def _frozen_by(self, name: str, named: set[str], torch_frozen: set[str], already: dict[str, str]) -> str | None:
        """What keeps the weight ``name`` from training (case 8), or None: it trains."""
        if not self._is_trainable(name):
            return already.get(name, "autodiff")
        if name in named:  # named without a wildcard: it trains, whatever froze it before
            return None
        if name in already:
            return already[name]
        return "torch" if name in torch_frozen else None

    def _named(self) -> set[str]:
        """The names ``trainable`` gives without a wildcard."""
        return {p for p in self.trainable if not any(c in p for c in "*?[")}

    def _is_trainable(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.trainable) and not any(
            fnmatch.fnmatchcase(name, p) for p in self.frozen
        )

    def _inputs(self, graph: gs.Graph) -> list[gs.Tensor]:
        by_name = {t.name: t for t in graph.inputs}
        unknown = [n for n in self.inputs if n not in by_name]
        if unknown:
            raise PassError(f"inputs={unknown} are not graph inputs; the graph inputs are: {', '.join(by_name)}")
        return [by_name[n] for n in self.inputs]


@dataclass(frozen=True)
class VectorJacobian(Autodiff):
    """The gradients of named outputs against gradients given at run time (a vector-Jacobian
    product): what torch's autograd hands a module's backward.

    1. For each output ``y`` named in ``outputs`` (floating point), a graph input ``y_seed``
       typed like ``y`` holds dL/dy; the backward starts from these seeds (no loss is
       computed), so the result is the gradient of sum(y * y_seed) over the outputs.
    2. Which tensors get gradients, and their names, are autodiff's (``trainable``, ``frozen``,
       ``inputs``; ``P_grad``); the outputs stay outputs. A parameter no output depends on gets
       none, with a warning.
    3. Roles record the parameters and gradients; the model has no loss (``graphforge.torch``'s
       GraphforgeModule runs the forward and the backward as two segments of it).
    Only standard ai.onnx operators are emitted.
    """

    name = "vjp"
    ensures = (Fact.GRADIENTS,)
    loss: str = field(default="loss", init=False)  # no loss here: the seeds stand for it
    outputs: tuple[str, ...] = ()

    def _targets(self, graph: gs.Graph) -> list[tuple[gs.Tensor, gs.Tensor | None]]:
        if not self.outputs:
            raise PassError("vjp needs outputs=[...]: the outputs whose gradients come in as <output>_seed inputs")
        by_name = {t.name: t for t in graph.outputs}
        unknown = [n for n in self.outputs if n not in by_name]
        if unknown:
            raise PassError(f"outputs={unknown} are not graph outputs; the graph outputs are: {', '.join(by_name)}")
        taken = set(graph.tensors())
        targets = []
        for name in dict.fromkeys(self.outputs):
            y = by_name[name]
            if y.dtype is None or np.dtype(y.dtype).kind != "f":
                raise PassError(f"output {name!r} is not floating point ({y.dtype}): it has no gradient to seed")
            seed_name = f"{name}_seed"
            if seed_name in taken:
                raise PassError(f"cannot add the input {seed_name!r}: the model already has a tensor with that name")
            seed = gs.Variable(seed_name, dtype=y.dtype, shape=list(y.shape) if y.shape is not None else None)
            graph.inputs.append(seed)
            targets.append((y, seed))
        return targets

    def _what(self, targets, *, named: bool = True) -> str:
        return ", ".join(repr(t.name) for t, _ in targets)

    def _build(self, graph: gs.Graph, targets, wrt: list[gs.Tensor], hooks: dict) -> dict[int, gs.Tensor]:
        return build_subgraph_gradients(graph, targets, wrt, opset=graph.opset or 1, prefix=GRAD_PREFIX, hooks=hooks)

    def _record(self, model: Model, targets) -> None:
        model.metadata.pop(roles.LOSS, None)
        model.metadata.pop(roles.LOSS_SEED, None)


#: how torch.onnx's dynamo exporter (onnxscript) names the values it creates: lifted and folded constants
_EXPORTER_CONSTANT = re.compile(r"_?val_\d+")


def _record_frozen(model: Model, frozen: dict[str, str]) -> None:
    """Case 8: the frozen role holds exactly the weights left frozen (none: no key, so a
    program without frozen weights is as it was)."""
    if frozen:
        roles.set_json(model, roles.FROZEN, {name: FrozenWeight(name, by).to_json() for name, by in frozen.items()})
    else:
        model.metadata.pop(roles.FROZEN, None)
    # an initializer a model lists among its inputs too (torch.onnx.export's keep_initializers_as_inputs)
    # is an overridable default, bound by the runner, which onnxruntime never prepacks: a constant instead
    model.initializer_inputs = [n for n in model.initializer_inputs if n not in frozen]


def _only_a_setting(t: gs.Tensor) -> bool:
    """Case 2d: whether every node reading ``t`` reads it at an input its rule calls a setting."""
    readers = list(t.outputs)
    for node in readers:
        rule = RULES.get(node.op, node.domain)
        slots = [i for i, x in enumerate(node.inputs) if x is t]
        if rule is None or not slots or any(rule.setting(i) is None for i in slots):
            return False
    return bool(readers)


def _train_batchnorms_torch_trained(model: Model, pass_name: str) -> None:
    """The BatchNormalization nodes torch ran in training mode and the dynamo exporter wrote in
    inference mode (``graphforge.ir.TORCH_TRAINING_BATCHNORMS``) normalise with the batch's
    statistics, as torch trains them, and write the running statistics' new values (outputs 1
    and 2, which the optimizer carries), as a TorchScript export has them."""
    try:
        wanted = set(json.loads(model.metadata.get(TORCH_TRAINING_BATCHNORMS, "[]")))
    except (json.JSONDecodeError, TypeError):
        return
    if not wanted:
        return
    taken = set(model.graph.tensors())
    changed = 0
    for node in model.graph.nodes:
        if node.op != "BatchNormalization" or len(node.outputs) != 1 or node.outputs[0].name not in wanted:
            continue
        if len(node.inputs) < 5 or node.attrs.get("training_mode"):
            continue
        node.attrs["training_mode"] = 1
        for k in (1, 2):
            name = f"{node.outputs[0].name}/running_statistic{k}"
            while name in taken:
                name += "_"
            taken.add(name)
            statistic = node.inputs[2 + k]
            node.outputs.append(gs.Variable(name, statistic.dtype, statistic.shape))
        changed += 1
    if changed:
        warnings.warn(
            f"{pass_name}: {changed} BatchNormalization node(s) that torch ran in training mode were exported in "
            "inference mode (torch.onnx's dynamo exporter does so); they train in training mode, normalising "
            "with the batch's statistics, as torch does",
            stacklevel=4,
        )


def _warn_of_folded_parameters(metadata: dict[str, str], pass_name: str) -> None:
    """Case 2b's blind spot: parameters the dynamo exporter's optimizer folded into constants
    (``graphforge.ir.TORCH_FOLDED``) are no initializers of theirs any more, so nothing trains them."""
    try:
        folded = json.loads(metadata.get(TORCH_FOLDED, "[]"))
    except json.JSONDecodeError:
        return
    if not folded or not isinstance(folded, list):
        return
    shown = ", ".join(map(str, folded[:5])) + (f" and {len(folded) - 5} more" if len(folded) > 5 else "")
    warnings.warn(
        f"{pass_name}: torch.onnx.export's optimizer folded {len(folded)} of the module's parameters into "
        f"constants (a Linear weight into its transpose) or merged equal ones, so they do not train: {shown}; "
        "export with optimize=False to train them",
        stacklevel=4,  # the caller of run()
    )


def _torch_parameter(name: str, kinds: dict[str, str]) -> bool:
    """Case 2b: whether torch.export's signature (when the model has one) lets ``name`` be a parameter."""
    if not kinds:
        return True
    kind = kinds.get(name)
    if kind is not None:
        return kind == "PARAMETER"
    return _EXPORTER_CONSTANT.fullmatch(name) is None


def _feeding(loss: gs.Tensor) -> set[int]:
    """Ids of the tensors the loss is computed from (through any op and type), walking
    producers back from the loss; what a node's subgraphs read counts as its inputs."""
    seen: set[int] = {id(loss)}
    stack = [loss]
    visited_nodes: set[int] = set()
    while stack:
        tensor = stack.pop()
        for node in tensor.inputs:  # the producer (none for graph inputs and initializers)
            if id(node) in visited_nodes:
                continue
            visited_nodes.add(id(node))
            for t in node_inputs(node):
                if id(t) not in seen:
                    seen.add(id(t))
                    stack.append(t)
    return seen


def _named_output(graph: gs.Graph, grad: gs.Tensor, name: str, like: gs.Tensor, outputs: list[gs.Tensor]) -> gs.Tensor:
    """Expose ``grad`` as the graph output ``name``, renaming it when it is a fresh backward
    tensor and going through an Identity when it is shared (a forward tensor, a constant,
    or the gradient of a tied parameter already exposed under another name)."""
    fresh = (
        isinstance(grad, gs.Variable)
        and grad.name.startswith(GRAD_PREFIX)
        and not any(grad is o for o in outputs)
        and not any(grad is o for o in graph.outputs)
    )
    if fresh:
        out = grad
        out.name = name
    else:
        out = gs.Variable(name)
        graph.nodes.append(gs.Node("Identity", name=f"{GRAD_PREFIX}{name}/Identity", inputs=[grad], outputs=[out]))
    out.dtype = like.dtype
    out.shape = list(like.shape) if like.shape is not None else None
    return out
