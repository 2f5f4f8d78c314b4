"""A MobileNetV3-style network: inverted residuals with Hardswish(inplace=True) and
squeeze-excitation gated by Hardsigmoid(inplace=True), as torchvision's."""

import torch
import torch.nn as nn


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, squeezed: int):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeezed, 1)
        self.relu = nn.ReLU(inplace=True)
        self.fc2 = nn.Conv2d(squeezed, channels, 1)
        self.scale_activation = nn.Hardsigmoid(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale_activation(self.fc2(self.relu(self.fc1(self.avgpool(x)))))
        return scale * x


def conv_bn_act(inp: int, out: int, kernel: int, stride: int = 1, groups: int = 1, act: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(inp, out, kernel, stride, kernel // 2, groups=groups, bias=False),
                               nn.BatchNorm2d(out)]
    if act:
        layers.append(nn.Hardswish(inplace=True))
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """Expand (1x1), depthwise (3x3), squeeze-excite, project (1x1); a residual where the shape allows."""

    def __init__(self, inp: int, expanded: int, out: int, stride: int = 1):
        super().__init__()
        self.use_residual = stride == 1 and inp == out
        self.block = nn.Sequential(
            conv_bn_act(inp, expanded, 1),
            conv_bn_act(expanded, expanded, 3, stride, groups=expanded),
            SqueezeExcitation(expanded, max(expanded // 4, 2)),
            conv_bn_act(expanded, out, 1, act=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out + x if self.use_residual else out


class MobileNetV3Small(nn.Module):
    def __init__(self, width: int = 4, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            conv_bn_act(3, width, 3),
            InvertedResidual(width, 4 * width, width),
            InvertedResidual(width, 4 * width, 2 * width, stride=2),
            InvertedResidual(2 * width, 6 * width, 2 * width),
            conv_bn_act(2 * width, 6 * width, 1),
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(6 * width, 8 * width), nn.Hardswish(inplace=True),
                                        nn.Linear(8 * width, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        return self.classifier(torch.flatten(self.avgpool(x), 1))
