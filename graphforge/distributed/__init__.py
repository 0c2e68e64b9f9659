"""Data-parallel training on torch.distributed (torchrun; gloo on the CPU, NCCL on CUDA).

::

    # torchrun --standalone --nproc-per-node=2 my_training.py
    from graphforge.distributed import DataParallel, World
    world = World.join()                       # rank, world size and backend from torchrun
    module = Module("program.onnx", state)     # a program compiled with the allreduce pass
    DataParallel(module, world)                # rank 0's state everywhere; steps now reduce
    loss = module.train_step(**my_share_of_the_batch)

``graphforge train`` does this itself when torchrun starts it (graphforge/train/loop.py).
world.py joins the group and turns failed collectives into one-line errors naming the
ranks that are gone; data_parallel.py cuts the training step at the gradient buckets and
reduces them while backward goes on; zero.py shards the optimizer states and gradients
(ZeRO stages 1 and 2: ``ZeroDataParallel`` for a program compiled with the zero pass);
tensor_parallel.py sums across a tensor-parallel group where each member's program marks it
(``TensorParallel``); ``World.mesh(tensor=T)`` lays the processes out as data replicas of
tensor groups, each a World of its own (a member is then both: ``TensorParallel(module,
mesh.tensor)`` and ``DataParallel(module, mesh.data)``). Needs torch (``pip install graphforge[torch]``).
"""

from graphforge.distributed.data_parallel import CommStats, DataParallel
from graphforge.distributed.tensor_parallel import TensorParallel
from graphforge.distributed.world import DEFAULT_TIMEOUT_S, DistributedError, Mesh, World, digest, launched
from graphforge.distributed.zero_data_parallel import ZeroDataParallel

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "CommStats",
    "DataParallel",
    "DistributedError",
    "Mesh",
    "TensorParallel",
    "World",
    "ZeroDataParallel",
    "digest",
    "launched",
]
