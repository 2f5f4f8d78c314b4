"""A model whose Python control flow depends on tensor values: neither fx nor export captures it."""

import torch
import torch.nn as nn


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.a(x).sum()
        return self.b(x).sum()
