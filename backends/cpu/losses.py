"""Advantages and losses: GRPO, PPO (clipped, with GAE and a value loss) and DAPO (decoupled
clip, token-level aggregation, overlong shaping), with a KL penalty to the reference."""
from __future__ import annotations

import torch


def group_advantages(rewards: list[float], group: int, estimator: str, normalize: bool,
                     masked: list[bool] | None = None) -> list[float]:
    """GRPO/DAPO: (r - group mean) / group std; RLOO: r - mean of the other samples. A masked
    sample (its score failed) is left out of its group's statistics and gets advantage 0."""
    masked = masked or [False] * len(rewards)
    out = []
    for start in range(0, len(rewards), group):
        scored = [i for i in range(start, min(start + group, len(rewards))) if not masked[i]]
        adv = dict(zip(scored, _advantages(torch.tensor([rewards[i] for i in scored], dtype=torch.float64),
                                           estimator, normalize).tolist())) if scored else {}
        out += [adv.get(i, 0.0) for i in range(start, min(start + group, len(rewards)))]
    return out


def _advantages(r: torch.Tensor, estimator: str, normalize: bool) -> torch.Tensor:
    if estimator == "rloo" and len(r) > 1:
        return r - (r.sum() - r) / (len(r) - 1)
    adv = r - r.mean()
    if normalize and len(r) > 1:
        adv = adv / (r.std() + 1e-6)
    return adv


def gae(reward: float, values: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """Token advantages and returns for one response whose reward arrives at its last token."""
    advantages, running = [0.0] * len(values), 0.0
    for t in reversed(range(len(values))):
        next_value = values[t + 1] if t + 1 < len(values) else 0.0
        delta = (reward if t == len(values) - 1 else 0.0) + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages, [a + v for a, v in zip(advantages, values)]


def overlong_penalty(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment: 0 up to max - buffer, then linearly down to -1 at max."""
    if buffer <= 0 or length <= max_tokens - buffer:
        return 0.0
    return max(-1.0, (max_tokens - buffer - length) / buffer)


def policy_loss(logp, old_logp, ref_logp, advantages, mask, loss: str, clip: float, clip_high: float,
                kl: float) -> tuple[torch.Tensor, dict]:
    """Summed (not averaged) loss of a micro-batch; the trainer divides by the step's sequence or
    token count before the optimizer step, so that accumulation over micro-batches is exact.
    All tensors are [B, T] over response tokens; mask is 1 on real tokens."""
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - clip, 1 + clip_high) * advantages)
    per_token = -surrogate
    if kl > 0 and ref_logp is not None:
        diff = ref_logp - logp
        per_token = per_token + kl * (torch.exp(diff) - diff - 1)  # k3 estimator, >= 0
    per_token = per_token * mask
    if loss == "grpo":  # a mean per sequence, summed over sequences
        total = (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    else:  # ppo and dapo: summed over tokens
        total = per_token.sum()
    clipped = ((ratio - 1).abs() > clip).float() * mask
    return total, {"clip_fraction": float(clipped.sum() / mask.sum().clamp(min=1))}
