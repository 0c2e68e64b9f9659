"""What the benchmarks share: where each keeps its cache, how a report names the machine and the
packages it ran, and the randomly initialized GPT-2 exports several of them time."""

from __future__ import annotations

import importlib
import os
import platform
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

#: every benchmark's cache lives in a folder of its own below this one
CACHE_ROOT = Path(tempfile.gettempdir()) / "graphforge-bench"
#: GPT-2 small's shapes (the exporter's context length; the training benchmark sets its own)
GPT2_SMALL = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
#: Qwen2-0.5B's shapes (its config.json): Qwen2Config's keys
QWEN2_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
}


def cache(name: str) -> Path:
    """The cache folder of the benchmark ``name`` (made when first written)."""
    return CACHE_ROOT / name


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def version(package: str) -> str:
    """``package``'s version as a report prints it ("absent" where it does not import)."""
    try:
        return getattr(importlib.import_module(package), "__version__", "?")
    except ImportError:
        return "absent"


def ort_training_version(python: str | None) -> str:
    """The onnxruntime-training version the interpreter ``python`` has (the peer of some rows)."""
    if python is None:
        return "not installed"
    proc = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('onnxruntime-training'))"],
        capture_output=True,
        text=True,
    )
    return proc.stdout.strip() or "of unknown version"


def gpt2_module(config: dict):
    """The randomly initialized GPT-2 that ``export_gpt2`` exports (transformers'
    GPT2LMHeadModel, seeded, every vector made random), in eval mode."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    inner = GPT2LMHeadModel(
        GPT2Config(**config, attn_implementation="eager", use_cache=False, bos_token_id=0, eos_token_id=0)
    )
    with torch.no_grad():  # the exporter merges equal initializers (zero biases): make every one random
        for p in inner.parameters():
            if p.dim() == 1:
                p.add_(0.05 * torch.randn(p.shape))
    return inner.eval()


def export_gpt2(path: Path, config: dict, *, with_loss: bool = False) -> Path:
    """A randomly initialized GPT-2 (``config``: GPT2Config's keys) exported by the TorchScript
    exporter to ``path``, unless it is already there: ``input_ids -> logits``, or with
    ``with_loss`` ``(input_ids, labels) -> loss`` (the mean cross-entropy)."""
    if path.exists():
        return path
    import torch

    inner = gpt2_module(config)

    class Exported(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, labels=None):
            mask = torch.ones_like(input_ids)  # transformers 5.x traces a dynamic length only with a mask
            logits = self.inner(input_ids=input_ids, attention_mask=mask).logits
            if labels is None:
                return logits
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    ids = torch.randint(0, config["vocab_size"], (2, 16))
    seq = {0: "batch", 1: "seq"}
    inputs, names = ((ids, ids), ["input_ids", "labels"]) if with_loss else ((ids,), ["input_ids"])
    output = "loss" if with_loss else "logits"
    axes = {name: seq for name in names} | ({} if with_loss else {"logits": seq})
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Exported().eval(),
            inputs,
            str(partial),
            dynamo=False,
            do_constant_folding=False,
            opset_version=17,
            input_names=names,
            output_names=[output],
            dynamic_axes=axes,
        )
    partial.replace(path)
    return path


def checked_then_warm(step, batches: list, check: int, warmup: int) -> list[float]:
    """The losses of the first ``check`` steps (what the sides of a run must agree on), then
    ``warmup`` more steps, untimed; ``step(*batch)`` returns the loss."""
    losses = [float(step(*batches[i % len(batches)])) for i in range(check)]
    for i in range(warmup):
        step(*batches[i % len(batches)])
    return losses


def timed_steps(step, batches: list, steps: int) -> list[float]:
    """The seconds each of ``steps`` steps takes, over ``batches`` in turn."""
    times = []
    for i in range(steps):
        started = time.perf_counter()
        step(*batches[i % len(batches)])
        times.append(time.perf_counter() - started)
    return times
