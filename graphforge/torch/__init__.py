"""The PyTorch front end: ``nn.Module`` in, graphforge program out (needs the torch extra,
``pip install graphforge[torch]``; importing ``graphforge`` alone never imports torch)."""

from graphforge.torch.export import export_for_training, train_program

__all__ = ["export_for_training", "train_program"]
