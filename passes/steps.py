"""The steps pass: a training program's step run k times in one ONNX ``Loop``, over stacked batches."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphforge import roles
from graphforge.errors import PassError
from graphforge.graph import Model
from graphforge.ir import subgraphs_of
from graphforge.pass_infra import Pass, PassResult, check_number
from graphforge.pass_spec import ParameterValueError
from graphforge.program import ProgramRoles

#: the metadata key of what the pass made (graphforge/roles.py)
STEPS = roles.STEPS
#: the leading dim of the stacked inputs and the scan outputs where k is left to the run
STEPS_DIM = "steps"
#: prefix of the names inside the loop's body (its copy of the step), and of the pass's own constants
PREFIX = "steps::"


@dataclass(frozen=True)
class Steps(Pass):
    """Run ``k`` training steps in one run: the program's step becomes the body of an ONNX ``Loop``.

    1. The carried tensors (parameters, optimizer states, accumulators, buffers) are the loop's
       carried values: each step reads what the one before wrote; the outputs ``P_next`` are
       the values after the k-th step.
    2. Every other input the step reads per run (the batch, the labels, the learning rate, the
       step count, the lazy-reset flag, the dropout key) is stacked: it takes a new leading
       axis of size k, and step i reads slice i. So the runtime feeds the k learning rates its
       schedule gives and the step counts s, s+1, …, s+k-1, and each step computes what it
       computes alone, bit for bit.
    3. The loss and the step's reports (``grad_norm``, loss scaling's ``update_skipped``) are
       the loop's scan outputs, [k] each; the gradients, the forward outputs and ``step_next``
       are not outputs of the k steps.
    4. Inputs that are neither (frozen weights held as initializers, constants) are read by
       every step as they are.
    The inputs, the carried outputs and the loss keep their names; inside the body every name
    is prefixed ``steps::``. Refused: a program that is not a training program, one already
    wrapped, one compiled for several processes (allreduce, zero, pipeline, tensor_parallel:
    their runtimes cut the step where a collective runs), and one whose nodes hold subgraphs.
    """

    name = "steps"
    k: int = 8

    def __post_init__(self):
        check_number(self, "k", at_least=1)
        if isinstance(self.k, bool) or not isinstance(self.k, int):
            raise ParameterValueError(f"pass 'steps' parameter 'k': expected a whole number ≥ 1, got {self.k!r}")

    def run(self, model: Model) -> PassResult:
        proto = model.to_proto()
        program_roles = ProgramRoles.of_proto(proto)
        refuse_unsteppable(program_roles)
        initializers = {t.name for t in proto.graph.initializer}
        carried = {c.input: c.output for c in program_roles.carried}
        fixed = [i.name for i in proto.graph.input if i.name in initializers and i.name not in carried]
        scans = [program_roles.loss or "loss", *program_roles.step_reports]
        wrapped = steps_model(proto, self.k, carried=carried, fixed=fixed, scans=scans)
        return PassResult(Model.from_proto(wrapped), changed=True, note=f"{self.k} steps per run")


def refuse_unsteppable(program_roles: ProgramRoles) -> None:
    """A PassError saying why a program cannot run several steps in one run, if it cannot."""
    program_roles.require_training_program()
    if STEPS in program_roles.metadata:
        raise PassError("the program runs several steps per run already (the steps pass ran on it)")
    for what, present in (
        ("the allreduce or zero pass", program_roles.allreduce is not None),
        ("pipeline stages", program_roles.stages is not None),
        ("tensor_parallel", program_roles.tensor_parallel is not None),
    ):
        if present:
            raise PassError(
                f"the program was compiled with {what}: several steps per run take a one-process program, whose "
                "step has no collective to cut at"
            )


def steps_model(
    proto: onnx.ModelProto,
    k: int | None,
    *,
    carried: Mapping[str, str],
    fixed: Collection[str] = (),
    scans: Sequence[str] = ("loss",),
) -> onnx.ModelProto:
    """``proto`` (one training step) as ``k`` steps in one ``Loop`` (see Steps): ``carried``
    maps each carried input to the output that replaces it, ``fixed`` names the inputs every
    step reads as they are, every other input is stacked, ``scans`` are the per-step outputs
    the result returns as [k, ...]. ``k`` None: as many steps as the stacked inputs have slices
    (their leading dim is then ``STEPS_DIM``). Returns a new model; ``proto`` is unchanged."""
    graph = proto.graph
    nested = next((n for n in graph.node if any(True for _ in subgraphs_of([n]))), None)
    if nested is not None:
        raise PassError(
            f"node {nested.name or nested.output[0]!r} ({nested.op_type}) holds a subgraph: the steps pass wraps "
            "programs without control flow"
        )
    outputs = {o.name: o for o in graph.output}
    for name in [*carried.values(), *scans]:
        if name not in outputs:
            raise PassError(f"the program has no output {name!r} to carry or to return per step")
    inputs = [i for i in graph.input]
    stacked = [i for i in inputs if i.name not in carried and i.name not in fixed]
    # the names the body reads from the graph around it, as they are: constants and fixed inputs
    outer = ({t.name for t in graph.initializer} - set(carried) - {i.name for i in stacked}) | set(fixed)

    def inner(name: str) -> str:
        return name if not name or name in outer else PREFIX + name

    body = _body(graph, carried, stacked, scans, inner)
    stacked_names = {i.name for i in stacked}
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    del out.graph.node[:], out.graph.input[:], out.graph.output[:], out.graph.value_info[:]
    kept = [t for t in graph.initializer if t.name not in stacked_names]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    trip, cond = PREFIX + "k", PREFIX + "cond"
    out.graph.initializer.append(numpy_helper.from_array(_array(True, "bool"), cond))
    if k is not None:
        out.graph.initializer.append(numpy_helper.from_array(_array(k, "int64"), trip))
    elif stacked:  # as many steps as the stacked inputs have slices
        first, axis = stacked[0].name, PREFIX + "axis0"
        out.graph.initializer.append(numpy_helper.from_array(_array(0, "int64"), axis))
        out.graph.node.append(helper.make_node("Shape", [first], [PREFIX + "shape"], name=PREFIX + "shape"))
        out.graph.node.append(helper.make_node("Gather", [PREFIX + "shape", axis], [trip], name=PREFIX + "k", axis=0))
    else:
        raise PassError("the program has no input to stack: give k, the number of steps a run makes")
    for value in inputs:
        out.graph.input.append(_with_leading(value, k) if value.name in stacked_names else value)
    carried_outputs = [outputs[name] for name in carried.values()]
    out.graph.output.extend(carried_outputs)
    out.graph.output.extend(_with_leading(outputs[name], k) for name in scans)
    loop = helper.make_node(
        "Loop",
        [trip, cond, *carried],
        [*carried.values(), *scans],
        name=PREFIX + "loop",
        body=body,
    )
    out.graph.node.append(loop)
    record = {"k": k, "stacked": sorted(stacked_names), "fixed": sorted(fixed), "carried": dict(carried)}
    record["scans"] = list(scans)
    metadata = {p.key: p.value for p in out.metadata_props}
    metadata[STEPS] = json.dumps(record, sort_keys=True)
    del out.metadata_props[:]
    for key, value in metadata.items():
        out.metadata_props.add(key=key, value=value)
    return out


def _body(graph, carried: Mapping[str, str], stacked, scans: Sequence[str], inner) -> onnx.GraphProto:
    """The loop's body: slice i of each stacked input, the step's nodes renamed, the carried
    values and the scans out."""
    iteration, cond_in, cond_out = PREFIX + "i", PREFIX + "cond_in", PREFIX + "cond_out"
    types = {v.name: v for v in [*graph.input, *graph.output, *graph.value_info]}
    nodes = [helper.make_node("Identity", [cond_in], [cond_out], name=PREFIX + "cond")]
    for value in stacked:
        nodes.append(
            helper.make_node(
                "Gather", [value.name, iteration], [inner(value.name)], name=PREFIX + "slice/" + value.name
            )
        )
    for node in graph.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.input[:] = [inner(n) for n in node.input]
        copy.output[:] = [inner(n) for n in node.output]
        nodes.append(copy)
    body_inputs = [
        helper.make_tensor_value_info(iteration, TensorProto.INT64, []),
        helper.make_tensor_value_info(cond_in, TensorProto.BOOL, []),
        *(_renamed(types[name], inner(name)) for name in carried),
    ]
    body_outputs = [
        helper.make_tensor_value_info(cond_out, TensorProto.BOOL, []),
        *(_renamed(types[name], inner(name)) for name in [*carried.values(), *scans]),
    ]
    value_info = [_renamed(v, inner(v.name)) for v in graph.value_info]
    value_info += [_renamed(v, inner(v.name)) for v in stacked]
    body = helper.make_graph(nodes, PREFIX + "step", body_inputs, body_outputs, value_info=value_info)
    return body


def _renamed(value: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    copy = onnx.ValueInfoProto()
    copy.CopyFrom(value)
    copy.name = name
    return copy


def _with_leading(value: onnx.ValueInfoProto, k: int | None) -> onnx.ValueInfoProto:
    """``value`` with a new leading dim of size ``k`` (None: ``STEPS_DIM``; a stacked input, a scan output)."""
    copy = onnx.ValueInfoProto()
    copy.CopyFrom(value)
    if not copy.type.tensor_type.HasField("shape"):
        return copy  # of unknown rank: stays unknown
    shape = copy.type.tensor_type.shape
    dims = [onnx.TensorShapeProto.Dimension()] + [d for d in shape.dim]
    if k is None:
        dims[0].dim_param = STEPS_DIM
    else:
        dims[0].dim_value = k
    del shape.dim[:]
    shape.dim.extend(dims)
    return copy


def _array(value, dtype: str) -> np.ndarray:
    return np.array(value, dtype)
