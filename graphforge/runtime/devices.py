"""Where a runner's buffers live and its sessions run: a device named by the user ("cpu",
"cuda", "cuda:1") resolved against what this onnxruntime build can actually use."""

from __future__ import annotations

from dataclasses import dataclass

import onnxruntime as ort

from graphforge.errors import DeviceError
from graphforge.runtime.sessions import CPU, CUDA, available_providers, provider_works


@dataclass(frozen=True)
class Device:
    """Where a runner's buffers live and its sessions run: an OrtValue device type and id,
    and the providers its sessions use."""

    type: str
    id: int
    providers: tuple

    @property
    def name(self) -> str:
        return self.type if self.type == "cpu" else f"{self.type}:{self.id}"


def resolve_device(device: str | None) -> Device:
    """The Device for "cpu", "cuda", "cuda:N", or None (the best that works here)."""
    if device is None:
        providers = available_providers()
        if providers[0] != CUDA:
            return Device("cpu", 0, tuple(providers))
        device = "cuda"
    text = str(device).strip().lower()
    kind, _, index = text.partition(":")
    if kind == "cpu" and not index:
        return Device("cpu", 0, (CPU,))
    if kind in ("cuda", "gpu") and (not index or index.isdigit()):
        device_id = int(index or 0)
        if not provider_works(CUDA):
            why = (
                "this onnxruntime build has no CUDA provider (install onnxruntime-gpu)"
                if CUDA not in ort.get_available_providers()
                else "no CUDA device is usable on this machine"
            )
            raise DeviceError(f"device {device!r} asks for CUDA, but {why}; use device 'cpu'")
        return Device("cuda", device_id, ((CUDA, {"device_id": str(device_id)}), CPU))
    raise DeviceError(f"unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:N'")
