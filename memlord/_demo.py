"""The demo that ``python -m memlord`` runs: a small transformer-like model built while
lifetime tracking is on, cast to bfloat16 with the torch move hooks on, then half of its
blocks dropped.

It lives apart from ``__main__`` so that call sites treat it, and only it, as user code:
its lines are the sites the demo prints, while ``python -m memlord run``'s own frames
stay memlord's (a storage that dies after the profiled script ended has no user site).
"""

from __future__ import annotations

import gc
import platform
from typing import cast

import torch
from torch import nn

from . import MemLord, __version__, format_bytes


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = torch.softmax((q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5, dim=-1)
        return cast(torch.Tensor, self.out((att @ v).reshape(b, t, d)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return cast(torch.Tensor, x + self.mlp(self.ln2(x)))


class TinyLM(nn.Module):
    """Embedding, blocks, and a head tied to the embedding (counted once)."""

    def __init__(self, vocab: int = 2048, dim: int = 128, layers: int = 4, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return cast(torch.Tensor, self.head(self.ln_f(x)))


def param_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def show(title: str, lord: MemLord) -> None:
    raw, human = lord.allocated()
    print(f"{title:<44} allocated {human:>10}   freed {lord.freed()[1]:>10}")


def demo(layers: int) -> int:
    print(f"memlord {__version__} | torch {torch.__version__} | Python {platform.python_version()}")
    lord = MemLord(auto_gc_bytes="auto")
    threshold = lord.auto_gc_bytes
    print(f"auto-GC threshold: {format_bytes(threshold) if threshold else 'off (no CUDA device)'}")
    print()

    with lord.hook_into_python():
        model = TinyLM(layers=layers)
        show(f"built TinyLM ({layers} blocks, tied head)", lord)
        expected = param_bytes(model)
        print(f"{'  parameters and buffers in the model':<44} {format_bytes(expected):>20}")

        with lord.hook_into_torch():
            model.to(torch.bfloat16)
        show("cast to bfloat16 (torch hooks)", lord)

        tokens = torch.randint(0, 2048, (2, 16))
        with torch.no_grad():
            logits = model(tokens)
        del logits, tokens
        del model.blocks[layers // 2 :]
        gc.collect()
        show(f"dropped blocks {layers // 2}..{layers - 1}", lord)
        print(
            f"{'  parameters and buffers still alive':<44} {format_bytes(param_bytes(model)):>20}"
        )

    # Explicit accounting, no hooks: a KV cache allocated and freed by hand.
    kv_cache = (torch.zeros(2, 4, 64, 32), torch.zeros(2, 4, 64, 32))
    lord.allocate(kv_cache)
    show("allocated a KV cache with lord.allocate()", lord)
    lord.free(kv_cache)
    show("freed it with lord.free()", lord)

    print()
    print(repr(lord))
    print()
    for name, site in (
        ("top allocation site", lord.top_alloc_site()),
        ("top free site", lord.top_free_site()),
    ):
        if site is not None:
            device, where, nbytes = site
            print(f"{name + ':':<22} {where}  on {device}  ({format_bytes(nbytes)})")
    del model
    gc.collect()
    print()
    print("Reports of your own script (JSON, Perfetto trace, HTML; HTML needs memlord[report]):")
    print("  python -m memlord run --html report.html --json profile.json your_script.py")
    return 0
