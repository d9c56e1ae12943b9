"""The Ray runtime: the same controller and worker loops as the local runtime, with each
generation instance and the learner in a Ray actor. Data and weights move through the object
store. A generation actor that dies is detected, its work re-queued by the controller and the
actor restarted; one that keeps dying ends the run with a clear message. A learner that cannot
leave its process (the Ascend backend's megatron rank 0: `learner_in_actor`) is built inside its
actor (learner_actor.py), pinned to rank 0's node (placement.py), which also publishes version 0
and joins each engine's weight-transfer group; an engine or learner actor that dies while they
join ends the run at once, naming the instance. A time-shared (colocated) pool's engines are
actors on the nodes of their NPUs, started asleep before the learner's actor builds the trainer,
and its switches are carried out here (colocated.py)."""
from __future__ import annotations

import copy
import dataclasses
import time
from typing import cast

from aspc.controller.config import UnsupportedPlan
from aspc.drivers.local.runtime import LocalRuntime
from aspc.drivers.local.workers import InstanceLost, WorkerFailed
from aspc.drivers.ray.placement import device_bundles, engine_node, missing_devices, rank0_node
from aspc.ir.kinds import ROLE_CALLS
from aspc.roles import LearnerInActor

MAX_RESTARTS = 3
JOIN_TIMEOUT_S = 600  # an engine's actor and the learner's meeting in its weight-transfer group
PLACEMENT_TIMEOUT_S = 60  # for the cluster to reserve the actors' bundles
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


def missing_cluster_devices(plan, address: str | None) -> str | None:
    """Why the Ray cluster (at `address`, else a local one) cannot hold the run's actors, or None:
    with Ray the NPUs are the cluster's, not those of the host the driver runs on."""
    try:
        ray = start_ray(address)
    except RayUnavailable as error:
        return str(error)
    except ConnectionError as error:
        return f"cannot join the Ray cluster at {address}: {error}"
    return missing_devices(ray, plan)


class _GeneratorActor:
    """Inside a Ray worker: one generation instance (the CPU backend's generator, or an engine that
    first joins the learner's weight-transfer group: `transfer`)."""

    def __init__(self, generator, state, set_threads, transfer=None):
        set_threads(1)  # a CPU actor holds a fraction of a core (CPU_SHARE): one thread, not one per core
        self.generator = generator
        if transfer is not None:  # the learner actor joins the same group meanwhile (ActorBuiltLearner)
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
        except actor_lost(self.ray) as error:
            self.active, self.buffer = 0, []
            raise InstanceLost(str(error)) from None


class _LearnerInActor:
    """The executors as the local runtime's build sees them when the learner lives in an actor:
    its trainer is the actor, version 0 comes from there, and engines are handed over unstarted
    (their actors start them and join the learner's transfer groups)."""

    def __init__(self, executors, learner: RemoteLearner, switch=None):
        self.inner, self.learner, self.switch = executors, learner, switch

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def switch_pool(self, pool: str, mode: str) -> None:
        """A time-shared pool's switch: the driver's (colocated.PoolSwitch), over the actors."""
        if self.switch is None:
            return self.inner.switch_pool(pool, mode)
        self.switch(pool, mode)

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
        """Version 0, published where the learner was built; its actor failing to build ends the run."""
        try:
            return self.ray.get(self.actor.initial_weights.remote())
        except self.ray.exceptions.RayError as error:
            raise WorkerFailed(f"the learner's actor failed while building the trainer: {cause(error)}") from None

    def __getattr__(self, method):
        if method in ROLE_CALLS:
            return lambda rollouts: self._get(self.actor.run.remote(method, rollouts))
        raise AttributeError(method)

    def optimizer_step(self):
        return self._get(self.actor.optimizer_step.remote())

    def snapshot(self):
        return self._get(self.actor.snapshot.remote())

    def parts(self):
        return self._get(self.actor.parts.remote())

    def _get(self, ref):
        """A call's result. The actor dying (killed, out of memory, its node's raylet gone) ends the
        run with one message naming it, as a dead learner process does (InstanceLost: WorkerFailed)."""
        try:
            return self.ray.get(ref)
        except actor_lost(self.ray) as error:
            raise InstanceLost(f"the learner's Ray actor died ({cause(error).split('. ')[0]})") from None


def actor_lost(ray) -> tuple:
    """The errors of a call whose actor is gone: ActorDiedError and ActorUnavailableError are
    RayActorError; RaySystemError when the node's Ray processes died under it."""
    return ray.exceptions.RayActorError, ray.exceptions.RaySystemError


def cause(error) -> str:
    """A Ray error's last line: the exception raised in the actor (its traceback precedes it)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


class RayRuntime(LocalRuntime):
    def __init__(self, plan, base_dir, options, executors, address: str | None = None):
        options = dataclasses.replace(options, workers="threads")  # its actors are the processes
        super().__init__(plan, base_dir, options, executors)
        if self.config.filters_groups:  # its learner actor keeps the rewards it computes
            raise UnsupportedPlan("filter_groups (dynamic sampling) runs on the local runtime only for now: "
                                  "run with --runtime local, or remove filter_groups")
        self.ray = start_ray(address)
        self.restarts: dict[int, int] = {}
        self._joins: dict = {}  # instance -> (the learner's pending join of its transfer group, its actor's start)
        self._engine_actors: list = []  # a time-shared pool's engines (colocated.py), started before the learner

    def build(self) -> None:
        from aspc.drivers.ray.learner_actor import LearnerActor

        in_actor = getattr(self.executors, "learner_in_actor", False)
        colocated = in_actor and self.config.shared_pool is not None
        if in_actor:
            self._learner_in_actor(colocated)
        super().build()
        ray = self.ray
        if not in_actor:
            self.placement = self._placement_group()
        self._gen_actor = ray.remote(_GeneratorActor)
        self._templates = {}
        if colocated:
            self._hand_pool_to_engines()
        for worker in [] if colocated else self.gen_workers:  # side by side; then all have joined their groups
            self._templates[worker.index] = copy.deepcopy(worker.generator)
            worker.generator = self._remote_generator(worker.index, wait=False)
        self._joined()
        if not in_actor:
            learner_class = self._learner_class(LearnerActor)
            learner_options = self._bundle(self.config.instances)
            learner_actor = learner_class.options(**learner_options).remote(self.learner, self.executors.set_threads)
            self.learner_worker.learner = RemoteLearner(ray, learner_actor)

    def _learner_in_actor(self, colocated: bool) -> None:
        """The learner actor, on its bundle on rank 0's node, builds the learner itself
        (ActorBuiltLearner); the local runtime's build then reaches it through _LearnerInActor.
        Rank 0's node is where its transfer groups' `master_address` points (MASTER_ADDR). A
        time-shared pool's engines start first, each on its NPUs' node, and sleep (colocated.py)."""
        from aspc.drivers.ray.colocated import PoolSwitch, start_engines
        from aspc.drivers.ray.learner_actor import ActorBuiltLearner

        count, executors = self.config.instances, cast(LearnerInActor, self.executors)  # its learner_in_actor said so
        engines = [engine_node(self.ray, executors.engine_address(i), i) for i in range(count)] if colocated else None
        self.placement = self._placement_group(rank0_node(self.ray, executors.learner_address()), engines)
        executors.engines_in_actors()  # on the NPUs of their actors (colocated: started before the learner)
        if colocated:
            start_engines(self.ray, self, {i: executors.unstarted_engine(i, count) for i in range(count)})
        options = self._bundle(count)
        actor = self._learner_class(ActorBuiltLearner).options(**options).remote(executors)
        switch = PoolSwitch(self.ray, self._engine_actors, actor) if colocated else None
        self.executors = _LearnerInActor(executors, RemoteLearner(self.ray, actor), switch)

    def _hand_pool_to_engines(self) -> None:
        """The controller starts a time-shared pool in generation (its first mode): the trainer
        offloads, then each engine's actor joins its transfer engine and wakes into the published
        version."""
        from aspc.drivers.ray.colocated import wake_into

        executors = self.executors
        assert isinstance(executors, _LearnerInActor), "a time-shared pool on Ray keeps the learner in its actor"
        for worker in self.gen_workers:
            worker.generator = RemoteGenerator(self.ray, self._engine_actors[worker.index])
        executors.switch(self.config.shared_pool, self.controller.mode)
        info = [executors.transfer_info(i) for i in range(self.config.instances)]
        wake_into(self.ray, self._engine_actors, info, self.ray.put(self.weights[max(self.weights)]))

    def _learner_class(self, cls):
        from aspc.drivers.ray.learner_actor import remote_learner_class

        return remote_learner_class(cls, self.config.instances)

    def _placement_group(self, learner_node: dict | None = None, engine_nodes: list | None = None):
        """One bundle per generation instance, then the learner's (`learner_node`: the resource that
        pins it to rank 0's node): `NPU` bundles of an instance's devices on Ascend pools, each with
        an actor's share of a CPU; on a CPU pool shares of a CPU, packed onto one node. A colocated
        instance's bundle holds no NPU and is pinned to its NPUs' node (`engine_nodes`)."""
        from ray.util.placement_group import placement_group, remove_placement_group

        kind, self.devices = device_bundles(self.plan, engines_share=engine_nodes is not None)
        bundles = [{"CPU": CPU_SHARE, **devices} for devices in self.devices] or \
            [{"CPU": CPU_SHARE} for _ in range(self.config.instances + 1)]
        bundles[-1].update(learner_node or {})
        if self.devices:  # the learner's actor holds its share of the node resource too: it runs on that bundle
            self.devices[-1].update(learner_node or {})
            for index, pin in enumerate(engine_nodes or []):
                bundles[index].update(pin)
                self.devices[index].update(pin)
        # accelerator bundles go wherever each fits (one bundle never spans nodes); the rollout pool's
        # and rank 0's devices are on different nodes in the launch plan (backends/ascend/topology.py)
        group = placement_group(bundles, strategy="STRICT_PACK" if kind == "CPU" else "PACK")
        try:
            self.ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except self.ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise UnsupportedPlan(f"the Ray cluster did not reserve the run's actors in {PLACEMENT_TIMEOUT_S} s "
                                  f"(bundles {bundles}; the cluster has {self.ray.cluster_resources()}, free "
                                  f"{self.ray.available_resources()}): free or add the devices") from None
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
            joining = self.executors.learner.actor.join_transfer_group.remote(index)
        actor = self._gen_actor.options(**self._bundle(index)).remote(self._templates[index],
                                                                      self.ray.put(self.weights[version]),
                                                                      self.executors.set_threads, transfer)
        if transfer is not None:
            self._joins[index] = (joining, actor.pid.remote())  # pid: answered once the actor has started
        if wait:
            self._joined()
        return RemoteGenerator(self.ray, actor)

    def _joined(self) -> None:
        """Wait until each engine actor asked for has started (joined its transfer group, loaded
        its weights) and the learner has joined the same group (one group at a time, each when its
        engine's actor joins). Whichever side fails first ends the run, naming the instance: an
        engine that dies in its join would otherwise leave the learner blocked in it until HCCL's
        own timeout."""
        sides = {}
        for index, (joining, started) in self._joins.items():
            sides[joining] = (index, "the learner's side")
            sides[started] = (index, f"generation instance {index}'s actor")
        self._joins = {}
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while sides:
            done, _ = self.ray.wait(list(sides), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                waiting = sorted({index for index, _ in sides.values()})
                raise WorkerFailed(f"generation instances {waiting} did not join their weight-transfer groups with "
                                   f"the learner in {JOIN_TIMEOUT_S} s")
            index, side = sides.pop(done[0])
            try:
                self.ray.get(done[0])
            except self.ray.exceptions.RayError as error:
                raise WorkerFailed(f"generation instance {index} did not join its weight-transfer group with the "
                                   f"learner: {side} failed: {cause(error)}") from None

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
                self._final_parts = self._last_parts(learner)
            actors.append(learner.actor)
        actors += self._engine_actors  # a colocated start that failed leaves no worker holding them
        for actor in actors:
            self.ray.kill(actor)
        if getattr(self, "placement", None) is not None:
            remove_placement_group(self.placement)
            self.placement = None

    def _last_parts(self, learner: RemoteLearner):
        """The learner's state before its actor is freed; None if the actor died (`learner_lost`
        says why: nothing is saved after it, the last checkpoint on disk stays the resume point)."""
        try:
            return learner.parts()
        except InstanceLost as error:
            self.learner_lost = str(error)
            return None

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
            if self._engine_actors:
                raise WorkerFailed(f"colocated generation instance {action.instance} failed; an engine that shares "
                                   "its NPUs with trainer ranks is not restarted during a run (it must start while "
                                   "its NPUs are free): rerun, or give generation a pool of its own")
            self.gen_workers[action.instance].inbox.put(("replace", self._remote_generator(action.instance)))
            return
        super()._act(action)
