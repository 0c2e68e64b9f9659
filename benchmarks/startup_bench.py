"""Time to the first training step: what a new user waits for before graphforge trains, beside
torch eager's wait on the same model.

In a fresh process each time, on an export made beforehand: ``import graphforge``, the compile
(``loss, autodiff, adamw`` from the export), ``Module`` (the program's initial state on the
device), the first ``train_step`` (the forward/backward segment split off and specialized to
the batch's dims, its sessions made, torch imported for the fused update) and the second (a
step as every later one). Then the first Module goes and a second one on the same program is
made in the same process, as a resume makes, and stepped once: its first step finds the
program's cut into forward/backward and update, and their specialization, made (one per
program, and per program and dims, in a process). torch eager's side: its import, the module
built and moved into train mode, AdamW, and its first two steps. Each figure is the median of
REPEATS runs. The Qwen2-style row has Qwen2-0.5B's shapes, the size the CUDA issue's start-up
figures were taken on.

    python benchmarks/run.py startup
"""

from __future__ import annotations

import gc
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import train_bench as tb  # noqa: E402  (the models, their export and the optimizer settings)

TITLE = "Time to the first step"
REPEATS = 3
TIMEOUT_S = 900
#: Qwen2-0.5B's shapes (494 M parameters, the embedding tied to the head), at sequence 64
QWEN2_05B = {
    "num_hidden_layers": 24,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "seq": 64,
}
FULL = [
    tb.Spec("gpt2", "GPT-2 2×256, vocab 50257", 8, tb.FULL[2].config, steps=2),
    tb.Spec("gpt2", "GPT-2 small 12×768, vocab 50257", 8, tb.GPT2_SMALL, steps=2),
    tb.Spec("qwen2", "Qwen2-style 24×896, vocab 151936 (494 M)", 4, QWEN2_05B, steps=2),
]
QUICK = [tb.QUICK[2]]
#: (label, key in the child's report) of graphforge's phases, in order
PHASES = [
    ("import", "import_s"),
    ("compile", "compile_s"),
    ("Module", "module_s"),
    ("first step", "first_s"),
    ("second step", "second_s"),
]


def child(job: dict) -> dict:
    start = time.perf_counter()
    data = np.load(job["batches"])
    (x0, y0), (x1, y1) = (data["x0"], data["y0"]), (data["x1"], data["y1"])
    if job["side"] == "torch":
        import torch

        imported = time.perf_counter()
        spec = tb.Spec(**job["spec"])
        step = tb.torch_adamw_step(tb.build_torch(spec).train(), "cpu")
        built = time.perf_counter()
        step(x0, y0)
        first = time.perf_counter()
        step(x1, y1)
        second = time.perf_counter()
        del torch
        return {"import_s": imported - start, "module_s": built - imported, "first_s": first - built,
                "second_s": second - first}  # fmt: skip
    import graphforge

    imported = time.perf_counter()
    program = graphforge.compile(job["model"], tb.PIPELINE).model
    compiled = time.perf_counter()
    module = graphforge.Module(program, device="cpu")
    made = time.perf_counter()
    module.train_step(x0, y0)
    first = time.perf_counter()
    module.train_step(x1, y1)
    second = time.perf_counter()
    update = module.update_note.removeprefix("update: ").split(" (")[0]
    del module  # as a resume does (two 494 M models' states would not fit beside each other)
    gc.collect()
    resumed = time.perf_counter()
    again = graphforge.Module(program, device="cpu")
    again.train_step(x0, y0)
    second_module = time.perf_counter()
    return {
        "import_s": imported - start,
        "compile_s": compiled - imported,
        "module_s": made - compiled,
        "first_s": first - made,
        "second_s": second - first,
        "again_s": second_module - resumed,
        "update": update,
    }


def _median(results: list[dict], key: str) -> float | None:
    values = [r[key] for r in results if key in r]
    return statistics.median(values) if values else None


def run(quick: bool = False) -> str:
    rows, notes = [], []
    for spec in QUICK if quick else FULL:
        folder = tb.CACHE.parent / "startup" / re.sub(r"[^0-9A-Za-z]+", "_", spec.label)
        print(f"  {spec.label}: export", flush=True)
        model, _, batches, _ = tb.prepare(spec, folder)
        results = {"graphforge": [], "torch eager": []}
        for _ in range(REPEATS):
            for side in results:
                job = {"side": "torch" if side == "torch eager" else "graphforge", "spec": spec.__dict__,
                       "model": str(model), "batches": str(batches)}  # fmt: skip
                results[side].append(tb.run_child(__file__, job, timeout=TIMEOUT_S))
        ours, theirs = results["graphforge"], results["torch eager"]
        cells = []
        for _, key in PHASES:
            value = _median(ours, key)
            cells.append("—" if value is None else f"{value:.2f}")
        to_first = sum(_median(ours, k) for k in ("import_s", "compile_s", "module_s", "first_s"))
        torch_first = sum(_median(theirs, k) for k in ("import_s", "module_s", "first_s"))
        rows.append(
            f"| {spec.label} | {' | '.join(cells)} | {to_first:.2f} | {_median(ours, 'again_s'):.2f} | "
            f"{torch_first:.2f} | {to_first / torch_first:.1f}× |"
        )
        notes.append(
            f"- {spec.label}: torch eager: import {_median(theirs, 'import_s'):.2f} s, model and AdamW "
            f"{_median(theirs, 'module_s'):.2f} s, first step {_median(theirs, 'first_s'):.2f} s, second "
            f"{_median(theirs, 'second_s'):.2f} s; graphforge's update: {ours[0]['update']}"
        )
    return "\n".join(
        [
            "Seconds from a fresh process to the end of the first training step (CPU, 2 threads as the "
            "machine has; the export made beforehand), each phase the median of "
            f"{REPEATS} fresh processes; “again”: the first Module dropped, a second one on the same program in "
            "the same process made and stepped once, as a resume does (its cut and specialization are found, not "
            "made again). torch eager beside it: "
            "import, model and AdamW built, first step.",
            "",
            "| model | import s | compile s | Module s | first step s | second step s | to the first step s | "
            "again s | torch eager to the first step s | graphforge / torch |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            *rows,
            "",
            *notes,
        ]
    )


if __name__ == "__main__":
    tb.child_main(child, run)
