"""Training on a device: the artifact folders graphforge writes for runtimes in any language
(``artifacts``: training, eval and optimizer models, the whole step, an inference model, the
checkpoint and a manifest), and onnxruntime-training's on-device Python API over them
(``CheckpointState``, ``Module``, ``Optimizer``, ``LinearLRScheduler``), so that its scripts
run on stock onnxruntime with their import lines changed::

    from graphforge import artifacts                      # was: from onnxruntime.training import artifacts
    from graphforge.ondevice import CheckpointState, Module, Optimizer, LinearLRScheduler

The JavaScript runtime (js/) reads the same folders on onnxruntime-node and onnxruntime-web.
"""

from graphforge.ondevice import artifacts
from graphforge.ondevice.api import CheckpointState, LinearLRScheduler, Module, Optimizer, Parameter, Parameters

__all__ = ["CheckpointState", "LinearLRScheduler", "Module", "Optimizer", "Parameter", "Parameters", "artifacts"]
