"""Table rows for the recurrent ops LSTM, GRU and RNN (appended to op_cases.CASES).

onnxruntime runs them in float32 only, so the oracle is float32 central differences; the
gradients match them to about 1e-4 relative, and the rows state 2e-3 (the table's float32
default, 2e-2, would let a wrong clip or mask through less surely). Sizes are tiny (3 steps,
batch 2, 3 inputs, hidden 2): the oracle runs the model twice per input element. Layout 1
(batch first), which onnxruntime's kernels refuse, is checked in test_recurrent.py.
"""

from __future__ import annotations

import numpy as np
from gradcheck import Case

rng = np.random.default_rng(21)
T, N, F, H = 3, 2, 3, 2  # steps, batch, input features, hidden
#: a full and a short sequence, and the other way round
LENS, LENS_SWAPPED = np.array([3, 1], np.int32), np.array([2, 3], np.int32)


def r(*shape):
    return rng.uniform(-1, 1, size=shape)


def inputs(gates: int, directions: int = 1, *, bias=True, lens=None, h0=True, c0=False, peepholes=False):
    """X, W, R, B, sequence_lens, initial_h (initial_c, P) for ``gates`` gates; omitted ones None."""
    d = directions
    values = [r(T, N, F), r(d, gates * H, F), r(d, gates * H, H), r(d, 2 * gates * H) if bias else None, lens]
    values.append(r(d, N, H) if h0 else None)
    if gates == 4:
        values += [r(d, N, H) if c0 else None, r(d, 3 * H) if peepholes else None]
    while values[-1] is None:
        values.pop()
    return values


def row(op: str, values, attrs=None, *, outputs: int | None = None, **kwargs) -> Case:
    outputs = outputs or {"LSTM": 3, "GRU": 2, "RNN": 2}[op]
    return Case(
        op, values, {"hidden_size": H, **(attrs or {})}, outputs=outputs, f32_rtol=2e-3, f32_atol=2e-3, **kwargs
    )


BIDIRECTIONAL = {"direction": "bidirectional"}
#: only the named output reaches the loss (the rule gets no gradient for the others)
ONLY_Y_H = (("Identity", ["out1"], {}),)
ONLY_Y_C = (("Identity", ["out2"], {}),)

RECURRENT_CASES = [
    row("LSTM", inputs(4, c0=True, peepholes=True)),
    row("LSTM", inputs(4, bias=False, h0=False), {"direction": "reverse"}, id="LSTM-reverse-bare"),
    row("LSTM", inputs(4, 2, c0=True), BIDIRECTIONAL, id="LSTM-bidirectional"),
    row("LSTM", inputs(4, lens=LENS, c0=True), id="LSTM-sequence-lens"),
    row("LSTM", inputs(4, lens=LENS_SWAPPED, c0=True, peepholes=True), {"direction": "reverse"},
        id="LSTM-sequence-lens-reverse-peepholes"),
    row("LSTM", inputs(4, h0=False, peepholes=True), {"input_forget": 1, "clip": 0.7}, id="LSTM-input-forget-clip"),
    row("LSTM", inputs(4, bias=False, h0=False),
        {"activations": ["HardSigmoid", "Softsign", "Softplus"], "activation_alpha": [0.3], "activation_beta": [0.4]},
        id="LSTM-activations"),
    row("LSTM", inputs(4), after=ONLY_Y_C, id="LSTM-only-Y_c"),
    # the node lists Y_h only (Y and Y_c not produced), as onnx's test_lstm_defaults: the
    # rule once indexed the missing Y_c's gradient
    row("LSTM", inputs(4), outputs=2, omit=(0,), id="LSTM-Y_h-only-listed"),
    row("LSTM", inputs(4, c0=True, peepholes=True), omit=(0,), id="LSTM-no-Y"),
    row("GRU", inputs(3)),
    row("GRU", inputs(3), {"linear_before_reset": 1, "direction": "reverse"}, id="GRU-linear-before-reset-reverse"),
    row("GRU", inputs(3, 2, lens=LENS), {**BIDIRECTIONAL, "linear_before_reset": 1}, id="GRU-bidirectional-sequence-lens"),
    row("GRU", inputs(3, 2, lens=LENS_SWAPPED), BIDIRECTIONAL, id="GRU-bidirectional-sequence-lens-reset-after"),
    row("GRU", inputs(3, bias=False, h0=False),
        {"activations": ["LeakyRelu", "Elu"], "activation_alpha": [0.2, 0.8], "clip": 0.9}, id="GRU-activations-clip"),
    row("GRU", inputs(3, h0=False),
        {"activations": ["ScaledTanh", "Affine"], "activation_alpha": [0.8, 0.5], "activation_beta": [1.3, 0.2],
         "linear_before_reset": 1}, id="GRU-activations-linear-before-reset"),
    row("RNN", inputs(1)),
    row("RNN", inputs(1, 2, lens=LENS_SWAPPED), BIDIRECTIONAL, id="RNN-bidirectional-sequence-lens"),
    row("RNN", inputs(1, h0=False), {"activations": ["Relu"]}, id="RNN-relu"),
    row("RNN", inputs(1), {"activations": ["ThresholdedRelu"], "activation_alpha": [0.1], "clip": 0.8},
        id="RNN-thresholded-relu-clip"),
    row("RNN", inputs(1), {"activations": ["Sigmoid"], "direction": "reverse"}, after=ONLY_Y_H, id="RNN-only-Y_h"),
]  # fmt: skip
