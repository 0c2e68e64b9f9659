"""DistributedDataParallel over GraphforgeModule, 2 real gloo processes: each rank trains on
half of every batch; the parameters equal one plain torch process on the whole batches (DDP
averages the gradients, as the mean loss over the whole batch does)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _launch import run_ranks

torch = pytest.importorskip("torch")

WORKER = Path(__file__).parent / "_ddp_graphforge_module.py"


def test_ddp_of_two_ranks_equals_one_process_on_the_whole_batch(tmp_path):
    out = tmp_path / "params"
    finished = run_ranks(2, [str(WORKER), str(out)], timeout=180)
    for done in finished:
        assert done.returncode == 0, done.output[-3000:]
    ranks = [dict(np.load(f"{out}.rank{r}.npz")) for r in (0, 1)]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    rng = np.random.default_rng(1)
    for _ in range(5):
        x, y = rng.standard_normal((8, 8)).astype(np.float32), rng.integers(0, 3, 8)
        loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for name, value in net.named_parameters():
        np.testing.assert_array_equal(ranks[0][name], ranks[1][name])  # DDP keeps the replicas equal
        np.testing.assert_allclose(ranks[0][name], value.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
