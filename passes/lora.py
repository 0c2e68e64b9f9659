"""The lora pass: low-rank adapters on a model's linear layers, as PEFT's LoRA, the base frozen."""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Literal

import ml_dtypes  # onnx's own dependency: the types NumPy lacks (bfloat16)
import numpy as np
import onnx
import onnx_graphsurgeon as gs
from graphforge.passes.lora_layers import ALL_LINEAR, LinearLayer, linear_layers, select
from graphforge.passes.lora_peft import CONFIG, WEIGHTS, PeftAdapters, read_peft
from onnx import numpy_helper

from graphforge import roles
from graphforge.builder import Builder
from graphforge.errors import PassError
from graphforge.graph import Model
from graphforge.ir import TORCH_MODULES, is_parameter, onnx_dtype, recorded_json
from graphforge.pass_infra import Fact, Pass, PassResult, check_number
from graphforge.pass_spec import ParameterValueError
from graphforge.program import FrozenWeight, LoraAdapter, ProgramRoles
from graphforge.stand_ins import is_left_out, lazy_tensor, store_values

_TYPES = {"float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}


@dataclass(frozen=True)
class Lora(Pass):
    """Add low-rank adapters (LoRA) to a forward model's linear layers, named, laid out and
    initialized as PEFT's, and freeze the rest of the model.

    1. Linear layers: MatMul nodes whose second input is a 2-D floating-point initializer
       ([in, out]) or its 2-D Transpose ([out, in]: torch's Linear exported unfolded), and
       Gemm nodes (transA 0, alpha 1) whose B is one (transB 1: [out, in]; 0: [in, out], GPT-2's
       Conv1D). The adapters' own products are none.
    2. A layer's module name is the module a dynamo export's node metadata names (recorded at
       import: its optimizer folds weights into ``val_<n>`` constants), else its weight's name
       less ``.weight`` where it ends so (torch's parameter names, which both exporters keep
       where they do not fold the weight), else the node's TorchScript scope as a module path
       (``/model/layers.0/self_attn/q_proj/MatMul`` is ``model.layers.0.self_attn.q_proj``;
       passes/lora_layers.py), else the weight's name. Where one name would stand for two
       weights, each is named by its weight.
    3. ``targets`` choose modules as PEFT's ``target_modules``: a list matches a layer whose
       module name or weight name is an item or ends with "." and an item; a string is a
       regular expression one of them matches whole; ``all-linear`` is every linear layer but
       the output head (a layer whose product reaches a graph output through reshapes,
       transposes, casts and elementwise ops with a constant alone: the logits' layer, as
       PEFT leaves out a model's output embeddings). ``exclude`` then removes layers the same
       way. A pattern that matches no layer is an error naming it and the closest names.
    4. Each module gains A ([r, in], ``<module>.lora_A.weight``) and B ([out, r],
       ``<module>.lora_B.weight``), of type ``dtype``; its product y becomes
       ``y + scale · (dropout(x) · Aᵀ) · Bᵀ``, computed in ``dtype`` and cast back, added to
       the product itself: before the bias an export adds after a MatMul (a tensor-parallel
       split sums both alike), after a Gemm's own. ``scale`` is alpha / r, or alpha / √r
       with ``rslora``. With ``dropout`` > 0 a training-mode Dropout reads the adapter's input
       alone (graphforge's runtime seeds it as every Dropout; opset 12 and later).
    5. ``init``: "peft" draws A Kaiming-uniform with a = √5 (uniform in ±1/√in), "gaussian"
       draws A normal with std 1/r, as PEFT's ``init_lora_weights`` True and "gaussian"; B is
       zero, so the model computes what it computed before. Drawn from ``seed``, module by
       module in graph order.
    6. Roles: every floating-point initializer the model had is recorded frozen (by "lora",
       as PEFT trains nothing but the adapters; autodiff keeps of the role the weights it
       would have trained, and trains a weight named in its ``trainable`` without a
       wildcard); ``graphforge.lora`` records each adapter: module, base weight, A, B, r,
       alpha, scale, dropout, dtype and the base weight's layout; and the base by reference:
       each of those weights' CRC-32 (of its values' bytes, as a checkpoint's), which a
       checkpoint of the program keeps, so that one trained on another base is refused.
    7. ``adapter``: a PEFT adapter folder (``save_pretrained``'s ``adapter_model.safetensors``
       and ``adapter_config.json``) to start from, to go on training adapters made elsewhere.
       Its weights name the modules (PEFT's ``base_model.model.<module>.lora_A.weight``; a
       name matches a module of that name or ending in "." and it, so a folder saved on the
       Hugging Face model fits an export of a wrapper around it) and give A and B their
       values; its config gives r, alpha, rslora and dropout. A value of those given to the
       pass must agree with the folder's (left at its default, the folder's is taken);
       targets and exclude are refused beside it. A module the model lacks, or weights whose
       shapes do not fit their layer (named, with both shapes), are refused.
    Nodes are named ``lora::<module>/…``; the model's inputs, outputs and tensors keep their
    names. A bad value (r ≤ 0, a dropout of 1) is refused by name, a module adapted already
    too, and the model is left as it was.
    """

    name = "lora"
    refuses = (Fact.GRADIENTS,)
    r: int = 8
    alpha: float = 8.0
    targets: str | tuple[str, ...] = ALL_LINEAR
    exclude: str | tuple[str, ...] = ()
    dropout: float = 0.0
    rslora: bool = False
    init: Literal["peft", "gaussian"] = "peft"
    seed: int = 0
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    adapter: str = ""

    def __post_init__(self):
        if not isinstance(self.r, int) or isinstance(self.r, bool):
            raise ParameterValueError(f"pass 'lora' parameter 'r': expected an integer ≥ 1, got {self.r!r}")
        check_number(self, "r", at_least=1)
        check_number(self, "alpha", above=0)
        check_number(self, "dropout", at_least=0, below=1)
        for what in ("targets", "exclude"):
            _check_patterns(what, getattr(self, what), allow_empty=what == "exclude")
        if self.init not in ("peft", "gaussian"):
            raise ParameterValueError(f"pass 'lora' parameter 'init': expected peft or gaussian, got {self.init!r}")
        if self.dtype not in _TYPES:
            raise ParameterValueError(f"pass 'lora' parameter 'dtype': expected one of {', '.join(_TYPES)}")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)

    def run(self, model: Model) -> PassResult:
        if self.adapter:
            return self._from_folder(model)
        return self._add_adapters(model, {})

    def _from_folder(self, model: Model) -> PassResult:
        """Case 7: the folder's settings and modules, checked against the model, then case 4
        with the folder's A and B."""
        folder = read_peft(self.adapter)
        settings = self._settings_of(folder)
        layers = linear_layers(model.graph, recorded_json(model.metadata, TORCH_MODULES, dict, {}))
        start = _starting_values(folder, layers)
        plain = replace(self, adapter="", targets=tuple(start), exclude=(), **settings)
        result = plain._add_adapters(model, start)
        return PassResult(result.model, True, f"{result.note}, from {folder.folder}")

    def _settings_of(self, folder: PeftAdapters) -> dict:
        defaults = {f.name: f.default for f in fields(self)}
        if self.targets != defaults["targets"] or self.exclude != defaults["exclude"]:
            raise PassError(f"lora(adapter={self.adapter!r}): the folder's weights name the modules; "
                            "leave targets and exclude out")  # fmt: skip
        settings = {"r": folder.r, "alpha": folder.alpha, "rslora": folder.rslora, "dropout": folder.dropout}
        for name, value in settings.items():
            given = getattr(self, name)
            if given != defaults[name] and given != value:
                raise PassError(
                    f"lora(adapter={self.adapter!r}): {name}={given} disagrees with the folder's {value} "
                    f"({CONFIG}); leave {name} out to take the folder's"
                )
        return settings

    def _add_adapters(self, model: Model, start: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> PassResult:
        """Cases 1 to 6; ``start``: module -> the A and B it starts from (case 7), else case 5's."""
        graph = model.graph
        self._check_opset(graph.opset or 1)
        layers = linear_layers(graph, recorded_json(model.metadata, TORCH_MODULES, dict, {}))
        chosen = select(layers, self.targets, self.exclude, graph)
        modules = _by_module(chosen)
        existing = ProgramRoles.of_model(model)
        _refuse_adapted(modules, existing.lora)
        _refuse_taken(modules, graph)
        made = {n for a in existing.lora for n in (a.a, a.b)}  # an earlier lora pass's adapters still train
        weights = [
            t.name
            for t in graph.tensors().values()
            if is_parameter(t) and not t.name.startswith(roles.PASS_CONSTANT_PREFIXES) and t.name not in made
        ]
        rng = np.random.default_rng(self.seed)
        builder = Builder(graph, prefix=roles.LORA_PREFIX)
        after: dict[int, list[gs.Node]] = {}
        adapters = [
            self._adapt(builder, module, layers_of, rng, after, start.get(module))
            for module, layers_of in modules.items()
        ]
        _in_order(graph, after)
        frozen = {name: f.to_json() for name, f in existing.frozen.items()}
        frozen.update({name: FrozenWeight(name, "lora").to_json() for name in weights if name not in frozen})
        roles.set_json(model, roles.FROZEN, frozen)
        recorded = [a.to_json() for a in existing.lora] + [a.to_json() for a in adapters]
        base = {**existing.lora_base, **_checksums(graph, [n for n in weights if n not in existing.lora_base])}
        roles.set_json(model, roles.LORA, {"adapters": recorded, "base": base})
        note = f"{len(adapters)} adapters of rank {self.r} ({sum(_size(a, modules) for a in adapters):,} parameters)"
        return PassResult(model, True, note)

    def _check_opset(self, opset: int) -> None:
        if self.dropout > 0 and opset < 12:
            raise PassError(f"dropout needs opset 12 or later (Dropout's ratio input); the model has {opset}")
        if self.dtype == "bfloat16" and opset < 13:
            raise PassError(f"dtype=bfloat16 needs opset 13 or later; the model has {opset}")

    def _adapt(
        self,
        b: Builder,
        module: str,
        layers: list[LinearLayer],
        rng: np.random.Generator,
        after: dict,
        start: tuple[np.ndarray, np.ndarray] | None,
    ) -> LoraAdapter:
        """Case 4 for one module: A and B (``start``'s values, else case 5's), and the adapter's
        sum at each of its nodes (the nodes made for a layer are listed in ``after`` under its
        node, to follow it)."""
        n_in, n_out = layers[0].features
        a_values, b_values = start if start is not None else (self._initial_a(rng, n_in), np.zeros((n_out, self.r)))
        a = _parameter(f"{module}.lora_A.weight", a_values, self.dtype)
        b_weight = _parameter(f"{module}.lora_B.weight", b_values, self.dtype)
        start = len(b.graph.nodes)
        with b.scope(module):
            a_t, b_t = b.op("Transpose", a, perm=[1, 0]), b.op("Transpose", b_weight, perm=[1, 0])
            for layer in layers:
                self._add_delta(b, layer, a_t, b_t)
                after[id(layer.node)] = list(b.graph.nodes[start:])
                start = len(b.graph.nodes)
        return LoraAdapter(
            module=module,
            weight=layers[0].weight.name,
            a=a.name,
            b=b_weight.name,
            r=self.r,
            alpha=float(self.alpha),
            scale=self.scale,
            rslora=self.rslora,
            dropout=float(self.dropout),
            dtype=self.dtype,
            fan_in_fan_out=layers[0].fan_in_fan_out,
        )

    def _initial_a(self, rng: np.random.Generator, n_in: int) -> np.ndarray:
        """Case 5: PEFT's kaiming_uniform_(a=√5) bound is gain · √(3 / fan_in) with gain
        √(2 / (1 + 5)), that is 1/√in."""
        if self.init == "gaussian":
            return rng.normal(0.0, 1.0 / self.r, (self.r, n_in))
        bound = 1.0 / math.sqrt(n_in)
        return rng.uniform(-bound, bound, (self.r, n_in))

    def _add_delta(self, b: Builder, layer: LinearLayer, a_t: gs.Tensor, b_t: gs.Tensor) -> None:
        """The layer's product y becomes y + scale · (dropout(x) · Aᵀ) · Bᵀ, under y's name."""
        node = layer.node
        x, y = node.inputs[0], node.outputs[0]
        low, base_type = _TYPES[self.dtype], onnx_dtype(layer.weight.dtype)  # MatMul's and Gemm's x, W, y: one type
        h = x if base_type == low else b.op("Cast", x, to=low)
        if self.dropout > 0:
            h = b.op("Dropout", h, b.constant(np.float32(self.dropout)), b.constant(np.array(True)))
        delta = b.op("MatMul", b.op("MatMul", h, a_t), b_t)
        delta = b.op("Mul", delta, _parameter(b.fresh_name("scale"), np.array(self.scale), self.dtype))
        if base_type != low:
            delta = b.op("Cast", delta, to=base_type)
        base = gs.Variable(b.fresh_name("base"), dtype=y.dtype, shape=y.shape)
        node.outputs[0] = base
        b.graph.nodes.append(gs.Node("Add", name=b.fresh_name("Add"), inputs=[base, delta], outputs=[y]))


def _check_patterns(what: str, patterns, *, allow_empty: bool) -> None:
    items = [patterns] if isinstance(patterns, str) else list(patterns)
    if not items and not allow_empty:
        raise ParameterValueError(f"pass 'lora' parameter {what!r}: name at least one module, or all-linear")
    if any(not isinstance(i, str) or not i for i in items):
        raise ParameterValueError(f"pass 'lora' parameter {what!r}: expected module names, got {patterns!r}")
    if isinstance(patterns, str) and patterns.lower() != ALL_LINEAR:
        try:
            re.compile(patterns)
        except re.error as exc:
            raise ParameterValueError(
                f"pass 'lora' parameter {what!r}: {patterns!r} is no regular expression ({exc})"
            ) from None


# --------------------------------------------------------------------------- writing the adapters


def _starting_values(folder: PeftAdapters, layers: Sequence[LinearLayer]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Case 7: the model's module -> the folder's A and B for it, their shapes checked."""
    modules: dict[str, LinearLayer] = {}
    for layer in layers:
        modules.setdefault(layer.module, layer)  # a module's first layer
    start = {}
    for name, (a, b) in folder.weights.items():
        hits = [m for m in modules if m == name or m.endswith("." + name)]
        if len(hits) != 1:
            some = ", ".join(list(modules)[:5]) + (", …" if len(modules) > 5 else "")
            why = f"fits {', '.join(hits)}" if hits else f"is no linear layer of the model (its layers: {some})"
            raise PassError(f"{Path(folder.folder) / WEIGHTS}: module {name!r} {why}")
        n_in, n_out = modules[hits[0]].features
        want = ([folder.r, n_in], [n_out, folder.r])
        if (list(a.shape), list(b.shape)) != want:
            raise PassError(
                f"{Path(folder.folder) / WEIGHTS}: the adapter of {hits[0]!r} does not fit it: lora_A {list(a.shape)} "
                f"and lora_B {list(b.shape)}, where the layer ({n_in} in, {n_out} out) takes {want[0]} and {want[1]}"
            )
        start[hits[0]] = (a, b)
    return start


def _by_module(layers: Sequence[LinearLayer]) -> dict[str, list[LinearLayer]]:
    """The chosen layers by module, in graph order: a module read at several nodes has one adapter."""
    modules: dict[str, list[LinearLayer]] = {}
    for layer in layers:
        modules.setdefault(layer.module, []).append(layer)
    return modules


def _refuse_adapted(modules: dict[str, list[LinearLayer]], adapters: Sequence[LoraAdapter]) -> None:
    done = {a.weight: a.module for a in adapters}
    for module, layers in modules.items():
        if layers[0].weight.name in done:
            raise PassError(
                f"module {module!r} has an adapter already ({done[layers[0].weight.name]}.lora_A/B); "
                "exclude it, or compile from the model without adapters"
            )


def _refuse_taken(modules: dict[str, list[LinearLayer]], graph: gs.Graph) -> None:
    taken = set(graph.tensors())
    for module in modules:
        for name in (f"{module}.lora_A.weight", f"{module}.lora_B.weight"):
            if name in taken:
                raise PassError(f"cannot add the adapter {name!r}: the model already has a tensor of that name")


def _in_order(graph: gs.Graph, after: dict[int, list[gs.Node]]) -> None:
    """The nodes made for each layer right after its node, so the graph stays in topological order."""
    made = {id(n) for nodes in after.values() for n in nodes}
    order = []
    for node in graph.nodes:
        if id(node) not in made:
            order.append(node)
            order.extend(after.get(id(node), ()))
    graph.nodes = order


def _parameter(name: str, values: np.ndarray, dtype: str) -> gs.Constant:
    """A constant of ``values`` in ``dtype`` (bfloat16 as a TensorProto, which NumPy cannot hold)."""
    if dtype != "bfloat16":
        return gs.Constant(name, np.asarray(values, dtype=np.dtype(dtype)))
    tensor = numpy_helper.from_array(np.asarray(values, np.float32).astype(ml_dtypes.bfloat16), name)
    constant = gs.Constant(name, np.zeros(tensor.dims, np.float32))
    store_values(constant, tensor)
    return constant


def _checksums(graph: gs.Graph, names: Sequence[str]) -> dict[str, int]:
    """Case 6: the CRC-32 of each weight's values (their bytes in C order, as a checkpoint
    checks its tensors'); a weight compiled without its values (the planner's) has none."""
    tensors = graph.tensors()
    sums = {}
    for name in names:
        constant = tensors[name]
        if is_left_out(constant):
            continue
        lazy = lazy_tensor(constant)
        values = numpy_helper.to_array(lazy) if lazy is not None else np.asarray(constant.values)
        sums[name] = zlib.crc32(np.ascontiguousarray(values).reshape(-1).view(np.uint8))
    return sums


def _size(adapter: LoraAdapter, modules: dict[str, list[LinearLayer]]) -> int:
    n_in, n_out = modules[adapter.module][0].features
    return adapter.r * (n_in + n_out)
