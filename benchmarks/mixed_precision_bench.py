"""Mixed precision on the CPU: graphforge's float16 program (``mixed_precision(dtype=float16)``)
beside its float32 program and PyTorch eager in float32, on GPT-2 2×256 (the Training step
section's model, batches and AdamW). Each side runs in a fresh process (cuda_bench's child
with ``GRAPHFORGE_BENCH_DEVICE=cpu``): step time is the median over the timed steps after the
warm-up; memory is the process's peak resident memory above what it held before setup.

    python benchmarks/run.py mixed_precision

The same sides on CUDA, with torch.autocast + GradScaler beside them, are the section
"Mixed precision (CUDA)" (mixed_precision_cuda_bench.py).
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import asdict, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import cuda_bench  # noqa: E402  (the child that measures one side on a device)
import helpers  # noqa: E402  (what the benchmarks share)
import train_bench as tb  # noqa: E402

TITLE = "Mixed precision (CPU)"
CACHE = helpers.cache("mixed-precision")
FULL = [replace(tb.FULL[2], steps=20)]
QUICK = [tb.QUICK[2]]


def sides(device: str) -> list[tuple[str, dict]]:
    """(label, job settings) of each measured side; torch's AMP recipe only on CUDA (torch's
    CPU autocast runs bfloat16, with no GradScaler)."""
    rows = [
        ("graphforge, float32", {"side": "graphforge"}),
        ("graphforge, mixed_precision(float16)", {"side": "graphforge", "precision": "float16"}),
        ("torch eager, float32", {"side": "torch"}),
    ]
    if device == "cuda":
        rows.append(("torch eager, autocast(float16) + GradScaler", {"side": "torch", "autocast": "float16"}))
    return rows


def program(folder: Path, model: Path, fp32: Path, precision: str | None, provider: str) -> Path:
    if precision is None:
        return fp32
    import graphforge

    compiled = graphforge.compile(str(model), f"{tb.PIPELINE}, mixed_precision(dtype={precision}, provider={provider})")
    for record in compiled.records:
        if record.name == "mixed_precision":
            print(f"    mixed_precision: {record.note}", flush=True)
    return graphforge.save(compiled.model, folder / f"program-{precision}-{provider}.onnx")


def table(device: str, specs, cache: Path) -> str:
    """The section's body: one row per side of each model, ratios against the float32 sides."""
    provider = "cuda" if device == "cuda" else "cpu"
    memory_key = "peak_mib" if device == "cuda" else "peak_rss_mib"
    rows, notes = [], []
    for spec in specs:
        folder = cache / f"{device}-{re.sub(r'[^A-Za-z0-9]+', '_', spec.label)}-b{spec.batch}"
        print(f"  {spec.label}: export and compile", flush=True)
        model, fp32, batches, _ = tb.prepare(spec, folder)
        results = {}
        for label, side in sides(device):
            job = {**side, "spec": asdict(spec), "batches": str(batches), "device": device}
            if side["side"] == "graphforge":
                job["program"] = str(program(folder, model, fp32, side.get("precision"), provider))
            results[label] = cuda_bench.measure(job)
            print(f"  {spec.label}: {label}: {json.dumps(results[label])[:300]}", flush=True)
        base = results["graphforge, float32"]
        peers = {k: v for k, v in results.items() if k.startswith("torch") and "step_s" in v}
        for label, r in results.items():
            if "error" in r:
                rows.append(f"| {spec.label} | {label} | failed: {' '.join(r['error'].split())[-200:]} | | | |")
                continue
            speed = f"{base['step_s'] / r['step_s']:.2f}×" if "step_s" in base else "—"
            versus = " / ".join(f"{p['step_s'] / r['step_s']:.2f}×" for p in peers.values())
            memory = r.get(memory_key)
            rows.append(
                f"| {spec.label} | {label} | {r['step_s'] * 1000:.1f} ± {r['iqr_s'] * 1000 / 2:.1f} | {speed} | "
                f"{versus} | {'—' if memory is None else f'{memory:.0f}'} |"
            )
        notes.append(tb.first_losses(spec.label, results))
        notes.append(f"- {spec.label}: the torch columns are, in order: {' / '.join(peers)}")
    memory_what = "device MiB (NVML, above the CUDA context)" if device == "cuda" else "peak RSS MiB above setup"
    return "\n".join(
        [
            f"| model | side | step ms (median ± IQR/2) | × graphforge float32 speed | × torch speed | {memory_what} |",
            "| --- | --- | ---: | ---: | ---: | ---: |",
            *rows,
            "",
            *notes,
        ]
    )


def section(intro: str, body: str) -> str:
    """A section's text: ``intro``, the table and notes, and the versions that made them."""
    import graphforge

    versions = (
        f"graphforge {graphforge.__version__}, onnxruntime {helpers.version('onnxruntime')}, "
        f"torch {helpers.version('torch')}."
    )
    return "\n".join([intro, "", body, "", versions])


def run(quick: bool = False) -> str:
    os.environ["GRAPHFORGE_BENCH_DEVICE"] = "cpu"
    return section(
        f"Training steps on the CPU ({os.cpu_count()} cores, every side with onnxruntime's and torch's "
        "default threads): graphforge's float16 program against its float32 one and torch eager. "
        "Ratios above 1 mean the row is faster.",
        table("cpu", QUICK if quick else FULL, CACHE),
    )


if __name__ == "__main__":
    tb.child_main(cuda_bench.child, run)
