"""The loss modes of issue 35 against verl's own functions, imported and called as shipped (verl 0.9.1,
installed with --no-deps beside the test extra: README.md), on one fixed batch, within 1e-6: the KL
estimators (core_algos.kl_penalty), dual-clip PPO (compute_policy_loss_vanilla's clip_ratio_c),
GSPO's sequence ratio (compute_policy_loss_gspo), and the mismatch corrections, token and sequence
truncated and masked IS (rollout_corr_helper.compute_rollout_correction_and_rejection_mask, its
weights then multiplying compute_policy_loss_vanilla's losses: verl's decoupled mode) -- values
and gradients -- and the KL in the reward (compute_rewards, then compute_gae_advantage_return or
compute_grpo_outcome_advantage). Skipped where verl is not installed, unless ASPC_REQUIRE_PEERS=1 (.ci/run), where
that fails."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from aspc.rl.losses import Surrogate, kl_estimate, policy_loss, step_divisor
from aspc.rl.mismatch import mismatch_weights
from aspc.rl.objective import TokenTerms, micro_batch_loss
from aspc.rl.rollout import Rollout, TrainSettings, token_advantages

try:
    from verl.trainer.ppo import core_algos, rollout_corr_helper
    from verl.workers.config import ActorConfig
    MISSING = None
except ImportError as error:  # the peers are not installed: README.md's test command installs them
    MISSING = f"verl is not installed ({error}): pip install --no-deps verl==0.9.1"
if MISSING and os.environ.get("ASPC_REQUIRE_PEERS") == "1":
    raise RuntimeError(f"ASPC_REQUIRE_PEERS=1, and {MISSING}")
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

TOL = 1e-6
G = torch.Generator().manual_seed(35)
LENGTHS = [5, 3, 4, 2]
MASK = torch.tensor([[1.0 if t < n else 0.0 for t in range(5)] for n in LENGTHS], dtype=torch.float64)
LOGP = -torch.rand(4, 5, generator=G, dtype=torch.float64) * 2
OLD = LOGP + (torch.rand(4, 5, generator=G, dtype=torch.float64) - 0.5) * 0.8
FAR = LOGP - torch.tensor([[1.5, 0.0, 1.3, 0.0, 0.2]] * 4, dtype=torch.float64)  # ratios above 3 on some tokens
ENGINE = LOGP + (torch.rand(4, 5, generator=G, dtype=torch.float64) - 0.5) * 1.8  # some weights outside [0.5, 2]
REF = LOGP + (torch.rand(4, 5, generator=G, dtype=torch.float64) - 0.5) * 0.4
ADV = torch.tensor([[1.3], [-0.7], [0.4], [-1.1]], dtype=torch.float64).expand(4, 5)
VERL_AGG = {"token_mean": "token-mean", "seq_mean_token_mean": "seq-mean-token-mean"}


def actor_config(clip=0.2, clip_high=0.28, dual_clip=3.0) -> ActorConfig:
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, use_dynamic_bsz=False,
                       clip_ratio=clip, clip_ratio_low=clip, clip_ratio_high=clip_high, clip_ratio_c=dual_clip)


def mean(loss_sum, aggregation):
    return loss_sum / step_divisor(aggregation, len(LENGTHS), int(MASK.sum()), 8)


def leaf(t):
    return t.clone().requires_grad_(True)


def gradient(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


def settings(**options) -> TrainSettings:
    base = dict(loss="ppo", lr=1e-3, kl=0.0, clip=0.2, clip_high=0.28, value_coef=0.5, entropy_coef=0.0,
                micro_tokens=64, weight_decay=0.0, grad_clip=0.0, overlong=0, max_tokens=8, estimator="grpo",
                gamma=1.0, lam=1.0, normalize=True, group=2)
    return TrainSettings(**(base | options))


# ---- KL -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("ours, verls", [("k1", "k1"), ("k2", "k2"), ("k3", "low_var_kl"),
                                         ("k3_plus", "k3+")])
def test_kl_estimators_match_verl_kl_penalty_in_value_and_gradient(ours, verls):
    mine, theirs = leaf(LOGP), leaf(LOGP)
    found, expected = kl_estimate(mine, REF, ours), core_algos.kl_penalty(theirs, REF, verls)
    assert torch.allclose(found, expected, atol=TOL)
    weights = torch.rand(4, 5, generator=G, dtype=torch.float64)
    assert torch.allclose(gradient((found * weights).sum(), mine), gradient((expected * weights).sum(), theirs),
                          atol=TOL)


def test_k3_plus_has_k2s_gradient():
    x = leaf(LOGP)
    assert torch.allclose(gradient(kl_estimate(x, REF, "k3_plus").sum(), x), LOGP - REF, atol=TOL)


@pytest.mark.parametrize("estimator, verls", [("k1", "k1"), ("k2", "k2")])
def test_the_kl_term_of_the_loss_is_verls_kl_loss(estimator, verls):
    """verl's actor: pg_loss + kl_loss_coef x agg_loss(kl_penalty(log_prob, ref_log_prob, kl_loss_type))."""
    ours, _ = policy_loss(LOGP, OLD, REF, ADV, MASK, "ppo", 0.2, 0.28, 0.05, "token_mean",
                          surrogate=Surrogate(kl_estimator=estimator))
    pg, _ = core_algos.compute_policy_loss_vanilla(OLD, LOGP, ADV, MASK, "token-mean", actor_config())
    kl = core_algos.agg_loss(core_algos.kl_penalty(LOGP, REF, verls), MASK, "token-mean")
    assert float(mean(ours, "token_mean")) == pytest.approx(float(pg + 0.05 * kl), abs=TOL)


# ---- dual-clip ----------------------------------------------------------------------------------
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_dual_clip_matches_verl_compute_policy_loss_vanilla(aggregation):
    assert float(torch.exp(LOGP - FAR).max()) > 3  # some negative-advantage tokens are dual-clipped
    mine, theirs = leaf(LOGP), leaf(LOGP)
    ours, info = policy_loss(mine, FAR, None, ADV, MASK, "ppo", 0.2, 0.28, 0.0, aggregation)
    expected, metrics = core_algos.compute_policy_loss_vanilla(FAR, theirs, ADV, MASK, VERL_AGG[aggregation],
                                                               actor_config())
    assert mean(ours, aggregation).item() == pytest.approx(float(expected), abs=TOL)
    assert info["clip_fraction"] == pytest.approx(metrics["actor/pg_clipfrac"], abs=TOL)
    assert torch.allclose(gradient(mean(ours, aggregation), mine), gradient(expected, theirs), atol=TOL)
    undone, _ = policy_loss(LOGP, FAR, None, ADV, MASK, "ppo", 0.2, 0.28, 0.0, aggregation,
                            surrogate=Surrogate(dual_clip=0))
    assert float(undone) > float(ours)  # without it the negative-advantage tokens lose more


# ---- GSPO ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_gspo_matches_verl_compute_policy_loss_gspo(aggregation):
    mine, theirs = leaf(LOGP), leaf(LOGP)
    ours, info = policy_loss(mine, OLD, None, ADV, MASK, "grpo", 0.2, 0.28, 0.0, aggregation,
                             surrogate=Surrogate(ratio="sequence"))
    expected, metrics = core_algos.compute_policy_loss_gspo(OLD, theirs, ADV, MASK, VERL_AGG[aggregation],
                                                            actor_config())
    assert mean(ours, aggregation).item() == pytest.approx(float(expected), abs=TOL)
    assert info["clip_fraction"] == pytest.approx(metrics["actor/pg_clipfrac"], abs=TOL)
    assert torch.allclose(gradient(mean(ours, aggregation), mine), gradient(expected, theirs), atol=TOL)


def test_gspo_over_packed_rows_is_gspo_over_their_sequences():
    """Two packed rows of two sequences each give the unpacked loss and gradient."""
    rows = [(0, 1), (2, 3)]
    width = max(LENGTHS[a] + LENGTHS[b] for a, b in rows)

    def packed(t):
        out = torch.zeros(2, width, dtype=t.dtype)
        for r, (a, b) in enumerate(rows):
            out[r, :LENGTHS[a]] = t[a, :LENGTHS[a]]
            out[r, LENGTHS[a]:LENGTHS[a] + LENGTHS[b]] = t[b, :LENGTHS[b]]
        return out

    segments = torch.zeros(2, width, dtype=torch.long)
    for r, (first, _) in enumerate(rows):
        segments[r, LENGTHS[first]:] = 1
    form = Surrogate(ratio="sequence")
    flat, packed_logp = leaf(LOGP), leaf(packed(LOGP))
    unpacked, _ = policy_loss(flat, OLD, None, ADV, MASK, "grpo", 0.2, 0.28, 0.0, surrogate=form)
    together, _ = policy_loss(packed_logp, packed(OLD), None, packed(ADV.contiguous()), packed(MASK), "grpo", 0.2,
                              0.28, 0.0, segments=segments, surrogate=form)
    assert float(together) == pytest.approx(float(unpacked), abs=TOL)
    assert torch.allclose(gradient(together, packed_logp), packed(gradient(unpacked, flat)), atol=TOL)


# ---- the mismatch corrections -------------------------------------------------------------------
VERL_MODES = {"token_tis": ("token", 2.0), "seq_tis": ("sequence", 2.0), "token_mis": ("token", "0.5_2.0"),
              "seq_mis": ("sequence", "0.5_2.0")}


@pytest.mark.parametrize("mode", list(VERL_MODES))
def test_mismatch_weights_match_verl_rollout_correction(mode):
    level, threshold = VERL_MODES[mode]
    proto, _, _ = rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
        LOGP, ENGINE, MASK, rollout_is=level, rollout_is_threshold=threshold)
    expected = proto.batch["rollout_is_weights"]
    found = mismatch_weights(LOGP, ENGINE, MASK, mode, cap=2.0, floor=0.5)
    assert torch.allclose(found.weights * MASK, expected, atol=TOL)
    assert 0 < float((found.changed * MASK).sum()) < float(MASK.sum())  # some weights truncated or masked, not all


@pytest.mark.parametrize("mode", list(VERL_MODES))
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_a_mismatch_corrected_loss_is_verls_decoupled_loss(mode, aggregation):
    """On fresh samples: the ratio against the trainer's proximal log-probs, the weights from the
    engine's (verl decoupled mode: old_log_prob recomputed, rollout_is_weights on pg_losses)."""
    level, threshold = VERL_MODES[mode]
    mine, theirs = leaf(LOGP), leaf(LOGP)
    s = settings(mismatch=mode, loss_agg=aggregation)
    found = micro_batch_loss(TokenTerms(mine, ENGINE, ADV, MASK), s, mode)
    proto, _, _ = rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
        LOGP, ENGINE, MASK, rollout_is=level, rollout_is_threshold=threshold)
    expected, _ = core_algos.compute_policy_loss_vanilla(LOGP, theirs, ADV, MASK, VERL_AGG[aggregation],
                                                         actor_config(), proto.batch["rollout_is_weights"])
    assert mean(found.loss, aggregation).item() == pytest.approx(float(expected), abs=TOL)
    assert torch.allclose(gradient(mean(found.loss, aggregation), mine), gradient(expected, theirs), atol=TOL)


def test_stale_samples_keep_the_off_policy_correction_and_fresh_ones_take_the_mismatch_one():
    """Rows 0 and 2 fresh, rows 1 and 3 stale: the micro-batch's loss is the fresh rows' under the
    mismatch correction plus the stale rows' under off_policy's alone."""
    fresh = torch.tensor([[1.0], [0.0], [1.0], [0.0]], dtype=torch.float64).expand(4, 5)
    s = settings(mismatch="seq_tis", off_policy="tis")
    mixed = micro_batch_loss(TokenTerms(LOGP, ENGINE, ADV, MASK, fresh=fresh), s, "seq_tis")

    def rows_loss(rows, mode):
        return float(micro_batch_loss(TokenTerms(LOGP[rows], ENGINE[rows], ADV[rows], MASK[rows]), s, mode).loss)

    assert float(mixed.loss) == pytest.approx(rows_loss([0, 2], "seq_tis") + rows_loss([1, 3], "none"), abs=TOL)
    assert rows_loss([0, 2], "seq_tis") != pytest.approx(rows_loss([0, 2], "none"), abs=1e-3)
    assert float((mixed.mismatch.changed * (1 - fresh)).sum()) == 0  # no stale token counts as corrected


# ---- KL in the reward ---------------------------------------------------------------------------
SCORES = [1.0, 0.0, 0.5, 1.0]
VALUES = torch.rand(4, 5, generator=G, dtype=torch.float64)


def _rollouts() -> list[Rollout]:
    return [Rollout([1], [2] * n, LOGP[i, :n].tolist(), "", None, reward=SCORES[i], ref_logprobs=REF[i, :n].tolist(),
                    values=VALUES[i, :n].tolist()) for i, n in enumerate(LENGTHS)]


def _padded(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor([row + [0.0] * (5 - len(row)) for row in rows], dtype=torch.float64)


def _verl_token_rewards() -> torch.Tensor:
    """verl compute_rewards: the scores at each response's last token, minus kl_ratio x k1."""
    scores = torch.zeros(4, 5, dtype=torch.float64)
    for i, n in enumerate(LENGTHS):
        scores[i, n - 1] = SCORES[i]
    return core_algos.compute_rewards(scores, LOGP, REF, 0.1) * MASK


def test_kl_in_the_reward_then_gae_matches_verl():
    s = settings(estimator="gae", normalize=True, gamma=1.0, lam=0.95, kl_reward=0.1)
    advantages, returns = token_advantages(_rollouts(), s)
    expected, expected_returns = core_algos.compute_gae_advantage_return(_verl_token_rewards(), VALUES, MASK, 1.0, 0.95)
    assert torch.allclose(_padded(advantages), expected * MASK, atol=TOL)
    assert torch.allclose(_padded(returns), expected_returns * MASK, atol=TOL)
    without, _ = token_advantages(_rollouts(), settings(estimator="gae", normalize=True, gamma=1.0, lam=0.95))
    assert not torch.allclose(_padded(without), _padded(advantages), atol=1e-3)  # the KL moved them


def test_kl_in_the_reward_then_grpo_matches_verl():
    s = settings(estimator="grpo", normalize=True, kl_reward=0.1, group=2)
    advantages, _ = token_advantages(_rollouts(), s)
    expected, _ = core_algos.compute_grpo_outcome_advantage(_verl_token_rewards(), MASK, np.array([0, 0, 1, 1]))
    assert torch.allclose(_padded(advantages), expected * MASK, atol=TOL)
