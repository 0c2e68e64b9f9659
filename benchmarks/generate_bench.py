"""Generation: tokens a second of `graphforge generate`'s Generator against transformers' own
generate on torch eager, on the same randomly initialized model: GPT-2 small, and a Qwen2 at
Qwen2-0.5B's shapes (grouped-query attention, rotary positions, a vocabulary of 151,936).

Greedy, batch 1, a 32-token prompt, 64 new tokens (EOS never ends a run early), 2 threads on
both sides (onnxruntime's intra-op threads, torch.set_num_threads), and the cache sides again
on 1. graphforge runs two exports of the same weights: the plain forward (input_ids -> logits),
given a cache by the kv_cache pass (Generator's default) and with cache=False (the whole prefix
again for each token), and one with cache inputs in optimum's names
(past_key_values.N.key/value in, present.N.key/value out; exported through a wrapper that hands
transformers the past, as the kv_cache pass writes it); transformers runs with its cache
and without (use_cache=False). The Qwen2 runs the plain forward's rows and transformers' (its
cache inputs would need a wrapper per family; the pass is what a user of graphforge gets). Each figure is the median of REPEATS runs after one untimed run,
the sides taking turns; every side's tokens are checked to be transformers' with its cache.

    python benchmarks/run.py generate
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import helpers  # noqa: E402

TITLE = "Generation"
CACHE = helpers.cache("generate")
THREADS = 2
REPEATS = 3
FULL = {"label": "GPT-2 small 12×768, vocab 50257", "config": helpers.GPT2_SMALL, "prompt": 32, "new": 64}
QUICK = {
    "label": "GPT-2 2×64, vocab 512",
    "config": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 512, "n_positions": 128},
    "prompt": 8,
    "new": 8,
}
#: Qwen2-0.5B's shapes, random weights, the embedding tied to the head
QWEN2_05B = {**helpers.QWEN2_05B, "max_position_embeddings": 1024}
QWEN2_FULL = {"label": "Qwen2-0.5B shapes 24×896, 14 query / 2 kv heads, vocab 151936", "family": "qwen2",
              "config": QWEN2_05B, "prompt": 32, "new": 64}  # fmt: skip
QWEN2_QUICK = {"label": "Qwen2 2×64, 4 query / 2 kv heads, vocab 512", "family": "qwen2", "prompt": 8, "new": 8,
               "config": {**QWEN2_05B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "vocab_size": 512, "max_position_embeddings": 128}}  # fmt: skip
#: the rows: (label, which side, threads); the cache sides again on one thread, where a machine
#: whose cores other work shares does not make torch's two threads wait for each other
ROWS = [
    ("graphforge, cache inputs", "graphforge-cache", 2),
    ("graphforge, plain forward given a cache by the kv_cache pass", "graphforge-pass", 2),
    ("graphforge, plain forward (prefix recomputed, cache=False)", "graphforge-plain", 2),
    ("transformers generate, torch eager, with its cache", "torch-cache", 2),
    ("transformers generate, torch eager, use_cache=False", "torch-plain", 2),
    ("graphforge, cache inputs", "graphforge-cache", 1),
    ("transformers generate, torch eager, with its cache", "torch-cache", 1),
]
#: a family with no cache-inputs export here runs the other rows
PLAIN_ROWS = [row for row in ROWS if row[1] != "graphforge-cache"]


def qwen2_module(config: dict):
    """A randomly initialized Qwen2ForCausalLM (seeded, eval mode, eager attention)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    settings = Qwen2Config(**config, tie_word_embeddings=True, attn_implementation="eager", bos_token_id=0,
                           eos_token_id=0)  # fmt: skip
    return Qwen2ForCausalLM(settings).eval()


def export_plain(module, path: Path) -> Path:
    """``module`` (a transformers causal LM) as input_ids, attention_mask -> logits, exported by
    the TorchScript exporter with dynamic batch and sequence, unless ``path`` is there."""
    if path.exists():
        return path
    import torch

    class CausalLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    ids = torch.randint(0, module.config.vocab_size, (2, 16))
    axes = {n: {0: "batch", 1: "seq"} for n in ("input_ids", "attention_mask", "logits")}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(CausalLM().eval(), (ids, torch.ones_like(ids)), str(partial), dynamo=False,
                          do_constant_folding=False, opset_version=17, input_names=["input_ids", "attention_mask"],
                          output_names=["logits"], dynamic_axes=axes)  # fmt: skip
    import onnx

    # a model over 2 GiB keeps its weights beside it; the file is moved in place last
    model = onnx.load(str(partial))
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")
    partial.unlink()
    for stale in partial.parent.glob(partial.name + "*"):
        stale.unlink()
    return path


def export_with_cache(module, path: Path) -> Path:
    """``module`` (a GPT2LMHeadModel) with cache inputs and outputs in optimum's names."""
    if path.exists():
        return path
    import torch
    from transformers import DynamicCache

    config = module.config
    layers, heads, head_dim = config.n_layer, config.n_head, config.n_embd // config.n_head

    class WithCache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(config=config)
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=cache, use_cache=True)  # fmt: skip
            return (out.logits, *[t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)])

    pasts = [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    presents = [f"present.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    example = (torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, 5, dtype=torch.int64), torch.arange(3, 5)[None],
               *torch.randn(2 * layers, 1, heads, 3, head_dim))  # fmt: skip
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"}}
    axes |= {"position_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
    axes |= {n: {0: "batch", 2: "past"} for n in pasts} | {n: {0: "batch", 2: "total"} for n in presents}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(WithCache().eval(), example, str(partial), dynamo=False, do_constant_folding=False,
                          opset_version=17, input_names=["input_ids", "attention_mask", "position_ids", *pasts],
                          output_names=["logits", *presents], dynamic_axes=axes)  # fmt: skip
    partial.replace(path)
    return path


def tokenizer(folder: Path) -> Path:
    """A byte-level BPE over data/text/ with no EOS named (so none ends a run): the runs feed
    token ids; the tokenizer only turns them into text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = folder / "tokenizer.json"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        texts = [p.read_text() for p in sorted((HERE.parent / "data" / "text").glob("*.jsonl"))]
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)  # fmt: skip
        bpe.train_from_iterator(texts, trainer)
        bpe.save(str(path))
    return path


def _rates(sides: dict, new: int) -> dict[str, tuple[float, list[int]]]:
    """Each side's tokens a second (the median of REPEATS timed runs, after one untimed) and
    its tokens; the sides take turns in each round, so a change in the machine's load falls on
    all of them alike."""
    tokens = {key: run() for key, run in sides.items()}
    times: dict[str, list[float]] = {key: [] for key in sides}
    for _ in range(REPEATS):
        for key, run in sides.items():
            started = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - started)
    return {key: (new / statistics.median(times[key]), tokens[key]) for key in sides}


def measure(spec: dict, cache: Path = CACHE) -> dict[tuple[str, int], tuple[float, bool]]:
    """Each row's (side, threads): (tokens a second, whether its tokens are transformers' with
    its cache)."""
    import numpy as np
    import torch

    from graphforge.generate import Generator

    family = spec.get("family", "gpt2")
    name = family + "_" + "_".join(f"{k}{v}" for k, v in sorted(spec["config"].items()))
    if family == "gpt2":
        module = helpers.gpt2_module(spec["config"])
        plain = helpers.export_gpt2(cache / f"{name}.onnx", spec["config"])
    else:
        module = qwen2_module(spec["config"])
        plain = export_plain(module, cache / name / "model.onnx")
    # Generator's default gives the plain forward a cache in memory with the kv_cache pass
    paths = {"graphforge-plain": plain, "graphforge-pass": plain}
    if family == "gpt2":
        paths["graphforge-cache"] = export_with_cache(module, cache / f"{name}_cache.onnx")
    words = tokenizer(cache / "tokenizer")
    prompt = np.random.default_rng(0).integers(0, spec["config"]["vocab_size"], spec["prompt"]).tolist()
    new = spec["new"]
    ids = torch.tensor([prompt])

    def side(key: str, threads: int):
        if key in paths:
            generator = Generator(paths[key], words, device="cpu", threads=threads, cache=key != "graphforge-plain")
            return lambda: generator.generate(prompt, max_new_tokens=new).ids

        def run():
            torch.set_num_threads(threads)
            with torch.no_grad():
                out = module.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                                      min_new_tokens=new, use_cache=key == "torch-cache", pad_token_id=0)  # fmt: skip
            return out[0, len(prompt) :].tolist()

        return run

    rates = _rates({(key, threads): side(key, threads) for _, key, threads in rows(spec)}, new)
    reference = rates[("torch-cache", THREADS)][1]
    return {key: (rate, tokens == reference and len(tokens) == new) for key, (rate, tokens) in rates.items()}


def report(spec: dict, measured: dict[tuple[str, int], tuple[float, bool]], load: tuple[float, float]) -> str:
    lines = [
        f"{spec['label']}, random weights; greedy, batch 1, a {spec['prompt']}-token prompt, {spec['new']} new "
        f"tokens; tokens a second (the median of {REPEATS} runs, prefill included). "
        f"{helpers.cpu_name()}, {helpers.usable_cores()} cores, load average {load[0]:.1f} before the run and "
        f"{load[1]:.1f} after it; onnxruntime {helpers.version('onnxruntime')}, torch {helpers.version('torch')}, "
        f"transformers {helpers.version('transformers')}.",
        "",
        "| side | threads | tokens/s | tokens equal transformers' with its cache |",
        "|---|---:|---:|---|",
    ]
    for label, key, threads in rows(spec):
        rate, agree = measured[(key, threads)]
        lines.append(f"| {label} | {threads} | {rate:.1f} | {'yes' if agree else 'NO'} |")
    return "\n".join(lines) + "\n"


def rows(spec: dict) -> list[tuple[str, str, int]]:
    return ROWS if spec.get("family", "gpt2") == "gpt2" else PLAIN_ROWS


def run(quick: bool) -> str:
    parts = []
    for spec in (QUICK, QWEN2_QUICK) if quick else (FULL, QWEN2_FULL):
        before = os.getloadavg()[0]
        measured = measure(spec)
        parts.append(report(spec, measured, (before, os.getloadavg()[0])))
    return "\n".join(parts)
