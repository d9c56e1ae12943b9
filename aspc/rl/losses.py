"""Advantages and losses: GRPO, PPO (clipped, dual-clipped, with GAE and a clipped value loss), DAPO
(decoupled clip, token-level aggregation, overlong shaping) and GSPO's sequence ratio, a KL penalty
to the reference (k1, k2, k3), an entropy bonus, and off-policy correction of stale samples
(truncated importance sampling, or AReaL's decoupled objective with a proximal policy); the
correction of the engine/trainer mismatch is aspc/rl/mismatch.py's.

Each loss here is a micro-batch *sum*; `step_divisor` is what the trainer divides the step's summed
gradients by, so that accumulation over micro-batches and streamed units is exact.
tests/test_losses_reference.py checks every function against the TRL / verl formula it follows."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import torch

LOG_RATIO_BOUND = 20.0  # verl compute_policy_loss_vanilla: log(pi / pi_old) clamped to +-20 before exp
K3_BOUND = 10.0  # verl kl_penalty_forward ("low_var_kl", "k3"): log(ref / pi) clamped to +-20, k3 to +-10
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
OFF_POLICY = ("clip", "tis", "decoupled")
KL_ESTIMATORS = ("k1", "k2", "k3", "k3_plus")  # verl kl_penalty's "k1", "k2", "low_var_kl", "k3+"
GSPO_LOG_RATIO_MAX = 10.0  # verl compute_policy_loss_gspo: the sequence log-ratio clamped above at 10
# The train options the IR leaves out at their defaults (aspc/frontend/schema.py says the same;
# tests/test_off_policy.py checks that both agree). loss_agg: None = by loss (default_aggregation).
class LossDefaults(TypedDict):
    loss_agg: str | None
    off_policy: str
    is_cap: float
    value_clip: float
    kl_estimator: str
    dual_clip: float
    ratio: str
    mismatch: str
    mismatch_cap: float
    mismatch_floor: float
    kl_reward: float
    routing_replay: str


LOSS_DEFAULTS: LossDefaults = {"loss_agg": None, "off_policy": "clip", "is_cap": 2.0, "value_clip": 0.0,
                               "kl_estimator": "k3", "dual_clip": 3.0, "ratio": "token", "mismatch": "none",
                               "mismatch_cap": 2.0, "mismatch_floor": 0.5, "kl_reward": 0.0, "routing_replay": "none"}


class NonFiniteError(ValueError):
    """A reward, advantage, loss or gradient is NaN or infinite: the step stops before the optimizer
    changes any weight. The message names the source (a reward function, a stage) and the sample
    where known, and what to do. A ValueError, so that a backend reports it as a user error."""


def default_aggregation(loss: str) -> str:
    """GRPO: a mean per sequence, then over sequences; PPO and DAPO: a mean over the step's tokens."""
    return "seq_mean_token_mean" if loss == "grpo" else "token_mean"


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
    if estimator == "rloo" and len(r) > 1:  # never scaled: the front end refuses normalize = true
        return r - (r.sum() - r) / (len(r) - 1)
    adv = r - r.mean()
    if normalize and len(r) > 1:
        adv = adv / (r.std() + 1e-6)
    return adv


def gae(reward: float, values: list[float], gamma: float, lam: float,
        token_rewards: list[float] | None = None) -> tuple[list[float], list[float]]:
    """Token advantages and returns for one response whose reward arrives at its last token, plus
    `token_rewards` at each token (KL in the reward: kl_rewards)."""
    advantages, running = [0.0] * len(values), 0.0
    for t in reversed(range(len(values))):
        next_value = values[t + 1] if t + 1 < len(values) else 0.0
        here = (reward if t == len(values) - 1 else 0.0) + (token_rewards[t] if token_rewards else 0.0)
        delta = here + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages, [a + v for a, v in zip(advantages, values)]


def kl_rewards(logp: list[float], ref_logp: list[float], coef: float, mask: list[int] | None = None) -> list[float]:
    """The KL in the reward, per token: -coef (log pi - log ref), k1 (verl compute_rewards, its
    use_kl_in_reward's default kl_penalty = kl), 0 where `mask` is 0 (tool tokens)."""
    mask = mask or [1] * len(logp)
    return [-coef * (p - q) * m for p, q, m in zip(logp, ref_logp, mask)]


def whiten(advantages: list[list[float]], skip: list[bool]) -> list[list[float]]:
    """GAE advantages whitened over the tokens trained together (verl masked_whiten: mean 0,
    unbiased variance 1); rows in `skip` (failed scores) keep their zeros and stay out of the
    statistics."""
    pooled = torch.tensor([a for row, s in zip(advantages, skip) if not s for a in row], dtype=torch.float64)
    if len(pooled) < 2:
        return advantages
    mean, scale = pooled.mean(), torch.rsqrt(pooled.var() + 1e-8)
    return [row if s else ((torch.tensor(row, dtype=torch.float64) - mean) * scale).tolist()
            for row, s in zip(advantages, skip)]


def overlong_penalty(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment: 0 up to max - buffer, then linearly down to -1 at max."""
    if buffer <= 0 or length <= max_tokens - buffer:
        return 0.0
    return max(-1.0, (max_tokens - buffer - length) / buffer)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str,
              segments: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> torch.Tensor:
    """The micro-batch's share of the step loss before `step_divisor` (verl agg_loss's numerator):
    seq_mean_token_mean sums each sequence's token mean; the others sum the tokens. A row is one
    sequence, or with `segments` (packed rows: the sequence index of each position, [R, T]) the
    means are over each row's sequences, exactly as if they were unpacked. `counts` ([R, T]: the
    tokens the loss counts in each position's whole sequence) is for a rank that holds part of each
    sequence (context parallelism): its share of every sequence's mean."""
    masked = per_token * mask
    if aggregation != "seq_mean_token_mean":
        return masked.sum()
    if counts is not None:
        return (masked / counts.clamp(min=1)).sum()
    if segments is None:
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    sums, tokens, _ = sequence_totals(per_token, mask, segments)
    return (sums / tokens.clamp(min=1)).sum()


def sequence_totals(values: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor | None = None) -> tuple:
    """Per sequence, the sum of `values * mask` and of `mask` ([sequences]), and each position's
    sequence index ([rows * positions]): a row is one sequence, or with `segments` (packed rows: the
    sequence index of each position, [R, T]) its sequences apart from another row's."""
    rows = torch.arange(len(values), device=values.device)[:, None]
    if segments is None:
        ids, count = rows.expand(values.shape).flatten(), len(values)
    else:
        ids = (segments + rows * (int(segments.max()) + 1)).flatten()
        count = int(ids.max()) + 1
    sums = torch.zeros(count, dtype=values.dtype, device=values.device).index_add(0, ids, (values * mask).flatten())
    tokens = torch.zeros(count, dtype=mask.dtype, device=mask.device).index_add(0, ids, mask.flatten())
    return sums, tokens, ids


def sequence_sums(values: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor | None = None) -> tuple:
    """At each position, the sum of `values * mask` over its sequence, and the sequence's masked tokens."""
    sums, tokens, ids = sequence_totals(values, mask, segments)
    return sums[ids].view_as(values), tokens[ids].view_as(values)


def step_divisor(aggregation: str, sequences: int, tokens: int, max_tokens: int) -> float:
    """What the step's summed loss is divided by: its tokens (token_mean), its sequences, or its
    sequences times the response budget (seq_mean_token_sum_norm, Dr. GRPO's constant)."""
    if aggregation == "token_mean":
        return max(tokens, 1)
    if aggregation == "seq_mean_token_sum_norm":
        return max(sequences, 1) * max_tokens
    return max(sequences, 1)


@dataclass(frozen=True)
class Correction:
    """How one micro-batch is corrected for the policy that generated it."""

    old_logp: torch.Tensor  # the ratio's denominator: the rollout policy (clip) or the proximal one
    weights: torch.Tensor | None  # per-token importance weights on the surrogate (detached), or None
    raw: torch.Tensor  # pi_proximal / pi_rollout per token, before any cap (for metrics)
    capped: torch.Tensor  # 1 where the cap truncated (tis) or dropped (decoupled) the weight


def off_policy_correction(proximal: torch.Tensor, rollout: torch.Tensor, mode: str, cap: float) -> Correction:
    """`proximal`: the log-probs of the policy at the start of the train step (detached); `rollout`:
    those recorded at generation. clip: the clipped ratio against the rollout policy (verl bypass
    mode, PPO-clip: importance sampling inside PPO's trust region); tis: the
    ratio against the proximal policy times min(w, cap) (verl rollout_is = token, TRL
    vllm_importance_sampling_mode = token_truncate); decoupled: the same ratio times w, tokens with
    w > cap dropped (AReaL ppo_actor_loss_fn, rejection with action = mask)."""
    raw = torch.exp(torch.clamp(proximal - rollout, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    if mode == "clip":
        return Correction(rollout, None, raw, torch.zeros_like(raw))
    capped = (raw > cap).float()
    weights = torch.clamp(raw, max=cap) if mode == "tis" else raw * (1 - capped)
    return Correction(proximal, weights, raw, capped)


@dataclass(frozen=True)
class Surrogate:
    """The surrogate's form beyond its clip range (the train stage's options; LOSS_DEFAULTS)."""

    dual_clip: float = LOSS_DEFAULTS["dual_clip"]  # 0: off; else the bound on -A r for A < 0 (> 1)
    ratio: str = LOSS_DEFAULTS["ratio"]  # token (PPO) | sequence (GSPO)
    kl_estimator: str = LOSS_DEFAULTS["kl_estimator"]


def policy_loss(logp, old_logp, ref_logp, advantages, mask, loss: str, clip: float, clip_high: float,
                kl: float, aggregation: str | None = None, weights=None, segments=None,
                counts=None, surrogate: Surrogate | None = None) -> tuple[torch.Tensor, dict]:
    """Summed (not averaged) clipped-surrogate loss of a micro-batch, with the KL penalty; the
    trainer divides by `step_divisor`. All tensors are [B, T] over response tokens; mask is 1 on
    real tokens; `weights` (off-policy and mismatch corrections) multiply the surrogate, not the KL
    term; `segments`, `counts`: packed rows' sequence indices, a sequence's counted tokens (aggregate);
    `surrogate`: dual-clip, token or sequence ratio, KL estimator. Trainers call it through
    objective.micro_batch_loss."""
    form = surrogate or Surrogate()
    ratio = (sequence_ratio(logp, old_logp, mask, segments) if form.ratio == "sequence"
             else torch.exp(torch.clamp(logp - old_logp, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)))
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip, 1 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    if form.dual_clip and form.ratio == "token":  # verl compute_policy_loss_vanilla's clip_ratio_c
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -advantages * form.dual_clip), per_token)
    if weights is not None:
        per_token = per_token * weights
    if kl > 0 and ref_logp is not None:
        per_token = per_token + kl * kl_estimate(logp, ref_logp, form.kl_estimator)
    total = aggregate(per_token, mask, aggregation or default_aggregation(loss), segments, counts)
    # the clip acts (zero gradient) where the clipped term is the smaller: a > 0 above 1 + clip_high,
    # a < 0 below 1 - clip (verl pg_clipfrac, TRL is_low_clipped | is_high_clipped)
    clipped_tokens = float(((clipped < unclipped).float() * mask).sum())
    return total, {"clip_fraction": clipped_tokens / max(float(mask.sum()), 1.0), "clipped_tokens": clipped_tokens}


def sequence_ratio(logp, old_logp, mask, segments=None) -> torch.Tensor:
    """GSPO's ratio (Zheng et al. 2025, verl compute_policy_loss_gspo): at each token the sequence's
    geometric-mean ratio exp(mean_t log(pi / pi_old)), detached, times pi / sg(pi), so that every
    token of a sequence shares one ratio and its gradient is the token's; clamped above at e^10."""
    sums, tokens = sequence_sums(logp.detach() - old_logp, mask, segments)
    log_ratio = logp - logp.detach() + sums / tokens.clamp(min=1)
    return torch.exp(torch.clamp(log_ratio, max=GSPO_LOG_RATIO_MAX))


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Schulman's estimates of KL(pi || ref) per token (verl kl_penalty): k1 = log pi - log ref,
    k2 = (log pi - log ref)^2 / 2, k3 (clamped: k3()); k3_plus has k3's value and k2's gradient, which
    is the unbiased gradient of the KL (verl's straight-through "k3+")."""
    if estimator == "k1":
        return logp - ref_logp
    k2 = 0.5 * (logp - ref_logp).square()
    if estimator == "k2":
        return k2
    if estimator == "k3_plus":
        return k2 - k2.detach() + k3(logp, ref_logp).detach()
    return k3(logp, ref_logp)


def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL(pi || ref) per token, exp(d) - d - 1 with d = log ref - log pi,
    clamped as verl does (d to +-20, the estimate to +-K3_BOUND): unclamped it overflows to inf once d
    passes ~88, and an inf at a padded position makes the masked sum NaN."""
    diff = torch.clamp(ref_logp - logp, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.clamp(torch.exp(diff) - diff - 1, -K3_BOUND, K3_BOUND)


def value_loss(values, old_values, returns, mask, clip: float) -> torch.Tensor:
    """Summed PPO value loss 0.5 (v - R)^2; with clip > 0 the larger of it and the loss of the
    prediction held within +-clip of the critic stage's values (verl compute_value_loss)."""
    losses = (values - returns) ** 2
    if clip > 0:
        held = old_values + torch.clamp(values - old_values, -clip, clip)
        losses = torch.maximum(losses, (held - returns) ** 2)
    return 0.5 * (losses * mask).sum()
