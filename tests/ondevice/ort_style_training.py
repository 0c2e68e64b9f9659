"""A training script in onnxruntime-training's documented on-device style: generate the
artifacts, then TrainStep, OptimizerStep and LazyResetGrad for each batch, the rate from a
LinearLRScheduler, and an EvalStep over the test split after each epoch.

Written for graphforge; onnxruntime-training 1.19.2 runs it with the two import lines
between the markers replaced by ``from onnxruntime.training import artifacts`` and
``from onnxruntime.training.api import ...`` (record_ort_losses.py). Prints its losses as JSON.

    python ort_style_training.py ARTIFACT_FOLDER [adamw|sgd]
"""

import json
import sys
from pathlib import Path

import numpy as np
import onnx

# imports:begin
from graphforge import artifacts
from graphforge.ondevice import CheckpointState, LinearLRScheduler, Module, Optimizer

# imports:end

REPO = Path(__file__).resolve().parents[2]
folder = Path(sys.argv[1])
kind = sys.argv[2] if len(sys.argv) > 2 else "adamw"
folder.mkdir(parents=True, exist_ok=True)
model = onnx.load(str(REPO / "examples" / "digits" / "model.onnx"))
artifacts.generate_artifacts(
    model,
    requires_grad=[t.name for t in model.graph.initializer],
    loss=artifacts.LossType.CrossEntropyLoss,
    optimizer=artifacts.OptimType.AdamW if kind == "adamw" else artifacts.OptimType.SGD,
    artifact_directory=str(folder),
)

state = CheckpointState.load_checkpoint(str(folder / "checkpoint"))
module = Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"))
optimizer = Optimizer(str(folder / "optimizer_model.onnx"), module)
scheduler = LinearLRScheduler(optimizer, warmup_step_count=4, total_step_count=30, initial_lr=0.01)

train, test = (np.load(REPO / "data" / "digits" / f"{split}.npz") for split in ("train", "test"))
batch, losses, eval_losses = 64, [], []
for _epoch in range(2):
    module.train()
    for start in range(0, 15 * batch, batch):
        loss = module(train["images"][start : start + batch], train["labels"][start : start + batch])
        optimizer.step()
        scheduler.step()
        module.lazy_reset_grad()
        losses.append(float(loss))
    module.eval()
    eval_losses.append(float(module(test["images"], test["labels"])))
print(json.dumps({"losses": losses, "eval_losses": eval_losses, "learning_rate": float(optimizer.get_learning_rate())}))
