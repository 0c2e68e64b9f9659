"""Rows of ``seq_len`` tokens cut from the token cache, and the batch arrays built from them.

A row holds pieces of samples: a piece is a run of one sample's tokens, and its positions
start at 0. The plan says which pieces each row holds:

1. ``text``, packed: the samples one after another, cut every ``seq_len`` tokens (as
   transformers' run_clm groups texts), so every row but the last is full and a sample may
   go on in the next row.
2. ``text``, not packed: each sample cut every ``seq_len`` tokens, one piece a row.
3. ``completions`` and ``chat``: each sample whole, cut to its first ``seq_len`` tokens (as
   MLX-LM and TRL truncate), several to a row in file order while the next one fits (packed),
   or one a row.

The arrays of a batch, built when the batch is taken (a file's rows are never all in memory):
``input_ids``; ``labels``, the next token of the same sample (``labels[t] = input_ids[t + 1]``,
so the loss compares the logits at t with them as they are, no shift), or the loss's ignore
index at a sample's last token, at a token not learned (the prompt, with data.mask_prompt) and
at padding: a label never crosses from one sample to the next; ``attention_mask``, 1 on tokens
and 0 on the padding at a row's end; ``position_ids``, counting from 0 in each piece;
``unshifted_labels``, the labels one place later (the ignore index first), as transformers'
models take ``labels`` when they shift them inside themselves (``input_ids`` where learned).

A causal model attends to every earlier token of its row: packed samples see the ones before
them in their row unless the model separates them itself. ``position_ids`` restart per
sample, but keep samples apart only in a model that builds its mask from them; a 2-D
``attention_mask`` marks padding, and cannot say which sample a token belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graphforge.train.text.cache import TokenCache

#: the arrays a text source offers, each [rows, seq_len] int64
ARRAYS = ("input_ids", "labels", "attention_mask", "position_ids", "unshifted_labels")


@dataclass(frozen=True)
class Plan:
    """Pieces of samples in rows: piece i is tokens starts[i] .. starts[i] + lengths[i] of the
    cache, of a sample ending at ends[i]; row r holds pieces rows[r] .. rows[r + 1] - 1."""

    starts: np.ndarray
    lengths: np.ndarray
    ends: np.ndarray
    rows: np.ndarray
    #: samples cut to seq_len (completions and chat), and samples left out: nothing to learn
    truncated: int = 0
    left_out: int = 0

    @property
    def count(self) -> int:
        return len(self.rows) - 1


def plan(cache: TokenCache, seq_len: int, *, fmt: str, pack: bool, learn_all: bool) -> Plan:
    """The rows of ``cache`` (see the module's docstring), without rows or samples that hold no
    label to learn (a batch of only those would have no loss)."""
    starts, lengths = cache.starts[:-1], np.diff(cache.starts)
    if fmt == "text":
        if pack:
            total = int(cache.starts[-1])
            cuts = np.union1d(starts, np.arange(0, total, seq_len))
            cuts = cuts[cuts < total]
            piece_lengths = np.diff(np.append(cuts, total))
            sample = np.searchsorted(cache.starts, cuts, side="right") - 1
            pieces = (cuts, piece_lengths, cache.starts[sample + 1])
            row_of = cuts // seq_len
        else:
            counts = -(-lengths // seq_len)
            first = np.repeat(starts, counts)
            within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
            begin = first + within * seq_len
            end = np.repeat(cache.starts[1:], counts)
            pieces = (begin, np.minimum(end - begin, seq_len), end)
            row_of = np.arange(len(begin))
        learned = _learnable(pieces, None)
        keep = np.bincount(row_of, learned, minlength=int(row_of[-1]) + 1 if len(row_of) else 0)[row_of] > 0
        row_of = np.unique(row_of[keep], return_inverse=True)[1]
        return _plan(tuple(p[keep] for p in pieces), row_of)
    learned = cache.targets.astype(np.int64) if not learn_all else np.maximum(lengths - 1, 0)
    cut = lengths > seq_len
    if cut.any():  # the targets within the first seq_len tokens (and the label after them)
        learned = learned.copy()
        pieces = (starts[cut], np.full(int(cut.sum()), seq_len), cache.starts[1:][cut])
        learned[cut] = _learnable(pieces, None if learn_all else cache.learned)
    keep = learned > 0
    begin, length, end = starts[keep], np.minimum(lengths[keep], seq_len), cache.starts[1:][keep]
    row_of = _next_fit(length, seq_len) if pack else np.arange(len(begin))
    return _plan((begin, length, end), row_of, truncated=int(cut.sum()), left_out=int((~keep).sum()))


def _learnable(pieces: tuple[np.ndarray, np.ndarray, np.ndarray], learned: np.ndarray | None) -> np.ndarray:
    """How many labels each piece holds: its positions whose next token is in the same sample
    (and, with ``learned``, one the model learns)."""
    begin, length, end = pieces
    within = np.minimum(length, end - begin - 1)
    if learned is None:
        return np.maximum(within, 0)
    return np.array([int(np.count_nonzero(learned[b + 1 : b + 1 + n])) for b, n in zip(begin, within, strict=True)])


def _next_fit(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """The row of each sample, in order: a new row when the next sample does not fit."""
    rows = np.empty(len(lengths), np.int64)
    row, fill = 0, 0
    for i, n in enumerate(lengths.tolist()):
        if fill + n > seq_len:
            row, fill = row + 1, 0
        rows[i], fill = row, fill + n
    return rows


def _plan(pieces, row_of: np.ndarray, **counts) -> Plan:
    begin, length, end = (np.asarray(p, np.int64) for p in pieces)
    count = int(row_of[-1]) + 1 if len(row_of) else 0
    rows = np.searchsorted(row_of, np.arange(count + 1))
    return Plan(begin, length, end, rows, **counts)


class Rows:
    """The batch arrays of a plan's rows, built from the cache for the rows asked for."""

    def __init__(
        self,
        cache: TokenCache,
        layout: Plan,
        seq_len: int,
        *,
        pad_id: int,
        ignore_index: int,
        learn_all: bool,
    ):
        self.cache, self.plan, self.seq_len = cache, layout, seq_len
        self.pad_id, self.ignore_index = pad_id, ignore_index
        self.learned = None if learn_all else cache.learned
        self._last: tuple[np.ndarray, dict[str, np.ndarray]] | None = None

    def __len__(self) -> int:
        return self.plan.count

    def build(self, index) -> dict[str, np.ndarray]:
        """The arrays of rows ``index`` (a slice or an array of row numbers); the last ones
        built are kept, since a batch asks for each array by itself."""
        wanted = np.arange(len(self))[index] if isinstance(index, slice) else np.asarray(index, np.int64)
        if self._last is not None and np.array_equal(self._last[0], wanted):
            return self._last[1]
        shape = (len(wanted), self.seq_len)
        out = {
            "input_ids": np.full(shape, self.pad_id, np.int64),
            "labels": np.full(shape, self.ignore_index, np.int64),
            "attention_mask": np.zeros(shape, np.int64),
            "position_ids": np.zeros(shape, np.int64),
        }
        tokens, plan = self.cache.tokens, self.plan
        for j, row in enumerate(wanted.tolist()):
            column = 0
            for p in range(plan.rows[row], plan.rows[row + 1]):
                begin, length, end = int(plan.starts[p]), int(plan.lengths[p]), int(plan.ends[p])
                span = slice(column, column + length)
                out["input_ids"][j, span] = tokens[begin : begin + length]
                out["attention_mask"][j, span] = 1
                out["position_ids"][j, span] = np.arange(length)
                after = slice(begin + 1, min(begin + 1 + length, end))  # the next tokens, within the sample
                labels = tokens[after].astype(np.int64)
                if self.learned is not None:
                    labels[self.learned[after] == 0] = self.ignore_index
                out["labels"][j, column : column + len(labels)] = labels
                column += length
        out["unshifted_labels"] = np.full(shape, self.ignore_index, np.int64)
        out["unshifted_labels"][:, 1:] = out["labels"][:, :-1]
        self._last = (wanted.copy(), out)
        return out

    def column(self, name: str) -> Column:
        return Column(self, name)


class Column:
    """One of the arrays, [rows, seq_len] int64, as data.py's sources index arrays: by a slice
    or an array of row numbers (built then, by :class:`Rows`)."""

    dtype = np.dtype(np.int64)
    ndim = 2

    def __init__(self, rows: Rows, name: str):
        self.rows, self.name = rows, name
        self.shape = (len(rows), rows.seq_len)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> np.ndarray:
        return self.rows.build(index)[self.name]
