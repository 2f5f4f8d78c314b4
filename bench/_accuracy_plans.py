"""The models and plans bench/simulator_accuracy.py measures: the zoo of real models it sweeps over 1,
2 and 4 devices (Hugging Face GPT-2, Llama, BERT and T5 from tests/hf.py's small configs, a ResNet,
the tied GPT, an MLP, an encoder-decoder, MobileNetV3); for its diagnosis a TinyGPT, an MLP of uneven
blocks, the null model (compute at microseconds), and the plan lists (model x devices x schedule x
microbatches).

Not a benchmark itself. The script imports it as `_accuracy_plans` (bench/ is on sys.path when a
script in it runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    target: torch.Tensor | None
    loss_fn: object
    keywords: dict = field(default_factory=dict)  # a Hugging Face batch (the model computes its loss)

    @property
    def example(self):
        return self.keywords or self.inputs

    def step(self, pipe) -> None:
        if self.keywords:
            pipe.step(**self.keywords)
        else:
            pipe.step(*self.inputs, target=self.target)


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


def zoo(batch: int = 16) -> list[Model]:
    """The real models of the sweep, each at `batch` samples a step (at least 8, issue 24)."""
    gpt = tests_models()  # puts the repository root on sys.path for the imports below
    import tests.hf as hf  # noqa: PLC0415
    from tests.models import cnn, encdec, mlp, mobilenet  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (batch, 16), generator=g)
    lm = {"input_ids": ids, "labels": ids.clone()}
    tokens = torch.randint(0, 64, (batch, 17), generator=g)
    images = torch.randn(batch, 3, 16, 16, generator=g)
    classes = torch.randint(0, 10, (batch,), generator=g)
    src, tgt = torch.randint(0, 40, (batch, 12), generator=g), torch.randint(0, 40, (batch, 13), generator=g)

    def hf_model(key: str, title: str, make) -> Model:
        return Model(key, title, make, (), None, None, lm)

    def seeded(make):
        def made():
            torch.manual_seed(0)
            return make()
        return made

    return [
        hf_model("gpt2", "HF GPT-2, 4 layers, d=32 (tests/hf.py)", seeded(lambda: hf.gpt2(4))),
        hf_model("llama", "HF Llama, 4 layers, d=32, GQA (tests/hf.py)", seeded(lambda: hf.llama(4))),
        hf_model("bert", "HF BERT masked LM, 4 layers, d=32 (tests/hf.py)", seeded(lambda: hf.bert(4))),
        hf_model("t5", "HF T5, 2 + 2 layers, d=32 (tests/hf.py)", seeded(lambda: hf.t5(2))),
        Model("resnet", "ResNet, 4 residual blocks, 16 channels, 16x16 images", seeded(lambda: cnn.ResNet(16, 4)),
              (images,), classes, F.cross_entropy),
        Model("gpt-tied", "TinyGPT, 4 blocks, tied embedding and head", seeded(lambda: gpt.TinyGPT(dim=64)),
              (tokens[:, :-1],), tokens[:, 1:], gpt.lm_loss),
        Model("mlp", "MLP, 8 layers of width 256", seeded(lambda: mlp.mlp(width=256, depth=8, classes=10)),
              (torch.randn(batch, 8, generator=g),), classes, F.cross_entropy),
        Model("encdec", "encoder-decoder, 3 + 3 layers, d=32", seeded(lambda: encdec.EncoderDecoder(dim=32)),
              (src, tgt[:, :-1]), tgt[:, 1:], lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())),
        Model("mobilenet", "MobileNetV3-Small, width 4, 16x16 images", seeded(lambda: mobilenet.MobileNetV3Small()),
              (images,), classes, F.cross_entropy),
    ]
