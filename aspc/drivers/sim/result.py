"""What a simulation reports: throughput, the bubble breakdown, the bound, staleness, a trace."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from aspc.drivers.sim.driver import Simulation
from aspc.memory import no_cycle_collection
from aspc.accounting.ledger import CATEGORIES, Ledger, gaps, merge, split_by, step_function_positive


@dataclass
class SimResult:
    pipeline: str
    schedule: str
    steps: int
    devices: int
    wall_s: float
    samples_per_step: int
    mean_prompt: float
    mean_response: float
    bubbles: dict[str, float]  # device-seconds per category; they sum to devices x wall
    staleness: dict[int, int]
    ledger: Ledger | None = field(default=None, repr=False)  # its spans: `spans`, made when first read
    pools: dict[str, tuple[int, float]] = field(default_factory=dict)  # pool -> (devices, busy device-seconds)
    tool_calls: int = 0  # agentic episodes: tool calls run (0 without an environment stage)
    endings: dict[str, int] = field(default_factory=dict)  # agentic episodes: why they ended -> count
    oversample: float = 0.0  # dynamic sampling: prompts generated per prompt trained (0: off)
    filtered_tokens: float = 0.0  # dynamic sampling: share of generated tokens never trained
    padded_groups: int = 0  # dynamic sampling: all-equal groups trained because a step hit its bound
    moves: tuple = ()  # runtime rebalancing: (when, generation instance, "learn" | "gen") as carried out
    # per generation instance: (the most tokens of context its KV cache held, its KV budget, preemptions)
    kv: tuple[tuple[float, float, int], ...] = ()

    @functools.cached_property
    def spans(self) -> list:
        """The trace: every piece of work and bubble (hundreds of thousands of generation segments
        for a large plan, made only when a trace, a plot or a report asks)."""
        return self.ledger.all_spans() if self.ledger is not None else []

    @property
    def step_time(self) -> float:
        return self.wall_s / self.steps

    @property
    def e2e_tps(self) -> float:
        """MindSpeed-RL's throughput: (mean response + mean prompt) x samples per step / devices / step time."""
        return (self.mean_prompt + self.mean_response) * self.samples_per_step / self.devices / self.step_time

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_step * self.steps / self.wall_s

    @property
    def bound_step_time(self) -> float:
        """The step time if every device did only useful work at the modelled efficiency."""
        return self.bubbles["useful"] / self.devices / self.steps

    @property
    def efficiency(self) -> float:
        return self.bound_step_time / self.step_time

    def share(self, category: str) -> float:
        return self.bubbles[category] / sum(self.bubbles.values())

    def pool_share(self, pool: str) -> float:
        """The pool's part of all busy device-seconds (generation, learner-side work, weight
        transfers and pool switches): what its stages cost the cluster."""
        total = sum(busy for _, busy in self.pools.values())
        return self.pools[pool][1] / total if total else 0.0

    def pool_utilization(self, pool: str) -> float:
        """The pool's busy device-seconds over its devices x wall time."""
        devices, busy = self.pools[pool]
        return busy / (devices * self.wall_s) if devices and self.wall_s else 0.0


def collect(sim: Simulation) -> SimResult:
    wall = sim.now
    devices = sum(p.count for p in sim.plan.pools)
    _account_switches(sim)
    decoded = _account_instances(sim, wall)
    _account_learners(sim, wall)
    pools = _pool_busy(sim, wall, decoded)
    bubbles = sim.ledger.close(devices * wall)
    trained = [(step, p) for step in range(sim.steps) for p in sim.controller.trained_prompts(step)]
    count = len(trained) * sim.data.group
    prompts = sum(sim.prompt_len(step, p) for step, p in trained) * sim.data.group / count
    used = sum(sim.group_model_tokens(step, p) for step, p in trained)  # not tool results
    responses = used / count
    result = SimResult(sim.plan.pipeline, sim.plan.schedule, sim.steps, devices, wall,
                       sim.data.samples_per_step, prompts, responses, bubbles,
                       dict(sorted(sim.controller.staleness.items())), sim.ledger, pools,
                       sim.tool_calls, dict(sorted(sim.endings.items())), *_dynamic_sampling(sim, used))
    result.moves = tuple(sim.moves)
    result.kv = tuple((inst.kv_peak, inst.kv_budget, inst.preemptions) for inst in sim.instances)
    return result


def _dynamic_sampling(sim: Simulation, used: int) -> tuple[float, float, int]:
    """(prompts generated per prompt trained, share of generated tokens never trained, groups padded);
    `used`: the model tokens of the samples trained."""
    groups = sim.controller.filter
    if groups is None:
        return 0.0, 0.0, 0
    steps = [groups.steps[s] for s in range(sim.steps) if s in groups.steps]
    history = sim.controller.gen.history
    generated = sum(sum(lengths) for (step, _), lengths in history.items() if step < sim.steps)
    return (sum(s.generated for s in steps) / (len(steps) * sim.data.prompts_per_step),
            1 - used / generated if generated else 0.0, sum(len(s.padded) for s in steps))


def _pool_busy(sim: Simulation, wall: float, segment_seconds: dict[int, float]) -> dict[str, tuple[int, float]]:
    """Busy device-seconds per pool, in the plan's pool order: generation instances' segments
    (prefill, decode, padding, weight loads: `segment_seconds`, each instance's as booked),
    learner-side executors' items (reward model, judge, reference, critic, train, optimizer,
    publish) and a time-shared pool's switches."""
    busy = {p.name: 0.0 for p in sim.plan.pools}
    for inst in sim.instances:
        busy[sim.gen_pool] += segment_seconds[inst.index] * inst.devices
    for ex in sim.executors:
        busy[ex.spec.pool] += sum(min(b, wall) - a for a, b in ex.busy if a < wall) * ex.devices
    for start, end, pool in sim.switch_spans:
        busy[pool] += max(0.0, min(end, wall) - start) * sim.plan.pool(pool).count
    trainer = sim.executors[sim.controller.devices.trainer]
    for index, spans in sim.lent_spans.items():  # a lent instance's devices work for the trainer
        lent = merge([(a, min(b, wall)) for a, b in spans])
        worked = sum(b - a for interval in trainer.busy for a, b in split_by(interval, lent)[0])
        busy[sim.gen_pool] += worked * sim.instances[index].devices
    return {p.name: (p.count, busy[p.name]) for p in sim.plan.pools}


def _mode_intervals(sim: Simulation, pool: str, wanted) -> list[tuple[float, float]]:
    marks = sim.modes.get(pool)
    if marks is None:
        return [(0.0, sim.now)] if "gen" in wanted else []
    out = []
    for (t, mode), (t2, _) in zip(marks, marks[1:] + [(sim.now, "")]):
        if mode in wanted and t2 > t:
            out.append((t, t2))
    return out


def _account_switches(sim: Simulation) -> None:
    for start, end, pool in sim.switch_spans:
        devices = sim.plan.pool(pool).count
        sim.ledger.span(f"{pool} switch", start, min(end, sim.now), "sync", "offload/onload", devices)


def _account_instances(sim: Simulation, wall: float) -> dict[int, float]:
    """Book each generation instance's segments and idle gaps; returns the seconds of its segments
    (before `wall`) by instance."""
    pool = sim.gen_pool
    owned = _mode_intervals(sim, pool, ("gen",))
    busy = {i.index: _busy(i.segments, wall) for i in sim.instances}
    # Inside an instance's idle gaps, all instances' busy time is its peers' busy time: one union
    anyone = merge([iv for ivs in busy.values() for iv in ivs])
    seconds = {}
    for inst in sim.instances:
        track = f"{sim.gen_stage.name}[{inst.index}]"
        seconds[inst.index] = sim.ledger.segments(track, inst.segments, wall, inst.devices)
        peers = anyone
        held = merge([(a, min(b, wall)) for a, b in inst.held_intervals(wall)])
        lent = merge([(a, min(b, wall)) for a, b in sim.lent_spans.get(inst.index, [])])  # the trainer books them
        for owned_start, owned_end in owned:
            for gap in [part for g in gaps(busy[inst.index], owned_start, owned_end) for part in split_by(g, lent)[1]]:
                tools, rest = split_by(gap, held)  # idle while its live episodes all wait on tools
                for a, b in tools:
                    sim.ledger.span(track, a, b, "tool_wait", "idle: every episode waits on a tool", inst.devices)
                for part in rest:
                    _account_idle(sim, track, part, peers, inst.devices)
    return seconds


def _busy(segments: list[tuple[float, float, str]], wall: float) -> list[tuple[float, float]]:
    """merge() of the segments cut at `wall`, in one pass: an instance books them in time order
    (hundreds of thousands); out of order, merge() sorts them."""
    out: list[list[float]] = []
    latest = float("-inf")
    for start, end, _ in segments:
        if start < latest:
            return merge([(a, min(b, wall)) for a, b, _ in segments])
        latest, end = start, min(end, wall)
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1][1] = end
        elif end > start:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _account_idle(sim: Simulation, track: str, gap: tuple[float, float], peers, devices: int) -> None:
    skew, wait = split_by(gap, peers)
    for a, b in skew:
        sim.ledger.span(track, a, b, "skewness", "idle: a peer still works", devices)
    for a, b in wait:
        sim.ledger.span(track, a, b, "sorting", "idle: input not released", devices)


def _account_learners(sim: Simulation, wall: float) -> None:
    """Learner-side executors (reward model, reference, critic, trainer): idle while finished
    samples are held back is a sorting bubble; the rest of their idle time stays idle."""
    held = merge([(a, min(b, wall)) for a, b in step_function_positive(sim.held)])
    for ex in sim.executors:
        spec = ex.spec
        owned = _mode_intervals(sim, spec.pool, ("learn",)) if spec.time_shared else [(0.0, wall)]
        for owned_start, owned_end in owned:
            for gap in gaps(ex.busy, owned_start, owned_end):
                waiting, _ = split_by(gap, held)
                for a, b in waiting:
                    sim.ledger.span(spec.name, a, b, "sorting", "idle: samples held back", ex.devices)


def simulate(plan, steps: int, pricing, progress=None) -> SimResult:
    """Run the plan for `steps` on the simulator with `pricing` (the sim backend's
    RooflinePricing, or a calibrated or fake one) and collect what it reports."""
    with no_cycle_collection():  # no reference cycles: refcounting frees it (driver.StepLengths)
        sim = Simulation(plan, steps, pricing, progress)
        sim.run()
        result = collect(sim)
        del sim  # freed before the collector runs again: it would scan all of it once, for nothing
    return result


__all__ = ["SimResult", "simulate", "CATEGORIES"]
