"""The Ray runtime: the same controller and worker loops as the local runtime, with each
generation instance and the learner in a Ray actor. Data and weights move through the object
store. A generation actor that dies is detected, its work re-queued by the controller and the
actor restarted; one that keeps dying ends the run with a clear message. A learner that cannot
leave its process (the Ascend backend's megatron rank 0: `learner_in_actor`) is built inside its
actor, which also publishes version 0 and joins each engine's weight-transfer group."""
from __future__ import annotations

import dataclasses

import copy

from aspc.ir.facts import hardware_table
from aspc.controller.config import UnsupportedPlan
from aspc.drivers.local.runtime import LocalRuntime
from aspc.drivers.local.workers import InstanceLost, WorkerFailed

MAX_RESTARTS = 3
JOIN_TIMEOUT_S = 600  # an engine's actor and the learner's meeting in its weight-transfer group
CPU_SHARE = 0.25  # a CPU actor's share of a core: the tiny models leave room for several per core


class RayUnavailable(Exception):
    """Ray is not installed (message: how to install it)."""


def require_ray():
    try:
        import ray
    except ImportError:
        raise RayUnavailable("the Ray runtime needs Ray: pip install 'aspc[ray]' (or pip install ray)") from None
    return ray


def start_ray(address: str | None):
    ray = require_ray()
    if not ray.is_initialized():
        if address:
            ray.init(address=address, ignore_reinit_error=True)
        else:
            ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    return ray


class _GeneratorActor:
    """Inside a Ray worker: one generation instance (the CPU backend's generator, or an engine that
    first joins the learner's weight-transfer group: `transfer`)."""

    def __init__(self, generator, state, set_threads, transfer=None):
        set_threads(1)  # a CPU actor holds a fraction of a core (CPU_SHARE): one thread, not one per core
        self.generator = generator
        if transfer is not None:  # the learner actor joins the same group meanwhile (_ActorBuiltLearner)
            self.generator.connect(transfer)
        self.generator.load_weights(state)

    def step(self, requests):
        for key, ids, seed in requests:
            self.generator.add(key, ids, seed)
        return self.generator.step() if self.generator.busy else []

    def load(self, state):
        self.generator.load_weights(state)

    def pid(self):
        import os

        return os.getpid()


class RemoteGenerator:
    """What a generation worker thread drives: the generator interface, over a Ray actor."""

    def __init__(self, ray, actor):
        self.ray, self.actor = ray, actor
        self.buffer: list = []
        self.active = 0

    @property
    def busy(self) -> bool:
        return bool(self.buffer) or self.active > 0

    def add(self, key, ids, seed) -> None:
        self.buffer.append((key, ids, seed))

    def step(self):
        requests, self.buffer = self.buffer, []
        self.active += len(requests)
        finished = self._get(self.actor.step.remote(requests))
        self.active -= len(finished)
        return finished

    def load_weights(self, state) -> None:
        self._get(self.actor.load.remote(self.ray.put(state)))

    def _get(self, ref):
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayActorError as error:
            self.active, self.buffer = 0, []
            raise InstanceLost(str(error)) from None


class _LearnerActor:
    """Inside a Ray worker: the learner, keeping each sample's rollout between its stages."""

    def __init__(self, learner, set_threads):
        set_threads(1)
        self.learner, self.rollouts = learner, {}

    def run(self, method, rollouts):
        kept = [self.rollouts.setdefault(r.key, r) for r in rollouts]
        getattr(self.learner, method)(kept)
        if method == "train":
            for r in kept:
                self.rollouts.pop(r.key, None)

    def optimizer_step(self):
        return self.learner.optimizer_step()

    def send_weights(self, version, instance):
        """An engine's refresh asks the learner to send it a published version (backends whose
        published weights stay with the learner: the Ascend backend's HandleSender)."""
        return self.learner.send_weights(version, instance)

    def snapshot(self):
        return self.learner.snapshot()

    def parts(self):
        l = self.learner
        return ({"actor": l.actor, "reference": l.ref, "critic": l.critic},
                {"actor": l.optimizer, "critic": l.critic_optimizer})


class _ActorBuiltLearner(_LearnerActor):
    """A learner that cannot leave its process (executors' `learner_in_actor`: megatron's rank 0 on
    an NPU, with its process groups and weight sender): built in this actor from the executors, which
    publish version 0 here and join each engine's weight-transfer group from here."""

    def __init__(self, executors):
        self.executors = executors
        super().__init__(executors.trainer(), executors.set_threads)

    def initial_weights(self):
        return self.executors.snapshot()

    def join_transfer_group(self, index: int) -> None:
        self.executors.join_trainer_side(index)


class _LearnerInActor:
    """The executors as the local runtime's build sees them when the learner lives in an actor:
    its trainer is the actor, version 0 comes from there, and engines are handed over unstarted
    (their actors start them and join the learner's transfer groups)."""

    def __init__(self, executors, learner: RemoteLearner):
        self.inner, self.learner = executors, learner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def trainer(self):
        return self.learner

    def snapshot(self):
        return self.learner.initial_weights()

    def generation_engine(self, index: int, instances: int):
        return self.inner.unstarted_engine(index, instances)


class RemoteLearner:
    def __init__(self, ray, actor):
        self.ray, self.actor = ray, actor

    def initial_weights(self):
        return self.ray.get(self.actor.initial_weights.remote())

    def __getattr__(self, method):
        if method in ("reward", "reference", "values", "train"):
            return lambda rollouts: self.ray.get(self.actor.run.remote(method, rollouts))
        raise AttributeError(method)

    def optimizer_step(self):
        return self.ray.get(self.actor.optimizer_step.remote())

    def snapshot(self):
        return self.ray.get(self.actor.snapshot.remote())

    def parts(self):
        return self.ray.get(self.actor.parts.remote())


class RayRuntime(LocalRuntime):
    def __init__(self, plan, base_dir, options, executors, address: str | None = None):
        options = dataclasses.replace(options, workers="threads")  # its actors are the processes
        super().__init__(plan, base_dir, options, executors)
        if self.config.filters_groups:  # its learner actor keeps the rewards it computes
            raise UnsupportedPlan("filter_groups (dynamic sampling) runs on the local runtime only for now: "
                                  "run with --runtime local, or remove filter_groups")
        self.ray = start_ray(address)
        self.restarts: dict[int, int] = {}
        self._joins: dict = {}  # instance -> the learner actor's pending join of its transfer group

    def build(self) -> None:
        in_actor = getattr(self.executors, "learner_in_actor", False)
        if in_actor:
            self._learner_in_actor()
        super().build()
        ray = self.ray
        if not in_actor:
            self.placement = self._placement_group()
        self._gen_actor = ray.remote(_GeneratorActor)
        self._templates = {}
        for worker in self.gen_workers:  # the engines start side by side; then all have joined their groups
            self._templates[worker.index] = copy.deepcopy(worker.generator)
            worker.generator = self._remote_generator(worker.index, wait=False)
        self._joined()
        if not in_actor:
            learner_options = self._bundle(self.config.instances)
            learner_actor = ray.remote(_LearnerActor).options(**learner_options).remote(self.learner,
                                                                                        self.executors.set_threads)
            self.learner_worker.learner = RemoteLearner(ray, learner_actor)

    def _learner_in_actor(self) -> None:
        """The learner actor, on its bundle, builds the learner itself (_ActorBuiltLearner); the
        local runtime's build then reaches it through _LearnerInActor."""
        self.placement = self._placement_group()
        options = self._bundle(self.config.instances)
        actor = self.ray.remote(_ActorBuiltLearner).options(**options).remote(self.executors)
        self.executors = _LearnerInActor(self.executors, RemoteLearner(self.ray, actor))

    def _placement_group(self):
        """One bundle per generation instance and one for the learner, packed onto one node:
        `NPU` bundles of an instance's devices on Ascend pools, a share of a CPU here."""
        from ray.util.placement_group import placement_group

        pool = self.plan.pool(self.gen_stage.pool)
        per_instance = self.gen_stage.parallel.devices
        kind = hardware_table()[pool.hardware].ray_resource  # NPU on Ascend pools, from aspc/data/hardware.toml
        # an accelerator bundle also holds the actor's share of a CPU; the learner's is its rank 0's device
        # (the other ranks of a megatron job start from the launch plan, aspc/backends/ascend/executors.py)
        instances = self.config.instances
        self.devices = [{kind: per_instance} for _ in range(instances)] + [{kind: 1}] if kind != "CPU" else []
        bundles = [{"CPU": CPU_SHARE, **devices} for devices in self.devices] or \
            [{"CPU": CPU_SHARE} for _ in range(instances + 1)]
        group = placement_group(bundles, strategy="STRICT_PACK" if per_instance <= 8 else "PACK")
        self.ray.get(group.ready(), timeout=60)
        return group

    def _bundle(self, index: int) -> dict:
        """An actor's options: its bundle, and the bundle's accelerators (Ray then sets
        ASCEND_RT_VISIBLE_DEVICES in the actor's process)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        devices = {} if not self.devices else {"num_gpus": self.devices[index]["GPU"]} \
            if "GPU" in self.devices[index] else {"resources": self.devices[index]}  # Ray wants GPUs as num_gpus
        return {"num_cpus": CPU_SHARE, **devices, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.placement, placement_group_bundle_index=index)}

    def _remote_generator(self, index: int, wait: bool = True) -> RemoteGenerator:
        """Instance `index`'s actor, loaded with the newest weights; where the learner lives in an
        actor, the instance's actor and the learner's first join the instance's transfer group
        (`wait`: until both have; else _joined() waits)."""
        version = max(self.weights)
        transfer = None
        if isinstance(self.executors, _LearnerInActor):
            transfer = self.executors.transfer_info(index)
            self._joins[index] = self.learner.actor.join_transfer_group.remote(index)
        actor = self._gen_actor.options(**self._bundle(index)).remote(self._templates[index],
                                                                      self.ray.put(self.weights[version]),
                                                                      self.executors.set_threads, transfer)
        if wait:
            self._joined()
        return RemoteGenerator(self.ray, actor)

    def _joined(self) -> None:
        """Wait until the learner has joined the transfer groups asked for (the learner's actor joins
        one group at a time, each when its engine's actor joins)."""
        while self._joins:
            index, joined = self._joins.popitem()
            try:
                self.ray.get(joined, timeout=JOIN_TIMEOUT_S)
            except (self.ray.exceptions.RayError, TimeoutError) as error:
                raise WorkerFailed(f"the learner did not join generation instance {index}'s weight-transfer "
                                   f"group: {error}") from None

    def _stop(self, drain: bool = False) -> None:
        """Stop the worker threads, then free the actors and the placement group (once)."""
        if self.stopped:
            return
        super()._stop(drain)
        from ray.util.placement_group import remove_placement_group

        actors = [w.generator.actor for w in getattr(self, "gen_workers", [])
                  if isinstance(w.generator, RemoteGenerator)]
        learner = getattr(getattr(self, "learner_worker", None), "learner", None)
        if isinstance(self.executors, _LearnerInActor):  # built before the workers were
            learner = self.executors.learner
        if isinstance(learner, RemoteLearner):
            if self.options.checkpoint_dir is not None:  # for a last checkpoint after the actors are gone
                self._final_parts = learner.parts()
            actors.append(learner.actor)
        for actor in actors:
            self.ray.kill(actor)
        if getattr(self, "placement", None) is not None:
            remove_placement_group(self.placement)
            self.placement = None

    def _parts(self):
        if getattr(self, "_final_parts", None) is not None:
            return self._final_parts
        learner = self.learner_worker.learner if hasattr(self, "learner_worker") else None
        if isinstance(learner, RemoteLearner):
            return learner.parts()
        return super()._parts()

    def _act(self, action) -> None:
        from aspc.controller.events import RestartInstance

        if isinstance(action, RestartInstance):
            count = self.restarts[action.instance] = self.restarts.get(action.instance, 0) + 1
            if count > MAX_RESTARTS:
                raise WorkerFailed(f"generation instance {action.instance} failed {count} times; giving up")
            self.gen_workers[action.instance].inbox.put(("replace", self._remote_generator(action.instance)))
            return
        super()._act(action)
