"""`aspc simulate --compare`: the synchronous baselines at their best mini-batching.

A synchronous framework trains one generation's rollouts in mini-batches, an optimizer step each
(verl's ppo_mini_batch_size, MindSpeed-RL's mini_batch_size): the later mini-batches are as stale as
asp's samples. So that every speed-up asp claims is over the strongest sync the language expresses,
a sync row whose train stage leaves `mini_batches` unwritten is simulated with each mini-batching
from 1 to asp's staleness + 1 (no sync sample is staler than asp's bound) and shows the fastest.
"""
from __future__ import annotations

import dataclasses

from aspc.plan.execution_plan import ExecutionPlan

SYNC_SCHEDULES = ("sync", "sync@colocated")


def with_mini_batches(plan: ExecutionPlan, mini_batches: int) -> ExecutionPlan:
    """The plan with its train stage's mini_batches set."""
    stages = tuple(dataclasses.replace(s, options=tuple({**dict(s.options), "mini_batches": mini_batches}.items()))
                   if s.kind == "train" else s for s in plan.stages)
    return dataclasses.replace(plan, stages=stages)


def written(plan: ExecutionPlan) -> bool:
    """Whether the train stage's mini_batches was written (then it is kept as written)."""
    return "mini_batches" in dict(plan.stages_of("train")[0].options)


def best_mini_batching(results: list, plans: dict, asp_staleness: int, simulate) -> tuple[list, list[str]]:
    """Each sync result replaced by its plan's fastest mini-batching (simulate(plan) -> result),
    and a line per sync row that says which was chosen among which."""
    notes, out = [], []
    choices = range(1, asp_staleness + 2)
    for r in results:
        plan = plans.get(r.schedule)
        if r.schedule not in SYNC_SCHEDULES or plan is None or written(plan) or len(choices) == 1:
            out.append(r)
            continue
        tried = {1: r} | {m: dataclasses.replace(simulate(with_mini_batches(plan, m)), schedule=r.schedule)
                          for m in choices[1:]}
        best = max(tried, key=lambda m: tried[m].e2e_tps)
        out.append(tried[best])
        shown = ", ".join(f"{m}: {tried[m].step_time:.1f} s" for m in tried)
        notes.append(f"{r.schedule}: at its best mini-batching, mini_batches = {best} (step time by "
                     f"mini_batches {shown}; asp's staleness {asp_staleness} bounds it)")
    return out, notes
