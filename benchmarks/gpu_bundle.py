"""onnxruntime-gpu for one GPU architecture, small enough to carry to a GPU machine without a network.

The onnxruntime-gpu wheel is about 255 MB, nearly all of it the CUDA provider's kernels for
every architecture from sm_75 to sm_120. A cubin runs only on its own major architecture, so a
machine of one kind (an H100 or H200: sm_90) needs only its own. This writes the wheel's
``onnxruntime/`` package as an xz tarball in which

1. every kernel image in the CUDA provider's ``.nv_fatbin`` section that is not for ``arch`` has
   its payload zeroed in place (headers and the file's layout unchanged, so the library loads
   as it was built; zeros compress to nothing);
2. what the Python binding never loads is left out: the C API's ``libonnxruntime.so``, the
   TensorRT provider, and the ``transformers``, ``quantization`` and ``datasets`` packages
   (``tools`` stays: graphforge's shape relations use its symbolic shape inference).

A fatbin section is a run of containers (8-byte aligned): a 16-byte header (magic 0xBA55ED50,
version, header size, size of the entries), then entries, each a header (its kind, its own
size, its payload's size, and at byte 28 the architecture as 10 × major + minor) followed by
its payload. ``cuda_check.py --prepare`` downloads the wheel and calls ``bundle``.

    python benchmarks/gpu_bundle.py WHEEL OUT.tar.xz [--arch 90]
"""

from __future__ import annotations

import argparse
import io
import struct
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from elftools.elf.elffile import ELFFile

FATBIN_MAGIC = 0xBA55ED50
#: what the Python binding never loads
LEFT_OUT = (
    "onnxruntime/capi/libonnxruntime.so",
    "onnxruntime/capi/libonnxruntime_providers_tensorrt.so",
    "onnxruntime/transformers/",
    "onnxruntime/quantization/",
    "onnxruntime/datasets/",
)
CUDA_PROVIDER = "libonnxruntime_providers_cuda.so"


@dataclass(frozen=True)
class Image:
    """One kernel image of a fatbin: its architecture, and where its payload is in the file."""

    arch: int
    start: int
    size: int


@dataclass
class Bundled:
    """What ``bundle`` kept and zeroed."""

    kept: int = 0
    zeroed: int = 0
    zeroed_bytes: int = 0
    files: int = 0


def fatbin_images(library: bytes | bytearray) -> Iterator[Image]:
    """Every kernel image in ``library``'s (an ELF shared object's) ``.nv_fatbin`` section."""
    section = ELFFile(io.BytesIO(library)).get_section_by_name(".nv_fatbin")
    if section is None:
        return
    at, end = section["sh_offset"], section["sh_offset"] + section["sh_size"]
    while at + 16 <= end:
        magic, _, header, size = struct.unpack_from("<IHHQ", library, at)
        if magic != FATBIN_MAGIC:
            at += 8  # padding to the next container
            continue
        entry, container_end = at + header, at + header + size
        while entry < container_end:
            _, _, entry_header, payload = struct.unpack_from("<HHIQ", library, entry)
            if entry_header == 0:
                break
            (arch,) = struct.unpack_from("<I", library, entry + 28)
            yield Image(arch, entry + entry_header, payload)
            entry += entry_header + payload
        at = container_end


def keep_only(library: bytearray, arch: int) -> Bundled:
    """Zero the payload of every image in ``library`` that is not for ``arch``, in place."""
    done = Bundled()
    for image in list(fatbin_images(library)):
        if image.arch == arch:
            done.kept += 1
        else:
            library[image.start : image.start + image.size] = bytes(image.size)
            done.zeroed += 1
            done.zeroed_bytes += image.size
    return done


def bundle(wheel: Path, target: Path, arch: int = 90) -> Bundled:
    """Write ``target`` (.tar.xz): ``wheel``'s onnxruntime package for ``arch`` alone."""
    done = Bundled()
    with zipfile.ZipFile(wheel) as archive, tarfile.open(target, "w:xz", preset=9) as tar:
        for member in archive.infolist():
            name = member.filename
            if not name.startswith("onnxruntime/") or member.is_dir() or name.startswith(LEFT_OUT):
                continue
            data = bytearray(archive.read(member))
            if name.endswith(CUDA_PROVIDER):
                pruned = keep_only(data, arch)
                done.kept, done.zeroed, done.zeroed_bytes = pruned.kept, pruned.zeroed, pruned.zeroed_bytes
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o755 if ".so" in Path(name).name else 0o644
            tar.addfile(info, io.BytesIO(data))
            done.files += 1
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--arch", type=int, default=90, help="the architecture kept, 10 × major + minor (90: sm_90)")
    args = parser.parse_args(argv)
    done = bundle(args.wheel, args.target, args.arch)
    print(
        f"{args.target}: {args.target.stat().st_size / 2**20:.1f} MiB, {done.files} files; {CUDA_PROVIDER}: "
        f"{done.kept} sm_{args.arch} images kept, {done.zeroed} others zeroed ({done.zeroed_bytes / 2**20:.0f} MiB)"
    )
    if done.kept == 0:
        print(f"no sm_{args.arch} image in {CUDA_PROVIDER}: this bundle cannot run there", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
