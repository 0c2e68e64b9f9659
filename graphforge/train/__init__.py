"""Training from a config file: ``graphforge train CONFIG.toml``, and the inference export.

::

    import graphforge.train

    result = graphforge.train.run("examples/digits/train.toml", out="out/digits")
    print(result.step, result.loss, result.eval)
    graphforge.train.export(result.program, "out/digits/model.onnx", checkpoint=result.checkpoint)

config.py reads and checks the TOML file, data.py makes the batches, setup.py checks
everything before a run and builds its trainer (topology.py says which of trainers/ this
process is), loop.py trains (resume.py: the state and settings it goes on from; stops.py:
Ctrl-C, SIGTERM and a loss that is not finite; progress.py: what it prints), logs.py writes
the JSONL log and TensorBoard scalars, profiling.py the onnxruntime trace,
inference_export.py the inference model.
"""

from graphforge.train.config import Config, load_config
from graphforge.train.inference_export import ExportReport, PeftExport, export, export_peft, find_checkpoint
from graphforge.train.loop import Interrupted, NonFiniteLoss, TrainResult, run
from graphforge.train.setup import prepare

__all__ = [
    "Config",
    "ExportReport",
    "Interrupted",
    "NonFiniteLoss",
    "PeftExport",
    "TrainResult",
    "export",
    "export_peft",
    "find_checkpoint",
    "load_config",
    "prepare",
    "run",
]
