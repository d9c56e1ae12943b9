"""The simulator backend's executors: what each action the controller takes costs on the
plan's hardware, from the roofline cost model (or from a CPU calibration). The sim driver asks
these questions and nothing else, so a test can hand it other answers (a fake of known
durations) and hold the simulator to the local runtime.
"""
from __future__ import annotations

import dataclasses
import math

from aspc.algorithms.packing import packed_lengths
from aspc.algorithms.slots import default_slots
from aspc.backends.sim.instance import GenInstance
from aspc.controller.events import Work
from aspc.controller.kinds import JUDGE_VERDICT_TOKENS, rule_for  # one verdict budget: priced here, lowered too
from aspc.costmodel.calibrated import Calibration, CalibratedGeneration, CalibratedLearner, CalibratedScorer
from aspc.costmodel.cores import CoreShare
from aspc.costmodel.learner import WorkCost, packed_ranks, work_cost
from aspc.costmodel.roofline import (GenerationCost, LearnerCost, broadcast_gbps, broadcast_load_seconds,
                                     colocated_load_seconds, dtype_bytes, engine_memory, hardware_of, offload_seconds,
                                     parameters, publish_seconds)
from aspc.costmodel.workload import Environment, draw_episode, step_lengths
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
        self.cores = CoreShare(calibration.cores, calibration.background) if calibration is not None else None
        self.gen_stage = plan.stages_of("generate")[0]
        self.train_stage = plan.stages_of("train")[0]
        self.data = plan.dataset(self.gen_stage.data)
        prompts, responses = step_lengths(self.data, 0)  # sample k answers prompt k // group
        tokens = sum(prompts) * self.data.group + sum(responses)
        self.mean_tokens = tokens / len(responses) + self._mean_observations(responses)
        model = plan.model(self.gen_stage.model)
        self.weight_bytes = model.arch.total_params() * dtype_bytes(model.dtype)
        self._packed: dict[tuple, list] = {}
        self._lengths = {}
        self._generation_costs: dict[str, GenerationCost] = {}  # per stage: its instances share the memos
        self._dispatch_wait = parameters()["learner"]["unit_dispatch_s"]  # read once: priced per learner unit

    def _mean_observations(self, responses: list[int]) -> float:
        """Agentic episodes: a sequence's KV and the learner's sequence hold its tool results too."""
        envs = self.plan.stages_of("environment")
        if not envs:
            return 0.0
        env, group = Environment.of(dict(envs[0].options)), self.data.group
        draws = [draw_episode(env, self.data, 0, i // group, i % group, length) for i, length in enumerate(responses)]
        return sum(sum(d.observations) for d in draws) / len(draws)

    # ---- generation ----
    def generation_instance(self, stage: StagePlan, instance: Instance) -> GenInstance:
        """The instance's decode cost and the sequences it holds at once: on the roofline its KV room
        in the stage's gpu_memory_utilization, capped by its max_num_seqs per data-parallel rank;
        calibrated, the CPU runtime's slots (the same cap)."""
        static = stage.batching != "continuous"
        options = dict(stage.options)
        max_num_seqs = options.get("max_num_seqs")
        if self.calibration is not None:
            cost = CalibratedGeneration(self.calibration, share=self.cores)
            capacity = default_slots(self.data.samples_per_step, len(stage.instances), self.data.group,
                                     max_num_seqs, stage.parallel.dp)
            return GenInstance(instance.index, cost, capacity, static, instance.device_count)
        cost, memory = self._generation_cost(stage), engine_memory(self.plan, stage)
        if static:  # a static batch holds every member to its end: room for the longest each
            longest = self.data.max_prompt + self.data.max_response
            return GenInstance(instance.index, cost, cost.capacity(longest, memory, max_num_seqs), True,
                               instance.device_count)
        capacity = cost.capacity(self.mean_tokens, memory, max_num_seqs)
        return GenInstance(instance.index, cost, capacity, False, instance.device_count, cost.kv_tokens(memory))

    def _generation_cost(self, stage: StagePlan) -> GenerationCost:
        if stage.name not in self._generation_costs:
            model = self.plan.model(stage.model)
            self._generation_costs[stage.name] = GenerationCost(
                model.arch, hardware_of(self.plan, stage), stage.parallel, dtype_bytes(model.dtype),
                dict(stage.options).get("graph_mode", True))
        return self._generation_costs[stage.name]

    def load(self, devices: int, interrupt: bool) -> float:
        """A generation instance loads a published version (an interrupted batch re-prefills on top):
        on the trainer's devices by resharding in place and onloading its shard, on its own by
        receiving the trainer's broadcast (aspc/costmodel/roofline.py, "weight sync"). Neither
        depends on how many devices receive."""
        if self.calibration is not None:
            return self.calibration.weight_load
        if self._transfer() == "offload_onload":
            return colocated_load_seconds(self.plan, self.train_stage, self.gen_stage)
        return broadcast_load_seconds(self.plan, self.train_stage, self.gen_stage)

    def _transfer(self) -> str:
        return self.plan.weight_syncs[0].transfer if self.plan.weight_syncs else "link"

    # ---- learner-side executors ----
    def work(self, work: Work, stage: StagePlan, token_lengths: list[int]) -> WorkCost:
        rule = rule_for(stage)
        if rule.priced_as == "judge":
            return self._judged(stage, token_lengths)
        if self.calibration is not None:
            return self._calibrated_work(work, stage, token_lengths)
        stage = _shaped(stage)
        cost = self._learner_cost(stage)
        key = (work.step, work.samples[0], len(work.samples), stage.micro_batching, stage.parallel.dp)
        if key not in self._packed:  # reference and train pack the same unit the same way
            self._packed[key] = packed_ranks(stage, token_lengths, self.mean_tokens)
        found = work_cost(stage, cost, rule.priced_as, self._packed[key])
        return dispatched(found, cost.rank_devices * stage.parallel.dp, self._dispatch_wait)

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
        several waves if more). Prefill and the verdict's decode at the engine's saturated batch
        are useful, the rest of a smaller wave's decode is tail; under static batching (no
        continuous-batching pass on the generate stage) each wave's prompts pad to its longest,
        and the pad tokens' prefill and KV reads are padding."""
        devices = stage.instances[0].device_count if stage.instances else 1
        verdict = JUDGE_VERDICT_TOKENS
        inputs = [math.ceil(len(rubric) / CHARS_PER_TOKEN) + t for t in token_lengths]
        if self.calibration is not None:  # the CPU judge: a forward pass per sample, the samples on threads
            seconds = CalibratedScorer(self.calibration).judge(len(inputs))
            return WorkCost(seconds, seconds * devices, 0.0, 0.0)
        cost, saturated = self.judge_engine(stage, model_name, sum(inputs) / max(len(inputs), 1) + verdict)
        capacity = max(1, min(saturated, concurrency or saturated))
        static = (stage.batching or self.gen_stage.batching) != "continuous"
        seconds = unpadded = useful = 0.0
        for first in range(0, len(inputs), capacity):
            wave = inputs[first:first + capacity]
            batch, tokens = len(wave), sum(wave)
            padded = batch * max(wave) if static else tokens
            seconds += _judge_call(cost, batch, padded, verdict)
            unpadded += _judge_call(cost, batch, tokens, verdict)
            useful += _judge_call(cost, batch, tokens, verdict, saturated)
        return WorkCost(seconds, useful * devices, (seconds - unpadded) * devices, 0.0, (unpadded - useful) * devices)

    def judge_engine(self, stage: StagePlan, model_name: str, tokens_per_sequence: float):
        """(the judge model's generation cost on one instance of the stage, the sequences it
        holds at once: its KV room for sequences of this length, capped by max_num_seqs). A reward
        stage takes no engine options (max_num_seqs, gpu_memory_utilization are generate's): the
        judge engine runs with the cost model's defaults, the memory share its launch gets too, and
        its batch is bounded by the source's `concurrency` (in `judge`; lowered as its max_num_seqs)."""
        if self.calibration is not None:
            slots = default_slots(self.data.samples_per_step, len(stage.instances), self.data.group)
            return CalibratedGeneration(self.calibration), slots
        model = self.plan.model(model_name)
        hw = hardware_of(self.plan, stage)
        cost = GenerationCost(model.arch, hw, stage.parallel, dtype_bytes(model.dtype), True)
        return cost, cost.capacity(tokens_per_sequence, memory=None, max_num_seqs=None)

    def optimizer(self, loading: bool = False) -> float:
        """The trainer's step: its gradient reduction, then Adam. `loading`: a generation instance is
        loading weights meanwhile; on separate pools that is the trainer's broadcast on the network,
        which takes its rate of the links the reduction crosses (time-shared, nothing trains then)."""
        cost = self._learner_cost(self.train_stage, False)
        if self.calibration is not None or not loading or self._transfer() == "offload_onload":
            return cost.optimizer()
        return cost.optimizer(broadcast_gbps(hardware_of(self.plan, self.train_stage).network_gbps))

    def publish(self, devices: int, time_shared: bool) -> float:
        """The trainer hands out a new version: its sending rank assembles the full tensors (the
        broadcast itself is priced once, on the receiving instances' load), or nothing moves when
        generation shares its devices (the instances reshard when they load)."""
        if self.calibration is not None:  # the learner process sends its snapshot to the controller's
            return self.calibration.publish
        if time_shared:
            return 0.0
        return publish_seconds(self.plan, self.train_stage)

    def switch(self, devices: int) -> float:
        """A time-shared pool changes hands: weights and optimizer state move host <-> device
        (on a CPU, threads share memory: nothing moves)."""
        if self.calibration:  # on a CPU nothing moves: the controller hands the pool to the other side
            return self.calibration.switch
        return offload_seconds(self.weight_bytes * 8 / devices)  # 16 B of training state a parameter, sharded

    def move(self, devices: int) -> float:
        """Runtime rebalancing moves a generation instance to or from the trainer (`devices`: the
        trainer's with the instance): the training state resharded over them moves host <-> device,
        as a pool switch moves it; a returned instance then loads the weights (priced by `load`)."""
        return self.switch(devices)

    def _learner_cost(self, stage: StagePlan, recompute: bool | None = None):
        if self.calibration is not None:
            return self._calibrated_cost(stage)
        model = self.plan.model(_model_of(stage))
        if recompute is None:
            recompute = bool(dict(stage.options).get("recompute", False))
        hw = hardware_of(self.plan, stage)
        return LearnerCost(model.arch, hw, stage.parallel, recompute, dtype_bytes(model.dtype))


    def _calibrated_work(self, work: Work, stage: StagePlan, token_lengths: list[int]) -> WorkCost:
        """As the CPU runtime runs a unit, whatever the plan's packing: a reward model scores it in
        one batch; the learner cuts it into first-fit-decreasing micro-batches of the train stage's
        `micro_tokens`. Each batch is padded to its longest sequence."""
        cost = self._calibrated_cost(stage)
        if stage.kind == "reward":
            return _padded_cost(cost.forward, [token_lengths])
        budget = max(dict(self.train_stage.options).get("micro_tokens") or 0, max(token_lengths))
        batches = packed_lengths(token_lengths, budget)
        return _padded_cost(cost.train if rule_for(stage).priced_as == "train" else cost.forward, batches)

    def _calibrated_cost(self, stage: StagePlan):
        """A reward model scores in the controller's process; the learner process runs reference,
        critic and train passes (train and optimizer training a critic too where the plan has one)."""
        if stage.kind == "reward":
            return CalibratedScorer(self.calibration)
        critic = bool(self.plan.stages_of("critic"))
        return CalibratedLearner(self.calibration, stage.parallel.tp * stage.parallel.pp * stage.parallel.cp, critic)


def _padded_cost(run, batches: list[list[int]]) -> WorkCost:
    """`run(tokens, squares, samples)` over batches padded to their longest: the pad tokens are padding."""
    seconds = sum(run(len(b) * max(b), 0.0, len(b)) for b in batches)
    useful = sum(run(sum(b), 0.0, len(b)) for b in batches)
    return WorkCost(seconds, useful, seconds - useful, 0.0)


def _judge_call(cost, batch: int, context: int, verdict: int, saturated: int | None = None) -> float:
    """A wave of `batch` sequences holding `context` tokens in all: their prefill, then `verdict`
    decode steps over a context that grows by one token per sequence each step. `saturated`: the
    roofline instead — each sequence's share of a step of the engine's saturated batch (the
    verdict decoded below it is tail, docs/simulator.md)."""
    step = batch * cost.beta(saturated) / saturated if saturated else cost.beta(batch)
    return cost.prefill(context, batch) + verdict * step \
        + cost.alpha * (verdict * context + batch * verdict * (verdict - 1) / 2)


def _model_of(stage: StagePlan) -> str:
    """The model a stage runs: its own, or a reward stage's model(...) source."""
    if stage.model is not None:
        return stage.model
    return next(s.get("model") for s in dict(stage.options)["sources"] if s.func == "model")


def dispatched(cost: WorkCost, devices: int, wait: float) -> WorkCost:
    """A learner unit reaches its executor in one call (`wait`: [learner] unit_dispatch_s): its devices wait."""
    return dataclasses.replace(cost, seconds=cost.seconds + wait, dispatch=cost.dispatch + wait * devices)


def _shaped(stage: StagePlan) -> StagePlan:
    if stage.micro_batching is not None:
        return stage
    return dataclasses.replace(stage, micro_batching=MicroBatching(REWARD_MODEL_MICRO_TOKENS, (), "tokens", "none",
                                                                   None))
