"""The simulator backend's executors: what each action the controller takes costs on the
plan's hardware, from the roofline cost model (or from a CPU calibration). The sim driver asks
these questions and nothing else, so a test can hand it other answers (a fake of known
durations) and hold the simulator to the local runtime.
"""
from __future__ import annotations

import dataclasses
import math

from aspc.algorithms.slots import default_slots
from aspc.backends.sim.instance import GenInstance
from aspc.controller.events import Work
from aspc.controller.kinds import JUDGE_VERDICT_TOKENS, rule_for  # one verdict budget: priced here, lowered too
from aspc.costmodel.calibrated import Calibration, CalibratedGeneration, CalibratedLearner
from aspc.costmodel.learner import WorkCost, packed_ranks, work_cost
from aspc.costmodel.roofline import (GenerationCost, LearnerCost, dtype_bytes, hardware_of, offload_seconds,
                                     usable_hbm, weight_sync_seconds)
from aspc.costmodel.workload import Environment, draw_episode, sample_step
from aspc.plan.execution_plan import ExecutionPlan, Instance, MicroBatching, StagePlan

# A reward model scores whole sequences; the pack pass does not shape its micro-batches yet, so
# they are priced packed without padding into this many tokens (the reward-model issue, 12).
REWARD_MODEL_MICRO_TOKENS = 16384

# An LLM judge reads its rubric prompt, the prompt and the response, then writes a short verdict
# ("Score: 7" after a sentence or two of reasons): this many decode steps per judged sample, the
# same for every sample (docs/simulator.md, "Judges"). Its rubric, the judge(prompt = "...")
# text, is counted at this many characters per token (the usual rate of English BPE vocabularies).
CHARS_PER_TOKEN = 4


class RooflinePricing:
    """`calibration`: measured CPU costs in place of the roofline (backends/cpu/calibrate.py)."""

    def __init__(self, plan: ExecutionPlan, calibration: Calibration | None = None):
        self.plan, self.calibration = plan, calibration
        self.gen_stage = plan.stages_of("generate")[0]
        self.train_stage = plan.stages_of("train")[0]
        self.data = plan.dataset(self.gen_stage.data)
        samples = sample_step(self.data, 0)
        self.mean_tokens = sum(s.tokens for s in samples) / len(samples) + self._mean_observations(samples)
        model = plan.model(self.gen_stage.model)
        self.weight_bytes = model.arch.total_params() * dtype_bytes(model.dtype)
        self._packed: dict[tuple, list] = {}
        self._lengths = {}

    def _mean_observations(self, samples) -> float:
        """Agentic episodes: a sequence's KV and the learner's sequence hold its tool results too."""
        envs = self.plan.stages_of("environment")
        if not envs:
            return 0.0
        env, group = Environment.of(dict(envs[0].options)), self.data.group
        draws = [draw_episode(env, self.data, 0, i // group, i % group, s.response_len) for i, s in enumerate(samples)]
        return sum(sum(d.observations) for d in draws) / len(draws)

    # ---- generation ----
    def generation_instance(self, stage: StagePlan, instance: Instance) -> GenInstance:
        static = stage.batching != "continuous"
        if self.calibration is not None:
            cost = CalibratedGeneration(self.calibration)
            capacity = default_slots(self.data.samples_per_step, len(stage.instances), self.data.group)
        else:
            model = self.plan.model(stage.model)
            hw = hardware_of(self.plan, stage)
            cost = GenerationCost(model.arch, hw, stage.parallel, dtype_bytes(model.dtype),
                                  dict(stage.options).get("graph_mode", True))
            capacity = cost.capacity(self.mean_tokens, usable_hbm(hw))
        return GenInstance(instance.index, cost, capacity, static, instance.device_count)

    def load(self, devices: int, interrupt: bool) -> float:
        """A generation instance loads a published version (an interrupted batch re-prefills on top)."""
        if self.calibration is not None:
            return self.calibration.weight_load
        transfer = self.plan.weight_syncs[0].transfer if self.plan.weight_syncs else "link"
        if transfer == "offload_onload":
            return offload_seconds(self.weight_bytes / self.gen_stage.parallel.tp, devices)
        learner_devices = self.train_stage.instances[0].device_count
        return weight_sync_seconds(self.weight_bytes, min(devices, learner_devices))

    # ---- learner-side executors ----
    def work(self, work: Work, stage: StagePlan, token_lengths: list[int]) -> WorkCost:
        rule = rule_for(stage)
        if rule is not None and rule.priced_as == "judge":
            return self._judged(stage, token_lengths)
        stage = _shaped(stage)
        cost = self._learner_cost(stage)
        key = (work.step, work.samples[0], len(work.samples), stage.micro_batching, stage.parallel.dp)
        if key not in self._packed:  # reference and train pack the same unit the same way
            self._packed[key] = packed_ranks(stage, token_lengths, self.mean_tokens)
        return work_cost(stage, cost, "train" if work.kind == "train" else "forward", self._packed[key])

    def _judged(self, stage: StagePlan, token_lengths: list[int]) -> WorkCost:
        """A reward stage with judge(...) sources: each judge generates a verdict for every sample
        of the unit (one after another on the stage's executor); a model(...) source beside them
        adds its forward pass."""
        costs = []
        for source in dict(stage.options)["sources"]:
            if source.func == "judge":
                costs.append(self.judge(stage, source.get("model"), source.get("prompt") or "", token_lengths,
                                        source.get("concurrency")))
            elif source.func == "model":
                scorer = dataclasses.replace(_shaped(stage), model=source.get("model"))
                packed = packed_ranks(scorer, token_lengths, self.mean_tokens)
                costs.append(work_cost(scorer, self._learner_cost(scorer), "forward", packed))
        return WorkCost(*(sum(getattr(c, f.name) for c in costs) for f in dataclasses.fields(WorkCost)))

    def judge(self, stage: StagePlan, model_name: str, rubric: str, token_lengths: list[int],
              concurrency: int | None = None) -> WorkCost:
        """One judge call per streamed unit on one instance of the stage: prefill of (rubric +
        prompt + response) per sample, then JUDGE_VERDICT_TOKENS decode steps of the whole batch —
        the generation roofline of the judge model on the stage's layout. The batch is the unit's
        samples, bounded by the instance's KV room and the source's `concurrency` (calls in flight;
        several waves if more). Decode of the verdict
        and prefill are useful; under static batching (no continuous-batching pass on the
        generate stage) each wave's prompts pad to its longest, and the pad tokens' prefill and KV
        reads are padding."""
        devices = stage.instances[0].device_count if stage.instances else 1
        verdict = JUDGE_VERDICT_TOKENS
        inputs = [math.ceil(len(rubric) / CHARS_PER_TOKEN) + t for t in token_lengths]
        cost, capacity = self.judge_engine(stage, model_name, sum(inputs) / max(len(inputs), 1) + verdict)
        capacity = max(1, min(capacity, concurrency or capacity))
        static = (stage.batching or self.gen_stage.batching) != "continuous"
        seconds = useful = 0.0
        for first in range(0, len(inputs), capacity):
            wave = inputs[first:first + capacity]
            batch, tokens = len(wave), sum(wave)
            padded = batch * max(wave) if static else tokens
            seconds += _judge_call(cost, batch, padded, verdict)
            useful += _judge_call(cost, batch, tokens, verdict)
        return WorkCost(seconds, useful * devices, (seconds - useful) * devices, 0.0)

    def judge_engine(self, stage: StagePlan, model_name: str, tokens_per_sequence: float):
        """(the judge model's generation cost on one instance of the stage, the sequences it
        holds at once: its KV room for sequences of this length, capped by max_num_seqs)."""
        if self.calibration is not None:
            slots = default_slots(self.data.samples_per_step, len(stage.instances), self.data.group)
            return CalibratedGeneration(self.calibration), slots
        model = self.plan.model(model_name)
        hw = hardware_of(self.plan, stage)
        cost = GenerationCost(model.arch, hw, stage.parallel, dtype_bytes(model.dtype), True)
        return cost, cost.capacity(tokens_per_sequence, usable_hbm(hw))

    def optimizer(self) -> float:
        return self._learner_cost(self.train_stage, False).optimizer()

    def publish(self, devices: int, time_shared: bool) -> float:
        """The trainer hands out a new version: over the link, or nothing moves when generation
        shares its devices (the instances onload it when the pool switches back)."""
        if time_shared:
            return 0.0
        return self.calibration.weight_load if self.calibration else weight_sync_seconds(self.weight_bytes, devices)

    def switch(self, devices: int) -> float:
        """A time-shared pool changes hands: weights and optimizer state move host <-> device
        (on a CPU, threads share memory: nothing moves)."""
        return 0.0 if self.calibration else offload_seconds(self.weight_bytes * 8, devices)

    def _learner_cost(self, stage: StagePlan, recompute: bool | None = None):
        if self.calibration is not None:
            return CalibratedLearner(self.calibration, stage.parallel.tp * stage.parallel.pp * stage.parallel.cp)
        model = self.plan.model(_model_of(stage))
        if recompute is None:
            recompute = bool(dict(stage.options).get("recompute", False))
        return LearnerCost(model.arch, hardware_of(self.plan, stage), stage.parallel, recompute)


def _judge_call(cost, batch: int, context: int, verdict: int) -> float:
    """A wave of `batch` sequences holding `context` tokens in all: their prefill, then `verdict`
    decode steps over a context that grows by one token per sequence each step."""
    return cost.prefill(context, batch) + verdict * cost.beta(batch) \
        + cost.alpha * (verdict * context + batch * verdict * (verdict - 1) / 2)


def _model_of(stage: StagePlan) -> str:
    """The model a stage runs: its own, or a reward stage's model(...) source."""
    if stage.model is not None:
        return stage.model
    return next(s.get("model") for s in dict(stage.options)["sources"] if s.func == "model")


def _shaped(stage: StagePlan) -> StagePlan:
    if stage.micro_batching is not None:
        return stage
    return dataclasses.replace(stage, micro_batching=MicroBatching(REWARD_MODEL_MICRO_TOKENS, (), "tokens", "none",
                                                                   None))
