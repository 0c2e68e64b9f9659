"""The fuse pass: apply the fusion rules to a program, for one onnxruntime provider."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from graphforge import roles
from graphforge.errors import PassError
from graphforge.graph import Model
from graphforge.ort_compat import nchwc_block_size, resolve_provider
from graphforge.pass_infra import Pass, PassResult
from graphforge.shapes import infer_shapes

from .engine import Context, apply
from .rules import CONV_INPUT_GRAD_NCHWC, CONV_NCHWC, RULES


@dataclass(frozen=True)
class Fuse(Pass):
    """Rewrite the program's slow formulations into faster ones that compute the same values,
    in standard ONNX ops (passes/fusion/rules; each rule's documentation gives its measurement):

    - ``relu_backward_mask``: a ReLU's gradient as dy · float(y > 0) instead of a Where (equal
      wherever the upstream gradient is finite);
    - ``maxpool_backward_unpool``: a MaxPool's gradient with windows that do not overlap as one
      MaxUnpool instead of a ScatterElements into zeros (bit for bit the same);
    - ``conv_input_grad_nchwc``: a stride-1 Conv's input gradient with at least 16×16 positions
      as onnxruntime's blocked-channel (NCHWc) CPU Conv instead of ConvTranspose (the same sums
      in another order). Its weight layout depends on the CPU's vector width: the program
      records it, and a session on a CPU with another refuses the program;
    - ``conv_nchwc``: a forward Conv (a kernel over 1×1, at least 8×8 output positions) on the same
      NCHWc kernels, its weights blocked each step, instead of im2col + GEMM image by image (the
      same sums in another order; the layout is recorded as above, and ``prune`` puts the Conv
      back: an exported model has the user's op);
    - ``conv_stacked`` and ``conv_transpose_stacked``: a Conv or ConvTranspose over images of
      at most 16 positions (4×4) as one over the batch stacked into one tall image, with zero
      rows between the images (onnxruntime's CPU kernels run image by image, one GEMM as narrow
      as the image; the same sums). A forward node rewritten is recorded, and ``prune`` puts
      it back: an exported model has the user's op.

    ``rules``: the rule names to apply (default: all, in the order above). ``provider`` ("auto":
    CUDA where it works here, else the CPU): a rule emits an op only where onnxruntime's provider
    has a kernel for it. The note says how often each rule fired and why candidates were
    refused; the model records it as ``graphforge.fusion``. Run it last: a later pass sees the
    fused ops like any other.
    """

    name = "fuse"

    rules: tuple[str, ...] = ()
    provider: Literal["auto", "cpu", "cuda"] = "auto"

    def __post_init__(self):
        chosen = (self.rules,) if isinstance(self.rules, str) else tuple(self.rules)
        known = [r.name for r in RULES]
        unknown = [r for r in chosen if r not in known]
        if unknown:
            raise ValueError(
                f"rules={list(chosen)}: no rule {', '.join(map(repr, unknown))}; the rules: {', '.join(known)}"
            )
        object.__setattr__(self, "rules", chosen)

    def run(self, model: Model) -> PassResult:
        try:
            provider = resolve_provider(self.provider)
        except ValueError as exc:
            raise PassError(f"{exc}; compile with provider=cpu, or on the machine that trains") from None
        rules = [r for r in RULES if not self.rules or r.name in self.rules]
        shaped = {r.pattern.nodes[r.pattern.root].op for r in rules if r.shapes}
        if shaped and any(n.op in shaped for n in model.graph.nodes):
            model = infer_shapes(model, in_place=True)  # their checks read static sizes, which a gradient is not given
        context = Context(provider, model.graph.opset or 13)
        report = apply(model.graph, rules, context)
        record = {"provider": provider, **report.to_json()}
        if context.restore:
            record["restore"] = context.restore  # the forward nodes prune puts back
        if report.fired[CONV_INPUT_GRAD_NCHWC.name] or report.fired[CONV_NCHWC.name]:
            record["nchwc_block"] = nchwc_block_size()  # the weights' layout: the runtime checks its CPU's
        roles.set_json(model, roles.FUSION, record)
        return PassResult(model, bool(report.fired), note=report.note())
