"""A DenseNet-style network: dense layers (BN, ReLU(inplace=True), conv) whose outputs are
concatenated onto their inputs, and transitions between blocks, as torchvision's."""

import torch
import torch.nn as nn


class DenseLayer(nn.Module):
    def __init__(self, inp: int, growth: int, bottleneck: int = 2):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(inp)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(inp, bottleneck * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bottleneck * growth)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bottleneck * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(features, 1)
        return self.conv2(self.relu2(self.norm2(self.conv1(self.relu1(self.norm1(x))))))


class DenseBlock(nn.Module):
    def __init__(self, layers: int, inp: int, growth: int):
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(inp + i * growth, growth) for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, 1)


class Transition(nn.Sequential):
    def __init__(self, inp: int, out: int):
        super().__init__(nn.BatchNorm2d(inp), nn.ReLU(inplace=True), nn.Conv2d(inp, out, 1, bias=False),
                         nn.AvgPool2d(2))


class DenseNet(nn.Module):
    def __init__(self, growth: int = 4, stem: int = 8, classes: int = 10):
        super().__init__()
        mid = stem + 3 * growth
        self.features = nn.Sequential(
            nn.Conv2d(3, stem, 3, padding=1, bias=False),
            nn.BatchNorm2d(stem),
            nn.ReLU(inplace=True),
            DenseBlock(3, stem, growth),
            Transition(mid, mid // 2),
            DenseBlock(3, mid // 2, growth),
            nn.BatchNorm2d(mid // 2 + 3 * growth),
        )
        self.classifier = nn.Linear(mid // 2 + 3 * growth, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu_(self.features(x))
        return self.classifier(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))
