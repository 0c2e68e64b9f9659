"""Modules both front-end test files train (graphforge.torch's wrapper and train_program)."""

from __future__ import annotations

import torch


class RMSNormNet(torch.nn.Module):
    """A Llama-style block: RMSNorm, which TorchScript's exporter has no symbolic for (the
    dynamo exporter has)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.up, self.norm, self.head = torch.nn.Linear(8, 16), torch.nn.RMSNorm(16), torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.nn.functional.silu(self.norm(self.up(x))))
