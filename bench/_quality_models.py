"""The three models bench/plan_quality.py partitions: TinyGPT with an untied head, an MLP of uneven
blocks, and a VGG-style convnet whose FLOPs fall with depth while its parameters rise.

Not a benchmark itself. The script imports it as `_quality_models` (bench/ is on sys.path when a
script in it runs).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import Case, tests_models


def gpt_case(args) -> Case:
    gpt = tests_models()
    torch.manual_seed(0)
    model = gpt.TinyGPT(vocab=args.vocab, dim=args.dim, heads=4, layers=args.blocks, context=args.seq, tie=False)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
    title = (f"gpt: TinyGPT {args.blocks} blocks, d={args.dim}, vocab {args.vocab} (untied head), seq {args.seq}, "
             f"batch {args.batch}")
    return Case("gpt", title, model, (ids[:, :-1],), ids[:, 1:], gpt.lm_loss)


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def mlp_widths(args) -> list[int]:
    g = torch.Generator().manual_seed(0)
    return [round(args.hidden * 10 ** float(torch.rand((), generator=g))) for _ in range(args.mlp_blocks)]


def mlp_case(args) -> Case:
    torch.manual_seed(0)
    widths = mlp_widths(args)
    model = nn.Sequential(*[MLPBlock(args.mlp_dim, h) for h in widths], nn.Linear(args.mlp_dim, 10))
    x = torch.randn(args.mlp_batch, args.mlp_dim)
    y = torch.randint(0, 10, (args.mlp_batch,))
    title = (f"mlp: {args.mlp_blocks} blocks Linear({args.mlp_dim}, h) -> GELU -> Linear(h, {args.mlp_dim}), "
             f"h in [{min(widths)}, {max(widths)}] (FLOPs {max(widths) / min(widths):.1f}x apart), batch {args.mlp_batch}")
    return Case("mlp", title, model, (x,), y, F.cross_entropy)


class ConvBlock(nn.Module):
    """3x3 convolution + ReLU (VGG without BatchNorm); stride 2 halves the resolution."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride=stride, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


def cnn_shapes(args) -> list[tuple[int, int, int]]:
    """(in channels, out channels, output resolution) of every conv block, the stem first: level l
    runs at size / 2^l with round(width * growth^l) channels, and its first block does the halving."""
    shapes, cin = [], 3
    for level, blocks in enumerate(int(b) for b in args.cnn_blocks.split(",")):
        cout, res = round(args.cnn_width * args.cnn_growth**level), args.cnn_size >> level
        for _ in range(blocks):
            shapes.append((cin, cout, res))
            cin = cout
    return shapes


def cnn_case(args) -> Case:
    torch.manual_seed(0)
    shapes = cnn_shapes(args)
    strides = [2 if i and res < shapes[i - 1][2] else 1 for i, (_, _, res) in enumerate(shapes)]
    _, last, res = shapes[-1]
    head = nn.Sequential(nn.Flatten(), nn.Linear(last * res * res, args.cnn_fc), nn.ReLU(), nn.Linear(args.cnn_fc, 10))
    model = nn.Sequential(*[ConvBlock(cin, cout, s) for (cin, cout, _), s in zip(shapes, strides, strict=True)], head)
    x = torch.randn(args.cnn_batch, 3, args.cnn_size, args.cnn_size)
    y = torch.randint(0, 10, (args.cnn_batch,))
    # multiply-adds per sample and parameters per layer (the conv blocks, then the head)
    macs = [cin * cout * 9 * r * r for cin, cout, r in shapes] + [sum(p.numel() for p in head.parameters())]
    params = [sum(p.numel() for p in layer.parameters()) for layer in model]
    top = int(args.cnn_blocks.split(",")[0])  # the blocks at full resolution, the stem included

    def spread(xs: list[int]) -> float:
        return max(xs) / min(xs)

    def share(xs: list[int], part: slice) -> str:
        return f"{sum(xs[part]) / sum(xs):.0%}"

    channels = "/".join(dict.fromkeys(str(cout) for _, cout, _ in shapes))
    title = (f"cnn: VGG-style, {args.cnn_blocks} blocks 3x3 conv + ReLU per level, {args.cnn_size}->{res} px, channels "
             f"{channels} (x{args.cnn_growth:.3g} per halving), FC {last * res * res}->{args.cnn_fc}->10, batch "
             f"{args.cnn_batch}. Blocks after the stem: FLOPs {spread(macs[1:-1]):.0f}x apart (max/min), params "
             f"{spread(params[1:-1]):.0f}x apart the other way; {args.cnn_size} px level: {share(macs, slice(top))} of "
             f"FLOPs, {share(params, slice(top))} of params; FC head: {share(macs, slice(-1, None))} of FLOPs, "
             f"{share(params, slice(-1, None))} of params")
    return Case("cnn", title, model, (x,), y, F.cross_entropy)
