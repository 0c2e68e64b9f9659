"""Serve the page that fine-tunes a small language model in the browser (examples/web-lm/index.html).

    .venv/bin/python examples/web-lm/serve.py            # or: make web-lm
    → open http://127.0.0.1:8000/examples/web-lm/

The base model and its tokenizer are make lm's (out/lm/base/model.onnx, out/lm/tokenizer.json;
--model and --tokenizer choose others: a causal LM taking input_ids, and maybe attention_mask
and position_ids, [batch, seq] → logits [batch, seq, vocab]). It writes what the page reads
into out/web-lm/:

- artifacts/: the LoRA training artifacts of the base (`graphforge artifacts` with PIPELINE:
  the adapters train, the base is frozen), and program.onnx, the program they were cut from
  (what `graphforge export --checkpoint` reads a downloaded checkpoint with);
- generate.onnx: the inference model the page generates with, the adapters in it as plain
  inputs (no values: the page feeds the ones it trains, from its checkpoint state) and the
  base's weights inside;
- tokenizer.json and tokenizer_config.json, read in the page by @huggingface/tokenizers.

then serves the repository's folder on 127.0.0.1 only, cross-origin isolated (COOP and COEP),
as examples/web/serve.py does.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import onnx
from onnx import helper

import graphforge
from graphforge.ondevice.artifacts import write_artifacts
from graphforge.program import ProgramRoles
from graphforge.runtime.inference import export_inference_model
from graphforge.tempfiles import write_atomically

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "out" / "web-lm"
MODEL = REPO / "out" / "lm" / "base" / "model.onnx"
TOKENIZER = REPO / "out" / "lm" / "tokenizer.json"
#: adapters of rank 8 on every linear layer (PEFT's 'all-linear'), the base frozen; the
#: logits' last axis is the vocabulary; the gradients accumulate (runTrainStep, runOptimizerStep)
PIPELINE = (
    "lora(r=8, alpha=16), loss(kind=cross_entropy, output=logits, axis=-1), autodiff, adamw(lr=1e-2, accumulate=true)"
)


def _web_serve():
    """examples/web/serve.py: its handler (MIME types, COOP and COEP) and server."""
    spec = importlib.util.spec_from_file_location("web_serve", REPO / "examples" / "web" / "serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def server(port: int = 8000, root: Path = REPO):
    """A server of ``root`` on 127.0.0.1:``port`` (0: any free port), not yet serving: the digits
    page's (examples/web/serve.py), whose responses are cross-origin isolated."""
    return _web_serve().server(port, root)


def missing(model: Path, tokenizer: Path) -> str | None:
    """One line saying what is missing (make lm writes both), or None."""
    for what, path in (("base model", model), ("tokenizer", tokenizer)):
        if not path.is_file():
            return f"no {what} at {path}: run make lm first (it trains one), or give --model and --tokenizer"
    return None


def prepare(model: Path = MODEL, tokenizer: Path = TOKENIZER, out: Path = OUT, pipeline: str = PIPELINE) -> Path:
    """out/artifacts (with program.onnx), out/generate.onnx and the tokenizer's files; the folder."""
    out.mkdir(parents=True, exist_ok=True)
    program = graphforge.compile(model, pipeline).model
    write_artifacts(program, out / "artifacts")
    graphforge.save(program, out / "artifacts" / "program.onnx")
    write_atomically(out / "generate.onnx", generation_model(program).SerializeToString())
    settings = tokenizer.parent / "tokenizer_config.json"  # (its EOS; none: {})
    write_atomically(out / "tokenizer.json", tokenizer.read_bytes())
    write_atomically(out / settings.name, settings.read_bytes() if settings.is_file() else b"{}")
    return out


def generation_model(program) -> onnx.ModelProto:
    """The forward of ``program`` (a LoRA training program) for generation: its outputs, the
    frozen base's weights inside, each adapter's A and B a graph input without a value.
    (onnxruntime-web leaves out of a session an input that an initializer also names, so
    the adapters cannot be inputs with defaults here.)"""
    proto = program.to_proto() if hasattr(program, "to_proto") else program
    adapters = ProgramRoles.read(proto).lora
    model = export_inference_model(proto, merge_adapters=False)
    names = {n for a in adapters for n in (a.a, a.b)}
    kept = [t for t in model.graph.initializer if t.name not in names]
    for t in model.graph.initializer:
        if t.name in names:
            model.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", type=Path, default=MODEL, help="the base model (default: make lm's)")
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER, help="its tokenizer.json (default: make lm's)")
    args = parser.parse_args(argv)
    problem = missing(args.model, args.tokenizer)
    if problem is None and not (REPO / "js" / "node_modules" / "@huggingface" / "tokenizers").is_dir():
        problem = (
            "onnxruntime-web or @huggingface/tokenizers is missing: run make install first (it runs npm ci in js/)"
        )
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    try:
        prepare(args.model, args.tokenizer)
    except graphforge.GraphforgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return _web_serve().serve(args.port, "examples/web-lm/")


if __name__ == "__main__":
    sys.exit(main())
