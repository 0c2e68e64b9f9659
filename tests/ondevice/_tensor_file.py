"""Arrays in one file, as graphforge's JavaScript drivers read them (js/test/driver/steps.mjs,
benchmarks/js/sides.mjs): their bytes one after another, each 8-byte aligned, and for each its
name, dtype, shape, offset and size."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np


def write_tensors(path: Path, groups: Iterable[Iterable[tuple[str, np.ndarray]]]) -> list[list[dict]]:
    """Write each group's (name, array) pairs into ``path``; where each array is, by group."""
    blob, index = bytearray(), []
    for group in groups:
        entries = []
        for name, value in group:
            value = np.ascontiguousarray(value)
            entries.append(
                {
                    "name": name,
                    "dtype": value.dtype.name,
                    "shape": list(value.shape),
                    "offset": len(blob),
                    "bytes": value.nbytes,
                }
            )
            blob += value.tobytes()
            blob += bytes(-len(blob) % 8)  # the next array aligned
        index.append(entries)
    path.write_bytes(bytes(blob))
    return index
