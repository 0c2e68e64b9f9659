"""Small torch models for the runtime tests, their ONNX exports and compiled programs.

Every builder is deterministic: the same seed gives the same torch module, so a test can
export one copy and train another in torch as the oracle. 1-D parameters get seeded
jitter, because the TorchScript exporter merges equal initializers (all-zero biases,
all-one BatchNorm scales) and training must keep them apart.
"""

from __future__ import annotations

import io
import warnings

import numpy as np

import graphforge

N_IN, N_HIDDEN, N_OUT = 8, 16, 3


def _jitter(module, seed: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in module.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))


def mlp(seed: int = 0):
    """8-16-3 MLP with Tanh."""
    import torch

    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(N_IN, N_HIDDEN), torch.nn.Tanh(), torch.nn.Linear(N_HIDDEN, N_OUT))
    _jitter(module, seed)
    return module


def dropout_mlp(seed: int = 0):
    """8-16-3 MLP with Dropout between the layers."""
    import torch

    torch.manual_seed(seed)
    module = torch.nn.Sequential(
        torch.nn.Linear(N_IN, N_HIDDEN), torch.nn.Tanh(), torch.nn.Dropout(0.5), torch.nn.Linear(N_HIDDEN, N_OUT)
    )
    _jitter(module, seed)
    return module


def cnn(seed: int = 0):
    """Conv → BatchNorm → ReLU → global average pool → Linear: BatchNorm keeps running stats."""
    import torch

    torch.manual_seed(seed)
    module = torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, padding=1),
        torch.nn.BatchNorm2d(4, momentum=0.2),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, N_OUT),
    )
    _jitter(module, seed)
    with torch.no_grad():  # running statistics that differ from the defaults
        bn = module[1]
        bn.running_mean.copy_(0.1 * torch.arange(4.0))
        bn.running_var.copy_(1.0 + 0.2 * torch.arange(4.0))
    return module


SEQ = 5  # the LSTM regressor's sequence length


def lstm(seed: int = 0):
    """x [batch, SEQ, 8] -> LSTM (hidden 6, batch first) -> Linear on the last step -> [batch, 3]."""
    import torch

    class LstmRegressor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.LSTM(N_IN, 6, batch_first=True)
            self.head = torch.nn.Linear(6, N_OUT)

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])

    torch.manual_seed(seed)
    module = LstmRegressor()
    _jitter(module, seed)
    return module


def export(module, example, *, training: bool = False) -> bytes:
    """TorchScript export with input ``x`` (dynamic batch) and output ``y``.

    Exports a copy: tracing in training mode runs the forward pass, which moves BatchNorm
    running statistics; the file holds the moved values (see ``buffers_from_onnx``)."""
    import copy

    import torch

    module = copy.deepcopy(module)
    mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
    module.train(training)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            (example,),
            buffer,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
            dynamo=False,
            do_constant_folding=False,
            opset_version=17,
            training=mode,
        )
    return buffer.getvalue()


def mlp_onnx(seed: int = 0) -> bytes:
    import torch

    return export(mlp(seed), torch.zeros(2, N_IN))


def dropout_mlp_onnx(seed: int = 0) -> bytes:
    import torch

    return export(dropout_mlp(seed), torch.zeros(2, N_IN), training=True)


def cnn_onnx(seed: int = 0) -> bytes:
    import torch

    return export(cnn(seed), torch.zeros(2, 2, 5, 5), training=True)


def lstm_onnx(seed: int = 0) -> bytes:
    import torch

    return export(lstm(seed), torch.zeros(2, SEQ, N_IN))


def buffers_from_onnx(module, onnx_bytes: bytes) -> None:
    """Copy the exported buffers (BatchNorm running statistics, as the trace left them) into
    ``module``, so it starts from the program's initial state."""
    import onnx
    import torch
    from onnx import numpy_helper

    initializers = {t.name: t for t in onnx.load_from_string(onnx_bytes).graph.initializer}
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if name in initializers:
                buffer.copy_(torch.from_numpy(numpy_helper.to_array(initializers[name]).copy()))


def compile_program(onnx_bytes: bytes, optimizer: str, *, loss: str = "loss(kind=mse, output=y)"):
    return graphforge.compile(onnx_bytes, f"{loss}, autodiff, {optimizer}").model


def batches(count: int, batch: int = 6, *, seed: int = 0, shape=(N_IN,)):
    """(x, targets) pairs for an mse loss, float32."""
    rng = np.random.default_rng(seed)
    return [
        (
            rng.standard_normal((batch, *shape)).astype(np.float32),
            rng.standard_normal((batch, N_OUT)).astype(np.float32),
        )
        for _ in range(count)
    ]
