"""A PPO-style update captured with graphstep: several minibatches and optimizer steps in one call.

    python examples/rl_ppo.py                        # CUDA if available, else CPU
    python examples/rl_ppo.py --device cpu --iters 6

An MLP policy (Gaussian actions) and value function. Each iteration collects a rollout from a toy
environment (a point pushed toward the origin, reward = -distance), computes advantages with GAE outside
the graph, then calls one captured `ppo_update`: `--epochs` passes over `--minibatches` minibatches, each
a clipped-surrogate + value + entropy loss, backward, gradient clipping and an Adam step. One call is
epochs x minibatches optimizer steps; the minibatch order is a device permutation drawn inside the
step, so a replay shuffles as eager would. The policy's distributions skip argument validation, a
host sync (see `ActorCritic.dist`). On CUDA the same training runs again without graphstep and
both update times are printed (skip with --no-compare).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

OBS, ACT = 8, 2


class ActorCritic(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.pi = nn.Sequential(
            nn.Linear(OBS, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, ACT)
        )
        self.v = nn.Sequential(
            nn.Linear(OBS, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1)
        )
        self.log_std = nn.Parameter(torch.full((ACT,), -0.5))

    def dist(self, obs: torch.Tensor) -> torch.distributions.Normal:  # obs: (N, OBS)
        # validate_args=False: torch.distributions checks every argument and sample on the host (a
        # GPU sync), which no CUDA graph can hold. Here the check cannot fail on a healthy run (the
        # mean comes from a Linear, the scale is exp(...) > 0); a diverged run shows NaN in the loss.
        return torch.distributions.Normal(self.pi(obs), self.log_std.exp(), validate_args=False)

    def value(self, obs: torch.Tensor) -> torch.Tensor:  # (N, OBS) -> (N,)
        return self.v(obs).squeeze(-1)


@torch.no_grad()
def rollout(policy: ActorCritic, obs: torch.Tensor, horizon: int, gamma: float = 0.99, lam: float = 0.95):
    """Steps a batch of toy environments; returns flat (obs, actions, old log-probs, advantages, returns)."""
    observations, actions, logps, rewards, values = [], [], [], [], []
    for _ in range(horizon):
        d = policy.dist(obs)
        a = d.sample()
        observations.append(obs)
        actions.append(a)
        logps.append(d.log_prob(a).sum(-1))
        values.append(policy.value(obs))
        obs = obs.clone()
        obs[:, :ACT] += 0.1 * a.clamp(-1, 1)
        rewards.append(-0.1 * obs[:, :ACT].norm(dim=-1))
    last_value = policy.value(obs)
    advantages, gae = [], torch.zeros_like(last_value)
    for t in reversed(range(horizon)):
        next_value = values[t + 1] if t + 1 < horizon else last_value
        gae = rewards[t] + gamma * next_value - values[t] + gamma * lam * gae
        advantages.append(gae)
    advantages = torch.stack(advantages[::-1])
    returns = advantages + torch.stack(values)
    flat = lambda xs: torch.stack(xs).flatten(0, 1)  # noqa: E731 (T, E, ...) -> (T*E, ...)
    return obs, (flat(observations), flat(actions), flat(logps), advantages.flatten(), returns.flatten())


def train(
    device: torch.device, iters: int, args: argparse.Namespace, *, captured: bool
) -> tuple[float, float]:
    """Returns (last update's mean loss, ms per update over the second half, rollouts excluded)."""
    import graphstep

    torch.manual_seed(0)
    policy = ActorCritic().to(device)
    opt = torch.optim.Adam(policy.parameters(), lr=3e-4)

    def ppo_update(obs, actions, old_logp, adv, returns):  # (N, OBS), (N, ACT), (N,), (N,), (N,)
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        n = obs.shape[0]
        size = n // args.minibatches
        losses = []
        for _ in range(args.epochs):
            order = torch.randperm(n, device=obs.device)  # drawn on the device: a replay reshuffles
            for k in range(args.minibatches):
                idx = order[k * size : (k + 1) * size]
                d = policy.dist(obs[idx])
                ratio = (d.log_prob(actions[idx]).sum(-1) - old_logp[idx]).exp()
                surrogate = torch.min(ratio * adv[idx], ratio.clamp(1 - args.clip, 1 + args.clip) * adv[idx])
                value_loss = (policy.value(obs[idx]) - returns[idx]).pow(2).mean()
                loss = -surrogate.mean() + 0.5 * value_loss - 0.01 * d.entropy().sum(-1).mean()
                loss.backward()
                nn.utils.clip_grad_norm_(policy.parameters(), 0.5)
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
        return torch.stack(losses).mean()

    if captured:
        ppo_update = graphstep.capture(ppo_update, model=policy, optimizer=opt)
    obs = torch.randn(args.envs, OBS, device=device)
    update_s, timed_from = 0.0, iters // 2
    for i in range(iters):
        obs, batch = rollout(policy, obs, args.horizon)
        _sync(device)
        t0 = time.perf_counter()
        loss = ppo_update(*batch)  # epochs x minibatches optimizer steps in one call
        _sync(device)
        if i >= timed_from:
            update_s += time.perf_counter() - t0
        print(f"{'graphstep' if captured else 'eager'} iter {i:3d}  loss {loss.item():+.4f}  "
              f"reward {-batch[0][:, :ACT].norm(dim=-1).mean().item():+.3f}")  # fmt: skip
    ms = update_s / max(1, iters - timed_from) * 1e3
    if captured:
        ppo_update.close()
    return loss.item(), ms


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", "--steps", type=int, default=30, help="rollout + update iterations")
    parser.add_argument("--envs", type=int, default=64)
    parser.add_argument("--horizon", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--minibatches", type=int, default=4)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-compare", action="store_true", help="on CUDA, skip the eager run")
    args = parser.parse_args()
    device = torch.device(args.device)
    loss, ms = train(device, args.iters, args, captured=True)
    print(f"graphstep: final loss {loss:+.4f}, {ms:.2f} ms per update")
    if device.type == "cuda" and not args.no_compare:
        eager_loss, eager_ms = train(device, args.iters, args, captured=False)
        print(
            f"eager:     final loss {eager_loss:+.4f}, {eager_ms:.2f} ms per update ({eager_ms / ms:.1f}x graphstep)"
        )


if __name__ == "__main__":
    main()
