"""How two tensors of one shape differ: max |a - b|, max relative difference, elements that differ.

A diff of two GPT-2-small checkpoints compares 124 M weights, all of them different, so this
is written for speed: the tensors are read where they lie (a memory map of the file, see
source.py), compared in cache-sized chunks in the tensors' own precision (float32 for
float32 and narrower floats, float64 for float64 and integers) with reused buffers, on a few
threads for large tensors. Only a chunk holding a NaN or an infinity, or whose float32
difference overflows, is redone the slow, exact way in float64. The two maxima are then
recomputed in float64 at the elements where they were found, so they equal an all-float64
computation's (up to which of two elements within float32 rounding of each other wins).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from graphforge.diff.result import ValueStats

#: elements per chunk: three float32 buffers of this size stay in a core's L2 cache
CHUNK = 1 << 15
#: tensors with at least this many elements are split across threads
PARALLEL_ELEMENTS = 1 << 21
_THREADS = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)))


def work_dtype(dtype: np.dtype) -> np.dtype | None:
    """The precision two tensors of ``dtype`` are compared in; None for non-numeric types."""
    if dtype.kind == "f":
        return np.dtype(np.float32) if dtype.itemsize <= 4 else np.dtype(np.float64)
    if dtype.kind in "iub":
        return np.dtype(np.float64)
    if dtype.kind == "c":
        return np.dtype(np.complex128)
    if dtype.kind == "V" and dtype.names is None and dtype.itemsize <= 2:  # ml_dtypes: bfloat16, float8, int4
        try:
            np.zeros(1, dtype).astype(np.float32)
        except (TypeError, ValueError):
            return None
        return np.dtype(np.float32)
    return None


def value_stats(x: np.ndarray, y: np.ndarray) -> ValueStats:
    """max |x - y|, max |x - y| / max(|x|, |y|) (0 where both are 0) and the count of
    differing elements; NaN equals NaN, a NaN against a number makes both maxima NaN.
    Non-numeric types (strings) get only the count: both maxima are None."""
    x, y = x.reshape(-1), y.reshape(-1)
    work_x, work_y = work_dtype(x.dtype), work_dtype(y.dtype)
    if work_x is None or work_y is None:
        return ValueStats(None, None, int(np.count_nonzero(x != y)), int(x.size))
    n = x.size
    if "c" in (work_x.kind, work_y.kind):
        return _combine([_exact_range(x, y, 0, n)], n)
    work = work_x if work_x == work_y else np.dtype(np.float64)
    if n < PARALLEL_ELEMENTS or _THREADS == 1:
        return _combine([_range(x, y, 0, n, work)], n)
    step = -(-n // (_THREADS * 4) // CHUNK) * CHUNK  # a few ranges per thread, whole chunks
    starts = range(0, n, step)
    with ThreadPoolExecutor(_THREADS) as pool:
        parts = list(pool.map(lambda s: _range(x, y, s, min(n, s + step), work), starts))
    return _combine(parts, n)


def _combine(parts: list[tuple[float, float, int]], n: int) -> ValueStats:
    max_abs = max((p[0] for p in parts), default=0.0)
    max_rel = max((p[1] for p in parts), default=0.0)
    if any(np.isnan(p[0]) for p in parts):
        max_abs = max_rel = float("nan")
    return ValueStats(float(max_abs), float(max_rel), sum(p[2] for p in parts), int(n))


def _range(x: np.ndarray, y: np.ndarray, start: int, end: int, work: np.dtype) -> tuple[float, float, int]:
    """(max abs, max rel, differing) over x[start:end], chunk by chunk, in ``work`` precision."""
    with np.errstate(all="ignore"):  # per thread: overflows and NaNs are handled below
        return _range_quiet(x, y, start, end, work)


def _range_quiet(x: np.ndarray, y: np.ndarray, start: int, end: int, work: np.dtype) -> tuple[float, float, int]:
    size = min(CHUNK, end - start)
    d = np.empty(size, work)
    s = np.empty(size, work)
    t = np.empty(size, work)
    tiny = np.finfo(work).smallest_subnormal
    max_abs = max_rel = 0.0
    differing = 0
    for lo in range(start, end, CHUNK):
        hi = min(end, lo + CHUNK)
        k = hi - lo
        xs, ys = x[lo:hi], y[lo:hi]
        dk, sk, tk = d[:k], s[:k], t[:k]
        np.subtract(xs, ys, out=dk, dtype=work, casting="unsafe")
        np.abs(dk, out=dk)
        i = int(dk.argmax())
        m = float(dk[i])
        if m == 0.0:
            continue  # equal (NaN-free: a NaN would be the maximum)
        if not np.isfinite(m):  # NaN, infinity, or an overflow in ``work``: the exact way
            part = _exact_range(xs, ys, 0, k)
            if np.isnan(part[0]):
                return part[0], part[1], differing + part[2] + _count_rest(x, y, hi, end)
            max_abs, max_rel, differing = max(max_abs, part[0]), max(max_rel, part[1]), differing + part[2]
            continue
        differing += int(np.count_nonzero(dk))
        np.abs(xs, out=sk, dtype=work, casting="unsafe")
        np.abs(ys, out=tk, dtype=work, casting="unsafe")
        np.maximum(sk, tk, out=sk)
        np.maximum(sk, tiny, out=sk)  # both 0: their difference is 0 too, and 0 / tiny is 0
        np.divide(dk, sk, out=sk)
        j = int(sk.argmax())
        # the maxima found in ``work`` precision, recomputed in float64 where they are
        max_abs = max(max_abs, _abs_diff(xs[i], ys[i]))
        max_rel = max(max_rel, _rel_diff(xs[j], ys[j]))
    return max_abs, max_rel, differing


def _abs_diff(a, b) -> float:
    return abs(float(a) - float(b))


def _rel_diff(a, b) -> float:
    a, b = float(a), float(b)
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale > 0 else 0.0


def _count_rest(x: np.ndarray, y: np.ndarray, start: int, end: int) -> int:
    """Differing elements of x[start:end] (NaN equal to NaN), once the maxima are known to be NaN."""
    count = 0
    for lo in range(start, end, CHUNK):
        xs, ys = x[lo : min(end, lo + CHUNK)], y[lo : min(end, lo + CHUNK)]
        equal = xs == ys
        if xs.dtype.kind in "fcV" or ys.dtype.kind in "fcV":
            equal |= _isnan(xs) & _isnan(ys)
        count += int(xs.size - np.count_nonzero(equal))
    return count


def _isnan(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind in "fc":
        return np.isnan(a)
    return np.isnan(a.astype(np.float32)) if a.dtype.kind == "V" else np.zeros(a.shape, bool)


def _exact_range(x: np.ndarray, y: np.ndarray, start: int, end: int) -> tuple[float, float, int]:
    """The reference computation, in float64 (complex128 for complex), chunk by chunk."""
    kind = np.complex128 if x.dtype.kind == "c" or y.dtype.kind == "c" else np.float64
    max_abs = max_rel = 0.0
    differing = 0
    for lo in range(start, end, CHUNK):
        hi = min(end, lo + CHUNK)
        xs, ys = x[lo:hi].astype(kind), y[lo:hi].astype(kind)
        equal = (xs == ys) | (np.isnan(xs) & np.isnan(ys))
        differing += int(xs.size - np.count_nonzero(equal))
        if equal.all():
            continue
        with np.errstate(invalid="ignore", over="ignore"):
            delta = np.abs(xs - ys)
        delta[equal] = 0.0
        if np.isnan(delta).any():
            return float("nan"), float("nan"), differing + _count_rest(x, y, hi, end)
        scale = np.maximum(np.abs(xs), np.abs(ys))
        with np.errstate(invalid="ignore", divide="ignore"):
            rel = np.where(scale > 0, delta / np.where(scale > 0, scale, 1.0), 0.0)
        max_abs, max_rel = max(max_abs, float(delta.max())), max(max_rel, float(rel.max()))
    return max_abs, max_rel, differing
