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
from graphforge.passes.autodiff.values import Emitter, Value, raw

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


def _square(t):
    return t * t


def _where(e: Emitter, cond, yes, no, like):
    """Where(cond, yes, no), numbers as scalars of ``like``'s type."""
    return e.where(cond, e.scalar(yes, like) if isinstance(yes, float) else yes, e.scalar(no, like))


#: y = f(z), as ONNX ops
_FORWARD: dict[str, Callable] = {
    "sigmoid": lambda e, z, a: z.sigmoid(),
    "tanh": lambda e, z, a: z.tanh(),
    "relu": lambda e, z, a: z.op("Relu"),
    "affine": lambda e, z, a: z * a.alpha + a.beta,
    "leakyrelu": lambda e, z, a: z.op("LeakyRelu", alpha=a.alpha),
    "thresholdedrelu": lambda e, z, a: e.where(z > a.alpha, z, 0.0),
    "scaledtanh": lambda e, z, a: (z * a.beta).tanh() * a.alpha,
    "hardsigmoid": lambda e, z, a: z.op("HardSigmoid", alpha=a.alpha, beta=a.beta),
    "elu": lambda e, z, a: z.op("Elu", alpha=a.alpha),
    "softsign": lambda e, z, a: z.op("Softsign"),
    "softplus": lambda e, z, a: z.op("Softplus"),
}

#: f'(z) from z and y = f(z), always of z's shape (it is scanned over time)
_DERIVATIVE: dict[str, Callable] = {
    "sigmoid": lambda e, z, y, a: y * (1 - y),
    "tanh": lambda e, z, y, a: 1 - y * y,
    "relu": lambda e, z, y, a: _where(e, z > 0, 1.0, 0.0, z),
    "affine": lambda e, z, y, a: e.scalar(a.alpha, z).expand(z.op("Shape")),
    "leakyrelu": lambda e, z, y, a: _where(e, z < 0, a.alpha, 1.0, z),
    "thresholdedrelu": lambda e, z, y, a: _where(e, z > a.alpha, 1.0, 0.0, z),
    "scaledtanh": lambda e, z, y, a: _DERIVATIVE["tanh"](e, z, y / a.alpha, a) * (a.alpha * a.beta),
    "hardsigmoid": lambda e, z, y, a: _where(e, (y > 0) & (y < 1), a.alpha, 0.0, z),
    "elu": lambda e, z, y, a: _where(e, z < 0, y + a.alpha, 1.0, z),
    "softsign": lambda e, z, y, a: _square(z.abs() + 1).reciprocal(),
    "softplus": lambda e, z, y, a: z.sigmoid(),
}


def _activate(e: Emitter, z_raw, act: Activation, clip: float | None):
    """A gate's value f(clip(z_raw))."""
    z = z_raw if clip is None else z_raw.op("Max", e.scalar(-clip, z_raw)).op("Min", e.scalar(clip, z_raw))
    y = _FORWARD[act.name](e, z, act)
    y.dtype = z_raw.dtype
    return y, z


def _gate(e: Emitter, z_raw, act: Activation, clip: float | None):
    """A gate's value f(clip(z_raw)) and its derivative with respect to z_raw."""
    y, z = _activate(e, z_raw, act, clip)
    d = _DERIVATIVE[act.name](e, z, y, act)
    d.dtype = z_raw.dtype
    if clip is not None:  # a clipped pre-activation passes no gradient
        d = e.where(z_raw.abs() < clip, d, e.scalar(0.0, z_raw))
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

    valid: Value  # step t < len
    next_valid: Value  # step t + 1 < len
    alive: Value  # len > 0


@dataclass
class Direction:
    """One direction of the node in layout 0: x [T, N, I], w [G·H, I], r [G·H, H], bias [2·G·H]
    (Wb then Rb), h0 [N, H], y [T, N, H] (every h_t), and the gradients reaching it; ``e`` emits
    into the main graph."""

    e: Emitter
    x: Value
    w: Value
    r: Value
    bias: Value | None
    h0: Value
    y: Value
    dy: Value | None
    dy_h: Value | None
    zeros: Value  # [N, H]
    reverse: bool
    acts: tuple[Activation, ...]
    clip: float | None
    hidden: int
    steps: Steps | None
    want: dict[str, bool]
    attrs: dict  # the node's attributes (input_forget, linear_before_reset)
    c0: Value | None = None  # LSTM
    dy_c: Value | None = None
    p: Value | None = None


def _recurrent(ctx, dys, cell: Cell):
    roles = {name: i for i, name in enumerate(cell.inputs)}
    want = {name: ctx.x(i) is not None and ctx.wants(ctx.x(i)) for name, i in roles.items()}
    want["sequence_lens"] = False
    if not any(want.values()):
        return [None] * len(ctx.inputs)
    layout = ctx.attr("layout", 0)
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
    x, y, dy = _perm(x, seq), _perm(y, per_dir), _perm(dys[0], per_dir)
    state = {"initial_h": _perm(ctx.x(roles["initial_h"]), seq), "Y_h": _perm(dys[1], seq)}
    if "initial_c" in roles:
        state |= {"initial_c": _perm(ctx.x(roles["initial_c"]), seq), "Y_c": _perm(dys[2], seq)}
    lens = ctx.x(roles["sequence_lens"])
    steps = _steps(ctx, x, lens) if lens is not None else None
    y0 = y.op("Gather", ctx.const(np.int64(0)), axis=0)  # [D, N, H]
    zeros = ctx.zeros_like(y0.op("Gather", ctx.const(np.int64(0)), axis=0))
    grads = []
    for d, backwards in enumerate(reverse):

        def pick(t, axis=0, d=d):
            return None if t is None else t.op("Gather", ctx.const(np.int64(d)), axis=axis)

        h0 = pick(state["initial_h"])
        direction = Direction(
            e=ctx, x=x, w=pick(ctx.x(1)), r=pick(ctx.x(2)), bias=pick(ctx.x(3)), h0=h0 if h0 is not None else zeros,
            y=pick(y, 1), dy=pick(dy, 1), dy_h=_alive(ctx, steps, pick(state["Y_h"])), zeros=zeros,
            reverse=backwards, acts=acts[d], clip=clip, hidden=hidden, steps=steps, want=want,
            attrs=dict(ctx.node.attrs),
        )  # fmt: skip
        if "initial_c" in roles:
            c0 = pick(state["initial_c"])
            direction.c0 = c0 if c0 is not None else zeros
            direction.dy_c = _alive(ctx, steps, pick(state["Y_c"]))
            direction.p = pick(ctx.x(roles["P"]))
        with ctx.b.scope(f"{ctx.node.name or ctx.node.op}/{'reverse' if backwards else 'forward'}"):
            grads.append(cell.backward(direction))
    result = [
        _assemble(ctx, name, [g.get(name) for g in grads], layout) if want[name] else None for name in cell.inputs
    ]
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


def _perm(t, perm):
    return t if t is None or perm is None else t.transpose(perm)


def _steps(ctx, x, lens) -> Steps:
    if ctx.opset < 11:
        ctx.fail("sequence_lens needs opset 11+ (the step mask is made with Range)")
    zero, one = ctx.const(np.int64(0)), ctx.const(np.int64(1))
    count = ctx.shape(x).op("Gather", zero, axis=0)
    position = ctx.op("Range", zero, count, one).unsqueeze([1, 2])  # [T, 1, 1]
    lens = lens.cast(np.int64).unsqueeze([0, 2])  # [1, N, 1]
    return Steps(position < lens, position + one < lens, lens.squeeze([0]) > zero)


def _alive(e: Emitter, steps: Steps | None, dy_last):
    """A final state's gradient, none for sequences of length 0 (onnxruntime outputs zeros there)."""
    if dy_last is None or steps is None:
        return dy_last
    return e.where(steps.alive, dy_last, 0.0)


def _assemble(e: Emitter, name: str, parts: list, layout: int):
    """The input's gradient from the directions' ones: X sums them, the others stack them."""
    if any(p is None for p in parts):
        return None
    if name == "X":
        total = e.sum(parts)
        return total.transpose([1, 0, 2]) if layout else total
    stacked = e.concat([p.unsqueeze([0]) for p in parts], axis=0) if len(parts) > 1 else parts[0].unsqueeze([0])
    return stacked.transpose([1, 0, 2]) if layout and name.startswith("initial_") else stacked


# ----------------------------------------------------------------------------- shared pieces of the math


def _previous(d: Direction, seq, first):
    """seq's value one step earlier in processing order, ``first`` before the first step: h_{t-1} from Y."""
    first = first.unsqueeze([0])
    if not d.reverse:
        return d.e.concat([first, seq.slice(0, 0, -1)], axis=0)
    shifted = d.e.concat([seq.slice(0, 1), first], axis=0)
    # backwards, a sequence's first step is its last valid one: Y[t+1] there is padding
    return shifted if d.steps is None else d.e.where(d.steps.next_valid, shifted, first)


def _biases(d: Direction, gates: int):
    """(Wb, Rb), each [G·H], or (None, None)."""
    if d.bias is None:
        return None, None
    n = gates * d.hidden
    return d.bias.slice(0, 0, n), d.bias.slice(0, n, 2 * n)


def _project(inputs, weight, bias=None):
    """inputs · weightᵀ (+ bias) over all steps: [T, N, K] x [M, K] -> [T, N, M]."""
    out = inputs @ weight.transpose([1, 0])
    return out if bias is None else out + bias


def _split(z, hidden: int, count: int, axis: int = 2):
    """The ``count`` gate blocks of z along ``axis`` (the last of [T, N, G·H])."""
    return [z.slice(axis, k * hidden, (k + 1) * hidden) for k in range(count)]


def _outer(dz, inputs):
    """Σ over steps and batch of dz[t, n]ᵀ · inputs[t, n]: a weight's gradient, one MatMul."""
    return dz.flatten(2).transpose([1, 0]) @ inputs.flatten(2)


def _total(dz):
    return dz.sum([0, 1])


def _scan(d: Direction, body, states: list, scans: dict, *, backwards: bool, outputs: int):
    """A Scan over time (axis 0 of each of ``scans``, None entries left out) carrying ``states``.
    ``body(e, states, slices)`` emits one step with the body's Emitter ``e`` (slices by the
    scans' keys; what else the step reads of the main graph it makes ``e``'s with ``e.value``)
    and returns (new states, per-step outputs). Returns (final states, stacked outputs)."""
    b = d.e.b
    scans = {k: v for k, v in scans.items() if v is not None}
    graph = gs.Graph(opset=b.opset)
    e = Emitter(Builder(graph, prefix=b.fresh_name("step") + "/"))
    state_in = [gs.Variable(e.b.fresh_name("state"), dtype=t.dtype) for t in states]
    slices = {k: gs.Variable(e.b.fresh_name(k), dtype=t.dtype) for k, t in scans.items()}
    new_states, per_step = body(e, [e.value(t) for t in state_in], {k: e.value(t) for k, t in slices.items()})
    produced, results = {id(o) for n in graph.nodes for o in n.outputs}, []
    for t in map(raw, [*new_states, *per_step]):  # a body output is a tensor of its own, made in the body
        results.append(t if id(t) in produced and all(t is not r for r in results) else e.b.op("Identity", t))
    for t, like in zip(results, [*states, *[states[0]] * len(per_step)], strict=True):
        t.dtype = like.dtype
    graph.inputs, graph.outputs = [*state_in, *slices.values()], results
    out = d.e.op(
        "Scan", *states, *scans.values(), outputs=len(results), body=graph, num_scan_inputs=len(scans),
        scan_input_directions=[int(backwards)] * len(scans), scan_output_directions=[int(backwards)] * outputs,
    )  # fmt: skip
    out = out if isinstance(out, list) else [out]
    for t in out:
        t.dtype = states[0].dtype
    return out[: len(states)], out[len(states) :]


def _step_mask(e: Emitter, m, new, old):
    """A step past a sequence's length passes ``old`` through."""
    return new if m is None else e.where(m, new, old)


def _dh(states: list, s: dict):
    """In a backward step: the gradient reaching h_t, carried from the step after it plus dY_t."""
    return states[0] + s["dy"] if "dy" in s else states[0]


def _start(d: Direction, dy_last):
    return dy_last if dy_last is not None else d.zeros


def _linear_grads(d: Direction, dz_w, dz_r, h_prev) -> dict:
    """Gradients of X, W, R and B from the per-step gradients of x_t·Wᵀ + Wb (dz_w) and of
    h_{t-1}·Rᵀ + Rb (dz_r). dz_r None: the caller makes R's, and Rb is added where Wb is."""
    out = {}
    if d.want["X"]:
        out["X"] = dz_w @ d.w
    if d.want["W"]:
        out["W"] = _outer(dz_w, d.x)
    if d.want["R"] and dz_r is not None:
        out["R"] = _outer(dz_r, h_prev)
    if d.want["B"]:
        out["B"] = d.e.concat([_total(dz_w), _total(dz_r if dz_r is not None else dz_w)], axis=0)
    return out


# ----------------------------------------------------------------------------- LSTM


def _lstm(d: Direction) -> dict:
    # gates i, o, f, c (W's row order): i = f(z_i + P_i⊙c_{t-1}), f = f(z_f + P_f⊙c_{t-1}) (1 - i with
    # input_forget), g = g(z_c), c_t = f⊙c_{t-1} + i⊙g, o = f(z_o + P_o⊙c_t), h_t = o⊙h(c_t)
    e, hidden = d.e, d.hidden
    f_act, g_act, h_act = d.acts
    forget = bool(d.attrs.get("input_forget", 0))
    h_prev = _previous(d, d.y, d.h0)
    wb, rb = _biases(d, 4)
    zi, zo, zf, zc = _split(_project(d.x, d.w, wb) + _project(h_prev, d.r, rb), hidden, 4)
    peep = _split(d.p, hidden, 3, axis=0) if d.p is not None else None  # P_i, P_o, P_f
    g, dg = _gate(e, zc, g_act, d.clip)
    c_prev, c = _cell_states(d, zi, zf, g, peep, forget)
    if peep is not None:
        zi, zf, zo = zi + c_prev * peep[0], zf + c_prev * peep[2], zo + c * peep[1]
    i, di = _gate(e, zi, f_act, d.clip)
    f, df = (1 - i, None) if forget else _gate(e, zf, f_act, d.clip)
    o, do = _gate(e, zo, f_act, d.clip)
    hc, dhc = _gate(e, c, h_act, None)
    # with dh = dh_t + dY_t: dz_o = dh·h(c)·o', dc = dc_t + dh·o·h'(c) + dz_o·P_o, dz_i = dc·g·i'
    # (dc·(g - c_{t-1})·i' with input_forget), dz_f = dc·c_{t-1}·f', dz_c = dc·i·g'; then
    # dc_{t-1} = dc·f + dz_i·P_i + dz_f·P_f and dh_{t-1} = dz·R: coefficients, all computed here
    ko, via_h, kg = hc * do, o * dhc, i * dg
    ki = ((g - c_prev) if forget else g) * di
    kf = c_prev * df if df is not None else e.zeros_like(c_prev)
    carry = f
    if peep is not None:
        via_h, carry = via_h + ko * peep[1], carry + ki * peep[0]
        carry = carry if forget else carry + kf * peep[2]

    def step(e, states, s):
        dh, r = _dh(states, s), e.value(d.r)
        dc = states[1] + dh * s["via_h"]
        dz = _step_mask(e, s.get("valid"), e.concat([dc, dh, dc, dc], axis=1) * s["coef"], e.scalar(0.0, dh))
        dh_prev = _step_mask(e, s.get("valid"), dz @ r, states[0])
        return [dh_prev, _step_mask(e, s.get("valid"), dc * s["carry"], states[1])], [dz]

    coef = e.concat([ki, ko, kf, kg], axis=2)
    scans = {"dy": d.dy, "coef": coef, "via_h": via_h, "carry": carry, "valid": d.steps and d.steps.valid}
    starts = [_start(d, d.dy_h), _start(d, d.dy_c)]
    (dh0, dc0), (dz,) = _scan(d, step, starts, scans, backwards=not d.reverse, outputs=1)
    out = {**_linear_grads(d, dz, dz, h_prev), "initial_h": dh0, "initial_c": dc0}
    if d.want["P"]:
        dzi, dzo, dzf = _split(dz, hidden, 3)
        out["P"] = e.concat([_total(dzi * c_prev), _total(dzo * c), _total(dzf * c_prev)], axis=0)
    return out


def _cell_states(d: Direction, zi, zf, g, peep, forget: bool):
    """c_{t-1} and c_t of every step: the one recurrence the backward needs that Y does not hold."""
    act = d.acts[0]
    if peep is None:  # the gates do not read c: all steps at once, the loop only combines them
        i = _activate(d.e, zi, act, d.clip)[0]
        scans = {"i": i, "f": 1 - i if forget else _activate(d.e, zf, act, d.clip)[0], "g": g}
    else:
        scans = {"zi": zi, "zf": zf, "g": g}
    scans["valid"] = d.steps and d.steps.valid

    def step(e, states, s):
        c = states[0]
        if peep is None:
            i, f = s["i"], s["f"]
        else:
            p_i, p_f = e.value(peep[0]), e.value(peep[2])
            i = _activate(e, s["zi"] + c * p_i, act, d.clip)[0]
            f = 1 - i if forget else _activate(e, s["zf"] + c * p_f, act, d.clip)[0]
        new = _step_mask(e, s.get("valid"), f * c + i * s["g"], c)
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
    e, hidden = d.e, d.hidden
    f_act, g_act = d.acts
    linear = bool(d.attrs.get("linear_before_reset", 0))
    h_prev = _previous(d, d.y, d.h0)
    wb, rb = _biases(d, 3)
    xz, xr, xn = _split(_project(d.x, d.w, wb), hidden, 3)
    r_zr, r_n = d.r.slice(0, 0, 2 * hidden), d.r.slice(0, 2 * hidden, 3 * hidden)
    rb_zr, rb_n = _split(rb, 2 * hidden, 2, axis=0) if rb is not None else (None, None)
    hz, hr = _split(_project(h_prev, r_zr), hidden, 2)
    if rb_zr is not None:
        hz, hr = (t + piece for t, piece in zip((hz, hr), _split(rb_zr, hidden, 2, axis=0), strict=True))
    z, dz = _gate(e, xz + hz, f_act, d.clip)
    r, dr = _gate(e, xr + hr, f_act, d.clip)
    q = _project(h_prev, r_n, rb_n) if linear else None  # h_{t-1}·R_nᵀ + Rb_n
    reset = None if linear else r * h_prev
    n, dn = _gate(e, xn + (r * q if linear else _project(reset, r_n, rb_n)), g_act, d.clip)
    # with dh = dh_t + dY_t: dz_z = dh·(h_{t-1} - n)·z', dz_n = dh·(1 - z)·n', dh_{t-1} gets dh·z,
    # dz_z·R_z, dz_r·R_r and the n gate's share through R_n
    kz, kn = (h_prev - n) * dz, (1 - z) * dn
    valid = d.steps and d.steps.valid
    if linear:  # dz_r = dz_n·q·r' and d(h_{t-1}·R_nᵀ) = dz_n·r: dh times coefficients, like dz_z
        kr, kq = kn * q * dr, kn * r
        scans = {"dy": d.dy, "coef": e.concat([kz, kr, kq], axis=2), "z": z, "valid": valid}
        step = _gru_step_linear(d)
    else:  # u = dz_n·R_n is the gradient of r⊙h_{t-1}: dz_r = u·h_{t-1}·r', and u·r reaches h_{t-1}
        kr = h_prev * dr
        scans = {"dy": d.dy, "kz": kz, "kn": kn, "kr": kr, "z": z, "r": r, "valid": valid}
        step = _gru_step(d, r_zr, r_n)
    (dh0,), (dh,) = _scan(d, step, [_start(d, d.dy_h)], scans, backwards=not d.reverse, outputs=1)
    dzz, dzn = dh * kz, dh * kn
    if linear:
        dzr = dh * kr
        out = _linear_grads(d, e.concat([dzz, dzr, dzn], axis=2), e.concat([dzz, dzr, dh * kq], axis=2), h_prev)
    else:
        dzr = (dzn @ r_n) * kr
        out = _linear_grads(d, e.concat([dzz, dzr, dzn], axis=2), None, h_prev)
        if d.want["R"]:
            out["R"] = e.concat([_outer(e.concat([dzz, dzr], axis=2), h_prev), _outer(dzn, reset)], axis=0)
    return {**out, "initial_h": dh0}


def _gru_step_linear(d: Direction):
    def step(e, states, s):
        dh = _dh(states, s)
        dz = e.concat([dh, dh, dh], axis=1) * s["coef"]
        dh_prev = dh * s["z"] + dz @ e.value(d.r)
        return [_step_mask(e, s.get("valid"), dh_prev, states[0])], [
            _step_mask(e, s.get("valid"), dh, e.scalar(0.0, dh))
        ]

    return step


def _gru_step(d: Direction, r_zr, r_n):
    def step(e, states, s):
        dh = _dh(states, s)
        u = (dh * s["kn"]) @ e.value(r_n)
        dzr = e.concat([dh * s["kz"], u * s["kr"]], axis=1)
        dh_prev = dh * s["z"] + u * s["r"] + dzr @ e.value(r_zr)
        return [_step_mask(e, s.get("valid"), dh_prev, states[0])], [
            _step_mask(e, s.get("valid"), dh, e.scalar(0.0, dh))
        ]

    return step


GRU_CELL = Cell(("Sigmoid", "Tanh"), ("X", "W", "R", "B", "sequence_lens", "initial_h"), _gru)


@gradient("GRU")
def gru(ctx, dys):
    return _recurrent(ctx, dys, GRU_CELL)


# ----------------------------------------------------------------------------- RNN


def _rnn(d: Direction) -> dict:
    # h_t = f(x_t·Wᵀ + h_{t-1}·Rᵀ + Wb + Rb); backwards: dz_t = (dh_t + dY_t)·f', dh_{t-1} = dz_t·R
    h_prev = _previous(d, d.y, d.h0)
    wb, rb = _biases(d, 1)
    _, slope = _gate(d.e, _project(d.x, d.w, wb) + _project(h_prev, d.r, rb), d.acts[0], d.clip)

    def step(e, states, s):
        dh = _dh(states, s)
        dz = _step_mask(e, s.get("valid"), dh * s["slope"], e.scalar(0.0, dh))
        return [_step_mask(e, s.get("valid"), dz @ e.value(d.r), states[0])], [dz]

    scans = {"dy": d.dy, "slope": slope, "valid": d.steps and d.steps.valid}
    (dh0,), (dz,) = _scan(d, step, [_start(d, d.dy_h)], scans, backwards=not d.reverse, outputs=1)
    return {**_linear_grads(d, dz, dz, h_prev), "initial_h": dh0}


RNN_CELL = Cell(("Tanh",), ("X", "W", "R", "B", "sequence_lens", "initial_h"), _rnn)


@gradient("RNN")
def rnn(ctx, dys):
    return _recurrent(ctx, dys, RNN_CELL)
