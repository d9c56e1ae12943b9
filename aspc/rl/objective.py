"""The policy's objective on one micro-batch, written once: every trainer (the CPU learner, the
megatron trainer) lays its micro-batch out as it likes -- padded rows of one sequence each, or
packed rows of several -- computes its log-probs (and entropies) with its own engine, and hands
them here. The off-policy correction, the clipped surrogate, the KL penalty, the entropy bonus and
the aggregation are this module's, so two trainers given the same samples give the same loss and
gradient (tests/test_trainer_differential.py). The result is a micro-batch *sum*; the trainer
divides the step's summed gradients by `losses.step_divisor` at its optimizer step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from aspc.rl.losses import Correction, Surrogate, aggregate, off_policy_correction, policy_loss
from aspc.rl.mismatch import MismatchWeights, mismatch_weights
from aspc.rl.rollout import TrainSettings


@dataclass(frozen=True)
class TokenTerms:
    """A micro-batch's per-token tensors, [rows, positions], as the trainer laid them out."""

    logp: torch.Tensor  # the trainer's log-probs of the response tokens, with their graph
    rollout_logp: torch.Tensor  # the engine's, recorded when the tokens were generated
    advantages: torch.Tensor
    mask: torch.Tensor  # 1 on the tokens a loss counts (response tokens the model wrote)
    ref_logp: torch.Tensor | None = None  # the reference's: the KL penalty (None: no penalty)
    entropy: torch.Tensor | None = None  # needed when the settings' entropy_coef is not 0
    segments: torch.Tensor | None = None  # packed rows: the sequence each position is of; None: a row is one
    counts: torch.Tensor | None = None  # context parallelism: the counted tokens of each position's whole sequence
    fresh: torch.Tensor | None = None  # 1 on tokens of samples the weights being trained generated; None: all


@dataclass(frozen=True)
class MicroBatchLoss:
    loss: torch.Tensor  # the micro-batch's summed share of the step loss, before step_divisor
    tokens: float  # the tokens it counted
    clipped_tokens: float  # of them, those whose ratio the clip held
    correction: Correction  # the off-policy weights applied (for the step's metrics)
    mismatch: MismatchWeights | None = None  # the mismatch correction's, on fresh tokens


def micro_batch_loss(terms: TokenTerms, s: TrainSettings, mismatch: str = "none") -> MicroBatchLoss:
    """The policy loss of one micro-batch under the train stage's settings, with the trainer's
    mismatch correction this step (`mismatch`: a mode of aspc/rl/mismatch.py, auto resolved). The
    proximal policy (AReaL) is the trainer's own, detached: its weights change only at the
    optimizer step. Stale tokens take `off_policy`'s correction; with a mismatch correction, fresh
    tokens take it instead, their ratio against the proximal policy (verl's decoupled mode)."""
    proximal = terms.logp.detach()
    correction = off_policy_correction(proximal, terms.rollout_logp, s.off_policy, s.is_cap)
    old_logp, weights, fixed = correction.old_logp, correction.weights, None
    if mismatch != "none":
        fresh = terms.mask if terms.fresh is None else terms.mask * terms.fresh
        fixed = mismatch_weights(proximal, terms.rollout_logp, fresh, mismatch, s.mismatch_cap, s.mismatch_floor,
                                 terms.segments)
        on = fresh > 0
        old_logp = torch.where(on, proximal, old_logp)
        weights = torch.where(on, fixed.weights, torch.ones_like(proximal) if weights is None else weights)
    form = Surrogate(s.dual_clip, s.ratio, s.kl_estimator)
    loss, info = policy_loss(terms.logp, old_logp, terms.ref_logp, terms.advantages, terms.mask, s.loss,
                             s.clip, s.clip_high, s.kl, s.aggregation, weights, terms.segments, terms.counts, form)
    if s.entropy_coef:  # aggregated as the policy loss is (verl compute_entropy_loss)
        if terms.entropy is None:
            raise ValueError("entropy_coef is set but the trainer gave no entropies")
        loss = loss - s.entropy_coef * aggregate(terms.entropy, terms.mask, s.aggregation, terms.segments,
                                                 terms.counts)
    return MicroBatchLoss(loss, float(terms.mask.sum()), info["clipped_tokens"], correction, fixed)


def segments_of(spans: list[tuple[int, int]], width: int) -> torch.Tensor:
    """[1, width]: at each position of a packed row, the index of the sequence whose (first, end)
    span holds it (positions outside every span are masked out of the loss: index 0)."""
    segments = torch.zeros(1, width, dtype=torch.long)
    for index, (first, end) in enumerate(spans):
        segments[0, first:end] = index
    return segments
