"""The CPU learner: rewards, reference log-probs, critic values and the policy update, per
streamed unit of samples; the optimizer step once per training step.

The policy at the start of a train step is its proximal policy (AReaL): the weights change only at
the optimizer step, so its log-probs are the current ones, detached, with no extra forward.

Nothing non-finite is trained on: a NaN or infinite reward, advantage or loss of a unit, or
gradient norm of a step, raises NonFiniteError (losses.py) before the optimizer changes any weight,
the step's gradients discarded, so the last checkpoint the run keeps is a sound one."""
from __future__ import annotations

import math

import torch

from aspc.backends.cpu.batching import (prompt_groups, shared_prompt_batch, sharing_keys, token_logprobs,
                                        token_values)
from aspc.backends.cpu.generator import PolicyWeights
from aspc.backends.cpu.model import published_state
from aspc.rl.losses import NonFiniteError, step_divisor, value_loss
from aspc.rl.mismatch import Mismatch, MismatchCorrection
from aspc.rl.objective import TokenTerms, micro_batch_loss
from aspc.rl.rollout import Rollout, Shaping, TaskReward, TrainSettings, step_advantages, token_advantages
from aspc.algorithms.packing import first_fit_decreasing


class Learner:
    def __init__(self, actor, ref, critic, settings: TrainSettings, reward_fn, decode=None):
        """`reward_fn(prompt, response text, answer, metadata)`: the pipeline's rule and python
        rewards; `decode`: response ids -> that text (the model's tokenizer)."""
        self.actor, self.ref, self.critic, self.s, self.reward_fn = actor, ref, critic, settings, reward_fn
        self.task_reward = TaskReward(reward_fn, decode or _decode, Shaping(settings.overlong, settings.max_tokens))
        self.optimizer = torch.optim.AdamW(actor.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
        self.critic_optimizer = None if critic is None else torch.optim.AdamW(critic.parameters(),
                                                                              lr=settings.critic_lr)
        self.shaped = settings.overlong > 0  # DAPO's overlong shaping (any loss)
        self.correction = MismatchCorrection(settings.mismatch)  # the mode of this step (auto: chosen per step)
        self.step_stats = self._new_stats()
        self.version = 0  # optimizer steps taken: the version of the weights it publishes next
        self.deferred: list[list[Rollout]] = []  # the step's units, when GAE is whitened over the step

    # ---- forward stages ----
    def reward(self, rollouts: list[Rollout]) -> None:
        self.task_reward.score(rollouts)

    def reference(self, rollouts: list[Rollout]) -> None:
        reference_logprobs(self.ref, rollouts, self.s)

    @torch.no_grad()
    def values(self, rollouts: list[Rollout]) -> None:
        for chunk in self._micro_batches(rollouts):
            batch = shared_prompt_batch([(r.prompt, r.response) for r in chunk])
            values = token_values(self.critic, batch)
            for r, row, n in zip(chunk, values, batch.lengths):
                r.values = row[:n].tolist()

    # ---- training ----
    def train(self, rollouts: list[Rollout]) -> None:
        """Accumulate gradients for one unit (whole groups) of the current step. With GAE whitened
        over the step, the critic trains on the unit now (its returns are not whitened) and the
        policy once the optimizer step has the step's every unit."""
        self._require_finite_rewards(rollouts)
        token_adv, returns = self._advantages(rollouts)
        self._require_finite_advantages(rollouts, token_adv)
        if self.critic is not None:
            self._train_values(rollouts, returns)
        if self.s.whitens_over_step:
            self.deferred.append(rollouts)
            return
        self._train_policy(rollouts, token_adv)

    def _train_deferred(self) -> None:
        units, self.deferred = self.deferred, []
        for unit, (token_adv, _) in zip(units, step_advantages(units, self.s)):
            self._require_finite_advantages(unit, token_adv)
            self._train_policy(unit, token_adv)

    def _laid_out(self, rollouts: list[Rollout]):
        """(indices, rollouts, batch, loss mask) of each micro-batch."""
        for chunk_idx in self._micro_batch_indices(rollouts):
            chunk = [rollouts[i] for i in chunk_idx]
            batch = shared_prompt_batch([(r.prompt, r.response) for r in chunk], self._routes(chunk))
            mask = batch.response_mask()
            if chunk[0].loss_mask is not None:  # tool tokens: attended to, in no loss term
                mask = mask * _pad([r.loss_mask for r in chunk], batch.width)
            yield chunk_idx, chunk, batch, mask

    def _train_policy(self, rollouts: list[Rollout], token_adv: list[list[float]]) -> None:
        for chunk_idx, chunk, batch, mask in self._laid_out(rollouts):
            logp, entropy = token_logprobs(self.actor, batch, self.s.temperature)
            ref = _pad([r.ref_logprobs for r in chunk], batch.width) if chunk[0].ref_logprobs is not None else None
            fresh = torch.tensor([[float(r.policy_version == self.version)] for r in chunk]).expand_as(mask)
            terms = TokenTerms(logp, _pad([r.behaviour_logprobs for r in chunk], batch.width),
                               _pad([token_adv[i] for i in chunk_idx], batch.width), mask, ref, entropy, fresh=fresh)
            found = micro_batch_loss(terms, self.s, self.correction.mode)
            self._require_finite_loss(float(found.loss.detach()), "policy", chunk)
            found.loss.backward()
            self.step_stats.add(chunk, float(found.loss.detach()), found.tokens, found.clipped_tokens)
            self.step_stats.add_weights([self.version - r.policy_version for r in chunk], found.correction, mask)
            self.step_stats.mismatch.add(logp, terms.rollout_logp, mask * fresh)
            if found.mismatch is not None:
                self.step_stats.mismatch.add_weights(found.mismatch)

    def _train_values(self, rollouts: list[Rollout], returns: list) -> None:
        for chunk_idx, chunk, batch, mask in self._laid_out(rollouts):
            self.step_stats.value_loss += self._value_loss(chunk, batch, mask, [returns[i] for i in chunk_idx])

    def _advantages(self, rollouts: list[Rollout]):
        return token_advantages(rollouts, self.s)

    def _value_loss(self, chunk, batch, mask, returns) -> float:
        """Back-propagate the micro-batch's summed value loss; return it (times value_coef)."""
        values = token_values(self.critic, batch)
        old = _pad([r.values for r in chunk], batch.width)
        loss = self.s.value_coef * value_loss(values, old, _pad(returns, batch.width), mask, self.s.value_clip)
        self._require_finite_loss(float(loss.detach()), "value", chunk)
        loss.backward()
        return float(loss.detach())

    # ---- the non-finite guards: each raises before any weight changes ----
    def _require_finite_rewards(self, rollouts: list[Rollout]) -> None:
        """A reward that came from elsewhere (a reward model's or judge's executor, a remote
        learner) is checked here too; the reward functions check their own (rewards.py)."""
        for r in rollouts:
            if not r.masked and not math.isfinite(r.reward):
                self._stop(f"the reward of {_sample(r)} is {r.reward}: a reward must be a finite number; check the "
                           "reward stage's sources (a reward model or judge with damaged weights scores NaN)")

    def _require_finite_advantages(self, rollouts: list[Rollout], token_adv: list[list[float]]) -> None:
        for r, row in zip(rollouts, token_adv):
            if not all(math.isfinite(a) for a in row):
                self._stop(f"the advantage of {_sample(r)} is not finite (its reward {r.reward}); check the "
                           "critic's values and the reward stage's sources")

    def _require_finite_loss(self, loss: float, kind: str, chunk: list[Rollout]) -> None:
        if not math.isfinite(loss):
            self._stop(f"the {kind} loss of a micro-batch with {_sample(chunk[0])} is {loss}; lower the train "
                       "stage's lr, or set grad_clip, and continue from the last checkpoint with --resume")

    def _require_finite_gradients(self, norms: dict[str, float]) -> None:
        for model, norm in norms.items():
            if not math.isfinite(norm):
                self._stop(f"the {model}'s gradient norm is {norm} at step {self.version + 1}; lower the train "
                           "stage's lr, or set grad_clip, and continue from the last checkpoint with --resume")

    def _stop(self, reason: str) -> None:
        """Discard the step's gradients and deferred units (the weights are untouched) and raise
        NonFiniteError."""
        self.deferred = []
        for model in (self.actor, self.critic):
            if model is not None:
                model.zero_grad(set_to_none=True)
        raise NonFiniteError(f"{reason}; the step was not applied: no weight changed")

    def optimizer_step(self) -> dict:
        """Divide the summed gradients by the step's divisor (losses.step_divisor), clip, and step,
        once every gradient norm is known to be finite."""
        self._train_deferred()
        stats = self.step_stats
        scale = step_divisor(self.s.aggregation, stats.sequences, stats.tokens, self.s.max_tokens)
        norms = {"actor": _clip(self.actor, scale, self.s.grad_clip)}
        if self.critic is not None:
            norms["critic"] = _clip(self.critic, max(stats.tokens, 1), self.s.grad_clip)
        self._require_finite_gradients(norms)
        _apply(self.optimizer)
        if self.critic is not None:
            _apply(self.critic_optimizer)
        norm = norms["actor"]
        summary = stats.summary(scale, self.critic is not None, self.correction.reported) | {"grad_norm": norm}
        self.correction.after_step(stats.mismatch.counts)
        self.step_stats = self._new_stats()
        self.version += 1
        return summary

    def _new_stats(self) -> _StepStats:
        return _StepStats(self.shaped, Mismatch(self.s.mismatch_cap, self.s.mismatch_floor))

    def snapshot(self) -> PolicyWeights:
        return PolicyWeights(self.version, published_state(self.actor))

    def _micro_batch_indices(self, rollouts: list[Rollout]) -> list[list[int]]:
        return micro_batch_indices(rollouts, self.s.micro_tokens, self._routes(rollouts))

    def _routes(self, rollouts: list[Rollout]) -> list | None:
        """The engine's routes to replay in the policy's forward (routing_replay = rollout, R3)."""
        return [r.routes for r in rollouts] if self.s.routing_replay != "none" else None

    def _micro_batches(self, rollouts: list[Rollout]) -> list[list[Rollout]]:
        return [[rollouts[i] for i in idx] for idx in self._micro_batch_indices(rollouts)]


class ReferencePass:
    """A reference stage on executors of its own, beside the trainer's (e.g. on the generation
    pool, whose devices idle between generation bursts): the frozen reference model it is given,
    with the learner's micro-batching and temperature."""

    def __init__(self, model, settings: TrainSettings):
        self.model, self.s = model, settings

    def reference(self, rollouts: list[Rollout]) -> None:
        reference_logprobs(self.model, rollouts, self.s)


def micro_batch_indices(rollouts: list[Rollout], micro_tokens: int, routes: list | None = None) -> list[list[int]]:
    """Micro-batches of whole prompt groups, whose prompt goes through the model once
    (batching.shared_prompt_batch; with `routes` to replay, a group whose prompt took other experts is
    a row of its own), packed first-fit-decreasing by the tokens a group's row holds (its prompt and
    every response) within `micro_tokens`; a group over it is split in pieces."""
    pieces: list[list[int]] = []
    sizes: list[int] = []
    for members in prompt_groups(sharing_keys([r.prompt for r in rollouts], routes)).values():
        prompt = rollouts[members[0]].prompt
        pieces.append([])
        sizes.append(len(prompt))
        for i in members:
            if pieces[-1] and sizes[-1] + len(rollouts[i].response) > micro_tokens:
                pieces.append([])
                sizes.append(len(prompt))
            pieces[-1].append(i)
            sizes[-1] += len(rollouts[i].response)
    return [[i for k in bin_ for i in pieces[k]] for bin_ in first_fit_decreasing(sizes, max(micro_tokens, max(sizes)))]


@torch.no_grad()
def reference_logprobs(model, rollouts: list[Rollout], settings: TrainSettings) -> None:
    """Sets each rollout's ref_logprobs: the frozen model's log-probs of its response tokens."""
    for idx in micro_batch_indices(rollouts, settings.micro_tokens):
        chunk = [rollouts[i] for i in idx]
        batch = shared_prompt_batch([(r.prompt, r.response) for r in chunk])
        logp, _ = token_logprobs(model, batch, settings.temperature)
        for r, row, n in zip(chunk, logp, batch.lengths):
            r.ref_logprobs = row[:n].tolist()


class _StepStats:
    def __init__(self, shaped: bool = False, mismatch: Mismatch | None = None):
        self.sequences = self.tokens = 0
        self.loss = self.clipped = self.value_loss = 0.0  # sums over the step's micro-batches
        self.weights: dict[int, list[float]] = {}  # staleness -> [weight sum, tokens, capped tokens]
        self.rewards: list[float] = []  # the task's reward, as the reward functions gave it
        self.shaped_rewards: list[float] = []  # with shaping, as the advantage saw it
        self.shaped = shaped
        self.lengths: list[int] = []
        self.responses: set[int] = set()  # hashes of the step's distinct responses
        self.failed = 0  # samples whose score failed (masked, with the fallback reward)
        self.episodes: list[dict] = []  # agentic episodes trained this step
        self.mismatch = mismatch or Mismatch()  # the engine's log-probs against the trainer's (aspc/rl/mismatch.py)

    def add(self, chunk, loss: float, tokens: float, clipped_tokens: float) -> None:
        self.sequences += len(chunk)
        self.tokens += int(tokens)
        self.loss += loss
        self.clipped += clipped_tokens
        self.rewards += [r.task_reward for r in chunk if not r.masked]
        self.shaped_rewards += [r.reward for r in chunk if not r.masked]
        self.failed += sum(r.masked for r in chunk)
        self.episodes += [r.episode for r in chunk if r.episode is not None]
        self.lengths += [len(r.response) for r in chunk]
        self.responses.update(hash(tuple(r.response)) for r in chunk)

    def add_weights(self, staleness: list[int], correction, mask) -> None:
        """Per staleness, the importance weights pi_proximal / pi_rollout of the trained tokens."""
        raw, capped = correction.raw * mask, correction.capped * mask
        for row, stale in enumerate(staleness):
            total = self.weights.setdefault(stale, [0.0, 0.0, 0.0])
            total[0] += float(raw[row].sum())
            total[1] += float(mask[row].sum())
            total[2] += float(capped[row].sum())

    def summary(self, divisor: float, critic: bool, correction: str | None = None) -> dict:
        """`loss`: the loss the step optimised (its gradient is the one applied); `correction`: the
        mismatch correction the step used."""
        n, scored = max(self.sequences, 1), max(len(self.rewards), 1)  # the reward: of scored samples
        shaped = {"shaped_reward": sum(self.shaped_rewards) / scored} if self.shaped else {}
        failed = {"score_failed": self.failed} if self.failed else {}
        value = {"value_loss": self.value_loss / max(self.tokens, 1)} if critic else {}
        return {"reward": sum(self.rewards) / scored, **shaped, "response_len": sum(self.lengths) / n,
                "loss": self.loss / divisor, **value, "clip_fraction": self.clipped / max(self.tokens, 1),
                "samples": self.sequences, **failed, **self._weight_metrics(), **self.mismatch.metrics(correction),
                **episode_metrics(self.episodes),
                **self._spread()}

    def _spread(self) -> dict:
        """How much the step's rewards and responses varied (aspc/controller/health.py reads them)."""
        spread = max(self.rewards) - min(self.rewards) if self.rewards else 0.0
        return {"reward_spread": spread, "responses_distinct": len(self.responses)}

    def _weight_metrics(self) -> dict:
        """is_weight: the mean weight per staleness (1 when nothing changed since generation);
        is_capped: the fraction of those tokens whose weight the cap truncated or dropped."""
        rows = sorted((s, w) for s, w in self.weights.items() if w[1] > 0)
        return {"is_weight": {str(s): w[0] / w[1] for s, w in rows},
                "is_capped": {str(s): w[2] / w[1] for s, w in rows}} if rows else {}


def episode_metrics(episodes: list[dict]) -> dict:
    """Per step: mean turns and tool calls per episode, and how many ended for each reason."""
    if not episodes:
        return {}
    n = len(episodes)
    ended: dict[str, int] = {}
    for e in episodes:
        ended[e["ended"]] = ended.get(e["ended"], 0) + 1
    return {"turns": sum(e["turns"] for e in episodes) / n, "tool_calls": sum(e["tool_calls"] for e in episodes) / n,
            "ended": dict(sorted(ended.items()))}


def _clip(model, scale: float, grad_clip: float) -> float:
    """Divide the model's summed gradients by `scale`, clip them; their norm before clipping."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad /= scale
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf")))


def _apply(optimizer) -> None:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _sample(r: Rollout) -> str:
    """A sample as a message names it: its id where known, and its prompt."""
    where = f"sample {r.key} " if r.key is not None else "the sample "
    return f"{where}(prompt {r.prompt_text!r})"


def _pad(rows, width: int) -> torch.Tensor:
    return torch.tensor([list(r) + [0.0] * (width - len(r)) for r in rows], dtype=torch.float32)


def _decode(ids) -> str:
    from aspc.rl.tokenizer import decode

    return decode(ids)


