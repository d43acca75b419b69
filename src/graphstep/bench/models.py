"""`graphstep bench --suite models`: real models no one here wrote, from configs with random weights.

| config | model | batch | optimizer, scheduler |
|---|---|---|---|
| resnet50 | torchvision ResNet-50, channels_last | 32 × 3 × 224² | SGD(momentum 0.9) + OneCycleLR |
| vit_s16 | timm ViT-S/16 | 32 × 3 × 224² | AdamW + cosine, clip 1.0 |
| bert_base | transformers BERT-base, masked LM | 16 × 128 | AdamW + linear warm-up, clip 1.0 |
| llama_125m | transformers Llama, 12 × 768, 127M | 4 × 1024 | AdamW + cosine with warm-up, clip 1.0 |
| mixtral_moe | transformers Mixtral, 4 × 256, 8 experts (top 2), `"eager"` experts + auxiliary loss | 8 × 128 | AdamW + cosine with warm-up, clip 1.0 |
| mixtral_moe_grouped_mm | the same, `"grouped_mm"` experts | 8 × 128 | AdamW + cosine with warm-up, clip 1.0 |
| mixtral_moe_batched_mm | the same, `"batched_mm"` experts | 8 × 128 | AdamW + cosine with warm-up, clip 1.0 |
| ppo_mlp | 3-layer MLP policy + value net | 4 minibatches × 512 per call | Adam + linear decay, clip 0.5 |
| gcn | torch_geometric 2-layer GCN, 20k nodes | full graph | Adam |

All with bf16 autocast. Each builder imports its package first (`need`) and raises `PackageMissing`
when it cannot; nothing optional is imported at module level. `ctx.tiny` gives sizes for CPU tests.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .workloads import BenchConfig, BuildContext, Workload, need, version_of

N_BATCHES = 4
SCHEDULE_MARGIN = 16
"""Schedulers are sized for more steps than the run makes: OneCycleLR raises past its total."""


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _images(
    ctx: BuildContext, batch: int, res: int, classes: int, *, channels_last: bool
) -> list[tuple[Tensor, Tensor]]:
    g = _generator()
    out = []
    layout = torch.channels_last if channels_last else torch.contiguous_format
    for _ in range(N_BATCHES):
        x = torch.randn(batch, 3, res, res, generator=g).to(ctx.device, memory_format=layout)
        out.append((x, torch.randint(classes, (batch,), generator=g).to(ctx.device)))
    return out


def _classifier_step(ctx: BuildContext, opt: torch.optim.Optimizer, params: list, clip: float | None):
    def make_step(forward):
        def train_step(x: Tensor, y: Tensor) -> Tensor:  # x: (B, 3, H, W), y: (B,)
            with ctx.autocast():
                loss = F.cross_entropy(forward(x), y)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return train_step

    return make_step


# ---------------------------------------------------------------- vision


def resnet50(ctx: BuildContext) -> Workload:
    tv = need("torchvision")
    batch, res, classes = (2, 32, 10) if ctx.tiny else (32, 224, 1000)
    torch.manual_seed(0)
    with ctx.device:
        if ctx.tiny:  # ResNet-50's code (Bottleneck blocks), one block per stage, narrow
            resnet = tv.models.resnet
            model = resnet.ResNet(resnet.Bottleneck, [1, 1, 1, 1], num_classes=classes, width_per_group=8)
        else:
            model = tv.models.resnet50(num_classes=classes)
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, **ctx.fused())
    # OneCycleLR also cycles SGD's momentum (a Python number): graphstep moves SGD to an eager
    # segment the first time it changes (Config.optimizer_mode="auto"), once.
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=ctx.n_calls + SCHEDULE_MARGIN)
    return Workload(
        model=model, optimizer=opt, scheduler=sched, batches=_images(ctx, batch, res, classes, channels_last=True),
        make_step=_classifier_step(ctx, opt, list(model.parameters()), clip=None),
        details=dict(batch=f"{batch}×3×{res}×{res} channels_last", classes=classes,
                     optimizer="SGD(lr=0.1, momentum=0.9, weight_decay=1e-4)",
                     scheduler="OneCycleLR(max_lr=0.1), cycles momentum too", clip=None,
                     package=f"torchvision {version_of(tv)}"),
    )  # fmt: skip


def vit_s16(ctx: BuildContext) -> Workload:
    timm = need("timm")
    batch, res, classes = (2, 32, 10) if ctx.tiny else (32, 224, 1000)
    extra = dict(img_size=32, depth=2) if ctx.tiny else {}
    torch.manual_seed(0)
    with ctx.device:
        model = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=classes, **extra)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05, **ctx.fused())
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=ctx.n_calls + SCHEDULE_MARGIN)
    return Workload(
        model=model, optimizer=opt, scheduler=sched, batches=_images(ctx, batch, res, classes, channels_last=False),
        make_step=_classifier_step(ctx, opt, list(model.parameters()), clip=1.0),
        details=dict(batch=f"{batch}×3×{res}×{res}", classes=classes,
                     optimizer="AdamW(lr=1e-3, weight_decay=0.05)", scheduler="CosineAnnealingLR", clip=1.0,
                     package=f"timm {version_of(timm)}"),
    )  # fmt: skip


# ---------------------------------------------------------------- transformers


def _hf_step(ctx: BuildContext, opt: torch.optim.Optimizer, params: list):
    def make_step(forward):
        def train_step(
            input_ids: Tensor, attention_mask: Tensor | None, labels: Tensor
        ) -> Tensor:  # (B, T) each
            with ctx.autocast():
                loss = forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return train_step

    return make_step


def bert_base(ctx: BuildContext) -> Workload:
    transformers = need("transformers")
    if ctx.tiny:
        cfg = transformers.BertConfig(
            vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=64,
        )  # fmt: skip
        batch, seq = 2, 16
    else:
        cfg = transformers.BertConfig()  # bert-base: 12 layers, 768 wide, 12 heads, 30522 tokens
        batch, seq = 16, 128
    torch.manual_seed(0)
    with ctx.device:
        model = transformers.BertForMaskedLM(cfg)
    model.train()  # from_config models start in eval mode in some transformers releases
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, **ctx.fused())
    sched = transformers.get_linear_schedule_with_warmup(
        opt, num_warmup_steps=max(1, ctx.n_calls // 10), num_training_steps=ctx.n_calls + SCHEDULE_MARGIN
    )
    g = _generator()
    batches = []
    for _ in range(N_BATCHES):
        ids = torch.randint(cfg.vocab_size, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.int64)
        mask[: batch // 2, seq - seq // 4 :] = 0  # padding at the end of half the rows
        masked = (torch.rand(batch, seq, generator=g) < 0.15) & mask.bool()  # the 15% of MLM
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        batches.append((ids.to(ctx.device), mask.to(ctx.device), labels.to(ctx.device)))
    return Workload(
        model=model, optimizer=opt, scheduler=sched, batches=batches,
        make_step=_hf_step(ctx, opt, list(model.parameters())),
        details=dict(batch=f"{batch}×{seq} tokens, half the rows padded by a quarter, 15% masked",
                     optimizer="AdamW(lr=1e-4, weight_decay=0.01)",
                     scheduler="transformers.get_linear_schedule_with_warmup (10% warm-up)", clip=1.0,
                     attention=getattr(model.config, "_attn_implementation", None),
                     package=f"transformers {version_of(transformers)}"),
    )  # fmt: skip


def llama_125m(ctx: BuildContext) -> Workload:
    transformers = need("transformers")
    if ctx.tiny:
        shape = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
        batch, seq = 2, 16
    else:
        # 12 × 768 (GPT-2 small's shape) with a SwiGLU MLP of 1792: 127M parameters, head untied.
        shape = dict(vocab_size=32000, hidden_size=768, intermediate_size=1792, num_hidden_layers=12,
                     num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024)  # fmt: skip
        batch, seq = 4, 1024
    cfg = transformers.LlamaConfig(**shape, use_cache=False)  # training: no KV cache
    return _causal_lm(ctx, transformers, transformers.LlamaForCausalLM, cfg, batch, seq,
                      dict(batch=f"{batch}×{seq} tokens, no padding", shape=shape))  # fmt: skip


def _causal_lm(ctx: BuildContext, transformers: Any, model_class: Any, cfg: Any, batch: int, seq: int,
               details: dict) -> Workload:  # fmt: skip
    """A transformers causal LM on packed random tokens (no padding mask; labels shift inside), AdamW +
    cosine with warm-up, clip 1.0."""
    torch.manual_seed(0)
    with ctx.device:
        model = model_class(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, **ctx.fused())
    sched = transformers.get_cosine_schedule_with_warmup(
        opt, num_warmup_steps=max(1, ctx.n_calls // 10), num_training_steps=ctx.n_calls + SCHEDULE_MARGIN
    )
    g = _generator()
    batches = []
    for _ in range(N_BATCHES):
        ids = torch.randint(cfg.vocab_size, (batch, seq), generator=g).to(ctx.device)
        batches.append((ids, None, ids))
    return Workload(
        model=model, optimizer=opt, scheduler=sched, batches=batches,
        make_step=_hf_step(ctx, opt, list(model.parameters())),
        details=dict(**details, optimizer="AdamW(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)",
                     scheduler="transformers.get_cosine_schedule_with_warmup (10% warm-up)", clip=1.0,
                     attention=getattr(model.config, "_attn_implementation", None),
                     package=f"transformers {version_of(transformers)}"),
    )  # fmt: skip


def mixtral_moe(ctx: BuildContext, experts: str = "eager") -> Workload:
    """A mixture of experts in one of transformers' experts backends, with the auxiliary loss. Where a
    capture stops on CUDA (benchmarks/results/cpu_2026-11-27_moe-break-causes.md): `"eager"` experts
    dispatch tokens with `nonzero` (the experts module breaks); `"grouped_mm"` with these float32 weights
    takes torch's grouped-matmul fallback, which reads the offsets on the host (`_grouped_mm` breaks);
    `"batched_mm"` nowhere. The auxiliary loss: nowhere (`histc` in transformers 5.24; 5.17's
    `bincount` given its length is counted on the device while graphstep captures)."""
    transformers = need("transformers")
    shape = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                 max_position_embeddings=256)  # fmt: skip
    batch, seq = 8, 128
    if ctx.tiny:
        shape.update(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_local_experts=4
        )
        batch, seq = 2, 16
    cfg = transformers.MixtralConfig(
        **shape, use_cache=False, output_router_logits=True, router_aux_loss_coef=0.02,
        experts_implementation=experts,
    )  # fmt: skip
    return _causal_lm(ctx, transformers, transformers.MixtralForCausalLM, cfg, batch, seq,
                      dict(batch=f"{batch}×{seq} tokens", shape=shape, experts=experts, aux_loss=0.02))  # fmt: skip


def mixtral_moe_grouped_mm(ctx: BuildContext) -> Workload:
    return mixtral_moe(ctx, experts="grouped_mm")


def mixtral_moe_batched_mm(ctx: BuildContext) -> Workload:
    return mixtral_moe(ctx, experts="batched_mm")


# ---------------------------------------------------------------- reinforcement learning


def _mlp(n_in: int, hidden: int, n_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, n_out)
    )


class PPOAgent(nn.Module):
    """A Gaussian policy and a value net, 3 linear layers each (CleanRL's continuous-action agent)."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int):
        super().__init__()
        self.policy = _mlp(obs_dim, hidden, act_dim)
        self.value = _mlp(obs_dim, hidden, 1)
        self.log_std = nn.Parameter(torch.zeros(act_dim))

    def forward(self, obs: Tensor, act: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # obs (B, O), act (B, A)
        mean = self.policy(obs).float()
        log_std = self.log_std.expand_as(mean)
        # The Normal distribution written out: torch.distributions validates its arguments on the host.
        logp = (-0.5 * ((act - mean) / log_std.exp()) ** 2 - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        entropy = (0.5 + 0.5 * math.log(2 * math.pi) + log_std).sum(-1)
        return logp, entropy, self.value(obs).float().squeeze(-1)


def ppo_mlp(ctx: BuildContext) -> Workload:
    obs_dim, act_dim = 64, 8
    hidden, minibatch, n_mb = (32, 16, 4) if ctx.tiny else (256, 512, 4)
    torch.manual_seed(0)
    with ctx.device:
        model = PPOAgent(obs_dim, act_dim, hidden)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=3e-4, eps=1e-5, **ctx.fused())
    sched = torch.optim.lr_scheduler.LinearLR(
        opt, start_factor=1.0, end_factor=0.1, total_iters=ctx.n_calls + SCHEDULE_MARGIN
    )

    def make_step(forward):
        def ppo_update(obs: Tensor, act: Tensor, old_logp: Tensor, adv: Tensor, ret: Tensor) -> Tensor:
            # obs (M, B, O), act (M, B, A), old_logp/adv/ret (M, B): M minibatches, shuffled by the loop
            total = torch.zeros((), device=obs.device)
            for i in range(obs.shape[0]):
                with ctx.autocast():
                    logp, entropy, value = forward(obs[i], act[i])
                ratio = (logp - old_logp[i]).exp()
                a = (adv[i] - adv[i].mean()) / (adv[i].std() + 1e-8)
                pg_loss = torch.max(-a * ratio, -a * ratio.clamp(0.8, 1.2)).mean()
                v_loss = 0.5 * (value - ret[i]).pow(2).mean()
                loss = pg_loss + 0.5 * v_loss - 0.01 * entropy.mean()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 0.5)
                opt.step()
                opt.zero_grad(set_to_none=True)
                total = total + loss.detach()
            return total / obs.shape[0]

        return ppo_update

    g = _generator()
    batches = []
    for _ in range(N_BATCHES):
        obs = torch.randn(n_mb, minibatch, obs_dim, generator=g)
        act = torch.randn(n_mb, minibatch, act_dim, generator=g)
        old_logp = -0.5 * act.pow(2).sum(-1) - act_dim * 0.5 * math.log(2 * math.pi)  # under N(0, 1)
        adv, ret = torch.randn(n_mb, minibatch, generator=g), torch.randn(n_mb, minibatch, generator=g)
        batches.append(tuple(t.to(ctx.device) for t in (obs, act, old_logp, adv, ret)))
    return Workload(
        model=model, optimizer=opt, scheduler=sched, batches=batches, make_step=make_step,
        details=dict(batch=f"{n_mb} minibatches × {minibatch} transitions per call (clipped PPO loss, "
                     f"value loss, entropy bonus; a backward and an optimizer step per minibatch)",
                     obs_dim=obs_dim, act_dim=act_dim, hidden=hidden,
                     optimizer="Adam(lr=3e-4, eps=1e-5)", scheduler="LinearLR(1.0 -> 0.1)", clip=0.5),
    )  # fmt: skip


# ---------------------------------------------------------------- graphs


def gcn(ctx: BuildContext) -> Workload:
    pyg_nn = need("torch_geometric.nn")
    pyg = need("torch_geometric")
    nodes, degree, feats, hidden, classes = (64, 4, 8, 16, 4) if ctx.tiny else (20_000, 10, 128, 256, 40)

    class GCN(nn.Module):
        def __init__(self):
            super().__init__()
            # cached: the normalised adjacency is computed once (warm-up) and reused, as PyG's
            # transductive examples do; computing it uses boolean masks, which sync with the host.
            self.conv1 = pyg_nn.GCNConv(feats, hidden, cached=True)
            self.conv2 = pyg_nn.GCNConv(hidden, classes, cached=True)

        def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:  # x (N, F), edge_index (2, E)
            x = F.dropout(x, 0.5, self.training)
            x = self.conv1(x, edge_index).relu()
            x = F.dropout(x, 0.5, self.training)
            return self.conv2(x, edge_index)

    torch.manual_seed(0)
    with ctx.device:
        model = GCN()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4, **ctx.fused())

    def make_step(forward):
        def train_step(x: Tensor, edge_index: Tensor, train_idx: Tensor, y: Tensor) -> Tensor:
            with ctx.autocast():
                out = forward(x, edge_index)  # (N, classes)
            loss = F.cross_entropy(out[train_idx].float(), y[train_idx])  # index tensor: no host sync
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return train_step

    g = _generator()
    src = torch.randint(nodes, (nodes * degree,), generator=g)
    dst = torch.randint(nodes, (nodes * degree,), generator=g)
    edge_index = torch.stack([torch.cat([src, dst]), torch.cat([dst, src])])  # undirected: both ways
    x = torch.randn(nodes, feats, generator=g)
    y = torch.randint(classes, (nodes,), generator=g)
    train_idx = torch.randperm(nodes, generator=g)[: nodes // 2]
    batch = tuple(t.to(ctx.device) for t in (x, edge_index, train_idx, y))
    return Workload(
        model=model, optimizer=opt, batches=[batch], make_step=make_step,
        details=dict(batch=f"full graph: {nodes} nodes, {edge_index.shape[1]} directed edges, {feats} features, "
                     f"{classes} classes, half the nodes labelled", hidden=hidden, dropout=0.5,
                     optimizer="Adam(lr=0.01, weight_decay=5e-4)", scheduler=None, clip=None,
                     package=f"torch_geometric {version_of(pyg)}"),
    )  # fmt: skip


MODEL_CONFIGS = {
    c.name: c
    for c in (
        BenchConfig(name="resnet50", label="ResNet-50 (torchvision, 25.6M, batch 32×224²)", build=resnet50,
                    packages=("torchvision",)),
        BenchConfig(name="vit_s16", label="ViT-S/16 (timm, 22M, batch 32×224²)", build=vit_s16, packages=("timm",)),
        BenchConfig(name="bert_base", label="BERT-base MLM (transformers, 110M, batch 16×128)", build=bert_base,
                    packages=("transformers",)),
        BenchConfig(name="llama_125m", label="Llama-style decoder (transformers, 127M, batch 4×1024)",
                    build=llama_125m, packages=("transformers",)),
        BenchConfig(name="mixtral_moe", label="Mixtral-style MoE (transformers, eager experts + aux loss)",
                    build=mixtral_moe, packages=("transformers",)),
        BenchConfig(name="mixtral_moe_grouped_mm",
                    label="Mixtral-style MoE (transformers, grouped_mm experts + aux loss)",
                    build=mixtral_moe_grouped_mm, packages=("transformers",)),
        BenchConfig(name="mixtral_moe_batched_mm",
                    label="Mixtral-style MoE (transformers, batched_mm experts + aux loss)",
                    build=mixtral_moe_batched_mm, packages=("transformers",)),
        BenchConfig(name="ppo_mlp", label="PPO update, MLP policy + value (4 minibatches × 512)", build=ppo_mlp),
        BenchConfig(name="gcn", label="GCN, 2 layers (torch_geometric, 20k nodes)", build=gcn,
                    packages=("torch_geometric",)),
    )
}  # fmt: skip
