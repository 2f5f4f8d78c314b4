"""The models and plans bench/simulator_accuracy.py measures: a TinyGPT, an MLP of uneven blocks, the
null model (compute at microseconds), and the plan lists (model x devices x schedule x microbatches).

Not a benchmark itself. The script imports it as `_accuracy_plans` (bench/ is on sys.path when a
script in it runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import tests_models


@dataclass
class Model:
    key: str
    title: str
    make: object  # () -> nn.Module
    inputs: tuple
    target: torch.Tensor
    loss_fn: object


def gpt_model(args) -> Model:
    gpt = tests_models()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))

    def make():
        torch.manual_seed(0)
        return gpt.TinyGPT(vocab=args.vocab, dim=args.dim, heads=4, layers=args.blocks, context=args.seq, tie=False)

    title = f"TinyGPT {args.blocks} blocks, d={args.dim}, vocab {args.vocab}, seq {args.seq}, batch {args.batch}"
    return Model("gpt", title, make, (ids[:, :-1],), ids[:, 1:], gpt.lm_loss)


def mlp_model(args) -> Model:
    g = torch.Generator().manual_seed(0)
    widths = [round(args.hidden * 10 ** float(torch.rand((), generator=g))) for _ in range(args.mlp_blocks)]
    x, y = torch.randn(args.mlp_batch, args.mlp_dim, generator=g), torch.randint(0, 10, (args.mlp_batch,), generator=g)

    def make():
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(args.mlp_dim, h), nn.GELU(), nn.Linear(h, args.mlp_dim)) for h in widths]
        return nn.Sequential(*blocks, nn.Linear(args.mlp_dim, 10))

    title = f"MLP {args.mlp_blocks} blocks d={args.mlp_dim}, hidden {min(widths)}..{max(widths)}, batch {args.mlp_batch}"
    return Model("mlp", title, make, (x,), y, F.cross_entropy)


def null_model(batch: int) -> Model:
    """Compute the profiler puts at microseconds: what is left of a step is the runtime's own cost."""
    x, y = torch.randn(batch, 4), torch.randn(batch, 4)

    def make():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(4, 4) for _ in range(16)])

    return Model("null", "16 x Linear(4, 4)", make, (x,), y, F.mse_loss)


PLANS = [  # (model, devices, schedule, microbatches)
    ("gpt", 2, "gpipe", 4), ("gpt", 2, "gpipe", 8), ("gpt", 2, "1f1b", 8), ("gpt", 2, "interleaved", 4),
    ("gpt", 2, "varuna", 8), ("gpt", 4, "gpipe", 8), ("gpt", 4, "1f1b", 8), ("gpt", 4, "interleaved", 8),
    ("mlp", 2, "gpipe", 4), ("mlp", 2, "1f1b", 8), ("mlp", 2, "varuna", 4), ("mlp", 4, "1f1b", 8),
]
QUICK_PLANS = [("gpt", 2, "gpipe", 4), ("gpt", 2, "1f1b", 8), ("mlp", 2, "varuna", 4), ("mlp", 4, "1f1b", 8)]
