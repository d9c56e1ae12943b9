"""Every loss mode, advantage estimator, aggregation, entropy term and metric of the CPU backend
against reference formulas written here, independently, after the function of TRL 1.16
(trl/trainer/grpo_trainer.py, rloo_trainer.py) or verl (verl/trainer/ppo/core_algos.py,
rollout_corr_helper.py) or AReaL (areal/utils/functional/functional.py) that each cites, on one
fixed batch, within 1e-6."""
import math

import pytest
import torch

from aspc.backends.cpu.batching import make_batch, token_logprobs
from aspc.backends.cpu.learner import Learner
from aspc.rl.rollout import Rollout, TrainSettings
from aspc.rl.losses import (Surrogate, aggregate, gae, group_advantages, off_policy_correction, policy_loss,
                                      step_divisor, value_loss, whiten)
from aspc.backends.cpu.model import TinyQwen
from aspc.ir.facts import ModelArch

TOL = 1e-6
G = torch.Generator().manual_seed(18)
LENGTHS = [5, 3, 4, 2]
MASK = torch.tensor([[1.0 if t < n else 0.0 for t in range(5)] for n in LENGTHS], dtype=torch.float64)
LOGP = -torch.rand(4, 5, generator=G, dtype=torch.float64) * 2
OLD = LOGP + (torch.rand(4, 5, generator=G, dtype=torch.float64) - 0.5) * 0.8  # some ratios outside the clip
ROLLOUT = OLD + (torch.rand(4, 5, generator=G, dtype=torch.float64) - 0.5) * 2.0  # some weights above the cap
REF = LOGP + (torch.rand(4, 5, generator=G, dtype=torch.float64) - 0.5) * 0.4
ADV = torch.tensor([[1.3], [-0.7], [0.4], [-1.1]], dtype=torch.float64).expand(4, 5)
ENTROPY = torch.rand(4, 5, generator=G, dtype=torch.float64) * 3
REWARDS = [1.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.25, 0.0]
MAX_TOKENS = 8


# ---- references ---------------------------------------------------------------------------------
def verl_grpo_advantage(scores, group, norm_adv_by_std_in_grpo, epsilon=1e-6):
    """verl compute_grpo_outcome_advantage (norm_adv_by_std_in_grpo=False is Dr. GRPO's)."""
    out = []
    for start in range(0, len(scores), group):
        s = torch.tensor(scores[start:start + group], dtype=torch.float64)
        for x in s:
            out.append(float((x - s.mean()) / (torch.std(s) + epsilon)) if norm_adv_by_std_in_grpo
                       else float(x - s.mean()))
    return out


def verl_rloo_advantage(scores, group):
    """verl compute_rloo_outcome_advantage: r n/(n-1) - mean n/(n-1)."""
    out = []
    for start in range(0, len(scores), group):
        s = scores[start:start + group]
        n, mean = len(s), sum(s) / len(s)
        out += [x * n / (n - 1) - mean * n / (n - 1) for x in s]
    return out


def verl_gae(token_level_rewards, values, response_mask, gamma, lam):
    """verl compute_gae_advantage_return, before its masked_whiten."""
    nextvalues, lastgaelam, reversed_ = 0, 0, []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        reversed_.append(lastgaelam)
    advantages = torch.stack(reversed_[::-1], dim=1)
    return advantages, advantages + values


def verl_masked_whiten(values, mask):
    """verl.utils.torch_functional.masked_whiten with masked_var(unbiased=True)."""
    mean = (values * mask).sum() / mask.sum()
    var = (((values - mean) ** 2) * mask).sum() / mask.sum() * (mask.sum() / (mask.sum() - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def trl_per_token_loss(logp, old, ref, adv, epsilon_low, epsilon_high, beta, is_ratio=None):
    """TRL GRPOTrainer._compute_loss: -min(coef_1 A, coef_2 A), times the vLLM IS ratio, plus beta k3."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    if is_ratio is not None:
        per_token_loss = per_token_loss * is_ratio
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    return per_token_loss


def verl_low_var_kl(logprob, ref_logprob):
    """verl kl_penalty_forward(kl_penalty="low_var_kl" / "k3") (verl/trainer/ppo/core_algos.py at
    b178a3cd5): the log-ratio clamped to +-20, k3 to +-10."""
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, loss_scale_factor=None):
    """verl agg_loss (one data-parallel rank, the whole batch one micro-batch). verl's
    seq-mean-token-sum-norm is divided by the dp_actor's 1 / gradient_accumulation too: here with
    micro-batches of one sequence, where it is Dr. GRPO's sum / (B L), as TRL's dr_grpo."""
    if loss_agg_mode == "seq-mean-token-sum-norm":
        micro = [torch.sum(loss_mat[i:i + 1] * loss_mask[i:i + 1]) / loss_scale_factor for i in range(len(loss_mat))]
        return sum(m * (1 / len(micro)) for m in micro)
    if loss_agg_mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    if loss_agg_mode == "seq-mean-token-sum":
        return torch.sum(loss_mat * loss_mask, dim=-1).mean()
    if loss_agg_mode == "seq-mean-token-mean":
        return (torch.sum(loss_mat * loss_mask, dim=-1) / (loss_mask.sum(-1) + 1e-8)).mean()
    raise ValueError(loss_agg_mode)


def trl_loss(per_token_loss, mask, loss_type, max_completion_length=MAX_TOKENS):
    """TRL GRPOTrainer._compute_loss's aggregation per loss_type."""
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("dapo", "bnpo"):
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    assert loss_type == "dr_grpo"
    return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)


def verl_clipfrac(logp, old, adv, mask, clip_low, clip_high):
    """verl compute_policy_loss_vanilla's pg_clipfrac."""
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    return float((torch.gt(pg_losses2, pg_losses1).float() * mask).sum() / mask.sum())


def trl_clip_ratio(logp, old, adv, mask, epsilon_low, epsilon_high):
    """TRL GRPOTrainer's clip_ratio/region_mean: low- plus high-clipped tokens."""
    coef_1 = torch.exp(logp - old)
    low = (coef_1 < 1 - epsilon_low) & (adv < 0)
    high = (coef_1 > 1 + epsilon_high) & (adv > 0)
    return float(((low | high).float() * mask).sum() / mask.sum())


def verl_value_loss(vpreds, returns, values, response_mask, cliprange_value):
    """verl compute_value_loss, token-mean."""
    vpredclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    clipped = torch.max((vpreds - returns) ** 2, (vpredclipped - returns) ** 2)
    return 0.5 * verl_agg_loss(clipped, response_mask, "token-mean")


def total(loss_sum, aggregation):
    return loss_sum / step_divisor(aggregation, len(LENGTHS), int(MASK.sum()), MAX_TOKENS)


# ---- advantages ---------------------------------------------------------------------------------
@pytest.mark.parametrize("estimator", ["grpo", "dapo"])
@pytest.mark.parametrize("normalize", [True, False])
def test_group_advantages_match_verl_grpo(estimator, normalize):
    ours = group_advantages(REWARDS, 4, estimator, normalize)
    assert ours == pytest.approx(verl_grpo_advantage(REWARDS, 4, normalize), abs=TOL)


def test_rloo_advantages_match_verl():
    assert group_advantages(REWARDS, 4, "rloo", False) == pytest.approx(verl_rloo_advantage(REWARDS, 4), abs=TOL)


def test_gae_matches_verl_before_whitening():
    values = [[0.1, 0.3, -0.2, 0.5, 0.4], [0.2, -0.1, 0.6]]
    for reward, row in zip([1.0, -0.5], values):
        ours, returns = gae(reward, row, gamma=0.9, lam=0.8)
        rewards = torch.zeros(1, len(row), dtype=torch.float64)
        rewards[0, -1] = reward
        adv, ret = verl_gae(rewards, torch.tensor([row], dtype=torch.float64), torch.ones(1, len(row)), 0.9, 0.8)
        assert ours == pytest.approx(adv[0].tolist(), abs=TOL)
        assert returns == pytest.approx(ret[0].tolist(), abs=TOL)


def test_gae_whitening_matches_verl_masked_whiten():
    rows = [[0.5, 0.2, -0.1, 0.9, 0.3], [-0.4, 0.1, 0.7], [0.0, 0.0]]  # the last: a failed score, left out
    ours = whiten(rows, [False, False, True])
    padded = torch.tensor([rows[0], rows[1] + [0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2], dtype=torch.float64)
    reference = verl_masked_whiten(padded, mask)
    assert ours[0] == pytest.approx(reference[0].tolist(), abs=TOL)
    assert ours[1] == pytest.approx(reference[1, :3].tolist(), abs=TOL)
    assert ours[2] == [0.0, 0.0]


# ---- policy losses and aggregations -------------------------------------------------------------
@pytest.mark.parametrize("loss, aggregation, trl_type, verl_mode", [
    ("grpo", None, "grpo", "seq-mean-token-mean"),
    ("dapo", None, "dapo", "token-mean"),
    ("ppo", None, "bnpo", "token-mean"),
    ("grpo", "seq_mean_token_sum_norm", "dr_grpo", "seq-mean-token-sum-norm"),
    ("grpo", "seq_mean_token_sum", None, "seq-mean-token-sum"),
    ("dapo", "seq_mean_token_mean", "grpo", "seq-mean-token-mean"),
])
def test_policy_loss_matches_trl_and_verl(loss, aggregation, trl_type, verl_mode):
    clip_high = 0.28 if loss == "dapo" else 0.2
    ours, info = policy_loss(LOGP, OLD, REF, ADV, MASK, loss, 0.2, clip_high, 0.05, aggregation)
    agg = aggregation or ("seq_mean_token_mean" if loss == "grpo" else "token_mean")
    per_token = trl_per_token_loss(LOGP, OLD, REF, ADV, 0.2, clip_high, 0.05)
    if trl_type is not None:
        assert float(total(ours, agg)) == pytest.approx(float(trl_loss(per_token, MASK, trl_type)), abs=TOL)
    reference = verl_agg_loss(per_token, MASK, verl_mode, loss_scale_factor=MAX_TOKENS)
    assert float(total(ours, agg)) == pytest.approx(float(reference), abs=TOL)


@pytest.mark.parametrize("clip_high", [0.2, 0.28])
def test_clip_fraction_honours_clip_high_and_the_advantage_sign(clip_high):
    _, info = policy_loss(LOGP, OLD, None, ADV, MASK, "dapo", 0.2, clip_high, 0.0)
    assert info["clip_fraction"] == pytest.approx(verl_clipfrac(LOGP, OLD, ADV, MASK, 0.2, clip_high), abs=TOL)
    assert info["clip_fraction"] == pytest.approx(trl_clip_ratio(LOGP, OLD, ADV, MASK, 0.2, clip_high), abs=TOL)
    assert 0 < info["clip_fraction"] < 1  # the batch has clipped and unclipped tokens


def test_the_log_ratio_is_clamped_as_verl_does():
    far = LOGP - 40  # exp(40) overflows nothing only because of the clamp (dual-clip off: it would bound it)
    ours, _ = policy_loss(LOGP, far, None, -ADV.abs(), MASK, "ppo", 0.2, 0.2, 0.0, surrogate=Surrogate(dual_clip=0))
    expected = (math.exp(20.0) * ADV.abs() * MASK).sum()
    assert float(ours) == pytest.approx(float(expected), rel=TOL)


def test_the_k3_penalty_is_clamped_as_verl_does():
    """Far from the reference (log ref - log pi of 1..100, and 1000 at a padded position) the per-token
    penalty is verl's low_var_kl, finite: unclamped, exp(100) is 2.7e43 and exp(1000) inf, whose product
    with a 0 mask is NaN."""
    far = LOGP + torch.linspace(1, 100, 20, dtype=torch.float64).reshape(4, 5)
    far[3, 4] = LOGP[3, 4] + 1000  # MASK is 0 there (LENGTHS[3] = 2)
    zero_adv = torch.zeros_like(ADV)
    ours, _ = policy_loss(LOGP, LOGP, far, zero_adv, MASK, "grpo", 0.2, 0.2, 0.05, "token_mean")
    expected = (0.05 * verl_low_var_kl(LOGP, far) * MASK).sum()
    assert torch.isfinite(ours) and float(ours) == pytest.approx(float(expected), abs=TOL)
    near, _ = policy_loss(LOGP, LOGP, REF, zero_adv, MASK, "grpo", 0.2, 0.2, 0.05, "token_mean")
    assert float(near) == pytest.approx(float((0.05 * verl_low_var_kl(LOGP, REF) * MASK).sum()), abs=TOL)


@pytest.mark.parametrize("aggregation, verl_mode", [
    ("seq_mean_token_mean", "seq-mean-token-mean"), ("token_mean", "token-mean"),
    ("seq_mean_token_sum", "seq-mean-token-sum"), ("seq_mean_token_sum_norm", "seq-mean-token-sum-norm")])
def test_entropy_bonus_matches_verl_entropy_loss(aggregation, verl_mode):
    """verl: policy_loss = pg_loss - entropy_coeff * agg_loss(entropy, mask, loss_agg_mode)."""
    ours = total(aggregate(ENTROPY, MASK, aggregation), aggregation)
    assert float(ours) == pytest.approx(float(verl_agg_loss(ENTROPY, MASK, verl_mode, MAX_TOKENS)), abs=TOL)


def test_entropy_bonus_of_token_mean_is_trls_mean_token_entropy():
    """TRL 1.16: the bonus is the mean per-token entropy for every loss type."""
    ours = total(aggregate(ENTROPY, MASK, "token_mean"), "token_mean")
    assert float(ours) == pytest.approx(float((ENTROPY * MASK).sum() / MASK.sum()), abs=TOL)


def test_log_probs_and_entropy_are_at_the_sampling_temperature():
    """TRL _get_per_token_logps_and_entropies: logits / temperature, then selective_log_softmax and
    entropy_from_logits."""
    logits = torch.randn(2, 7, 11, generator=G)

    class Model:  # the head is the identity: the hidden states are the logits
        def hidden_states(self, tokens, positions, mask):
            return logits

        def logits(self, hidden):
            return hidden

    model = Model()
    batch = make_batch([([1, 2, 3], [4, 5, 6, 7]), ([1, 2], [8, 9])])
    logp, entropy = token_logprobs(model, batch, temperature=0.7)
    scaled = logits / 0.7
    for row, (start, length) in enumerate(zip(batch.starts, batch.lengths)):
        for t in range(length):
            position = start + t
            target = int(batch.tokens[row, position + 1])
            expected = torch.log_softmax(scaled[row, position], -1)[target]
            probs = torch.softmax(scaled[row, position], -1)
            expected_entropy = torch.logsumexp(scaled[row, position], -1) - (probs * scaled[row, position]).sum()
            assert float(logp[row, t]) == pytest.approx(float(expected), abs=TOL)
            assert float(entropy[row, t]) == pytest.approx(float(expected_entropy), abs=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_the_head_over_response_positions_equals_the_head_over_every_position(tied):
    """token_logprobs applies the output head to the response positions only (TRL's logits_to_keep):
    the log-probs and the gradient equal those of the head over the whole sequence."""
    model = TinyQwen(ModelArch(layers=1, hidden=16, heads=2, kv_heads=1, head_dim=8, ffn=32, vocab=32,
                               tied=tied, max_seq=32), seed=0)
    batch = make_batch([([1, 2, 3], [4, 5, 6, 7]), ([1, 2], [8, 9]), ([3] * 5, [7])])
    logp, _ = token_logprobs(model, batch, temperature=0.7)
    logp.sum().backward()
    fast = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    full = torch.log_softmax(model(batch.tokens, batch.positions, batch.mask) / 0.7, -1)
    targets = torch.roll(batch.tokens, -1, dims=1)
    total = torch.zeros(())
    for row, (start, length) in enumerate(zip(batch.starts, batch.lengths)):
        expected = full[row, start:start + length].gather(-1, targets[row, start:start + length, None]).squeeze(-1)
        assert torch.allclose(logp[row, :length], expected, atol=1e-6)
        total = total + expected.sum()
    total.backward()
    for name, p in model.named_parameters():
        assert torch.allclose(fast[name], p.grad, atol=1e-5), name


# ---- value loss ---------------------------------------------------------------------------------
@pytest.mark.parametrize("clip", [0.0, 0.1])
def test_value_loss_matches_verl(clip):
    vpreds = REF + 0.3
    returns, old = LOGP, OLD
    ours = value_loss(vpreds, old, returns, MASK, clip) / MASK.sum()
    reference = verl_value_loss(vpreds, returns, old, MASK, clip if clip else 1e9)
    assert float(ours) == pytest.approx(float(reference), abs=TOL)


# ---- off-policy correction ----------------------------------------------------------------------
def test_tis_matches_verl_and_trl_token_truncate():
    """verl compute_rollout_correction_weights (rollout_is = token) then pg_losses * weights; TRL
    vllm_importance_sampling_mode = token_truncate. The ratio is against the proximal policy."""
    correction = off_policy_correction(OLD, ROLLOUT, "tis", cap=2.0)
    weights = torch.exp(OLD - ROLLOUT).clamp(max=2.0)
    assert torch.allclose(correction.weights, weights, atol=TOL)
    assert 0 < float(correction.capped.sum()) < MASK.numel()  # some tokens truncated, not all
    ours, _ = policy_loss(LOGP, correction.old_logp, REF, ADV, MASK, "dapo", 0.2, 0.28, 0.05, None,
                          correction.weights)
    per_token = trl_per_token_loss(LOGP, OLD, REF, ADV, 0.2, 0.28, 0.05, is_ratio=weights)
    assert float(total(ours, "token_mean")) == pytest.approx(float(trl_loss(per_token, MASK, "dapo")), abs=TOL)


def test_decoupled_matches_areal_with_tokens_above_the_cap_dropped():
    """AReaL ppo_actor_loss_fn: ratio pi / pi_proximal clipped, times pi_proximal / pi_behave,
    tokens whose weight exceeds the cap masked (their count stays in the denominator)."""
    correction = off_policy_correction(OLD, ROLLOUT, "decoupled", cap=2.0)
    ours, _ = policy_loss(LOGP, correction.old_logp, None, ADV, MASK, "ppo", 0.2, 0.28, 0.0, None,
                          correction.weights)
    ratio = torch.exp(LOGP - OLD)
    pg_loss = torch.max(-ADV * ratio, -ADV * torch.clamp(ratio, 1 - 0.2, 1 + 0.28))
    behave_imp_weight = torch.exp(OLD - ROLLOUT)
    behave_imp_weight = torch.where(behave_imp_weight <= 2.0, behave_imp_weight, 0.0)
    reference = (pg_loss * behave_imp_weight * MASK).sum() / MASK.sum()
    assert float(total(ours, "token_mean")) == pytest.approx(float(reference), abs=TOL)


def test_clip_is_the_clipped_ratio_against_the_rollout_policy():
    correction = off_policy_correction(OLD, ROLLOUT, "clip", cap=2.0)
    assert correction.weights is None and torch.equal(correction.old_logp, ROLLOUT)
    assert torch.allclose(correction.raw, torch.exp(OLD - ROLLOUT), atol=TOL)


# ---- the learner's metrics ----------------------------------------------------------------------
ARCH = ModelArch(layers=1, hidden=16, heads=2, kv_heads=1, head_dim=8, ffn=32, vocab=32, tied=True, max_seq=32)


def _rollouts():
    g = torch.Generator().manual_seed(3)
    out = []
    for i, length in enumerate([6, 3, 5, 2, 4, 7, 1, 5]):
        response = torch.randint(3, 20, (length,), generator=g).tolist()
        behaviour = (-torch.rand(length, generator=g) * 3).tolist()
        out.append(Rollout([1, 5, 6], response, behaviour, "", None, reward=float(i % 3 == 0),
                           ref_logprobs=(-torch.rand(length, generator=g) * 3).tolist()))
    return out


@pytest.mark.parametrize("loss, off_policy, entropy_coef", [
    ("grpo", "clip", 0.01), ("dapo", "clip", 0.0), ("ppo", "tis", 0.01), ("grpo", "decoupled", 0.0)])
def test_the_reported_loss_is_the_optimised_loss(loss, off_policy, entropy_coef):
    """Over micro-batches of a few tokens, the step's `loss` and `clip_fraction` are those of the
    whole batch at once, by TRL's formulas (the loss whose gradient the step applies)."""
    model = TinyQwen(ARCH, seed=0)
    settings = TrainSettings(loss=loss, lr=1e-3, kl=0.05, clip=0.2, clip_high=0.28 if loss == "dapo" else 0.2,
                             value_coef=0.5, entropy_coef=entropy_coef, micro_tokens=12, weight_decay=0.0,
                             grad_clip=0.0, overlong=0, max_tokens=8, estimator="grpo", gamma=1.0, lam=1.0,
                             normalize=True, group=4, off_policy=off_policy, temperature=0.8)
    learner = Learner(model, None, None, settings, lambda *a: 0.0)
    rollouts = _rollouts()
    with torch.no_grad():
        batch = make_batch([(r.prompt, r.response) for r in rollouts])
        logp, entropy = token_logprobs(model, batch, 0.8)
    learner.train(rollouts)
    metrics = learner.optimizer_step()

    mask = batch.response_mask()
    pad = lambda rows: torch.tensor([list(r) + [0.0] * (batch.width - len(r)) for r in rows])  # noqa: E731
    rollout, ref = pad([r.behaviour_logprobs for r in rollouts]), pad([r.ref_logprobs for r in rollouts])
    adv = torch.tensor(group_advantages([r.reward for r in rollouts], 4, "grpo", True))[:, None].expand_as(mask)
    old, is_ratio = rollout, None
    if off_policy != "clip":
        old, weight = logp, torch.exp(logp - rollout)
        is_ratio = weight.clamp(max=2.0) if off_policy == "tis" else torch.where(weight <= 2.0, weight, 0.0)
    # TRL's surrogate with verl's clamped k3 (TRL does not clamp it; these rollouts' reference log-probs
    # are far enough from the model's for the clamp to act)
    per_token = trl_per_token_loss(logp, old, ref, adv, 0.2, settings.clip_high, 0.0, is_ratio) + \
        0.05 * verl_low_var_kl(logp, ref)
    trl_type = "grpo" if loss == "grpo" else "dapo"
    entropy_term = trl_loss(entropy, mask, trl_type)  # aggregated as the policy loss (verl)
    expected = trl_loss(per_token, mask, trl_type) - entropy_coef * entropy_term
    assert metrics["loss"] == pytest.approx(float(expected), abs=TOL)
    assert metrics["clip_fraction"] == pytest.approx(trl_clip_ratio(logp, old, adv, mask, 0.2, settings.clip_high),
                                                     abs=TOL)
    weights = torch.exp(logp - rollout)
    assert metrics["is_weight"] == {"0": pytest.approx(float((weights * mask).sum() / mask.sum()), abs=1e-5)}


@pytest.mark.parametrize("loss", ["grpo", "ppo", "dapo"])
def test_overlong_shaping_applies_with_every_loss(loss):
    """DAPO's soft overlong punishment (TRL get_soft_overlong_punishment, verl's DAPO reward
    manager): -1 at the budget, whatever the loss."""
    settings = TrainSettings(loss=loss, lr=1e-3, kl=0.0, clip=0.2, clip_high=0.2, value_coef=0.5, entropy_coef=0.0,
                             micro_tokens=64, weight_decay=0.0, grad_clip=0.0, overlong=4, max_tokens=8,
                             estimator="grpo", gamma=1.0, lam=1.0, normalize=True, group=2)
    learner = Learner(TinyQwen(ARCH, seed=0), None, None, settings, lambda *a: 1.0, decode=str)
    full, short = Rollout([1], [5] * 8, [0.0] * 8, "", None), Rollout([1], [5] * 2, [0.0] * 2, "", None)
    learner.reward([full, short])
    assert (full.reward, short.reward) == (0.0, 1.0)
