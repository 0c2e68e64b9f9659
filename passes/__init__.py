"""Every transformation graphforge ships, and the registry that names them.

The registry is an explicit list: what is registered does not depend on which modules
happen to have been imported.
"""

from graphforge.passes.allreduce import AllReduce
from graphforge.passes.autodiff import Autodiff, ExpandGradient, VectorJacobian
from graphforge.passes.cse import CommonSubexpressionElimination
from graphforge.passes.dce import DeadCodeElimination
from graphforge.passes.fold_constants import FoldConstants
from graphforge.passes.freeze import Freeze
from graphforge.passes.fusion import Fuse
from graphforge.passes.identity_elimination import IdentityElimination
from graphforge.passes.kv_cache import KvCache
from graphforge.passes.lora import Lora
from graphforge.passes.lora_merge import LoraMerge
from graphforge.passes.loss import Loss
from graphforge.passes.mixed_precision import MixedPrecision
from graphforge.passes.optimizers import SGD, Adam, AdamW, Lamb
from graphforge.passes.prune import Prune
from graphforge.passes.quantize_frozen import QuantizeFrozen
from graphforge.passes.recompute import Recompute
from graphforge.passes.specialize import Specialize
from graphforge.passes.stage_partition import StagePartition
from graphforge.passes.steps import Steps
from graphforge.passes.tensor_parallel import TensorParallel
from graphforge.passes.topo_sort import TopologicalSort
from graphforge.passes.zero import Zero

from graphforge.pass_infra import PassRegistry

REGISTRY = PassRegistry(
    [
        AllReduce,
        Autodiff,
        VectorJacobian,
        KvCache,
        Freeze,
        Lora,
        LoraMerge,
        QuantizeFrozen,
        Loss,
        SGD,
        Adam,
        AdamW,
        Lamb,
        MixedPrecision,
        StagePartition,
        Recompute,
        DeadCodeElimination,
        CommonSubexpressionElimination,
        ExpandGradient,
        FoldConstants,
        Fuse,
        IdentityElimination,
        TopologicalSort,
        Prune,
        Specialize,
        Steps,
        TensorParallel,
        Zero,
    ]
)

__all__ = [
    "REGISTRY",
    "SGD",
    "Adam",
    "AdamW",
    "AllReduce",
    "Autodiff",
    "CommonSubexpressionElimination",
    "DeadCodeElimination",
    "ExpandGradient",
    "FoldConstants",
    "Freeze",
    "Fuse",
    "IdentityElimination",
    "KvCache",
    "Lamb",
    "Lora",
    "LoraMerge",
    "Loss",
    "MixedPrecision",
    "Prune",
    "QuantizeFrozen",
    "Specialize",
    "StagePartition",
    "Steps",
    "TensorParallel",
    "TopologicalSort",
    "VectorJacobian",
    "Zero",
]
