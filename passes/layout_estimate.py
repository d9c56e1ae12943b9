"""The objective of `auto-place`: a layout's step time from the roofline cost model, in closed form.

Per step, from the declared length distributions (two sampled steps):
  generation  each instance decodes its share of the step's sequences: at its concurrency (KV room,
              max_num_seqs, and the sequences the schedule lets it hold) while the queue lasts, then
              the longest sequences drain in a shrinking batch; plus prefill and the weight load.
  learner     each learner-side stage's forward or training FLOPs on its data-parallel ranks, the
              1F1B fill/drain, the optimizer step and (disaggregated) assembling the weights to send.
  schedule    sync: generation then the learner; asp on separate pools: they overlap within the
              staleness bound (the drain of one step overlaps the next step's queue), but not
              perfectly: each side's variation from step to step stalls the other, which the
              2-norm of the two sides' times models (the slower side when one dominates, 1.41x it
              when balanced; fitted to the simulator on grpo_7b, bench/RESULTS.md); colocated:
              both sides one after the other, plus the pool switches.
The simulator prices the same terms event by event; this is its fluid approximation, used to rank
thousands of layouts in a second (bench/RESULTS.md, "Automatic placement", compares the two).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from aspc.algorithms.packing import bucket_for, choose_buckets, packed_lengths
from aspc.costmodel.learner import balance, pipeline_fill_drain
from aspc.costmodel.roofline import (GenerationCost, LearnerCost, broadcast_seconds, gather_to_sender_seconds,
                                     offload_seconds, parameters, reshard_seconds, weight_shard_bytes)
from aspc.costmodel.workload import sample_step
from aspc.ir.facts import DTYPE_BYTES
from aspc.ir.graph import Parallel, StageGraph, StageKind
from aspc.ir.layout_space import Candidate, Roles

SAMPLED_STEPS = 2


@dataclass(frozen=True)
class Estimate:
    step_s: float
    gen_s: float
    learn_s: float
    useful: float  # device-seconds per step at the roofline
    devices: int
    tokens: float  # prompt + response tokens per step

    @property
    def tps(self) -> float:
        return self.tokens / self.devices / self.step_s

    @property
    def efficiency(self) -> float:
        return min(1.0, self.useful / (self.devices * self.step_s))

    @property
    def bound(self) -> str:
        return "generation" if self.gen_s >= self.learn_s else "learner"


class Estimator:
    """Prices candidates of one program under one schedule; caches per stage shape."""

    def __init__(self, graph: StageGraph, roles: Roles, schedule: str, staleness: int,
                 packings: dict | None = None):
        """`packings`: a cache of packed steps that estimators of one program at other staleness
        bounds share (packing does not depend on it)."""
        self.graph, self.roles, self.schedule, self.staleness = graph, roles, schedule, staleness
        self.packings = {} if packings is None else packings
        data = graph.data[roles.gen.data]
        steps = [sample_step(data, s) for s in range(SAMPLED_STEPS)]
        self.responses = [sorted((x.response_len for x in step), reverse=True) for step in steps]
        self.prompt = sum(x.prompt_len for step in steps for x in step) / sum(map(len, steps))
        self.samples = data.samples_per_step
        self.lengths = [[x.tokens for x in step] for step in steps]
        self.tokens = sum(map(sum, self.lengths)) / SAMPLED_STEPS
        self.total_devices = sum(p.count for p in graph.pools.values())
        model = graph.models[roles.gen.model]
        self.arch, self.dtype = model.arch, DTYPE_BYTES[model.dtype]
        self.hw = graph.pools[roles.gen_pool].hardware

    def estimate(self, c: Candidate, packing: tuple[int, int] | None = None) -> Estimate:
        """`packing` (token budget, bucket count): price the micro-batches' padding and count as the
        pack pass forms them; None: unpadded, at the train stage's micro_tokens."""
        gen, gen_useful = self._generation(c.gen_parallel, c.gen_instances, c.colocated)
        learn, learn_useful = self._learner(c, packing)
        load, publish = self._sync(c)
        if c.colocated:
            step = gen + learn + load + publish
        elif self.schedule == "asp":  # overlapped, but each side's step-to-step variation stalls the other
            step = math.hypot(gen + load, learn + publish)
        else:
            step = gen + load + learn + publish
        return Estimate(step, gen + load, learn + publish, gen_useful + learn_useful, self.total_devices,
                        self.tokens)

    # ---- generation ----
    @functools.lru_cache(maxsize=4096)  # noqa: B019 (one estimator per search; freed with it)
    def _generation(self, par: Parallel, instances: int, colocated: bool) -> tuple[float, float]:
        """Seconds a step of the slowest instance and useful device-seconds. Overlapped (asp on its
        own devices): the queue of k + 1 steps feeds it. In phases (sync, or a time-shared pool):
        each phase generates the k + 1 steps the staleness bound allows, then drains."""
        gen = self.roles.gen
        cost = GenerationCost(self.arch, self.hw, par, self.dtype, gen.option("graph_mode", True))
        capacity = cost.capacity(self.tokens / self.samples, gen.option("gpu_memory_utilization"),
                                 gen.option("max_num_seqs"))
        per_phase = 1 + self.staleness
        merged = sorted((r for step in self.responses for r in step), reverse=True)
        share = merged[::instances * len(self.responses) // per_phase or 1]
        prefill = cost.prefill(int(len(share) * self.prompt)) / per_phase
        if colocated or self.schedule != "asp":
            seconds = self._drain(cost, share, max(1, min(capacity, len(share)))) / per_phase
        else:  # one step's share, with the queue of k + 1 steps in flight
            seconds = sum(self._overlapped(cost, step[::instances], min(capacity, len(step[::instances]) * per_phase))
                          for step in self.responses) / len(self.responses)
        tokens = sum(merged) / len(self.responses)
        saturated = tokens * (cost.beta(capacity) / capacity + cost.alpha * (self.prompt + tokens / self.samples / 2))
        return seconds + prefill, (saturated + prefill * instances) * par.devices

    def _overlapped(self, cost: GenerationCost, share: list[int], batch: int) -> float:
        """The queue at `batch` sequences; the next step's queue fills the drain, so of it only the
        longest sequence's own decode steps remain."""
        rate = batch / (cost.beta(batch) + cost.alpha * batch * (self.prompt + sum(share) / len(share) / 2))
        longest = share[0] * (cost.beta(1) + cost.alpha * (self.prompt + share[0] / 2))
        return max(sum(share) / rate, longest / (1 + self.staleness))

    def _drain(self, cost: GenerationCost, share: list[int], batch: int) -> float:
        """The shortest sequences at `batch` while the queue lasts, then the longest `batch` drain
        in a batch that shrinks as they end."""
        rate = batch / (cost.beta(batch) + cost.alpha * batch * (self.prompt + sum(share) / len(share) / 2))
        drain, last = 0.0, 0
        for i, length in enumerate(reversed(share[:batch])):  # shortest first: batch shrinks as they end
            alive = min(batch, len(share)) - i
            drain += (length - last) * (cost.beta(alive) + cost.alpha * alive * (self.prompt + length / 2))
            last = length
        return sum(share[batch:]) / rate + drain

    # ---- learner side ----
    def _learner(self, c: Candidate, packing: tuple[int, int] | None) -> tuple[float, float]:
        total = useful = 0.0
        for placed in c.layout.stages:
            stage = self.graph.stage(placed.stage)
            if stage.kind is StageKind.GENERATE:
                continue
            streamed = self.schedule == "asp" and not c.colocated
            seconds, busy = self._stage_cached(placed.stage, placed.parallel, placed.instances, streamed, packing)
            total += seconds
            useful += busy
        return total, useful

    @functools.lru_cache(maxsize=4096)  # noqa: B019
    def _stage_cached(self, name: str, par: Parallel, instances: int, streamed: bool,
                      packing: tuple[int, int] | None = None) -> tuple[float, float]:
        stage = self.graph.stage(name)
        model_name = stage.model or _scoring_model(stage)
        if model_name is None:
            return 0.0, 0.0
        arch = self.graph.models[model_name].arch
        recompute = bool(stage.option("recompute", False))
        cost = LearnerCost(arch, self.hw, par, recompute, DTYPE_BYTES[self.graph.models[model_name].dtype])
        ranks = par.dp * instances
        tokens = self.tokens / ranks
        squares = sum(x * x for step in self.lengths for x in step) / SAMPLED_STEPS / ranks
        train = stage.kind in (StageKind.TRAIN, StageKind.CRITIC)
        busy = (cost.train if train else cost.forward)(tokens, squares) * (stage.option("epochs", 1) or 1)
        if packing is None:
            padded = busy
            micro = max(1, math.ceil(self._unit_tokens(name, streamed) / par.dp
                                     / (stage.option("micro_tokens") or 16384)))
        else:
            factor, micro = self._packed(*packing, par.dp, streamed)
            padded = busy * factor
        seconds = padded + pipeline_fill_drain(padded, micro, par.pp) + (cost.optimizer() if train else 0.0)
        return seconds + self._units(streamed) * parameters()["learner"]["unit_dispatch_s"], \
            busy * cost.rank_devices * ranks

    def _packed(self, tokens: int, buckets: int, ranks: int, streamed: bool) -> tuple[float, float]:
        key = (tokens, buckets, ranks, streamed)
        if key not in self.packings:
            self.packings[key] = self._pack(*key)
        return self.packings[key]

    def _pack(self, tokens: int, buckets: int, ranks: int, streamed: bool) -> tuple[float, float]:
        """(processed / useful tokens, micro-batches of one rank per unit) when the sampled steps are
        packed as the simulator packs them: each unit (a streamed micro-batch of `stream` samples,
        else the step) balanced over the ranks, first-fit-decreasing into `tokens`, padded to the
        `buckets` sizes the pack pass would choose for these fills (0: dynamic shapes, no padding).
        Bucket sizes are aligned to 1/256 of the budget (the pass: 64 tokens) to keep it fast."""
        fills, per_rank = self._fills(tokens, ranks, streamed)
        sizes = choose_buckets(fills, buckets, tokens, max(64, tokens // 256)) if buckets else ()
        padded = sum(bucket_for(f, sizes) for f in fills) if sizes else sum(fills)
        return padded / sum(fills), per_rank

    def _fills(self, tokens: int, ranks: int, streamed: bool) -> tuple[list[int], float]:
        """Every micro-batch's tokens, and micro-batches of one rank per unit."""
        key = ("fills", tokens, ranks, streamed)
        if key not in self.packings:
            self.packings[key] = self._fill(tokens, ranks, streamed)
        return self.packings[key]

    def _fill(self, tokens: int, ranks: int, streamed: bool) -> tuple[list[int], float]:
        units = self._split(ranks, streamed)
        fills = [sum(b) for unit in units for rank in unit if rank for b in packed_lengths(rank, tokens)]
        return fills, max(1.0, len(fills) / (len(units) * ranks))

    def _split(self, ranks: int, streamed: bool) -> list[list[list[int]]]:
        """Each unit's sequence lengths balanced over the ranks (longest first onto the least loaded:
        within one sequence of the pass's Karmarkar-Karp, and fast), shared by every budget."""
        key = ("split", ranks, streamed)
        if key not in self.packings:
            stream = self.graph.schedule.option("stream") or 16
            units = [step[i:i + stream] for step in self.lengths for i in range(0, len(step), stream)] \
                if streamed else self.lengths
            self.packings[key] = [balance(unit, ranks) for unit in units]
        return self.packings[key]

    def _units(self, streamed: bool) -> int:
        """Learner units of a step: one call each ([learner] unit_dispatch_s)."""
        return math.ceil(self.samples / (self.graph.schedule.option("stream") or 16)) if streamed else 1

    def _unit_tokens(self, name: str, streamed: bool) -> float:
        """Tokens of one unit of learner work: a streamed micro-batch of `stream` samples under asp
        on separate devices (1F1B fills and drains once per unit), else the whole step."""
        if not streamed:
            return self.tokens
        return self.tokens * min(1.0, (self.graph.schedule.option("stream") or 16) / self.samples)

    # ---- weight sync and pool switches ----
    def _sync(self, c: Candidate) -> tuple[float, float]:
        """(generation side: loading a version, learner side: assembling it / switching the pool)."""
        train = next(s for s in c.layout.stages if self.graph.stage(s.stage).kind is StageKind.TRAIN)
        gen = c.layout.stage(self.roles.gen.name)
        if c.colocated:
            shard = weight_shard_bytes(self.arch, gen.parallel, self.dtype)
            switch = offload_seconds(self.arch.total_params() * self.dtype * 8 / self.roles.devices)
            load = reshard_seconds(self.arch, train.parallel, gen.parallel, self.hw, self.dtype) \
                + offload_seconds(shard)
            phase = 1 + self.staleness  # a time-shared pool switches once a phase of k + 1 steps
            return load / phase, 2 * switch / phase
        t = parameters()["transfer"]
        receivers = gen.instances * gen.parallel.devices
        load = t["weight_sync_fixed_s"] + broadcast_seconds(self.arch.total_params() * self.dtype, receivers,
                                                            self.hw.network_gbps)
        return load, gather_to_sender_seconds(self.arch, train.parallel, self.hw, self.dtype)


def _scoring_model(stage) -> str | None:
    sources = stage.option("sources") or ()
    return next((s.get("model") for s in sources if s.func in ("model", "judge")), None)
