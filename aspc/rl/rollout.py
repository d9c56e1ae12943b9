"""A sample as every trainer sees it (`Rollout`), the train stage's settings (`TrainSettings`), and
how a trainer scores its samples on the host (`TaskReward`): the pipeline's rule and python reward
functions on the response's text, plus DAPO's overlong shaping. Every trainer (the CPU learner, the
megatron trainer) and every reward executor scores through these, so a reward function is called
the same way everywhere: function(prompt, response text, answer, metadata)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any
from dataclasses import dataclass, field

from aspc.rl.losses import (LOSS_DEFAULTS, default_aggregation, gae, group_advantages, kl_rewards, overlong_penalty,
                             whiten)


@dataclass
class Rollout:
    """One sample as it moves through the learner."""

    prompt: list[int]
    response: list[int]
    behaviour_logprobs: list[float]
    prompt_text: str
    answer: str | None
    metadata: dict = field(default_factory=dict)
    reward: float = 0.0  # what the advantage uses: the task's reward plus any shaping
    task_reward: float = 0.0  # the reward functions' score alone
    ref_logprobs: list[float] | None = None
    values: list[float] | None = None
    key: tuple | None = None  # the sample id, so a remote learner can keep its copy
    masked: bool = False  # its score failed (aspc/controller/scoring.py): the fallback reward, advantage 0
    loss_mask: list[int] | None = None  # agentic: 0 on tool tokens, which no loss term counts
    episode: dict | None = None  # agentic: turns, tool calls, why it ended (aspc/controller/episodes.py)
    text: str | None = None  # what the reward reads (agentic: the final answer); None: the whole response
    policy_version: int = 0  # the policy it was generated under (the published weights' version)
    routes: Any = None  # MoE: the engine's experts per position, int16 [positions, moe layers, top_k] (R3)


@dataclass
class TrainSettings:
    loss: str
    lr: float
    kl: float
    clip: float
    clip_high: float
    value_coef: float
    entropy_coef: float
    micro_tokens: int
    weight_decay: float
    grad_clip: float
    overlong: int
    max_tokens: int
    estimator: str
    gamma: float
    lam: float
    normalize: bool
    group: int
    critic_lr: float = 1e-5
    loss_agg: str | None = LOSS_DEFAULTS["loss_agg"]  # None: by loss (default_aggregation)
    off_policy: str = LOSS_DEFAULTS["off_policy"]  # clip | tis | decoupled
    is_cap: float = LOSS_DEFAULTS["is_cap"]
    value_clip: float = LOSS_DEFAULTS["value_clip"]  # 0: off
    kl_estimator: str = LOSS_DEFAULTS["kl_estimator"]  # k1 | k2 | k3 | k3_plus
    dual_clip: float = LOSS_DEFAULTS["dual_clip"]  # 0: off
    ratio: str = LOSS_DEFAULTS["ratio"]  # token | sequence (GSPO)
    mismatch: str = LOSS_DEFAULTS["mismatch"]  # aspc/rl/mismatch.py's MODES
    mismatch_cap: float = LOSS_DEFAULTS["mismatch_cap"]
    mismatch_floor: float = LOSS_DEFAULTS["mismatch_floor"]
    kl_reward: float = LOSS_DEFAULTS["kl_reward"]  # 0: no KL in the reward
    routing_replay: str = LOSS_DEFAULTS["routing_replay"]  # none | rollout (R3: the engine's experts replayed)
    temperature: float = 1.0  # the sampling temperature: log-probs are of the logits over it

    @property
    def aggregation(self) -> str:
        return self.loss_agg or default_aggregation(self.loss)

    @property
    def whitens_over_step(self) -> bool:
        """GAE whitened over the step's every sample (the controller hands its units together:
        aspc/controller/config.py's whitens_over_step): a trainer defers their policy loss to the step."""
        return self.estimator == "gae" and self.normalize


def token_advantages(rollouts: list[Rollout], s: TrainSettings) -> tuple[list[list[float]], list]:
    """Each rollout's response-token advantages, and with GAE its returns (else None), for whole
    groups, as every trainer trains them: GRPO/DAPO/RLOO's group advantage on every token, or GAE
    over the critic's values, whitened over the rollouts given where the advantage stage normalizes
    (verl compute_gae_advantage_return; trainers give the step's: step_advantages). A masked sample
    (failed score) has advantage 0 and returns equal to its values."""
    if s.estimator == "gae":
        pairs = [gae(r.reward, _critic_values(r), s.gamma, s.lam, _kl_in_reward(r, s)) if not r.masked
                 else ([0.0] * len(_critic_values(r)), list(_critic_values(r))) for r in rollouts]
        advantages = [a for a, _ in pairs]
        if s.normalize:
            advantages = whiten(advantages, [r.masked for r in rollouts])
        return advantages, [ret for _, ret in pairs]
    scalar = group_advantages([r.reward + sum(_kl_in_reward(r, s) or []) for r in rollouts], s.group, s.estimator,
                              s.normalize, [r.masked for r in rollouts])
    return [[a] * len(r.response) for a, r in zip(scalar, rollouts)], [None] * len(rollouts)


def step_advantages(units: list[list[Rollout]], s: TrainSettings) -> list[tuple[list, list]]:
    """Each unit's token advantages and returns, computed over the step's units together (GAE
    whitened over the step, as under sync)."""
    advantages, returns = token_advantages([r for unit in units for r in unit], s)
    out, start = [], 0
    for unit in units:
        out.append((advantages[start:start + len(unit)], returns[start:start + len(unit)]))
        start += len(unit)
    return out


def _kl_in_reward(r: Rollout, s: TrainSettings) -> list[float] | None:
    """Each token's KL to the reference in the reward (kl_reward), of the engine's log-probs (verl
    takes the trainer's recomputed ones: equal where the engine agrees); None without it."""
    if not s.kl_reward:
        return None
    assert r.ref_logprobs is not None, f"sample {r.key}: kl_reward without the reference's log-probs"
    return kl_rewards(r.behaviour_logprobs, r.ref_logprobs, s.kl_reward, r.loss_mask)


def _critic_values(rollout: Rollout) -> list[float]:
    """The critic's values of a rollout: GAE runs only after the critic's pass set them."""
    assert rollout.values is not None, f"sample {rollout.key}: GAE without the critic's values"
    return rollout.values


def model_tokens(r: Rollout) -> int:
    """Tokens the model wrote (tool tokens do not count against its budget)."""
    return sum(r.loss_mask) if r.loss_mask is not None else len(r.response)


@dataclass(frozen=True)
class Shaping:
    """DAPO's overlong shaping of the task's reward (any loss): 0 up to max_tokens - overlong model
    tokens, then linearly down to -1 at max_tokens; overlong 0: none."""

    overlong: int
    max_tokens: int

    def shape(self, r: Rollout) -> None:
        """`r.reward` from `r.task_reward`, with the penalty of its length."""
        r.reward = r.task_reward
        if self.overlong:
            r.reward += overlong_penalty(model_tokens(r), self.max_tokens, self.overlong)


@dataclass(frozen=True)
class TaskReward:
    """How a trainer scores rollouts on the host: `function(prompt, response text, answer,
    metadata)` (aspc/rl/rewards.py's WeightedReward), the text decoded by the policy's tokenizer
    unless the rollout carries the text a reward reads (agentic: the final answer), then shaped."""

    function: Callable
    decode: Callable  # response ids -> text
    shaping: Shaping

    def score(self, rollouts: list[Rollout]) -> None:
        for r in rollouts:
            text = r.text if r.text is not None else self.decode(r.response)
            r.task_reward = self.function(r.prompt_text, text, r.answer, r.metadata)
            self.shaping.shape(r)
