"""GRPO's two pieces: group-relative advantages, and a token-level clipped policy-gradient loss
against the behaviour policy's logprobs (those the rollout returned)."""
from __future__ import annotations

import torch


def group_advantages(rewards: list[float], eps: float = 1e-4) -> list[float]:
    """(r - mean) / (std + eps) over one prompt's n samples: a group whose samples all earned the
    same reward teaches nothing (all zero)."""
    r = torch.tensor(rewards, dtype=torch.float64)
    if len(rewards) < 2:
        return [0.0] * len(rewards)
    return ((r - r.mean()) / (r.std(unbiased=False) + eps)).tolist()


def clipped_pg_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    clip: float = 0.2) -> tuple[torch.Tensor, dict]:
    """PPO's clipped surrogate, averaged over every response token of the batch (token level, as
    DAPO does, so long responses weigh by their tokens). `logp` [B, T] is the policy being trained,
    `old_logp` [B, T] the behaviour policy's (the engines' sampling logprobs; for a resumed partial,
    its first tokens came from older weights), `advantages` [B], `mask` [B, T] 1 on response tokens.
    Returns the loss and stats: the mean ratio and the share of tokens clipped."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    tokens = mask.sum().clamp(min=1)
    loss = -(surrogate * mask).sum() / tokens
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip).float()
        stats = {"ratio": float((ratio * mask).sum() / tokens), "clipped": float((clipped * mask).sum() / tokens)}
    return loss, stats
