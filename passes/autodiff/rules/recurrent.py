"""Recurrent ops: LSTM, GRU and RNN, by backpropagation through time as cuDNN does it.

The forward node stays (onnxruntime's kernel). Its output Y holds every h_t, so h_{t-1} is Y
shifted by one step (initial_h first) and every gate's pre-activation, for all steps at once,
is one MatMul per weight outside any loop. Only what recurs runs in a Scan over time, each
body a few elementwise ops and one small MatMul: the LSTM's cell state (forward), and the
backward recurrence of dh (and dc), which emits the per-step gate gradients. Then
dX = dgates·W, dW = Σ_t dgates_tᵀ·x_t, dR = Σ_t dgates_tᵀ·h_{t-1} and the bias sums are big
MatMuls and reductions outside the loop. Everything runs for any batch and sequence length.

What the rules follow is onnxruntime's CPU kernels, which run the forward:

1. Directions: a reverse direction is the same recurrence run backwards in time (its Scans
   run the other way, h_{t-1} is Y[t+1]); bidirectional is both, along num_directions.
2. layout 1 (batch first) is transposed to layout 0 at the boundary.
3. sequence_lens (opset 11+: the step mask needs Range): steps at or past a sequence's length
   pass the state through, output 0 and take no gradient; a reverse direction runs over the
   first len steps backwards. A length of 0 gives Y_h = Y_c = 0 (no gradient to the initial state).
4. Activations: the eleven ONNX lists, alpha and beta read as onnxruntime reads them (LSTM,
   GRU: consumed in order by the activations that take them, defaults LeakyRelu 0.01,
   HardSigmoid 0.2/0.5, Elu 1.0, else 0; RNN: one per direction, default 0).
5. clip bounds every gate's pre-activation (never the LSTM's cell state); its gradient is 0 outside.
6. LSTM peepholes P and input_forget (f = 1 - i); GRU linear_before_reset 0 and 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs
from graphforge.passes.autodiff.registry import RULES

from graphforge.builder import Builder

gradient = RULES.gradient

# ----------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class Activation:
    name: str  # lower case
    alpha: float = 0.0
    beta: float = 0.0


#: the ONNX names, and whether each takes an alpha and a beta (onnxruntime's rnn_helpers.cc)
_TAKES = {
    "Affine": (True, True), "Relu": (False, False), "LeakyRelu": (True, False), "ThresholdedRelu": (True, False),
    "Tanh": (False, False), "ScaledTanh": (True, True), "Sigmoid": (False, False), "HardSigmoid": (True, True),
    "Elu": (True, False), "Softsign": (False, False), "Softplus": (False, False),
}  # fmt: skip
_TAKES_LOWER = {k.lower(): v for k, v in _TAKES.items()}
#: onnxruntime's LSTM and GRU defaults where alpha/beta run out (everything else: 0)
_DEFAULTS = {"leakyrelu": (0.01, 0.0), "hardsigmoid": (0.2, 0.5), "elu": (1.0, 0.0)}


def _k(b: Builder, value: float, like: gs.Tensor) -> gs.Tensor:
    return b.scalar_like(value, like)


#: y = f(z), as ONNX ops
_FORWARD: dict[str, Callable] = {
    "sigmoid": lambda b, z, a: b.op("Sigmoid", z),
    "tanh": lambda b, z, a: b.op("Tanh", z),
    "relu": lambda b, z, a: b.op("Relu", z),
    "affine": lambda b, z, a: b.add(b.mul(z, _k(b, a.alpha, z)), _k(b, a.beta, z)),
    "leakyrelu": lambda b, z, a: b.op("LeakyRelu", z, alpha=a.alpha),
    "thresholdedrelu": lambda b, z, a: b.op("Where", b.op("Greater", z, _k(b, a.alpha, z)), z, _k(b, 0.0, z)),
    "scaledtanh": lambda b, z, a: b.mul(b.op("Tanh", b.mul(z, _k(b, a.beta, z))), _k(b, a.alpha, z)),
    "hardsigmoid": lambda b, z, a: b.op("HardSigmoid", z, alpha=a.alpha, beta=a.beta),
    "elu": lambda b, z, a: b.op("Elu", z, alpha=a.alpha),
    "softsign": lambda b, z, a: b.op("Softsign", z),
    "softplus": lambda b, z, a: b.op("Softplus", z),
}


def _where(b, cond, yes: float, no: float, like):
    return b.op("Where", cond, _k(b, yes, like), _k(b, no, like))


#: f'(z) from z and y = f(z), always of z's shape (it is scanned over time)
_DERIVATIVE: dict[str, Callable] = {
    "sigmoid": lambda b, z, y, a: b.mul(y, b.sub(_k(b, 1.0, y), y)),
    "tanh": lambda b, z, y, a: b.sub(_k(b, 1.0, y), b.mul(y, y)),
    "relu": lambda b, z, y, a: _where(b, b.op("Greater", z, _k(b, 0.0, z)), 1.0, 0.0, z),
    "affine": lambda b, z, y, a: b.op("Expand", _k(b, a.alpha, z), b.op("Shape", z)),
    "leakyrelu": lambda b, z, y, a: _where(b, b.op("Less", z, _k(b, 0.0, z)), a.alpha, 1.0, z),
    "thresholdedrelu": lambda b, z, y, a: _where(b, b.op("Greater", z, _k(b, a.alpha, z)), 1.0, 0.0, z),
    "scaledtanh": lambda b, z, y, a: b.mul(_DERIVATIVE["tanh"](b, z, b.div(y, _k(b, a.alpha, y)), a),
                                           _k(b, a.alpha * a.beta, z)),
    "hardsigmoid": lambda b, z, y, a: _where(b, b.op("And", b.op("Greater", y, _k(b, 0.0, y)),
                                                     b.op("Less", y, _k(b, 1.0, y))), a.alpha, 0.0, z),
    "elu": lambda b, z, y, a: b.op("Where", b.op("Less", z, _k(b, 0.0, z)), b.add(y, _k(b, a.alpha, y)), _k(b, 1.0, z)),
    "softsign": lambda b, z, y, a: b.op("Reciprocal", b.mul(s := b.add(b.op("Abs", z), _k(b, 1.0, z)), s)),
    "softplus": lambda b, z, y, a: b.op("Sigmoid", z),
}  # fmt: skip


def _activate(b: Builder, z_raw, act: Activation, clip: float | None):
    """A gate's value f(clip(z_raw))."""
    z = z_raw if clip is None else b.op("Min", b.op("Max", z_raw, _k(b, -clip, z_raw)), _k(b, clip, z_raw))
    y = _FORWARD[act.name](b, z, act)
    y.dtype = z_raw.dtype
    return y, z


def _gate(b: Builder, z_raw, act: Activation, clip: float | None):
    """A gate's value f(clip(z_raw)) and its derivative with respect to z_raw."""
    y, z = _activate(b, z_raw, act, clip)
    d = _DERIVATIVE[act.name](b, z, y, act)
    d.dtype = z_raw.dtype
    if clip is not None:  # a clipped pre-activation passes no gradient
        d = b.op("Where", b.op("Less", b.op("Abs", z_raw), _k(b, clip, z_raw)), d, _k(b, 0.0, z_raw))
    return y, d


# ----------------------------------------------------------------------------- the node, per direction


@dataclass(frozen=True)
class Cell:
    """What differs between LSTM, GRU and RNN: default activations, input roles, the math."""

    activations: tuple[str, ...]  # per direction
    inputs: tuple[str, ...]  # the op's inputs, by role
    backward: Callable[[Direction], dict]  # role -> gradient of this direction's slice


@dataclass(frozen=True)
class Steps:
    """The step masks sequence_lens makes, [T, N, 1] (alive: [N, 1])."""

    valid: gs.Tensor  # step t < len
    next_valid: gs.Tensor  # step t + 1 < len
    alive: gs.Tensor  # len > 0


@dataclass
class Direction:
    """One direction of the node in layout 0: x [T, N, I], w [G·H, I], r [G·H, H], bias [2·G·H]
    (Wb then Rb), h0 [N, H], y [T, N, H] (every h_t), and the gradients reaching it."""

    b: Builder
    x: gs.Tensor
    w: gs.Tensor
    r: gs.Tensor
    bias: gs.Tensor | None
    h0: gs.Tensor
    y: gs.Tensor
    dy: gs.Tensor | None
    dy_h: gs.Tensor | None
    zeros: gs.Tensor  # [N, H]
    reverse: bool
    acts: tuple[Activation, ...]
    clip: float | None
    hidden: int
    steps: Steps | None
    want: dict[str, bool]
    attrs: dict  # the node's attributes (input_forget, linear_before_reset)
    c0: gs.Tensor | None = None  # LSTM
    dy_c: gs.Tensor | None = None
    p: gs.Tensor | None = None


def _recurrent(ctx, dys, cell: Cell):
    roles = {name: i for i, name in enumerate(cell.inputs)}
    want = {name: ctx.x(i) is not None and ctx.wants(ctx.x(i)) for name, i in roles.items()}
    want["sequence_lens"] = False
    if not any(want.values()):
        return [None] * len(ctx.inputs)
    b, layout = ctx.b, ctx.attr("layout", 0)
    reverse, acts, clip = _attributes(ctx, cell)
    hidden = ctx.attr("hidden_size")
    if hidden is None:
        ctx.fail("hidden_size is not set")
    x = ctx.x(0)
    y = ctx.ensure_output(0, "Y")  # every h_t: the backward pass reads it
    if y.dtype is None:
        y.dtype = x.dtype if x.dtype is not None else np.float32
    # layout 0 inside: [T, N, I] / [T, D, N, H] / [D, N, H]
    seq, per_dir = ([1, 0, 2], [1, 2, 0, 3]) if layout else (None, None)
    # a node lists only the outputs up to the last one it produces (LSTM's Y_c may be absent)
    dys = [*dys, *[None] * ((3 if "initial_c" in roles else 2) - len(dys))]
    x, y, dy = _perm(b, x, seq), _perm(b, y, per_dir), _perm(b, dys[0], per_dir)
    state = {"initial_h": _perm(b, ctx.x(roles["initial_h"]), seq), "Y_h": _perm(b, dys[1], seq)}
    if "initial_c" in roles:
        state |= {"initial_c": _perm(b, ctx.x(roles["initial_c"]), seq), "Y_c": _perm(b, dys[2], seq)}
    lens = ctx.x(roles["sequence_lens"])
    steps = _steps(ctx, x, lens) if lens is not None else None
    y0 = b.op("Gather", y, b.constant(np.int64(0)), axis=0)  # [D, N, H]
    zeros = b.zeros_like(b.op("Gather", y0, b.constant(np.int64(0)), axis=0))
    grads = []
    for d, backwards in enumerate(reverse):

        def pick(t, axis=0, d=d):
            return None if t is None else b.op("Gather", t, b.constant(np.int64(d)), axis=axis)

        h0 = pick(state["initial_h"])
        direction = Direction(
            b=b, x=x, w=pick(ctx.x(1)), r=pick(ctx.x(2)), bias=pick(ctx.x(3)), h0=h0 if h0 is not None else zeros,
            y=pick(y, 1), dy=pick(dy, 1), dy_h=_alive(b, steps, pick(state["Y_h"])), zeros=zeros, reverse=backwards,
            acts=acts[d], clip=clip, hidden=hidden, steps=steps, want=want, attrs=dict(ctx.node.attrs),
        )  # fmt: skip
        if "initial_c" in roles:
            c0 = pick(state["initial_c"])
            direction.c0 = c0 if c0 is not None else zeros
            direction.dy_c = _alive(b, steps, pick(state["Y_c"]))
            direction.p = pick(ctx.x(roles["P"]))
        with b.scope(f"{ctx.node.name or ctx.node.op}/{'reverse' if backwards else 'forward'}"):
            grads.append(cell.backward(direction))
    result = [_assemble(b, name, [g.get(name) for g in grads], layout) if want[name] else None for name in cell.inputs]
    return result[: len(ctx.inputs)]


def _attributes(ctx, cell: Cell) -> tuple[tuple[bool, ...], list[tuple[Activation, ...]], float | None]:
    """Per direction whether it runs backwards in time and its activations; the clip."""
    direction = ctx.attr("direction", "forward")
    reverse = {"forward": (False,), "reverse": (True,), "bidirectional": (False, True)}.get(direction)
    if reverse is None:
        ctx.fail(f"unknown direction {direction!r}")
    names = list(ctx.attr("activations") or cell.activations * len(reverse))
    if ctx.node.op == "RNN" and len(names) == 2 and len(reverse) == 1:
        names = names[:1]  # onnxruntime reads ONNX's old default [Tanh, Tanh] as one Tanh
    per = len(cell.activations)
    if len(names) != per * len(reverse):
        ctx.fail(f"{len(names)} activations for {len(reverse)} direction(s) of {per}")
    alphas, betas = list(ctx.attr("activation_alpha") or []), list(ctx.attr("activation_beta") or [])
    acts = []
    for i, name in enumerate(names):
        key = name.lower()
        known = name in _TAKES if ctx.node.op == "RNN" else key in _TAKES_LOWER
        if not known:  # onnxruntime's RNN reads names case-sensitively (and runs Tanh for others)
            ctx.fail(f"activation {name!r} is not one of {', '.join(_TAKES)}")
        if ctx.node.op == "RNN":  # one alpha and beta per direction, default 0
            alpha, beta = (alphas[i] if i < len(alphas) else 0.0), (betas[i] if i < len(betas) else 0.0)
        else:  # consumed in order by the activations that take them
            takes, default = _TAKES_LOWER[key], _DEFAULTS.get(key, (0.0, 0.0))
            alpha = (alphas.pop(0) if alphas else default[0]) if takes[0] else 0.0
            beta = (betas.pop(0) if betas else default[1]) if takes[1] else 0.0
        acts.append(Activation(key, float(alpha), float(beta)))
    clip = ctx.attr("clip")
    clip = float(clip) if clip is not None and clip > 0 else None  # RNN: a negative clip is none
    return reverse, [tuple(acts[d * per : (d + 1) * per]) for d in range(len(reverse))], clip


def _perm(b: Builder, t, perm):
    return t if t is None or perm is None else b.transpose(t, perm)


def _steps(ctx, x, lens) -> Steps:
    if ctx.opset < 11:
        ctx.fail("sequence_lens needs opset 11+ (the step mask is made with Range)")
    b = ctx.b
    zero, one = b.constant(np.int64(0)), b.constant(np.int64(1))
    count = b.op("Gather", b.shape(x), zero, axis=0)
    position = b.unsqueeze(b.op("Range", zero, count, one), [1, 2])  # [T, 1, 1]
    lens = b.unsqueeze(b.cast(lens, np.int64), [0, 2])  # [1, N, 1]
    valid, next_valid = b.op("Less", position, lens), b.op("Less", b.add(position, one), lens)
    return Steps(valid, next_valid, b.op("Greater", b.squeeze(lens, [0]), zero))


def _alive(b: Builder, steps: Steps | None, dy_last):
    """A final state's gradient, none for sequences of length 0 (onnxruntime outputs zeros there)."""
    if dy_last is None or steps is None:
        return dy_last
    return b.op("Where", steps.alive, dy_last, _k(b, 0.0, dy_last))


def _assemble(b: Builder, name: str, parts: list, layout: int):
    """The input's gradient from the directions' ones: X sums them, the others stack them."""
    if any(p is None for p in parts):
        return None
    if name == "X":
        total = b.sum(parts)
        return b.transpose(total, [1, 0, 2]) if layout else total
    stacked = (
        b.op("Concat", *[b.unsqueeze(p, [0]) for p in parts], axis=0) if len(parts) > 1 else b.unsqueeze(parts[0], [0])
    )
    return b.transpose(stacked, [1, 0, 2]) if layout and name.startswith("initial_") else stacked


# ----------------------------------------------------------------------------- shared pieces of the math


def _previous(d: Direction, seq, first):
    """seq's value one step earlier in processing order, ``first`` before the first step: h_{t-1} from Y."""
    b = d.b
    first = b.unsqueeze(first, [0])
    if not d.reverse:
        return b.op("Concat", first, b.slice(seq, 0, 0, -1), axis=0)
    shifted = b.op("Concat", b.slice(seq, 0, 1), first, axis=0)
    # backwards, a sequence's first step is its last valid one: Y[t+1] there is padding
    return shifted if d.steps is None else b.op("Where", d.steps.next_valid, shifted, first)


def _biases(d: Direction, gates: int):
    """(Wb, Rb), each [G·H], or (None, None)."""
    if d.bias is None:
        return None, None
    n = gates * d.hidden
    return d.b.slice(d.bias, 0, 0, n), d.b.slice(d.bias, 0, n, 2 * n)


def _project(b: Builder, inputs, weight, bias=None):
    """inputs · weightᵀ (+ bias) over all steps: [T, N, K] x [M, K] -> [T, N, M]."""
    out = b.matmul(inputs, b.transpose(weight, [1, 0]))
    return out if bias is None else b.add(out, bias)


def _split(b: Builder, z, hidden: int, count: int, axis: int = 2):
    """The ``count`` gate blocks of z along ``axis`` (the last of [T, N, G·H])."""
    return [b.slice(z, axis, k * hidden, (k + 1) * hidden) for k in range(count)]


def _outer(b: Builder, dz, inputs):
    """Σ over steps and batch of dz[t, n]ᵀ · inputs[t, n]: a weight's gradient, one MatMul."""
    return b.matmul(b.transpose(b.op("Flatten", dz, axis=2), [1, 0]), b.op("Flatten", inputs, axis=2))


def _total(b: Builder, dz):
    return b.reduce_sum(dz, [0, 1], keepdims=False)


def _scan(d: Direction, body, states: list, scans: dict, *, backwards: bool, outputs: int):
    """A Scan over time (axis 0 of each of ``scans``, None entries left out) carrying ``states``.
    ``body(bb, states, slices)`` emits one step with builder ``bb`` (slices by the scans' keys)
    and returns (new states, per-step outputs). Returns (final states, stacked outputs)."""
    b = d.b
    scans = {k: v for k, v in scans.items() if v is not None}
    graph = gs.Graph(opset=b.opset)
    bb = Builder(graph, prefix=b.fresh_name("step") + "/")
    state_in = [gs.Variable(bb.fresh_name("state"), dtype=t.dtype) for t in states]
    slices = {k: gs.Variable(bb.fresh_name(k), dtype=t.dtype) for k, t in scans.items()}
    new_states, per_step = body(bb, state_in, slices)
    produced, results = {id(o) for n in graph.nodes for o in n.outputs}, []
    for t in [*new_states, *per_step]:  # a body output is a tensor of its own, made in the body
        results.append(t if id(t) in produced and all(t is not r for r in results) else bb.op("Identity", t))
    for t, like in zip(results, [*states, *[states[0]] * len(per_step)], strict=True):
        t.dtype = like.dtype
    graph.inputs, graph.outputs = [*state_in, *slices.values()], results
    out = b.op(
        "Scan", *states, *scans.values(), outputs=len(results), body=graph, num_scan_inputs=len(scans),
        scan_input_directions=[int(backwards)] * len(scans), scan_output_directions=[int(backwards)] * outputs,
    )  # fmt: skip
    out = out if isinstance(out, list) else [out]
    for t in out:
        t.dtype = states[0].dtype
    return out[: len(states)], out[len(states) :]


def _step_mask(bb: Builder, m, new, old):
    """A step past a sequence's length passes ``old`` through."""
    return new if m is None else bb.op("Where", m, new, old)


def _dh(bb: Builder, states: list, s: dict):
    """In a backward step: the gradient reaching h_t, carried from the step after it plus dY_t."""
    return bb.add(states[0], s["dy"]) if "dy" in s else states[0]


def _start(d: Direction, dy_last):
    return dy_last if dy_last is not None else d.zeros


def _linear_grads(d: Direction, dz_w, dz_r, h_prev) -> dict:
    """Gradients of X, W, R and B from the per-step gradients of x_t·Wᵀ + Wb (dz_w) and of
    h_{t-1}·Rᵀ + Rb (dz_r). dz_r None: the caller makes R's, and Rb is added where Wb is."""
    b, out = d.b, {}
    if d.want["X"]:
        out["X"] = b.matmul(dz_w, d.w)
    if d.want["W"]:
        out["W"] = _outer(b, dz_w, d.x)
    if d.want["R"] and dz_r is not None:
        out["R"] = _outer(b, dz_r, h_prev)
    if d.want["B"]:
        out["B"] = b.op("Concat", _total(b, dz_w), _total(b, dz_r if dz_r is not None else dz_w), axis=0)
    return out


# ----------------------------------------------------------------------------- LSTM


def _lstm(d: Direction) -> dict:
    # gates i, o, f, c (W's row order): i = f(z_i + P_i⊙c_{t-1}), f = f(z_f + P_f⊙c_{t-1}) (1 - i with
    # input_forget), g = g(z_c), c_t = f⊙c_{t-1} + i⊙g, o = f(z_o + P_o⊙c_t), h_t = o⊙h(c_t)
    b, hidden = d.b, d.hidden
    f_act, g_act, h_act = d.acts
    forget = bool(d.attrs.get("input_forget", 0))
    h_prev = _previous(d, d.y, d.h0)
    wb, rb = _biases(d, 4)
    zi, zo, zf, zc = _split(b, b.add(_project(b, d.x, d.w, wb), _project(b, h_prev, d.r, rb)), hidden, 4)
    peep = _split(b, d.p, hidden, 3, axis=0) if d.p is not None else None  # P_i, P_o, P_f
    g, dg = _gate(b, zc, g_act, d.clip)
    c_prev, c = _cell_states(d, zi, zf, g, peep, forget)
    if peep is not None:
        zi, zf, zo = b.add(zi, b.mul(c_prev, peep[0])), b.add(zf, b.mul(c_prev, peep[2])), b.add(zo, b.mul(c, peep[1]))
    i, di = _gate(b, zi, f_act, d.clip)
    f, df = (b.sub(_k(b, 1.0, i), i), None) if forget else _gate(b, zf, f_act, d.clip)
    o, do = _gate(b, zo, f_act, d.clip)
    hc, dhc = _gate(b, c, h_act, None)
    # with dh = dh_t + dY_t: dz_o = dh·h(c)·o', dc = dc_t + dh·o·h'(c) + dz_o·P_o, dz_i = dc·g·i'
    # (dc·(g - c_{t-1})·i' with input_forget), dz_f = dc·c_{t-1}·f', dz_c = dc·i·g'; then
    # dc_{t-1} = dc·f + dz_i·P_i + dz_f·P_f and dh_{t-1} = dz·R: coefficients, all computed here
    ko, via_h, kg = b.mul(hc, do), b.mul(o, dhc), b.mul(i, dg)
    ki = b.mul(b.sub(g, c_prev) if forget else g, di)
    kf = b.mul(c_prev, df) if df is not None else b.zeros_like(c_prev)
    carry = f
    if peep is not None:
        via_h, carry = b.add(via_h, b.mul(ko, peep[1])), b.add(carry, b.mul(ki, peep[0]))
        carry = carry if forget else b.add(carry, b.mul(kf, peep[2]))

    def step(bb, states, s):
        dh = _dh(bb, states, s)
        dc = bb.add(states[1], bb.mul(dh, s["via_h"]))
        dz = _step_mask(bb, s.get("valid"), bb.mul(bb.op("Concat", dc, dh, dc, dc, axis=1), s["coef"]), _k(bb, 0.0, dh))
        dh_prev = _step_mask(bb, s.get("valid"), bb.matmul(dz, d.r), states[0])
        return [dh_prev, _step_mask(bb, s.get("valid"), bb.mul(dc, s["carry"]), states[1])], [dz]

    coef = b.op("Concat", ki, ko, kf, kg, axis=2)
    scans = {"dy": d.dy, "coef": coef, "via_h": via_h, "carry": carry, "valid": d.steps and d.steps.valid}
    starts = [_start(d, d.dy_h), _start(d, d.dy_c)]
    (dh0, dc0), (dz,) = _scan(d, step, starts, scans, backwards=not d.reverse, outputs=1)
    out = {**_linear_grads(d, dz, dz, h_prev), "initial_h": dh0, "initial_c": dc0}
    if d.want["P"]:
        dzi, dzo, dzf = _split(b, dz, hidden, 3)
        sums = [_total(b, b.mul(dzi, c_prev)), _total(b, b.mul(dzo, c)), _total(b, b.mul(dzf, c_prev))]
        out["P"] = b.op("Concat", *sums, axis=0)
    return out


def _cell_states(d: Direction, zi, zf, g, peep, forget: bool):
    """c_{t-1} and c_t of every step: the one recurrence the backward needs that Y does not hold."""
    b, act = d.b, d.acts[0]
    if peep is None:  # the gates do not read c: all steps at once, the loop only combines them
        i = _activate(b, zi, act, d.clip)[0]
        scans = {"i": i, "f": b.sub(_k(b, 1.0, i), i) if forget else _activate(b, zf, act, d.clip)[0], "g": g}
    else:
        scans = {"zi": zi, "zf": zf, "g": g}
    scans["valid"] = d.steps and d.steps.valid

    def step(bb, states, s):
        c = states[0]
        if peep is None:
            i, f = s["i"], s["f"]
        else:
            i = _activate(bb, bb.add(s["zi"], bb.mul(c, peep[0])), act, d.clip)[0]
            f = (
                bb.sub(_k(bb, 1.0, i), i)
                if forget
                else _activate(bb, bb.add(s["zf"], bb.mul(c, peep[2])), act, d.clip)[0]
            )
        new = _step_mask(bb, s.get("valid"), bb.add(bb.mul(f, c), bb.mul(i, s["g"])), c)
        return [new], [c, new]

    _, (c_prev, c) = _scan(d, step, [d.c0], scans, backwards=d.reverse, outputs=2)
    return c_prev, c


LSTM_CELL = Cell(
    ("Sigmoid", "Tanh", "Tanh"), ("X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"), _lstm
)


@gradient("LSTM")
def lstm(ctx, dys):
    return _recurrent(ctx, dys, LSTM_CELL)


# ----------------------------------------------------------------------------- GRU


def _gru(d: Direction) -> dict:
    # gates z, r, n (W's rows z, r, h): z = f(x·W_zᵀ + h_{t-1}·R_zᵀ + b_z), r likewise,
    # n = g(x·W_nᵀ + Wb_n + r⊙(h_{t-1}·R_nᵀ + Rb_n)) with linear_before_reset, else
    # n = g(x·W_nᵀ + (r⊙h_{t-1})·R_nᵀ + Wb_n + Rb_n);  h_t = (1 - z)⊙n + z⊙h_{t-1}
    b, hidden = d.b, d.hidden
    f_act, g_act = d.acts
    linear = bool(d.attrs.get("linear_before_reset", 0))
    h_prev = _previous(d, d.y, d.h0)
    wb, rb = _biases(d, 3)
    xz, xr, xn = _split(b, _project(b, d.x, d.w, wb), hidden, 3)
    r_zr, r_n = b.slice(d.r, 0, 0, 2 * hidden), b.slice(d.r, 0, 2 * hidden, 3 * hidden)
    rb_zr, rb_n = _split(b, rb, 2 * hidden, 2, axis=0) if rb is not None else (None, None)
    hz, hr = _split(b, _project(b, h_prev, r_zr), hidden, 2)
    if rb_zr is not None:
        hz, hr = (b.add(t, piece) for t, piece in zip((hz, hr), _split(b, rb_zr, hidden, 2, axis=0), strict=True))
    z, dz = _gate(b, b.add(xz, hz), f_act, d.clip)
    r, dr = _gate(b, b.add(xr, hr), f_act, d.clip)
    q = _project(b, h_prev, r_n, rb_n) if linear else None  # h_{t-1}·R_nᵀ + Rb_n
    reset = None if linear else b.mul(r, h_prev)
    n, dn = _gate(b, b.add(xn, b.mul(r, q) if linear else _project(b, reset, r_n, rb_n)), g_act, d.clip)
    # with dh = dh_t + dY_t: dz_z = dh·(h_{t-1} - n)·z', dz_n = dh·(1 - z)·n', dh_{t-1} gets dh·z,
    # dz_z·R_z, dz_r·R_r and the n gate's share through R_n
    kz, kn = b.mul(b.sub(h_prev, n), dz), b.mul(b.sub(_k(b, 1.0, z), z), dn)
    valid = d.steps and d.steps.valid
    if linear:  # dz_r = dz_n·q·r' and d(h_{t-1}·R_nᵀ) = dz_n·r: dh times coefficients, like dz_z
        kr, kq = b.mul(b.mul(kn, q), dr), b.mul(kn, r)
        scans = {"dy": d.dy, "coef": b.op("Concat", kz, kr, kq, axis=2), "z": z, "valid": valid}
        step = _gru_step_linear(d)
    else:  # u = dz_n·R_n is the gradient of r⊙h_{t-1}: dz_r = u·h_{t-1}·r', and u·r reaches h_{t-1}
        kr = b.mul(h_prev, dr)
        scans = {"dy": d.dy, "kz": kz, "kn": kn, "kr": kr, "z": z, "r": r, "valid": valid}
        step = _gru_step(d, r_zr, r_n)
    (dh0,), (dh,) = _scan(d, step, [_start(d, d.dy_h)], scans, backwards=not d.reverse, outputs=1)
    dzz, dzn = b.mul(dh, kz), b.mul(dh, kn)
    if linear:
        dzr = b.mul(dh, kr)
        out = _linear_grads(
            d, b.op("Concat", dzz, dzr, dzn, axis=2), b.op("Concat", dzz, dzr, b.mul(dh, kq), axis=2), h_prev
        )
    else:
        dzr = b.mul(b.matmul(dzn, r_n), kr)
        out = _linear_grads(d, b.op("Concat", dzz, dzr, dzn, axis=2), None, h_prev)
        if d.want["R"]:
            zr = _outer(b, b.op("Concat", dzz, dzr, axis=2), h_prev)
            out["R"] = b.op("Concat", zr, _outer(b, dzn, reset), axis=0)
    return {**out, "initial_h": dh0}


def _gru_step_linear(d: Direction):
    def step(bb, states, s):
        dh = _dh(bb, states, s)
        dz = bb.mul(bb.op("Concat", dh, dh, dh, axis=1), s["coef"])
        dh_prev = bb.add(bb.mul(dh, s["z"]), bb.matmul(dz, d.r))
        return [_step_mask(bb, s.get("valid"), dh_prev, states[0])], [
            _step_mask(bb, s.get("valid"), dh, _k(bb, 0.0, dh))
        ]

    return step


def _gru_step(d: Direction, r_zr, r_n):
    def step(bb, states, s):
        dh = _dh(bb, states, s)
        u = bb.matmul(bb.mul(dh, s["kn"]), r_n)
        dzr = bb.op("Concat", bb.mul(dh, s["kz"]), bb.mul(u, s["kr"]), axis=1)
        dh_prev = bb.add(bb.add(bb.mul(dh, s["z"]), bb.mul(u, s["r"])), bb.matmul(dzr, r_zr))
        return [_step_mask(bb, s.get("valid"), dh_prev, states[0])], [
            _step_mask(bb, s.get("valid"), dh, _k(bb, 0.0, dh))
        ]

    return step


GRU_CELL = Cell(("Sigmoid", "Tanh"), ("X", "W", "R", "B", "sequence_lens", "initial_h"), _gru)


@gradient("GRU")
def gru(ctx, dys):
    return _recurrent(ctx, dys, GRU_CELL)


# ----------------------------------------------------------------------------- RNN


def _rnn(d: Direction) -> dict:
    # h_t = f(x_t·Wᵀ + h_{t-1}·Rᵀ + Wb + Rb); backwards: dz_t = (dh_t + dY_t)·f', dh_{t-1} = dz_t·R
    b = d.b
    h_prev = _previous(d, d.y, d.h0)
    wb, rb = _biases(d, 1)
    z = b.add(_project(b, d.x, d.w, wb), _project(b, h_prev, d.r, rb))
    _, slope = _gate(b, z, d.acts[0], d.clip)

    def step(bb, states, s):
        dh = _dh(bb, states, s)
        dz = _step_mask(bb, s.get("valid"), bb.mul(dh, s["slope"]), _k(bb, 0.0, dh))
        return [_step_mask(bb, s.get("valid"), bb.matmul(dz, d.r), states[0])], [dz]

    scans = {"dy": d.dy, "slope": slope, "valid": d.steps and d.steps.valid}
    (dh0,), (dz,) = _scan(d, step, [_start(d, d.dy_h)], scans, backwards=not d.reverse, outputs=1)
    return {**_linear_grads(d, dz, dz, h_prev), "initial_h": dh0}


RNN_CELL = Cell(("Tanh",), ("X", "W", "R", "B", "sequence_lens", "initial_h"), _rnn)


@gradient("RNN")
def rnn(ctx, dys):
    return _recurrent(ctx, dys, RNN_CELL)
