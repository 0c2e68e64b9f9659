"""The fixtures js/'s unit tests (node --test) take from graphforge in Python: three artifact
sets of the digits MLP (accumulating AdamW; SGD that does not accumulate; AdamW with the first
layer frozen) and the values Python computes (the schedules' rates, the dropout keys).

    .venv/bin/python tests/ondevice/js_fixtures.py FOLDER

``npm test`` (js/test/run.mjs) runs it into a temporary folder; test_js_runtime.py calls
``write_fixtures``. The tests find the folder in GRAPHFORGE_JS_FIXTURES.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import onnx

import graphforge
from graphforge import artifacts
from graphforge.ondevice.artifacts import write_artifacts
from graphforge.runtime.dropout import run_key
from graphforge.runtime.lr_schedules import make_schedule

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits" / "model.onnx"
PIPELINE = "loss(kind=cross_entropy, output=logits), autodiff, {}"
#: each schedule's options as the JS runtime spells them, and Python's names for them
SCHEDULES = {
    "constant": {"baseLr": 0.1, "warmupSteps": 3, "warmupStartFactor": 0.25},
    "linear": {"baseLr": 0.1, "warmupSteps": 2, "totalSteps": 10, "endLr": 0.01},
    "polynomial": {"baseLr": 0.1, "totalSteps": 10, "power": 2.0},
    "cosine": {"baseLr": 0.1, "warmupSteps": 3, "totalSteps": 12, "endLr": 0.001},
}
PYTHON_NAMES = {"baseLr": "base_lr", "warmupSteps": "warmup_steps", "warmupStartFactor": "warmup_start_factor",
                "totalSteps": "total_steps", "endLr": "end_lr", "power": "power"}  # fmt: skip
#: the parameters the frozen set does not train
FROZEN = ["fc1.weight", "fc1.bias"]


def write_fixtures(folder: Path) -> Path:
    """Write the fixtures into ``folder`` (made if missing); returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, optimizer in (("digits", "adamw(lr=1e-2, accumulate=true)"), ("plain", "sgd(lr=0.1)")):
        write_artifacts(graphforge.compile(DIGITS, PIPELINE.format(optimizer)).model, folder / name)
    artifacts.generate_artifacts(
        onnx.load(DIGITS), frozen_params=FROZEN, loss=artifacts.LossType.CrossEntropyLoss,
        artifact_directory=folder / "frozen", additional_output_names=["logits"],
    )  # fmt: skip
    schedules = []
    for kind, options in SCHEDULES.items():
        schedule = make_schedule(kind, None, **{PYTHON_NAMES[k]: v for k, v in options.items()})
        schedules.append({"kind": kind, "options": options, "rates": [schedule.lr_at(k) for k in range(14)]})
    keys = [
        {"seed": s, "step": t, "micro": m, "replica": r, "key": run_key(s, t, m, r).tolist()}
        for s, t, m, r in ((0, 0, 0, 0), (3, 17, 2, 1), (2**40, 123456, 7, 3))
    ]
    (folder / "values.json").write_text(json.dumps({"schedules": schedules, "keys": keys, "frozen": FROZEN}))
    return folder


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    write_fixtures(Path(sys.argv[1]))
