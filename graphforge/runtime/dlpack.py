"""The one bridge between torch tensors and onnxruntime's OrtValues, on the same memory.

Data parallelism reduces the gradients onnxruntime wrote, ZeRO and the update kernel update
the buffers the runner binds, and the PyTorch front end hands its tensors to sessions and
theirs back to autograd: all through these few functions, so each rule holds everywhere:

1. Nothing is copied: DLPack both ways; on the CPU, where this onnxruntime has no DLPack,
   NumPy's buffer protocol (still no copy).
2. bool crosses as bool: torch hands a bool tensor over DLPack as a type onnxruntime 1.31 does
   not read, and onnxruntime hands bool back as uint8. A bool tensor going to onnxruntime is
   copied through the host (masks: a few bytes); one coming back is viewed as bool.
3. Device memory that cannot cross without DLPack is refused with what to install, never
   copied through the host behind the caller's back.

torch is imported inside the functions: importing the runtime needs no torch.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from graphforge.errors import GraphforgeError
from graphforge.runtime.devices import Device


class BridgeError(GraphforgeError):
    """A tensor cannot cross between torch and onnxruntime on this build without a copy."""


def ortvalue_of(tensor) -> ort.OrtValue:
    """An OrtValue over ``tensor``'s memory (no copy), which it keeps alive; a bool tensor is
    the exception (case 2). ``tensor`` must not require grad (detach it first)."""
    import torch

    if tensor.dtype == torch.bool:
        device = tensor.device
        return ort.OrtValue.ortvalue_from_numpy(
            tensor.detach().cpu().numpy(), "cpu" if device.type == "cpu" else "cuda", device.index or 0
        )
    try:
        return ort.OrtValue.from_dlpack(tensor)
    except (AttributeError, TypeError, RuntimeError):
        if tensor.device.type != "cpu":
            raise BridgeError(
                "this onnxruntime cannot share CUDA memory with torch (its OrtValue has no DLPack import); "
                "install onnxruntime-gpu 1.16 or later"
            ) from None
        return ort.OrtValue.ortvalue_from_numpy(tensor.numpy())


def tensor_of(value: ort.OrtValue):
    """A torch tensor over an OrtValue's memory (no copy), which it keeps alive."""
    import torch

    if hasattr(value, "__dlpack__"):
        tensor = torch.from_dlpack(value)
    elif value.device_name().lower() == "cpu":
        tensor = torch.from_numpy(value.numpy())
    else:
        raise BridgeError("this onnxruntime cannot share CUDA memory with torch (its OrtValue has no DLPack export)")
    if value.data_type() == "tensor(bool)" and tensor.dtype != torch.bool:
        tensor = tensor.view(torch.bool)
    return tensor


def torch_dtype(dtype) -> object:
    """The torch dtype of a NumPy one."""
    import torch

    return torch.from_numpy(np.zeros(0, dtype)).dtype


def torch_device(device: Device):
    """The torch device of a runner's Device."""
    import torch

    return torch.device("cpu" if device.type == "cpu" else f"{device.type}:{device.id}")


def copy_on_device(target: ort.OrtValue, source: ort.OrtValue) -> None:
    """Copy ``source`` into ``target`` (same shape and dtype, on one device) by torch's copy on
    their memory, on torch's stream: ``synchronize`` before onnxruntime reads ``target``."""
    tensor_of(target).copy_(tensor_of(source))


def synchronize(device: Device) -> None:
    """Wait for what torch queued on ``device``: onnxruntime runs on a stream of its own."""
    if device.type == "cuda":
        import torch

        torch.cuda.current_stream(torch_device(device)).synchronize()
