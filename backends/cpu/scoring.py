"""The CPU backend's terms of a reward stage with model(...) or judge(...) sources: a tiny reward
model's scalar and a tiny judge's score (judge.py), summed with rule(...) and python(...) terms by the
engine-free RewardScorer of aspc/rl/scoring.py."""
from __future__ import annotations

from pathlib import Path

from aspc.backends.cpu.judge import CpuJudge
from aspc.backends.cpu.reward_model import RewardModel
from aspc.rl.rewards import RewardError
from aspc.rl.scoring import FunctionTerm, function_term


class _ModelTerm:
    def __init__(self, model: RewardModel, source: str):
        self.model, self.source = model, source

    def scores(self, rollouts: list) -> list[float]:
        return self.model([(r.prompt, r.response) for r in rollouts]).tolist()


def build_terms(sources, models: dict, base_dir: Path | None) -> list[tuple[object, float]]:
    """The stage's sources in order: model(NAME) -> the loaded reward model, judge(NAME) -> the
    loaded judge with the source's rubric and read, rule and python -> their functions. `models`:
    name -> a RewardModel or a judge's TinyQwen, each this instance's own copy."""
    terms: list[tuple[object, float]] = []
    term: _ModelTerm | CpuJudge | FunctionTerm
    for source in sources:
        if source.func == "model":
            term = _ModelTerm(models[source.get("model")], f"model({source.get('model')})")
        elif source.func == "judge":
            term = CpuJudge(models[source.get("model")], source.get("prompt"), source.get("read"))
            term.source = f"judge({source.get('model')})"
        elif source.func in ("rule", "python"):
            term = function_term(source, base_dir)
        else:
            raise RewardError(f"the CPU backend does not execute {source.func}(...) sources yet")
        terms.append((term, source.get("weight")))
    return terms
