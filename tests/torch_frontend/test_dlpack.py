"""The one torch <-> onnxruntime bridge (graphforge/runtime/dlpack.py), which data parallelism,
ZeRO, the update kernel and GraphforgeModule all cross by: no copy either way, bool as bool,
NumPy's buffer where this onnxruntime has no DLPack. Runs on ``GRAPHFORGE_TEST_DEVICE``."""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")

from graphforge.runtime.devices import Device  # noqa: E402
from graphforge.runtime.dlpack import ortvalue_of, tensor_of, torch_device, torch_dtype  # noqa: E402

DEVICE = os.environ.get("GRAPHFORGE_TEST_DEVICE", "cpu")
ORT_DEVICE = torch.device(DEVICE).type


def test_a_tensor_crosses_to_onnxruntime_on_its_memory():
    x = torch.randn(3, 4, device=DEVICE)
    value = ortvalue_of(x)
    assert value.data_ptr() == x.data_ptr()
    assert value.shape() == [3, 4] and value.data_type() == "tensor(float)"
    x.add_(1)  # the same memory: onnxruntime sees the write
    np.testing.assert_array_equal(value.numpy(), x.cpu().numpy())


@pytest.mark.parametrize(
    "array", [np.arange(12, dtype=np.float32).reshape(3, 4), np.array([[True, False], [False, True]])], ids=str
)
def test_an_ortvalue_crosses_to_torch_on_its_memory(array):
    """DLPack hands bool over as uint8: it comes back as bool."""
    value = ort.OrtValue.ortvalue_from_numpy(array, ORT_DEVICE, 0)
    tensor = tensor_of(value)
    assert tensor.dtype == torch.from_numpy(array).dtype and tensor.device.type == ORT_DEVICE
    assert tensor.data_ptr() == value.data_ptr()
    np.testing.assert_array_equal(tensor.cpu().numpy(), array)


def test_a_bool_tensor_reaches_onnxruntime_as_bool():
    """torch hands bool over DLPack as a type onnxruntime does not read: copied, and bool."""
    mask = torch.tensor([[True, False, True]], device=DEVICE)
    value = ortvalue_of(mask)
    assert value.data_type() == "tensor(bool)" and value.device_name().lower() == ORT_DEVICE
    np.testing.assert_array_equal(value.numpy(), mask.cpu().numpy())


def test_without_dlpack_the_cpu_crosses_through_numpys_buffer(monkeypatch):
    """An onnxruntime whose OrtValue has no DLPack import or export: still no copy on the CPU."""

    def no_import(_):
        raise AttributeError("from_dlpack")

    x = torch.randn(5)
    monkeypatch.setattr(ort.OrtValue, "from_dlpack", staticmethod(no_import))
    value = ortvalue_of(x)
    assert value.data_ptr() == x.data_ptr()
    monkeypatch.delattr(ort.OrtValue, "__dlpack__")  # raises where there is none to take away
    assert not hasattr(value, "__dlpack__")
    back = tensor_of(value)
    assert back.data_ptr() == x.data_ptr()


def test_dtypes_and_devices():
    assert torch_dtype(np.float16) == torch.float16 and torch_dtype(np.dtype("int64")) == torch.int64
    assert torch_device(Device("cpu", 0, ())) == torch.device("cpu")
    assert torch_device(Device("cuda", 1, ())) == torch.device("cuda:1")
