"""A plain MLP: a Sequential chain, the simplest pipeline."""

import torch.nn as nn


def mlp(width: int = 16, depth: int = 6, classes: int = 5) -> nn.Sequential:
    layers = [nn.Linear(8, width), nn.Tanh()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)
