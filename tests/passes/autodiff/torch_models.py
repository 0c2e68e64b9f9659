"""PyTorch models for the whole-model gradient tests, their TorchScript export, and the map
from the exported ONNX initializers back to the torch parameters.

Every builder is deterministic (seeded) and never downloads anything: the transformers
models are built from a config with random weights. Dropout is 0 / eval mode so torch and
onnxruntime compute the same function.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

OPSET = 17

MLP_SIZES = (784, 64, 32, 10)
GPT2_CONFIG = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 128, "n_positions": 64}
BERT_CONFIG = {
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 64,
}


def jitter_vectors(module: torch.nn.Module, seed: int) -> None:
    """Perturb every 1-D parameter (biases, norm scales) with seeded noise.

    The TorchScript exporter merges initializers with equal values (fresh LayerNorm weights
    are all ones, biases all zeros), which would tie parameters torch keeps apart."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in module.parameters():
            if param.dim() == 1:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))


def mlp(seed: int = 0) -> torch.nn.Module:
    """784-64-32-10 ReLU MLP with a (disabled, eval-mode) dropout: x [batch, 784] -> logits [batch, 10]."""
    torch.manual_seed(seed)
    n_in, h1, h2, n_out = MLP_SIZES
    module = torch.nn.Sequential(
        torch.nn.Linear(n_in, h1),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(h1, h2),
        torch.nn.ReLU(),
        torch.nn.Linear(h2, n_out),
    )
    jitter_vectors(module, seed)
    return module.eval()


#: the recurrent classifiers: x [batch, seq, FEATURES] -> logits [batch, CLASSES]
RECURRENT_SIZES = {"features": 4, "hidden": 5, "classes": 3}


class RecurrentClassifier(torch.nn.Module):
    """A batch-first torch.nn.LSTM/GRU/RNN and a Linear head reading both kinds of output: the
    mean over time of every step's output (Y) and the last layer's final state(s) (Y_h, Y_c)."""

    def __init__(self, rnn: torch.nn.Module):
        super().__init__()
        self.rnn = rnn
        states = 2 if isinstance(rnn, torch.nn.LSTM) else 1
        width = rnn.hidden_size * ((2 if rnn.bidirectional else 1) + states)
        self.head = torch.nn.Linear(width, RECURRENT_SIZES["classes"])

    def forward(self, x):
        out, state = self.rnn(x)
        finals = state if isinstance(state, tuple) else (state,)
        return self.head(torch.cat([out.mean(dim=1), *(s[-1] for s in finals)], dim=-1))


def recurrent(kind: str, seed: int = 0) -> torch.nn.Module:
    """lstm: 2 layers, bidirectional; gru: bidirectional; rnn_tanh: 2 layers; rnn_relu: bidirectional."""
    torch.manual_seed(seed)
    n_in, hidden = RECURRENT_SIZES["features"], RECURRENT_SIZES["hidden"]
    make = {
        "lstm": lambda: torch.nn.LSTM(n_in, hidden, num_layers=2, bidirectional=True, batch_first=True),
        "gru": lambda: torch.nn.GRU(n_in, hidden, bidirectional=True, batch_first=True),
        "rnn_tanh": lambda: torch.nn.RNN(n_in, hidden, num_layers=2, batch_first=True),
        "rnn_relu": lambda: torch.nn.RNN(n_in, hidden, nonlinearity="relu", bidirectional=True, batch_first=True),
    }
    module = RecurrentClassifier(make[kind]())
    jitter_vectors(module, seed)
    return module.eval()


class ClassesFirst(torch.nn.Module):
    """A language model returning logits as [batch, vocab, seq], cross_entropy's [N, C, d] layout.

    transformers 5.x traces a dynamic sequence length only with an explicit attention mask
    (without one it reaches aten::diff, which the TorchScript exporter lacks)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids):
        mask = torch.ones_like(input_ids)
        return self.inner(input_ids=input_ids, attention_mask=mask).logits.transpose(1, 2)


def gpt2(seed: int = 0) -> torch.nn.Module:
    """2-layer GPT-2 (eager attention, no dropout, tied wte/lm_head): input_ids [B, T] -> [B, V, T]."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        **GPT2_CONFIG,
        attn_implementation="eager",
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    jitter_vectors(model, seed)
    return ClassesFirst(model).eval()


def bert(seed: int = 0) -> torch.nn.Module:
    """2-layer BERT masked LM (eager attention, no dropout, tied decoder): input_ids [B, T] -> [B, V, T]."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(
        **BERT_CONFIG,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
        pad_token_id=0,
    )
    model = BertForMaskedLM(config)
    jitter_vectors(model, seed)
    return ClassesFirst(model).eval()


def export(module: torch.nn.Module, example: torch.Tensor, path: Path, input_name: str, dynamic: dict) -> Path:
    """TorchScript export (dynamo=False) keeping parameters as named initializers (no folding)."""
    module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # exporter deprecation and tracer warnings
        torch.onnx.export(
            module,
            (example,),
            str(path),
            dynamo=False,
            do_constant_folding=False,
            opset_version=OPSET,
            input_names=[input_name],
            output_names=["logits"],
            dynamic_axes={input_name: dynamic[input_name], "logits": dynamic["logits"]},
        )
    return path


# --------------------------------------------------------------------------- ONNX names -> torch names


@dataclass(frozen=True)
class Use:
    """One ONNX initializer that holds a torch parameter (or its transpose)."""

    initializer: str
    transposed: bool


def parameter_uses(model: onnx.ModelProto, module: torch.nn.Module) -> dict[str, list[Use]]:
    """torch parameter name -> the float initializers of ``model`` that hold it.

    An initializer named like a parameter is that parameter; any other float initializer
    (``onnx::MatMul_123`` and the like) is matched by value, as is or transposed, and must
    match exactly one parameter. Initializers matching none are exporter constants; a
    parameter the forward pass never reads has no initializer (an empty list). Tied
    parameters (GPT-2's wte and lm_head) are one torch parameter, and may be one initializer
    or several; their gradients add up either way."""
    params = {name: p.detach().numpy() for name, p in module.named_parameters()}
    uses: dict[str, list[Use]] = {name: [] for name in params}
    for init in model.graph.initializer:
        value = numpy_helper.to_array(init)
        if value.dtype.kind != "f":
            continue
        if init.name in params:
            assert np.array_equal(params[init.name], value), f"initializer {init.name!r} differs from the parameter"
            uses[init.name].append(Use(init.name, False))
            continue
        owners = [(name, transposed) for name, p in params.items() for transposed in _layouts(p, value)]
        if len(owners) > 1:
            raise AssertionError(f"initializer {init.name!r} matches several parameters by value: {owners}")
        for name, transposed in owners:
            uses[name].append(Use(init.name, transposed))
    return uses


def _layouts(param: np.ndarray, value: np.ndarray) -> list[bool]:
    """[False] if ``value`` equals ``param``, [True] if it equals its transpose, else []."""
    if param.shape == value.shape and np.array_equal(param, value):
        return [False]
    if param.ndim == 2 and param.T.shape == value.shape and np.array_equal(param.T, value):
        return [True]
    return []
