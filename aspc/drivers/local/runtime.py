"""The local runtime: the controller on the main thread, generation instances and learner-side
executors on threads, a backend's executors underneath (the CPU backend's real model, handed in
by the CLI). `aspc run --runtime local` (the default). On virtual time (virtual_time.py) the same
threads run deterministically, which the differential test against the simulator relies on."""
from __future__ import annotations

import sys
import threading
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import assert_never

from aspc.accounting.measured import bubble_shares
from aspc.controller import Controller, ControllerConfig
from aspc.controller.dynamic_sampling import PaddingWarnings
from aspc.controller.health import ConstantReward, ToolHealth
from aspc.controller.events import (Action, Checkpoint, Dispatch, Finished, InstanceIdle, MoveInstance, OptimizerStep,
                                    PoolSwitched, PublishWeights, RestartInstance, ResumeEpisode, RunTool, RunWork,
                                    Start, SwitchPool, SyncWeights, WeightsLoaded, WeightsPublished, WorkFinished)
from aspc.plan.execution_plan import ExecutionPlan
from aspc.drivers.local.metrics_file import MetricsFile, interrupts_held
from aspc.drivers.local.memory import release_free_memory
from aspc.drivers.local.published import PublishedVersions
from aspc.drivers.local.retention import prune
from aspc.roles import ExecutorsFactory
from aspc.drivers.local.scoring import GuardedJudge
from aspc.drivers.local.threads import threads_per_worker
from aspc.drivers.local.virtual_time import RealTime
from aspc.drivers.local.workers import (ExecutorWorker, GenerationWorker, InstanceLost, ToolWorker, WorkerFailed,
                                        reward_scores, trainer_runners)

SCORERS = ("forward_model", "judge")  # executor roles that score units on their own model


@dataclass
class RunOptions:
    steps: int
    warmstart_steps: int = 200
    metrics_path: Path | None = None
    seed: int = 0
    on_step: Callable[[int, dict], None] | None = None  # callback(step, metrics)
    on_warmstart: Callable[..., None] | None = None  # callback(step, loss)
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 10
    resume: bool = False
    threads: int | None = None  # torch threads per worker; None: a share of the cores (threads.py)
    workers: str = "threads"  # "processes": generation instances and the learner in processes (processes.py)
    keep: int | None = None  # step checkpoints kept, the newest; None: all (retention.py)
    # callback(message): a check of aspc/controller/health.py found a problem
    on_warning: Callable[[str], None] | None = None


@dataclass
class RunResult:
    metrics: list[dict] = field(default_factory=list)
    spans: list = field(default_factory=list)
    wall_s: float = 0.0
    samples_per_step: dict = field(default_factory=dict)  # step -> sorted sample ids trained


class LocalRuntime:
    def __init__(self, plan: ExecutionPlan, base_dir: Path | None, options: RunOptions, executors: ExecutorsFactory,
                 clock=None):
        """`executors`: the backend's factory (the CPU backend's CpuExecutors); building it reads
        the data file, so a user's data error is raised here. `clock`: RealTime (the default) or
        a VirtualTime that the executors also sleep on."""
        self.plan, self.options, self.base_dir = plan, options, base_dir
        every = options.checkpoint_every if options.checkpoint_dir is not None else 0
        self.config = ControllerConfig.from_plan(plan, options.steps, every)
        self.gen_stage, self.train_stage = plan.stages_of("generate")[0], plan.stages_of("train")[0]
        self.data = plan.dataset_of(self.gen_stage)
        self.executors = executors(plan, base_dir, options.seed)
        self.clock = clock or RealTime()
        self.events = self.clock.queue()
        self.internal: deque = deque()  # events of host work done on this thread, handled first
        self.results: dict = {}
        self.calls: dict = {}  # an episode's tool call, from its instance to its tool runner
        self.tool_results: dict = {}  # and the call's result, from the runner back to an instance
        self.lock = threading.Lock()
        self.weights: dict[int, dict] = {}
        self.step_metrics: dict[int, dict] = {}
        self.warmstart_s = 0.0
        self.resume_notes: list[str] = []  # what resuming chose and skipped, for the user
        self.resumed = None  # the checkpoint folder a resumed run continues from
        self.stopped = False
        self.learner_lost: str | None = None  # why the learner's state is gone (its process died)
        self.save_failed: Exception | None = None  # the CheckpointError of a save that failed: no other is tried

    # ---- building ----
    def accuracy(self, count: int = 128) -> float:
        """Greedy reward of the current policy on held-out prompts."""
        try:
            return self.executors.accuracy(count)
        finally:
            release_free_memory()  # its copy of the model and KV cache

    def _prompt(self, step: int, prompt: int):
        return self.executors.prompt(self.config.data_row(step, prompt))

    def build(self) -> None:
        self.threads = threads_per_worker(self.config.instances + len(self.config.executors), self.options.threads)
        resume_from = self._resume_point()
        if self.options.warmstart_steps and resume_from is None:
            self._start_fork_server()
            self._warm_start()
        self.executors.set_threads(self.threads)
        self.learner = self.executors.trainer()
        self.start_version = self._load(resume_from) if resume_from else 0
        self.weights[self.start_version] = self.executors.snapshot()
        self.published = PublishedVersions(self.weights)
        self.exec_workers = [self._executor_worker(spec) for spec in self.config.executors]
        for worker in self.exec_workers:
            worker.report_rewards = self.config.filters_groups
        self.learner_worker = next(w for w in self.exec_workers if w.learner is not None)
        self.learner_worker.completed = self.start_version
        self.learner_worker.move = self._move_instance
        self.learner_worker.saved = self.start_version if resume_from else None  # a fresh run: none on disk
        self.gen_workers = []
        for i in range(self.config.instances):
            engine = self.executors.generation_engine(i, self.config.instances)
            self.gen_workers.append(GenerationWorker(i, engine, self.weights, self.results, self.lock,
                                                     self.events, self.clock, self.calls))
        self.tool_health = ToolHealth(self._warn)
        self.constant_reward = ConstantReward(self._warn)
        self.padding_warnings = PaddingWarnings(self._warn)
        self.tool_workers = [ToolWorker(k, self.executors.tools(), self.calls, self.tool_results, self.lock,
                                        self.events, self.clock, self.tool_health)
                             for k in range(self.config.tool_workers)]
        if self.options.workers == "processes" and not self.complete:  # complete: nothing will run in them
            self._start_processes()
        self.slots = self.gen_workers[0].generator.slots
        self.controller = Controller(self.config, lambda step, p: len(self._prompt(step, p).ids),
                                     self.start_version)
        self.metrics_file = MetricsFile(self.options.metrics_path, self.start_version if resume_from else None)
        self.notes = [note for note in [self.metrics_file.open()] if note]  # built: now the file may change

    def _start_processes(self) -> None:
        """Move each generation engine and the learner into a process of its own (processes.py);
        the worker threads drive them from here."""
        from aspc.drivers.local.processes import ProcessEngine, ProcessLearner

        if self.clock.virtual:
            raise ValueError("process workers run on the wall clock; virtual time needs threads")
        search = [str(Path(self.base_dir).resolve())] if self.base_dir is not None else []
        started = []
        try:
            for worker in self.gen_workers:
                worker.generator = ProcessEngine(worker.name, worker.generator, self.threads,
                                                 self.executors.set_threads, search)
                started.append(worker.generator.child)
            self.learner_worker.learner = ProcessLearner(self.learner, self.threads, self.executors.set_threads,
                                                         search)
        except BaseException:  # the processes already started end with their pipes, or exit would wait for them
            for child in started:
                child.stop()
            raise
        for proxy in [w.generator for w in self.gen_workers] + [self.learner_worker.learner]:
            try:
                proxy.child.ready()  # they start side by side; the run's clock starts once all are up
            except InstanceLost as error:  # killed while it started
                raise WorkerFailed(str(error)) from None

    def _start_fork_server(self) -> None:
        """Process workers: the fork server imports torch while the warm start runs (the first
        child would start it otherwise)."""
        if self.options.workers == "processes":
            from aspc.drivers.local.processes import start_fork_server

            start_fork_server([self.executors.set_threads.__module__, type(self.executors).__module__])

    def _close_processes(self) -> None:
        """The run is over: the learner's final state back into this process's objects (for
        held-out evaluation and a last checkpoint), then every worker process ends. A learner
        that died took its state with it: `learner_lost` says so, and nothing is saved after it
        (this process's copy is the warm start's, or the resumed checkpoint's)."""
        from aspc.drivers.local.processes import ProcessEngine, WorkerProcessFailed

        learner = self._learner_process()
        if learner is not None:
            try:
                learner.adopt_into(*self.executors.parts(self.learner))
            except (InstanceLost, WorkerProcessFailed) as error:
                self.learner_lost = str(error)
            self.learner_worker.learner = self.learner
        proxies = [w.generator for w in getattr(self, "gen_workers", []) if isinstance(w.generator, ProcessEngine)]
        children = [p.child for p in proxies] + ([learner.child] if learner is not None else [])
        for child in children:  # all asked first: they end side by side
            child.stop()
        for child in children:
            child.join()

    def _learner_process(self):
        """The learner's process worker (its ProcessLearner), or None: threads, Ray, or not built."""
        from aspc.drivers.local.processes import ProcessLearner

        learner = getattr(getattr(self, "learner_worker", None), "learner", None)
        return learner if isinstance(learner, ProcessLearner) else None

    def _executor_worker(self, spec) -> ExecutorWorker:
        """The thread of one learner-side executor: the trainer's (named "learner"), a forward
        model's or a reference's; each stage it hosts runs through the role the stage-kind table names."""
        kinds = {s.name: s.kind for s in self.plan.stages}
        roles = {s.name: s.role for s in self.config.forward_stages}
        hosted = dict(spec.hosts)  # stage -> one instance index of it on these devices
        if self.config.train_stage not in hosted:
            runners = {stage: self._apart(kinds[stage], roles.get(stage), stage, index)
                       for stage, index in hosted.items()}
            return ExecutorWorker(spec.name, runners, self._rollouts, self.events, self.clock,
                                  switch=self.executors.switch_pool)
        saver = self._save if self.options.checkpoint_dir else None
        worker = ExecutorWorker("learner", {}, self._rollouts, self.events, self.clock, self.learner, self.weights,
                                self.step_metrics, saver, self.executors.switch_pool)
        trained = {stage: kinds[stage] for stage in hosted if roles.get(stage) not in SCORERS}
        worker.runners = trainer_runners(worker, trained)
        worker.runners.update({stage: self._scorer(roles[stage], stage, hosted[stage])
                               for stage in hosted if roles.get(stage) in SCORERS})
        return worker

    def _apart(self, kind: str, role: str | None, stage: str, index: int):
        """The call of a stage on an executor without the trainer: a reference's pass over the
        frozen reference (e.g. on the generation pool, between bursts), or a scorer's."""
        if kind == "reference":
            return self.executors.reference_model(stage, index).reference
        return self._scorer(role, stage, index)

    def _scorer(self, role: str | None, stage: str, index: int):
        """The call that scores a unit of a stage on its own model: a reward model's forward pass
        (`ForwardModel.score`) or an LLM judge's verdicts (`Judge.judge`)."""
        if role == "judge":
            policy = next(s.calls for s in self.config.forward_stages if s.name == stage)
            assert policy is not None, f"judge stage '{stage}' without its call policy"
            return GuardedJudge(self.executors.judge(stage, index).judge, stage, policy, self.clock)
        return self.executors.forward_model(stage, index).score

    def _warm_start(self) -> None:
        """The warm start runs with a worker's share of the cores (threads.py), as the RL workers
        do: on a loaded machine a thread per core ran it 1.9-3.6x slower than one thread (issue 36)."""
        self.executors.set_threads(self.threads)
        start = self.clock()
        self.executors.warm_start(self.options.warmstart_steps, on_step=self.options.on_warmstart)
        self.warmstart_s = self.clock() - start

    # ---- checkpoints ----
    def _resume_point(self):
        """The newest intact checkpoint of this run's configuration, or None (a fresh start)."""
        directory = self.options.checkpoint_dir
        if directory is None:
            return None
        if not self.options.resume:
            _refuse_to_mix_runs(directory, self.executors)
            return None
        point = self.executors.find_resume_point(directory)
        if point is None:
            self.resume_notes.append(f"no checkpoint in {directory}: starting from step 0")
            return None
        self._check_same_run(point, self.executors.read_manifest(point.path).get("config", {}))
        self.resume_notes += [f"skipped {why}" for why in point.skipped]
        self.resumed = point.path
        return point.path

    def _check_same_run(self, point, saved: dict) -> None:
        now = self._fingerprint()
        different = [f"{key}: {saved.get(key)!r} in the checkpoint, {now[key]!r} now"
                     for key in now if saved.get(key) != now[key]]
        if different:
            raise self.executors.checkpoint_error(
                f"{point.path} belongs to another run (" + "; ".join(different) + "); resume with the "
                "pipeline and options that wrote it, or start afresh with another --checkpoint folder")

    def _fingerprint(self) -> dict:
        """What must not change between a checkpoint and the run that resumes from it."""
        d = self.data
        return {"pipeline": self.plan.pipeline, "schedule": self.plan.schedule, "seed": self.options.seed,
                "models": {m.name: repr(m.arch) for m in self.plan.models},
                "data": f"{d.source}({d.location!r}) seed={d.seed} prompts_per_step={d.prompts_per_step} "
                        f"group={d.group}"}

    def _parts(self):
        process = self._learner_process()
        if process is not None:  # the learner's state is in its process
            return process.parts()
        return self.executors.parts(self.learner)

    def _save(self, version: int) -> None:
        """Checkpoint the learner's state at `version` (a failed write is a CheckpointError naming
        the path; it is kept in `save_failed`, and no later save is tried)."""
        try:
            self._write(version)
        except self.executors.checkpoint_error as error:
            self.save_failed = error
            raise

    def _write(self, version: int) -> None:
        """A learner in a process of its own writes its state itself (the factory's picklable
        `checkpoint_writer`): pulling a 135M model's weights and AdamW state through this process
        took ~20 s and 4 GB a save. Otherwise the state is saved from here."""
        directory = self.options.checkpoint_dir
        assert directory is not None, "a checkpoint asked of a run without a checkpoint folder"
        manifest = {"pipeline": self.plan.pipeline, "schedule": self.plan.schedule, "config": self._fingerprint()}
        process, writer = self._learner_process(), getattr(self.executors, "checkpoint_writer", None)
        if process is not None and writer is not None:
            failed = process.save(writer(manifest), self.executors.checkpoint_error, directory, version)
            if failed is not None:
                raise self.executors.checkpoint_error(failed)
        else:
            models, optimizers = self._parts()
            self.executors.save_checkpoint(directory, version, models, optimizers, manifest)
        prune(self.executors.step_folders(directory), version, self.options.keep)

    def _load(self, path) -> int:
        models, optimizers = self._parts()
        return self.executors.load_checkpoint(path, models, optimizers)["version"]

    def save_now(self) -> int | None:
        """After an interruption, once the workers stopped: record the metrics of every step the
        learner finished, then checkpoint the last one (None: there was nothing to save). The
        learner's weights are at `worker.stepped` (an optimizer step whose publish was dropped by
        the interruption counts). Nothing is saved when the learner's state is lost (its process
        died) or a save already failed: the last intact checkpoint on disk stays the resume point."""
        worker = getattr(self, "learner_worker", None)
        if worker is None or getattr(self, "result", None) is None or self.learner_lost:
            return None
        version = max(worker.completed or 0, worker.stepped or 0)
        for done in range(self.recorded + 1, version + 1):
            self._record(done - 1)
        if self.options.checkpoint_dir is None or self.save_failed is not None:
            return None
        if worker.saved != version:
            self._save(version)
            worker.saved = version
        return worker.saved

    def last_intact_checkpoint(self):
        """The checkpoint a --resume would continue from (a ResumePoint), or None: none on disk."""
        directory = self.options.checkpoint_dir
        if directory is None:
            return None
        try:
            return self.executors.find_resume_point(directory)
        except self.executors.checkpoint_error:
            return None

    def _rollouts(self, samples) -> list:
        out = []
        for sample in samples:
            with self.lock:
                finished = self.results[sample]
                rollout = self.rollouts.get(sample)
                if rollout is None:
                    rollout = self.executors.rollout(sample, finished, self._prompt(*sample[:2]))
                    self.rollouts[sample] = rollout
            out.append(rollout)
        return out

    # ---- running ----
    @property
    def complete(self) -> bool:
        """Resumed from a checkpoint at or past the last step: nothing is left to train."""
        return self.start_version >= self.config.steps

    def run(self) -> RunResult:
        """The RL phase; its clock starts here (the warm start is timed apart, `warmstart_s`)."""
        self.rollouts: dict = {}
        self.result = result = RunResult()
        self.recorded = self.start_version
        self.clock.reset()
        if self.complete:
            return result
        for worker in self._workers():
            worker.setup = partial(self.executors.set_threads, self.threads)
            self.clock.expect(worker.name)
            worker.start()
        try:
            self._handle(Start())
            for worker in self.gen_workers:
                self._handle(InstanceIdle(worker.index, self.slots))
            self._loop()
            self._stop(drain=True)  # the learner writes the final checkpoint first
            self._raise_late_error()
        finally:
            self._stop()
        result.wall_s = getattr(self, "stopped_at", None) or self.clock()
        result.spans = self.spans()
        return result

    def _loop(self) -> None:
        while not self.controller.finished:
            event = self.internal.popleft() if self.internal else self.events.get()
            if _is_error(event):
                self._raise_worker_error(*event[1:3])
            if isinstance(event, WeightsPublished):  # the row is on disk before any checkpoint of it
                self._record(event.version - 1)
            try:
                self._handle(event)
            except InstanceLost as error:  # a call made from here to a dead worker (the Ray learner's reward pass)
                raise WorkerFailed(str(error)) from None

    def _raise_worker_error(self, name: str, error: Exception) -> None:
        """A worker's error ends the run: a failed checkpoint write as the user error it is, a
        dead worker process by its own message (it names the process), anything else named by
        the worker."""
        if isinstance(error, self.executors.checkpoint_error):
            raise error
        if isinstance(error, InstanceLost):
            raise WorkerFailed(str(error))
        raise WorkerFailed(f"{name}: {type(error).__name__}: {error}")

    def _raise_late_error(self) -> None:
        """An error a worker reported after the controller finished (the final checkpoint's write,
        the learner dying during it): the run failed, it did not complete."""
        if self.learner_lost:
            raise WorkerFailed(self.learner_lost)
        for worker in self._workers():
            if worker.error is not None:
                self._raise_worker_error(worker.name, worker.error)

    def _record(self, step: int) -> None:
        wall = round(self.clock(), 3)
        metrics = {"step": step + 1, **self.step_metrics.get(step, {}), "wall_s": wall}
        stale = [s for (u, _, _), s in self._staleness_of(step)]
        metrics["staleness_mean"] = sum(stale) / len(stale) if stale else 0.0
        if self.options.checkpoint_dir is not None:  # the saves since the last row, in its wall_s
            metrics["checkpoint_s"] = round(self.learner_worker.take_save_seconds(), 3)
        if self.controller.filter is not None:  # dynamic sampling: the extra generation it took
            metrics.update(self.controller.filter.metrics(step))
            self.padding_warnings.record(self.controller.filter, step)
        previous = self.result.metrics[-1]["wall_s"] if self.result.metrics else 0.0
        tokens = metrics.get("samples", 0) * metrics.get("response_len", 0)
        metrics["tokens_per_s"] = round(tokens / max(wall - previous, 1e-9), 1)
        shares = bubble_shares(self.spans(), wall, start=previous)  # the workers' time since the last row
        metrics["bubbles"] = {c: round(v, 4) for c, v in shares.items() if v}
        with interrupts_held():  # a Ctrl-C cannot fall between the row and `recorded`
            self.metrics_file.append(metrics)
            self.recorded = step + 1
        self.result.metrics.append(metrics)
        self.constant_reward.record(step + 1, metrics)
        if self.options.on_step is not None:
            self.options.on_step(step + 1, metrics)

    def _warn(self, message: str) -> None:
        """Tell the user now (the CLI prints above its progress bar); stderr without a CLI."""
        if self.options.on_warning is not None:
            self.options.on_warning(message)
        else:
            print(message, file=sys.stderr)

    def _staleness_of(self, step: int):
        starts = self.controller.gen.start_version
        return [(s, step - starts[s]) for s in self.controller.used if s[0] == step and s in starts]

    def _handle(self, event) -> None:
        if isinstance(event, WeightsLoaded):
            self.published.loaded(event.instance, event.version)
        for action in self.controller.handle(event):
            self._act(action)
        if isinstance(event, PoolSwitched) and event.mode == "gen":  # after the syncs the switch set off
            for worker in self.gen_workers:
                worker.inbox.put(("wake", None))

    def _act(self, action: Action) -> None:
        match action:
            case Dispatch():
                payload = [(r.sample, self._prompt(*r.sample[:2]).ids, self._seed(r.sample)) for r in action.requests]
                self.gen_workers[action.instance].inbox.put(("requests", payload))
            case RunWork() if action.executor is None:  # a rule or python reward: here, at once
                rollouts = self._rollouts(sorted(action.work.samples))
                self._host_learner().reward(rollouts)
                scores = reward_scores(action.work, rollouts) if self.config.filters_groups else None
                self.internal.append(WorkFinished(action.work.id, scores))
            case RunWork():
                assert action.executor is not None  # the case above runs host stages
                self.exec_workers[action.executor].inbox.put(("work", action.work))
            case OptimizerStep():
                self.learner_worker.inbox.put(("optimizer", action.step))
            case PublishWeights():
                self.learner_worker.inbox.put(("publish", action.version))
            case SwitchPool():
                if action.mode == "learn":  # what generation still runs there waits (carry-over)
                    for worker in self.gen_workers:
                        worker.inbox.put(("suspend", None))
                self._switcher().inbox.put(("switch", (action.pool, action.mode)))
            case MoveInstance():
                self.learner_worker.inbox.put(("move", (action.instance, action.role)))
            case SyncWeights():
                self.published.requested(action.instance, action.version)
                self.gen_workers[action.instance].inbox.put(("sync", action.version))
            case RunTool():
                self.tool_workers[action.runner].inbox.put(("call", action.sample))
            case ResumeEpisode():
                with self.lock:
                    result = self.tool_results.pop(action.sample)
                home = self.gen_workers[action.home]
                if action.instance == action.home:
                    home.inbox.put(("resume", (action.sample, result)))
                else:
                    home.inbox.put(("move", (action.sample, result, self.gen_workers[action.instance])))
            case Checkpoint():
                self.learner_worker.inbox.put(("checkpoint", action.step))
            case RestartInstance():  # threads do not die alone: a raising one ends the run (WorkerFailed)
                lost = self.gen_workers[action.instance].lost
                raise WorkerFailed(f"generation instance {action.instance} failed" + (f": {lost}" if lost else ""))
            case Finished():
                pass
            case _:
                assert_never(action)

    def _switcher(self) -> ExecutorWorker:
        """Who carries out a switch of the time-shared pool: the learner's worker where the trainer
        time-shares it, else the first time-shared executor's (a reference on the generation pool),
        which is idle then (the controller switches only when nothing runs there) — the learner's
        inbox would hold the switch back until its current training work ends, as the simulator,
        which switches at once, does not."""
        shared = [k for k, spec in enumerate(self.config.executors) if spec.time_shared]
        if any(self.exec_workers[k] is self.learner_worker for k in shared):
            return self.learner_worker
        return self.exec_workers[shared[0]]

    def _move_instance(self, instance: int, role: str) -> None:
        """Runtime rebalancing, on the trainer's thread: the backend moves the instance's devices to
        or from the trainer where it can (`move_instance`). A backend without it (the CPU backend:
        every worker's threads share the same cores) needs nothing moved: the instance simply gets
        no work from the controller while lent, and its cores go to whoever computes."""
        move = getattr(self.executors, "move_instance", None)
        if move is not None:
            move(instance, role)

    def _host_learner(self):
        """Who computes rule and python rewards: the trainer, or with process workers this
        process's copy of it (a reward reads no weights; the trainer's process stays busy training)."""
        return self.learner if self._learner_process() is not None else self.learner_worker.learner

    def _seed(self, sample) -> int:
        return zlib.crc32(repr((self.data.seed, self.options.seed, sample)).encode())

    def spans(self) -> list:
        """The spans the workers recorded so far (a copy: they keep appending)."""
        return [s for w in self._workers() for s in list(w.spans)]

    def _workers(self) -> list:
        return [*self.exec_workers, *self.gen_workers, *getattr(self, "tool_workers", [])]

    def stop_workers(self) -> None:
        if hasattr(self, "learner_worker"):
            self._stop()

    def _stop(self, drain: bool = False) -> None:
        """Stop the workers. `drain`: the learner first finishes what it was given (the final
        checkpoint); otherwise (an interruption) it stops after the message at hand. Once."""
        if self.stopped:
            return
        workers = self._workers()
        for worker in workers:
            if not drain:
                worker.stopping.set()
            worker.inbox.put(("stop", None))
        self.clock.leave()  # on virtual time the workers now run to their end without this thread
        for worker in workers:
            if worker.is_alive():
                worker.join(timeout=120 if worker is self.learner_worker else 10)
        self.stopped_at = self.clock()  # the run's end: tearing the processes down is not part of it
        self._close_processes()
        close = getattr(self.executors, "close", None)  # e.g. a run's tool processes
        if close is not None:
            close()
        self.stopped = True


def _is_error(event) -> bool:
    """A worker's ("error", name, error, traceback); other events may be named tuples."""
    return type(event) is tuple and event[0] == "error"


def _refuse_to_mix_runs(directory: Path, executors) -> None:
    """A fresh run must not write its checkpoints among another run's: a later --resume would
    take whichever step is newest, from either run."""
    existing = sorted(executors.step_folders(directory))
    if existing:
        raise executors.checkpoint_error(
            f"{directory} already holds checkpoints of a run (up to {existing[-1][1].name}); continue that run "
            "with --resume, or give a new run another --checkpoint folder")
