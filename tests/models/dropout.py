"""Models that draw random masks: a small GPT with dropout everywhere (torch.export), and a probe
whose loss and gradient each spell out the masks they were computed with (torch.fx)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.models.gpt import Block, TinyGPT


class DropoutBlock(Block):
    """The GPT block with dropout on the attention weights (SDPA's dropout_p) and on both residual branches."""

    def __init__(self, dim: int, heads: int, context: int, p: float):
        super().__init__(dim, heads, context)
        self.p = p
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        x = x + self.drop(self.proj(attn.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class DropoutGPT(TinyGPT):
    """TinyGPT (tied embedding and head) with dropout on the embeddings (F.dropout) and in every block."""

    def __init__(self, p: float = 0.1, layers: int = 4, context: int = 16, **kwargs):
        super().__init__(layers=layers, context=context, **kwargs)
        dim, heads = self.tok.embedding_dim, self.blocks[0].heads
        self.blocks = nn.ModuleList(DropoutBlock(dim, heads, context, p) for _ in range(layers))
        self.p = p

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = F.dropout(self.tok(idx) + self.pos(positions), self.p, self.training)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class MaskLayer(nn.Module):
    """mask(ones) * w[which]: w[j, n] = 2^(j*width + n), so with one sample per microbatch and p = 1/2
    (a kept entry is 2, a dropped one 0) the sum of the outputs holds every microbatch's mask in its
    bits, exactly, and the gradient of w row j is microbatch j's mask from the backward's graph."""

    def __init__(self, microbatches: int, width: int, draw: str):
        super().__init__()
        self.width, self.draw = width, draw
        self.w = nn.Parameter(2.0 ** torch.arange(microbatches * width, dtype=torch.float32).view(microbatches, width))
        self.drop = nn.Dropout(0.5)

    def forward(self, which: torch.Tensor) -> torch.Tensor:
        rows = self.w[which]
        ones = torch.ones_like(rows)
        mask = self.drop(ones) if self.draw == "dropout" else 2 * torch.bernoulli(ones * 0.5)
        return mask * rows


class Total(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum()


class MaskProbe(nn.Sequential):
    """Two layers: the masked product (a stage that recomputes under varuna) and the sum (the last stage).
    `draw`: "dropout" (nn.Dropout) or "bernoulli" (torch.bernoulli: an op drawn under the lock)."""

    def __init__(self, microbatches: int = 4, width: int = 5, draw: str = "dropout"):
        super().__init__(MaskLayer(microbatches, width, draw), Total())


class RandomLeaves(nn.Module):
    """torch.fx leaves that draw inside (Dropout1d, RReLU, MultiheadAttention with dropout) and a
    torch-level random function: each runs through `keyed` under the lock."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(dim, dim), nn.Dropout1d(0.2), nn.RReLU(), nn.Linear(dim, dim))
        self.attn = nn.MultiheadAttention(dim, 2, dropout=0.1, batch_first=True)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers(x)
        h = self.attn(h, h, h, need_weights=False)[0] + 0.1 * torch.rand_like(h)
        return self.head(h).sum()
