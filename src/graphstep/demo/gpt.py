"""A small GPT for the demo, the benchmark and the GPU tests.

Embedding, pre-norm blocks of causal SDPA attention and a GELU MLP, LayerNorm, and a
cross-entropy loss: the shape of a real language model at a size where CPU launch
overhead, not GPU arithmetic, decides the step time.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 512
    """Number of token ids."""
    seq_len: int = 64
    """Longest sequence the position embedding covers."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability after attention and MLP (0 disables it)."""


TINY = GPTConfig()
"""Launch-bound: about 0.9M parameters, kernels far shorter than their launches."""

GPT2_SMALL = GPTConfig(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, n_embd=768)
"""GPT-2 small's shape (124M parameters), vocabulary padded to a multiple of 64."""


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc_out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, C)
        B, T, C = x.shape
        # qkv's output is laid out head by head, (head, q|k|v, head_dim), so a column-wise
        # tensor-parallel shard of it holds whole heads: the head count is read off the shard.
        qkv = self.qkv(self.ln1(x)).view(B, T, -1, 3, C // self.n_head)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))  # each (B, heads, T, head_dim)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(B, T, -1)))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = TINY):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:  # idx, targets: (B, T) int64
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, vocab)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def make_batches(
    cfg: GPTConfig, *, batch_size: int, n_batches: int, seed: int = 0, device: str | torch.device = "cpu"
) -> list[tuple[Tensor, Tensor]]:
    """Deterministic synthetic token data with learnable structure (next token = f(current))."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(cfg.vocab_size, generator=g)
    batches = []
    for _ in range(n_batches):
        x = torch.randint(cfg.vocab_size, (batch_size, cfg.seq_len), generator=g)
        y = perm[x]
        noise = torch.rand(x.shape, generator=g) < 0.1
        y = torch.where(noise, torch.randint(cfg.vocab_size, y.shape, generator=g), y)
        batches.append((x.to(device), y.to(device)))
    return batches
