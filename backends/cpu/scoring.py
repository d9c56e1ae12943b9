"""A reward stage with model(...) or judge(...) sources, scored on its own executor (the
ForwardModel and Judge roles of aspc/roles.py): `RewardScorer.score` sets each rollout's reward to
the stage's exact weighted sum of its sources — a reward model's scalar, a judge's score
(judge.py), and rule(...) / python(...) terms through the reward functions of rewards.py — with
the learner's overlong shaping. A source's score that is NaN or infinite stops the step with a
NonFiniteError naming the source and the sample (on a judge's stage, aspc/drivers/local/scoring.py
takes it as a failed call: the sample is masked with the judge's fallback reward)."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from aspc.rl.call_batching import BatchedCalls
from aspc.backends.cpu.judge import CpuJudge
from aspc.backends.cpu.reward_model import RewardModel
from aspc.rl.rewards import RULES, RewardError, load_callable, non_finite_reward, sample_text, score_one
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


class _ModelTerm:
    def __init__(self, model: RewardModel, source: str):
        self.model, self.source = model, source

    def scores(self, rollouts: list) -> list[float]:
        return self.model([(r.prompt, r.response) for r in rollouts]).tolist()


class _FunctionTerm:
    def __init__(self, function, source: str):
        self.function, self.source = function, source

    def scores(self, rollouts: list) -> list[float]:
        return [score_one(self.function, (r.prompt_text, decode(r.response), r.answer, r.metadata), self.source)
                for r in rollouts]


def build_terms(sources, models: dict, base_dir: Path | None) -> list[tuple[object, float]]:
    """The stage's sources in order: model(NAME) -> the loaded reward model, judge(NAME) -> the
    loaded judge with the source's rubric and read, rule and python -> their functions. `models`:
    name -> a RewardModel or a judge's TinyQwen, each this instance's own copy."""
    terms: list[tuple[object, float]] = []
    term: _ModelTerm | CpuJudge | _FunctionTerm
    for source in sources:
        if source.func == "model":
            term = _ModelTerm(models[source.get("model")], f"model({source.get('model')})")
        elif source.func == "judge":
            term = CpuJudge(models[source.get("model")], source.get("prompt"), source.get("read"))
            term.source = f"judge({source.get('model')})"
        elif source.func == "rule":
            term = _FunctionTerm(RULES[source.get("name")], f'rule("{source.get("name")}")')
        elif source.func == "python":
            term = _FunctionTerm(load_callable(source.get("function"), base_dir), f'python("{source.get("function")}")')
        else:
            raise RewardError(f"the CPU backend does not execute {source.func}(...) sources yet")
        terms.append((term, source.get("weight")))
    return terms
