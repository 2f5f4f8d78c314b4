"""A T5-shaped encoder-decoder: the encoder's output feeds every decoder layer (a long skip)."""

import torch
import torch.nn as nn


class EncoderLayer(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class DecoderLayer(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.cross = nn.Linear(dim, dim, bias=False)  # a bias here shifts softmax logits per row: dead
        self.ff = nn.Linear(dim, dim)

    def forward(self, y: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        context = torch.softmax(self.norm(y) @ self.cross(memory).transpose(1, 2), dim=-1) @ memory
        return y + torch.tanh(self.ff(context))


class EncoderDecoder(nn.Module):
    def __init__(self, vocab: int = 40, dim: int = 16, layers: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.ModuleList(EncoderLayer(dim) for _ in range(layers))
        self.decoder = nn.ModuleList(DecoderLayer(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        memory = self.embed(src)
        for layer in self.encoder:
            memory = layer(memory)
        y = self.embed(tgt_in)
        for layer in self.decoder:
            y = layer(y, memory)
        return self.head(y)
