"""The PyTorch front end: ``nn.Module`` in, graphforge program out (needs the torch extra,
``pip install graphforge[torch]``; importing ``graphforge`` alone never imports torch)."""

from graphforge.torch.export import export_for_training, train_program
from graphforge.torch.module import GraphforgeModule

__all__ = ["GraphforgeModule", "export_for_training", "train_program"]
