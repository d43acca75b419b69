"""Models with a piece no CUDA graph can record, for the graph-break tests (CPU and GPU): a top-2
mixture of experts that dispatches tokens with `torch.where` (a size that depends on the data), with
dropout inside the experts and around the layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Experts(torch.nn.Module):
    """Top-k token dispatch: each expert runs on the tokens routed to it (`torch.where`: a host sync)."""

    def __init__(self, dim: int, hidden: int, n: int, dropout: float = 0.1):
        super().__init__()
        self.up = torch.nn.ModuleList(torch.nn.Linear(dim, hidden) for _ in range(n))
        self.down = torch.nn.ModuleList(torch.nn.Linear(hidden, dim) for _ in range(n))
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, top: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, (up, down) in enumerate(zip(self.up, self.down)):
            token, slot = torch.where(top == e)
            if token.numel() == 0:
                continue
            h = down(self.drop(F.gelu(up(x[token]))))
            out = out.index_add(0, token, h * weights[token, slot, None])
        return out


class MoE(torch.nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32, n: int = 4, k: int = 2):
        super().__init__()
        self.router = torch.nn.Linear(dim, n, bias=False)
        self.experts = Experts(dim, hidden, n)
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.router(x).softmax(-1)
        weights, top = probs.topk(self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return self.experts(x, top, weights).reshape(shape)


class MoENet(torch.nn.Module):
    """Embedding-free: in (B, T, dim) -> regression head, MoE in the middle, dropout around it."""

    def __init__(self, dim: int = 16, layers: int = 2):
        super().__init__()
        self.inp = torch.nn.Linear(dim, dim)
        self.blocks = torch.nn.ModuleList(MoE(dim) for _ in range(layers))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(dim) for _ in range(layers))
        self.drop = torch.nn.Dropout(0.1)
        self.out = torch.nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.inp(x))
        for norm, block in zip(self.norms, self.blocks):
            h = h + self.drop(block(norm(h)))
        return self.out(h)
