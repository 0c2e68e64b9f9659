"""One rank of DistributedDataParallel over GraphforgeModule (gloo): half of each batch, five
AdamW steps; rank 0 saves the parameters to argv[1] and every rank its own to argv[1].rank<N>."""

import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from graphforge.torch import GraphforgeModule


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    model = DistributedDataParallel(GraphforgeModule(net, fallback="error"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rng = np.random.default_rng(1)
    for _ in range(5):
        x, y = rng.standard_normal((8, 8)).astype(np.float32), rng.integers(0, 3, 8)
        part = slice(rank * 8 // world, (rank + 1) * 8 // world)
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x[part])), torch.from_numpy(y[part]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    np.savez(f"{out}.rank{rank}", **{n: p.detach().numpy() for n, p in net.named_parameters()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
