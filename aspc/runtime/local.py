"""The local runtime: the controller on the main thread, generation instances and the learner on
threads, the CPU backend's real model underneath. `aspc run --runtime local` (the default)."""
from __future__ import annotations

import copy
import json
import queue
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from aspc.backends.cpu.data import PromptSource
from aspc.backends.cpu.generator import BatchGenerator
from aspc.backends.cpu.slots import default_slots
from aspc.backends.cpu.learner import Learner, Rollout, TrainSettings
from aspc.backends.cpu.model import TinyQwen
from aspc.backends.cpu.rewards import build_reward
from aspc.backends.cpu.warmstart import warm_start
from aspc.controller import Controller, ControllerConfig
from aspc.controller.events import Dispatch, InstanceIdle, OptimizerStep, RunWork, Start, SyncWeights
from aspc.plan import ExecutionPlan
from aspc.runtime.workers import GenerationWorker, LearnerWorker, WorkerFailed, wall_clock



@dataclass
class RunOptions:
    steps: int
    warmstart_steps: int = 200
    metrics_path: Path | None = None
    seed: int = 0
    on_step: object = None  # callback(step, metrics)
    on_warmstart: object = None  # callback(step, loss)
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 10
    resume: bool = False


@dataclass
class RunResult:
    metrics: list[dict] = field(default_factory=list)
    spans: list = field(default_factory=list)
    wall_s: float = 0.0
    samples_per_step: dict = field(default_factory=dict)  # step -> sorted sample ids trained


class LocalRuntime:
    def __init__(self, plan: ExecutionPlan, base_dir: Path | None, options: RunOptions):
        self.plan, self.options = plan, options
        self.config = ControllerConfig.from_plan(plan, options.steps)
        self.gen_stage, self.train_stage = plan.stages_of("generate")[0], plan.stages_of("train")[0]
        self.data = plan.dataset(self.gen_stage.data)
        self.prompts = PromptSource(self.data.source, self.data.location, self.data.seed,
                                    self.data.max_response, base_dir)
        self.events: queue.Queue = queue.Queue()
        self.results: dict = {}
        self.lock = threading.Lock()
        self.weights: dict[int, dict] = {}
        self.step_metrics: dict[int, dict] = {}
        self.clock = wall_clock()

    # ---- building ----
    def accuracy(self, count: int = 128) -> float:
        """Greedy reward of the current policy on held-out prompts."""
        from aspc.backends.cpu.evaluate import greedy_accuracy

        return greedy_accuracy(self.actor, self.prompts, self.reward_fn, count,
                               dict(self.gen_stage.options)["max_tokens"])

    def _prompt(self, step: int, prompt: int):
        return self.prompts(step * self.data.prompts_per_step + prompt)

    def build(self) -> None:
        self._check_supported()
        actor_plan = self.plan.model(self.train_stage.model)
        self.actor = TinyQwen(actor_plan.arch, seed=self.options.seed)
        resume_from = self._resume_point()
        if self.options.warmstart_steps and resume_from is None:
            warm_start(self.actor, self.prompts, self.options.warmstart_steps, on_step=self.options.on_warmstart)
        self.reward_fn = self._reward()
        self.learner = Learner(self.actor, self._reference(), self._critic(), self._settings(), self.reward_fn)
        self.start_version = self._load(resume_from) if resume_from else 0
        self.weights[self.start_version] = copy.deepcopy(self.actor.state_dict())
        saver = self._save if self.options.checkpoint_dir else None
        self.learner_worker = LearnerWorker(self.learner, self._rollouts, self.weights, self.step_metrics,
                                            self.events, self.clock, saver)
        slots = default_slots(self.data.samples_per_step, self.config.instances, self.data.group)
        options = dict(self.gen_stage.options)
        self.gen_workers = []
        for i in range(self.config.instances):
            model = copy.deepcopy(self.actor).eval()
            generator = BatchGenerator(model, slots, options["max_tokens"], options["temperature"],
                                       options["top_p"], static=self.gen_stage.batching != "continuous")
            self.gen_workers.append(GenerationWorker(i, generator, self.weights, self.results, self.lock,
                                                     self.events, self.clock))
        self.slots = slots
        self.controller = Controller(self.config, lambda step, p: len(self._prompt(step, p).ids),
                                     self.start_version)

    # ---- checkpoints ----
    def _check_supported(self) -> None:
        if dict(self.train_stage.options).get("epochs", 1) != 1:
            raise ValueError("the CPU backend trains one epoch per step; set epochs = 1")
        if self.plan.stages_of("environment"):
            raise ValueError("environment stages (agentic RL) are not executed by the CPU backend yet")

    def _resume_point(self):
        from aspc.backends.cpu import checkpoint

        if not self.options.resume or self.options.checkpoint_dir is None:
            return None
        return checkpoint.latest(self.options.checkpoint_dir)

    def _parts(self):
        l = self.learner
        return ({"actor": l.actor, "reference": l.ref, "critic": l.critic},
                {"actor": l.optimizer, "critic": l.critic_optimizer})

    def _save(self, version: int) -> None:
        from aspc.backends.cpu import checkpoint

        every = self.options.checkpoint_every
        if version % every and version != self.config.steps and not getattr(self, "_final", False):
            return
        models, optimizers = self._parts()
        checkpoint.save(self.options.checkpoint_dir, version, models, optimizers,
                        {"pipeline": self.plan.pipeline, "schedule": self.plan.schedule})

    def _load(self, path) -> int:
        from aspc.backends.cpu import checkpoint

        models, optimizers = self._parts()
        version = checkpoint.load(path, models, optimizers)["version"]
        _truncate(self.options.metrics_path, version)
        return version

    def save_now(self) -> int | None:
        """After the workers stopped (Ctrl-C): checkpoint the last published version."""
        version = self.learner_worker.completed
        if self.options.checkpoint_dir is None or version is None:
            return None
        self._final = True
        self._save(version)
        return version

    def _reference(self):
        stages = self.plan.stages_of("reference")
        if not stages:
            return None
        model = self.plan.model(stages[0].model)
        if model.frozen_of == self.train_stage.model:
            return copy.deepcopy(self.actor).eval()
        return TinyQwen(model.arch, seed=self.options.seed + 1).eval()

    def _critic(self):
        stages = self.plan.stages_of("critic")
        if not stages:
            return None
        return TinyQwen(self.plan.model(stages[0].model).arch, seed=self.options.seed + 2, value_head=True)

    def _reward(self):
        stages = self.plan.stages_of("reward")
        return build_reward(dict(stages[0].options)["sources"])

    def _settings(self) -> TrainSettings:
        t = dict(self.train_stage.options)
        adv = dict(self.plan.stages_of("advantage")[0].options)
        critic = self.plan.stages_of("critic")
        return TrainSettings(
            loss=t["loss"], lr=t["lr"], kl=t["kl"], clip=t["clip"], clip_high=t["clip_high"],
            value_coef=t["value_coef"], entropy_coef=t["entropy_coef"], micro_tokens=t["micro_tokens"],
            weight_decay=t["weight_decay"], grad_clip=t["grad_clip"], overlong=t["overlong"],
            max_tokens=dict(self.gen_stage.options)["max_tokens"], estimator=adv["estimator"],
            gamma=adv["gamma"], lam=adv["lam"], normalize=adv["normalize"], group=self.data.group,
            critic_lr=dict(critic[0].options)["lr"] if critic else 1e-5)

    def _rollouts(self, samples) -> list[Rollout]:
        out = []
        for sample in samples:
            with self.lock:
                finished = self.results[sample]
                rollout = self.rollouts.get(sample)
                if rollout is None:
                    prompt = self._prompt(*sample[:2])
                    rollout = Rollout(finished.prompt, finished.response, finished.logprobs, prompt.text,
                                      prompt.answer, prompt.metadata, key=sample)
                    self.rollouts[sample] = rollout
            out.append(rollout)
        return out

    # ---- running ----
    def run(self) -> RunResult:
        self.rollouts: dict = {}
        self.trained: dict[int, list] = {}
        result = RunResult()
        for worker in [self.learner_worker, *self.gen_workers]:
            worker.start()
        try:
            self._handle(Start())
            for worker in self.gen_workers:
                self._handle(InstanceIdle(worker.index, self.slots))
            self._loop(result)
        finally:
            self._stop()
        result.wall_s = self.clock()
        result.spans = self.spans()
        return result

    def _loop(self, result: RunResult) -> None:
        last_published = self.start_version
        while not self.controller.finished:
            event = self.events.get()
            if isinstance(event, tuple) and event[0] == "error":
                _, name, error, _trace = event
                raise WorkerFailed(f"{name}: {type(error).__name__}: {error}")
            self._handle(event)
            if self.controller.version > last_published:
                last_published = self.controller.version
                self._record(result, last_published - 1)

    def _record(self, result: RunResult, step: int) -> None:
        metrics = {"step": step + 1, **self.step_metrics.get(step, {}), "wall_s": round(self.clock(), 3)}
        stale = [s for (u, _, _), s in self._staleness_of(step)]
        metrics["staleness_mean"] = sum(stale) / len(stale) if stale else 0.0
        result.metrics.append(metrics)
        if self.options.metrics_path is not None:
            with open(self.options.metrics_path, "a", encoding="utf-8") as out:
                out.write(json.dumps(metrics) + "\n")
        if self.options.on_step is not None:
            self.options.on_step(step + 1, metrics)

    def _staleness_of(self, step: int):
        starts = self.controller.gen.start_version
        return [(s, step - starts[s]) for s in self.controller.used if s[0] == step and s in starts]

    def _handle(self, event) -> None:
        for action in self.controller.handle(event):
            self._act(action)

    def _act(self, action) -> None:
        if isinstance(action, Dispatch):
            payload = [(r.sample, self._prompt(*r.sample[:2]).ids, self._seed(r.sample)) for r in action.requests]
            self.gen_workers[action.instance].inbox.put(("requests", payload))
        elif isinstance(action, RunWork):
            self.learner_worker.inbox.put(("work", action.work))
        elif isinstance(action, OptimizerStep):
            self.learner_worker.inbox.put(("optimizer", action.step))
        elif isinstance(action, SyncWeights):
            self.gen_workers[action.instance].inbox.put(("sync", action.version))

    def _seed(self, sample) -> int:
        return zlib.crc32(repr((self.data.seed, self.options.seed, sample)).encode())

    def spans(self) -> list:
        """The spans the workers recorded so far (a copy: they keep appending)."""
        return [s for w in [self.learner_worker, *self.gen_workers] for s in list(w.spans)]

    def stop_workers(self) -> None:
        self._stop()

    def _stop(self) -> None:
        for worker in self.gen_workers:
            worker.inbox.put(("stop", None))
        self.learner_worker.inbox.put(("stop", None))
        for worker in [self.learner_worker, *self.gen_workers]:
            worker.join(timeout=10)


def _truncate(metrics_path: Path | None, version: int) -> None:
    """Resuming at `version`: forget the metrics of steps after it (they are trained again)."""
    if metrics_path is None or not metrics_path.exists():
        return
    kept = [line for line in metrics_path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= version]
    metrics_path.write_text("".join(line + "\n" for line in kept))
