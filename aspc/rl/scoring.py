"""A reward stage with model(...) or judge(...) sources, scored on its own executor (the
ForwardModel and Judge roles of aspc/roles.py), engine-free: `RewardScorer.score` sets each
rollout's reward to the stage's exact weighted sum of its sources' terms — a reward model's scalar,
a judge's score (an engine's: backends/cpu/scoring.py, backends/ascend/scorers.py), and rule(...) /
python(...) terms (`function_term`) through the reward functions of rewards.py — with the learner's
overlong shaping. A source's score that is NaN or infinite stops the step with a NonFiniteError
naming the source and the sample (on a judge's stage, aspc/drivers/local/scoring.py takes it as a
failed call: the sample is masked with the judge's fallback reward)."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from aspc.rl.call_batching import BatchedCalls
from aspc.rl.rewards import RULES, load_callable, non_finite_reward, sample_text, score_one
from aspc.rl.rollout import Shaping
from aspc.rl.tokenizer import decode


class RewardScorer:
    """One instance of a reward stage: the exact weighted sum of all the stage's sources. Serves
    as the ForwardModel (`score`) and the Judge (`judge`) role alike."""

    def __init__(self, terms: list[tuple[object, float]], shaping: Shaping):
        self.terms, self.shaping = terms, shaping  # (a term with .source and .scores(rollouts), weight)

    @torch.no_grad()
    def score(self, rollouts: list) -> None:
        totals = [0.0] * len(rollouts)
        for term, weight in self.terms:
            totals = [t + weight * s for t, s in zip(totals, finite_scores(term, rollouts))]
        for r, total in zip(rollouts, totals):
            r.task_reward = total
            self.shaping.shape(r)

    judge = score


def finite_scores(term, rollouts: list) -> list[float]:
    """The term's scores of the rollouts; NonFiniteError naming the term and the first sample
    whose score is NaN or infinite."""
    scores = [float(s) for s in term.scores(rollouts)]
    for r, value in zip(rollouts, scores):
        if not math.isfinite(value):
            source = getattr(term, "source", type(term).__name__)
            raise non_finite_reward(value, source, sample_text(r.prompt_text, decode(r.response)))
    return scores


class JudgeScorer:
    """A RewardScorer serving the Judge role on the CPU: `judge` batches concurrent calls
    (call_batching.py); `score` and `terms` are the scorer's own."""

    def __init__(self, scorer: RewardScorer):
        self.scorer, self.terms, self.score = scorer, scorer.terms, scorer.score
        self.judge = BatchedCalls(scorer.score)


class FunctionTerm:
    """A rule(...) or python(...) source: its function of the decoded text."""

    def __init__(self, function, source: str):
        self.function, self.source = function, source

    def scores(self, rollouts: list) -> list[float]:
        return [score_one(self.function, (r.prompt_text, decode(r.response), r.answer, r.metadata), self.source)
                for r in rollouts]


def function_term(source, base_dir: Path | None) -> FunctionTerm:
    """A rule(...) or python(...) source's term."""
    if source.func == "rule":
        return FunctionTerm(RULES[source.get("name")], f'rule("{source.get("name")}")')
    return FunctionTerm(load_callable(source.get("function"), base_dir), f'python("{source.get("function")}")')
