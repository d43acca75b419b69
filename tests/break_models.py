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


class CTCNet(torch.nn.Module):
    """A GRU over frames, log-probabilities over a small alphabet (blank = 0)."""

    def __init__(self, features: int = 16, hidden: int = 32, classes: int = 8):
        super().__init__()
        self.gru = torch.nn.GRU(features, hidden)
        self.head = torch.nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (T, N, features)
        return self.head(self.gru(x)[0]).log_softmax(-1)


class CTCHead(torch.nn.Module):
    """CTC loss computed on the host (CUDA's CTC backward has no deterministic kernel), the loss back
    on the model's device."""

    def forward(self, log_probs, targets, input_lengths, target_lengths):
        loss = F.ctc_loss(log_probs.cpu(), targets, input_lengths, target_lengths, zero_infinity=True)
        return loss.to(log_probs.device)


def ctc_batches(n: int, *, frames: int = 24, batch: int = 4, longest: int = 10, seed: int = 0) -> list:
    """Padded targets and lengths on the host; the lengths change every batch."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        targets = torch.randint(1, 8, (batch, longest), generator=g)
        target_lengths = torch.randint(3, longest + 1, (batch,), generator=g)
        input_lengths = torch.randint(frames - 6, frames + 1, (batch,), generator=g)
        out.append((torch.randn(frames, batch, 16, generator=g), targets, input_lengths, target_lengths))
    return out


def hungarian(cost):
    """Minimum-cost assignment of rows to columns, on the host (scipy where installed)."""
    try:
        from scipy.optimize import linear_sum_assignment
    except ImportError:
        import itertools

        rows = range(cost.shape[0])
        best = min(
            itertools.permutations(range(cost.shape[1]), cost.shape[0]),
            key=lambda cols: sum(cost[r][c] for r, c in zip(rows, cols)),
        )
        return list(rows), list(best)
    return linear_sum_assignment(cost)


class Matcher(torch.nn.Module):
    """DETR's Hungarian matcher: costs on the device, the assignment on the host, indices back."""

    @torch.no_grad()
    def forward(
        self, logits: torch.Tensor, boxes: torch.Tensor, labels: torch.Tensor, target_boxes: torch.Tensor
    ):
        prob = logits.softmax(-1)  # (B, Q, C)
        out = []
        for b in range(logits.shape[0]):
            c = -prob[b][:, labels[b]] + torch.cdist(boxes[b], target_boxes[b], p=1)  # (Q, T)
            rows, cols = hungarian(c.cpu().numpy())
            out.append((torch.as_tensor(rows, dtype=torch.int64), torch.as_tensor(cols, dtype=torch.int64)))
        return out


class SetCriterion(torch.nn.Module):
    """DETR's loss: match predictions to targets, then classification and box losses on the matched pairs."""

    def __init__(self, classes: int):
        super().__init__()
        self.matcher = Matcher()
        self.classes = classes

    def forward(self, logits, boxes, labels, target_boxes):
        indices = self.matcher(logits, boxes, labels, target_boxes)
        batch_idx = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)])
        src_idx = torch.cat([src for src, _ in indices])
        classes = torch.full(logits.shape[:2], self.classes, dtype=torch.int64, device=logits.device)
        classes[batch_idx, src_idx] = torch.cat([labels[i][tgt] for i, (_, tgt) in enumerate(indices)])
        loss_cls = F.cross_entropy(logits.flatten(0, 1), classes.flatten())
        matched = boxes[batch_idx, src_idx]
        wanted = torch.cat([target_boxes[i][tgt] for i, (_, tgt) in enumerate(indices)])
        return loss_cls + F.l1_loss(matched, wanted)


class TinyDETR(torch.nn.Module):
    def __init__(self, features: int = 16, queries: int = 6, classes: int = 3):
        super().__init__()
        self.queries = torch.nn.Parameter(torch.randn(queries, features))
        self.body = torch.nn.Linear(features, features)
        self.cls = torch.nn.Linear(features, classes + 1)
        self.box = torch.nn.Linear(features, 4)

    def forward(self, x: torch.Tensor):  # x: (B, features)
        h = torch.relu(self.body(x[:, None, :] + self.queries))
        return self.cls(h), self.box(h).sigmoid()


# -- shared data flow around a break: a tensor the segment uses, and the step uses outside it too ------


def _host_read(h: torch.Tensor) -> None:
    """A read on the host (what makes a capture stop here, and an automatic break of this module)."""
    torch.where(h[:, 0] > float("inf"))  # empty: changes nothing


class Mixer(torch.nn.Module):
    """Uses its input directly three times (two projections and a skip), so that its gradient is a sum
    of three contributions inside the module; `sync`: with a host read (an automatic break)."""

    def __init__(self, dim: int = 12, sync: bool = True):
        super().__init__()
        self.a = torch.nn.Linear(dim, dim)
        self.b = torch.nn.Linear(dim, dim)
        self.sync = sync

    def forward(self, h: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:  # h: (tokens, dim)
        if self.sync:
            _host_read(h)
        out = self.a(h) * torch.sigmoid(self.b(h)) + h * 0.5
        for e in extra:  # another tensor used twice inside: a second input of the same tensor, say
            out = out + e * h * 0.1 + torch.tanh(e)
        return out


class Scaled(torch.nn.Module):
    """Reads its own `scale` and takes a scale as an argument (the caller passes the same parameter)."""

    def __init__(self, dim: int = 12, sync: bool = True):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.logspace(1, -1, dim))
        self.sync = sync

    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.sync:
            _host_read(h)
        return h * scale + torch.tanh(h * self.scale)


class FloatNorm(torch.nn.LayerNorm):
    """LayerNorm in float32 under autocast on any device, as CUDA's autocast runs it (CPU's runs it in
    bfloat16): under autocast its result is a float32 activation that each Linear after it casts anew."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, self.weight, self.bias, self.eps)


class SharedNet(torch.nn.Module):
    """A break whose input the step uses outside it as well, in every arrangement the tests need:

    residual  `h = h + mix(h)` (pre-norm absent: the shared input itself);
    postnorm  `h = norm(h + mix(h))` (BERT's block);
    twice     `h = h + mix(h, h)`: one tensor passed twice;
    param     `h = norm(mix(h, scale)) * scale`: a parameter passed in, used twice inside and once after;
    chain     `h = h + mix2(mix(h), h)`: two breaks in a row, both reading `h`;
    reuse     `h = h + mix[0](h)` twice: one module's weights used by two calls of the break;
    passed    `h = norm(scaled(h, scaled.scale)) * scaled.scale`: a parameter the break reads itself
              and is passed too, and the step uses after it.
    Inputs are (tokens, dim): the linear layers take `h` itself, not a view of it. `stream32`: the
    residual stream is float32 under autocast too, so that the break's input is an activation that
    autocast casts to the low precision at each of its uses inside (postnorm's is, from its norm)."""

    def __init__(
        self,
        kind: str = "residual",
        dim: int = 12,
        layers: int = 2,
        sync: bool = True,
        stream32: bool = False,
    ):
        super().__init__()
        self.kind = kind
        self.stream32 = stream32
        self.inp = torch.nn.Linear(dim, dim)
        self.mix = torch.nn.ModuleList(Mixer(dim, sync) for _ in range(layers))
        self.mix2 = torch.nn.ModuleList(Mixer(dim, sync) for _ in range(layers if kind == "chain" else 0))
        self.norms = torch.nn.ModuleList(FloatNorm(dim) for _ in range(layers))
        self.scale = torch.nn.Parameter(torch.logspace(-1, 1, dim))
        self.scaled = Scaled(dim, sync)
        self.out = torch.nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h.float() if self.stream32 else h  # (no-op without autocast)
        for i, (mix, norm) in enumerate(zip(self.mix, self.norms)):
            if self.kind == "residual":
                h = h + mix(h)
            elif self.kind == "postnorm":
                h = norm(h + mix(h))
            elif self.kind == "twice":
                h = h + mix(h, h)
            elif self.kind == "param":
                h = norm(mix(h, self.scale)) * self.scale
            elif self.kind == "chain":
                h = h + self.mix2[i](mix(h), h)
            elif self.kind == "reuse":
                h = h + self.mix[0](h)
            elif self.kind == "passed":
                h = norm(self.scaled(h, self.scaled.scale)) * self.scaled.scale
        return self.out(h)


class TiedEmbedding(torch.nn.Module):
    """Looks its table up twice (a token and its neighbour), with a host read: the table's gradient
    gets two contributions inside the break."""

    def __init__(self, table: torch.nn.Embedding):
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: (tokens,)
        _host_read(ids[:, None].float())
        return self.table(ids) + 0.5 * self.table(ids.roll(1))


class TiedLM(torch.nn.Module):
    """A language model whose head is its embedding table (tied weights): the table is used inside the
    break (the lookups) and after it (the head)."""

    def __init__(self, vocab: int = 24, dim: int = 12):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.embed = TiedEmbedding(self.emb)
        self.mid = torch.nn.Linear(dim, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + torch.tanh(self.mid(h))
        return F.linear(h, self.emb.weight)  # logits through the same table


class Project(torch.nn.Module):
    """A linear layer applied twice (its weight cast twice under autocast), with a host read."""

    def __init__(self, dim: int = 12):
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        _host_read(h)
        return self.lin(h) + self.lin(h * 0.5)


class SharedWeightNet(torch.nn.Module):
    """The break's weight also used outside it, `where` ("before" or "after" the break): under
    autocast both uses cast the same parameter."""

    def __init__(self, where: str, dim: int = 12):
        super().__init__()
        self.where = where
        self.inp = torch.nn.Linear(dim, dim)
        self.project = Project(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.where == "before":
            h = F.linear(h, self.project.lin.weight)
        h = self.project(h)
        if self.where == "after":
            h = F.linear(h, self.project.lin.weight)
        return h.float().sum(-1, keepdim=True)
