"""Each replica's share of the data, as PyTorch's DistributedSampler: the global batch of a
step is the same set of samples for any number of replicas, split every N-th sample; a
partial last batch padded from the epoch's start; evaluation split without duplicates."""

from __future__ import annotations

import numpy as np
import pytest

from graphforge.errors import ConfigError
from graphforge.program import BatchInput
from graphforge.train.data import ArraySource, Conformer, IterableSource, Shard, Stream, open_source

SAMPLES = 37


def arrays(count: int = SAMPLES) -> dict[str, np.ndarray]:
    return {"x": np.arange(count, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)}


def source(replicas: int, index: int, *, batch_size: int = 4, drop_last: bool = False, pad: bool = True) -> ArraySource:
    return ArraySource(
        arrays(),
        {},
        batch_size=batch_size,
        shuffle=True,
        seed=5,
        drop_last=drop_last,
        label="test",
        shard=Shard(replicas, index),
        pad=pad,
    )


def ids(batch) -> list[int]:
    return [int(v) for v in batch["x"][:, 0]]


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_the_global_batch_of_each_step_is_the_same_samples_for_any_number_of_replicas(replicas):
    one = source(1, 0, batch_size=4 * replicas)
    shares = [source(replicas, r) for r in range(replicas)]
    assert all(s.batches_per_epoch == one.batches_per_epoch == -(-SAMPLES // (4 * replicas)) for s in shares)
    for epoch in (0, 1):
        whole = list(one.epoch(epoch))
        parts = [list(s.epoch(epoch)) for s in shares]
        for b, batch in enumerate(whole[:-1]):  # the full batches: rank r takes every N-th sample, from the r-th
            for r in range(replicas):
                assert ids(parts[r][b]) == ids(batch)[r::replicas]
        last = ids(whole[-1])
        sizes = {len(ids(p[-1])) for p in parts}
        assert sizes == {-(-len(last) // replicas)}  # every replica the same count: padded
        got = [i for p in parts for i in ids(p[-1])]
        assert set(last) <= set(got) and len(got) - len(last) < replicas
        first = ids(whole[0])
        assert set(got) - set(last) <= set(first)  # the padding: the epoch's first samples


def test_drop_last_drops_the_partial_global_batch_and_resuming_mid_epoch_keeps_the_order():
    shares = [source(2, r, drop_last=True) for r in range(2)]
    assert shares[0].batches_per_epoch == SAMPLES // 8
    full = [ids(b) for b in shares[1].epoch(0)]
    resumed = Stream(shares[1], {"epoch": 0, "batch": 2})
    assert [ids(resumed.next()) for _ in range(len(full) - 2)] == full[2:]
    assert resumed.position == {"epoch": 1, "batch": 0}


def test_evaluation_splits_without_duplicates_and_skips_empty_parts():
    parts = [[i for b in source(4, r, batch_size=10, pad=False).epoch(0) for i in ids(b)] for r in range(4)]
    together = sorted(i for p in parts for i in p)
    assert together == list(range(SAMPLES))
    last_batch = [list(source(4, r, batch_size=10, pad=False).epoch(0))[-1] for r in range(4)]
    assert all(len(ids(b)) > 0 for b in last_batch)


def test_too_few_samples_for_one_global_batch_is_refused(tmp_path):
    conformer = Conformer([BatchInput("x", np.dtype(np.float32), ("N", 2), False)], "cfg: data.train", print)
    path = tmp_path / "train.npz"
    np.savez(path, **arrays(10))
    kwargs = {"names": {}, "batch_size": 8, "shuffle": False, "seed": 0, "drop_last": True}
    assert open_source(path, conformer, **kwargs).batches_per_epoch == 1
    with pytest.raises(ConfigError, match=r"10 samples make no batch of data\.batch_size = 8 on each of 2 processes"):
        open_source(path, conformer, shard=Shard(2, 0), **kwargs)


def test_a_python_source_gives_replica_r_batches_r_r_plus_n_and_drops_an_incomplete_group():
    batches = [{"x": np.full((3, 2), i, np.float32)} for i in range(11)]
    conformer = Conformer([BatchInput("x", np.dtype(np.float32), ("N", 2), False)], "cfg: data.train", print)
    shares = [IterableSource(lambda: batches, conformer, "gen", Shard(3, r)) for r in range(3)]
    assert [s.count_batches() for s in shares] == [3, 3, 3]  # 11 batches: 3 groups of 3, 2 left out
    for r, share in enumerate(shares):
        assert [int(b["x"][0, 0]) for b in share.epoch(0)] == [r, r + 3, r + 6]
        assert [int(b["x"][0, 0]) for b in share.epoch(0, start=2)] == [r + 6]
