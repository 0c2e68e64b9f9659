"""The PyTorch front end: ``nn.Module`` in, graphforge program out (needs the torch extra,
``pip install graphforge[torch]``; importing ``graphforge`` alone never imports torch)."""

from graphforge.runtime.fused_update import FusedUpdate, use_fused_update
from graphforge.torch.export import export_for_training, train_program
from graphforge.torch.module import GraphforgeModule

__all__ = ["FusedUpdate", "GraphforgeModule", "export_for_training", "train_program", "use_fused_update"]
