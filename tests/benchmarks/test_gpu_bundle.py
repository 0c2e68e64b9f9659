"""benchmarks/gpu_bundle.py on a wheel built here: a CUDA provider library whose fatbin holds
kernel images for two architectures keeps one's payload byte for byte and zeroes the other's,
its size and layout unchanged; what the binding never loads is left out of the tarball."""

from __future__ import annotations

import struct
import sys
import tarfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from gpu_bundle import CUDA_PROVIDER, bundle, fatbin_images

SM90, SM80 = b"\x90" * 40, b"\x80" * 24


def _entry(arch: int, payload: bytes) -> bytes:
    header = bytearray(64)
    struct.pack_into("<HHIQ", header, 0, 2, 0x101, len(header), len(payload))
    struct.pack_into("<I", header, 28, arch)
    return bytes(header) + payload


def _fatbin() -> bytes:
    entries = _entry(90, SM90) + _entry(80, SM80)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(entries)) + entries + bytes(8)  # (padding after)


def _shared_object(fatbin: bytes, section_name: bytes = b".nv_fatbin") -> bytes:
    """An ELF64 file with a section of ``fatbin`` (and the section names' table), laid out as a
    linker lays one out."""
    names = b"\0" + section_name + b"\0.shstrtab\0"
    data_at = 64
    names_at = data_at + len(fatbin)
    headers_at = (names_at + len(names) + 7) // 8 * 8
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    elf = ident + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, headers_at, 0, 64, 0, 0, 64, 3, 2)
    body = bytearray(elf + fatbin + names)
    body += bytes(headers_at - len(body))

    def section(name: int, kind: int, offset: int, size: int) -> bytes:
        return struct.pack("<IIQQQQIIQQ", name, kind, 0, 0, offset, size, 0, 0, 8, 0)

    strtab_name = 2 + len(section_name)
    body += section(0, 0, 0, 0) + section(1, 1, data_at, len(fatbin)) + section(strtab_name, 3, names_at, len(names))
    return bytes(body)


def _wheel(folder: Path) -> Path:
    wheel = folder / "onnxruntime_gpu-0-cp312-cp312-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("onnxruntime/__init__.py", "version = 0\n")
        archive.writestr(f"onnxruntime/capi/{CUDA_PROVIDER}", _shared_object(_fatbin()))
        archive.writestr("onnxruntime/capi/libonnxruntime.so", b"never loaded by the binding")
        archive.writestr("onnxruntime/transformers/fusion.py", "")
        archive.writestr("onnxruntime/tools/symbolic_shape_infer.py", "# kept: graphforge uses it\n")
        archive.writestr("onnxruntime_gpu-0.dist-info/METADATA", "")
    return wheel


def test_the_bundle_keeps_one_architecture_and_what_the_binding_loads(tmp_path):
    library = _shared_object(_fatbin())
    assert [(i.arch, i.size) for i in fatbin_images(library)] == [(90, len(SM90)), (80, len(SM80))]
    target = tmp_path / "ort.tar.xz"
    done = bundle(_wheel(tmp_path), target, arch=90)
    assert (done.kept, done.zeroed, done.zeroed_bytes) == (1, 1, len(SM80))
    with tarfile.open(target) as tar:
        names = sorted(tar.getnames())
        provider = tar.extractfile(f"onnxruntime/capi/{CUDA_PROVIDER}").read()
        mode = tar.getmember(f"onnxruntime/capi/{CUDA_PROVIDER}").mode
    assert names == [
        "onnxruntime/__init__.py",
        f"onnxruntime/capi/{CUDA_PROVIDER}",
        "onnxruntime/tools/symbolic_shape_infer.py",
    ]
    assert mode == 0o755 and len(provider) == len(library)
    kept, zeroed = fatbin_images(library)
    expected = bytearray(library)  # the library as it was, but for the other architecture's payload
    expected[zeroed.start : zeroed.start + zeroed.size] = bytes(zeroed.size)
    assert provider == bytes(expected) and provider[kept.start : kept.start + kept.size] == SM90


def test_a_library_without_a_fatbin_has_no_images():
    assert [i.arch for i in fatbin_images(_shared_object(_fatbin()))] == [90, 80]
    assert list(fatbin_images(_shared_object(_fatbin(), section_name=b".rodata"))) == []
