"""A small transformer language model built from plain torch modules (attention written
out, so its scores are ordinary tensors), and a training step over it: the workload of
the sizing and lifetime tests and of docs/sizing.md's example."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) * (d // h) ** -0.5  # (b, h, t, t)
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(
        self, vocab: int = 256, d: int = 64, heads: int = 4, layers: int = 2, max_len: int = 512
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(max_len, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def training(seq: int = 64, optimizer: str = "adamw", seed: int = 0):
    """``(model, opt, step)``: ``step(batch_size, seq_len=seq)`` runs one training step
    on random tokens (made inside the step, so they count as the step's)."""
    torch.manual_seed(seed)
    model = TinyLM()
    if optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch_size: int, seq_len: int = seq) -> None:
        idx = torch.randint(0, 256, (batch_size, seq_len))
        tgt = torch.randint(0, 256, (batch_size, seq_len))
        opt.zero_grad(set_to_none=True)
        model(idx, tgt).backward()
        opt.step()

    return model, opt, step
