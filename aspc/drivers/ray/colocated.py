"""Colocated (time-shared) pools on the Ray runtime: the engines share their NPUs with the trainer's
ranks, node by node, and hand the pool over at the controller's switches.

What runs where (verl's hybrid engine on Ray does the same job with one worker per NPU holding both
the trainer rank and its engine shard: verl/single_controller/ray/base.py, RayWorkerGroup, and
verl/workers/fsdp_workers.py, ActorRolloutRefWorker with its rollout sharding manager):
- each generation instance is an actor (`ColocatedEngineActor`) pinned to the node of its NPUs
  (`node:<ip>`, placement.engine_node); it holds no NPU of Ray's: its vLLM processes take the
  launch plan's NPUs of that node (the executors' engine environment), which the trainer's ranks
  on the same chips also use; an instance with dp > 1 is the executors' engine group in that actor,
  with an actor per data-parallel rank (`EngineRankActor`) pinned to the rank's node;
- trainer rank 0 is the learner's actor on node 0 (learner_actor.ActorBuiltLearner); ranks > 0 stay
  the launch plan's follower processes on every node, outside Ray. They already follow rank 0's
  calls (offload, onload, the refresh's send: backends' call broadcast) over the megatron job's
  process groups, so the trainer is one job whichever runtime drives it, and each NPU IPC handle
  is made by the rank on the engine worker's own chip, on the engine's node;
- a refresh: the engine's actor asks the learner's actor for the chunks (`StreamRelay`); the
  learner's actor starts the send of every rank and passes each chunk's update_info on, one at a
  time, refilling the buffers only when the engine has loaded the chunk before;
- a switch (`PoolSwitch`): the driver carries out the controller's SwitchPool actions as the local
  runtime's executors do (to training: every engine on every node sleeps, then the trainer
  onloads; to generation: the trainer offloads, and each engine wakes at its refresh, weights
  first, or whole on work that finds it asleep). It decides nothing: when and which way is the
  controller's.
Start-up order on shared NPUs (backends' startup.py): the engines start while their NPUs are free
and sleep; the learner's actor builds the trainer only then."""
from __future__ import annotations

from aspc.drivers.local.workers import WorkerFailed
from aspc.drivers.ray.placement import engine_node
from aspc.drivers.ray.runtime import CPU_SHARE, JOIN_TIMEOUT_S, _GeneratorActor, cause


class ColocatedEngineActor(_GeneratorActor):
    """Inside a Ray worker on its NPUs' node: one colocated instance, started and put to sleep at
    once (its weights come at its first refresh, after the trainer offloads). An instance with
    dp > 1 (the executors' data-parallel engine group: `ranks`, `addresses`) runs each rank's engine
    in an actor of its own on that rank's node (`start_ranks`); this actor then holds the group,
    which reaches its ranks through them."""

    def __init__(self, engine, set_threads):  # not super's: it would load weights before the trainer offloads
        set_threads(1)
        self.generator = engine
        if hasattr(engine, "ranks"):
            import ray

            engine.ranks = ActorRanks(ray, start_ranks(ray, engine, set_threads))
        engine.sleep()  # starts vLLM on the launch plan's NPUs, then frees them for the trainer

    def connect(self, init_info: dict) -> None:
        self.generator.connect(init_info)

    def sleep(self) -> None:
        self.generator.sleep()


class EngineRankActor:
    """Inside a Ray worker on its NPUs' node: one data-parallel rank's engine of a colocated
    instance, called by the instance's engine group (its actor: ColocatedEngineActor). These actors
    are owned by the instance's actor and end with it."""

    def __init__(self, engine, set_threads):
        set_threads(1)
        self.engine = engine

    def call(self, method: str, *args):
        return getattr(self.engine, method)(*args)


class ActorRanks:
    """An engine group's ranks as Ray actors: a call goes to the ranks named, side by side, and
    returns once every one has answered."""

    def __init__(self, ray, actors: list):
        self.ray, self.actors = ray, actors

    def call(self, method: str, args: dict) -> dict:
        refs = {rank: self.actors[rank].call.remote(method, *a) for rank, a in args.items()}
        return dict(zip(refs, self.ray.get(list(refs.values()))))


def rank_options(ray, group) -> list[dict]:
    """Each data-parallel rank's actor options: pinned to the node of its NPUs (the group's
    `addresses`, from the launch plan and ASPC_NODES), holding no NPU of Ray's (its engine takes
    the launch plan's NPUs there, which the trainer's ranks on the same chips also use)."""
    return [{"num_cpus": CPU_SHARE, "resources": engine_node(ray, address, group.instance)}
            for address in group.addresses]


def start_ranks(ray, group, set_threads) -> list:
    """The group's rank actors, one per rank on its node, each holding its rank's (unstarted) engine."""
    remote = ray.remote(EngineRankActor)
    return [remote.options(**options).remote(engine, set_threads)
            for options, engine in zip(rank_options(ray, group), group.engines)]


class StreamRelay:
    """A published version's sender inside a colocated engine's actor: the engine's refresh reads
    the chunks the trainer's ranks send, through the learner's actor (`handle`). Only each chunk's
    description (names, shapes, NPU IPC handles) travels; the tensors stay in the ranks' buffers."""

    def __init__(self, handle):
        self.handle = handle

    def start(self, version: int, instance: int) -> int:
        import ray

        return ray.get(self.handle.start_stream.remote(version, instance))

    def updates(self, pending: int):
        import ray

        while (info := ray.get(self.handle.next_chunk.remote(pending))) is not None:
            yield info

    def wait(self, pending: int) -> None:
        import ray

        ray.get(self.handle.end_stream.remote(pending))  # a failed send raises here, on the engine's side


class PoolSwitch:
    """The Ray driver's side of a time-shared pool: the engine actors on every node and the learner's
    actor, handed over as the controller's SwitchPool actions say."""

    def __init__(self, ray, engines: list, learner):
        self.ray, self.engines, self.learner = ray, engines, learner
        self.holder = "learn"  # the trainer is built last, onloaded

    def __call__(self, pool: str, mode: str) -> None:
        if mode not in ("gen", "learn"):
            raise ValueError(f"unknown pool mode '{mode}'")
        if self.holder == mode:
            return
        if mode == "learn":
            self._all("sleep", [actor.sleep.remote() for actor in self.engines])
            self._all("onload", [self.learner.onload.remote()])
        else:
            self._all("offload", [self.learner.offload.remote()])
        self.holder = mode

    def _all(self, what: str, calls: list) -> None:
        try:
            self.ray.get(calls)
        except self.ray.exceptions.RayError as error:
            raise WorkerFailed(f"the time-shared pool's switch failed at {what}: {cause(error)}") from None


def start_engines(ray, runtime, templates: dict) -> list:
    """Each colocated engine's actor on its bundle (its node), started side by side; returns them
    once every engine is up and asleep, naming the instance whose start failed."""
    remote = ray.remote(ColocatedEngineActor)
    set_threads = runtime.executors.set_threads
    actors = [remote.options(**runtime._bundle(i)).remote(templates[i], set_threads) for i in sorted(templates)]
    runtime._engine_actors = actors  # stopped with the run, even if a start fails
    for index, actor in enumerate(actors):
        try:
            ray.get(actor.pid.remote(), timeout=JOIN_TIMEOUT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as error:
            raise WorkerFailed(f"colocated generation instance {index} did not start asleep on its NPUs: "
                               f"{cause(error)}") from None
    return actors


def wake_into(ray, actors: list, info: list, state) -> None:
    """The pool's first hand-over to generation (the controller starts in "gen"): each engine joins
    its transfer engine (`info[i]`) and takes version 0, waking through that refresh."""
    pending = {i: actor.connect.remote(info[i]) for i, actor in enumerate(actors)}
    pending = {i: [pending[i], actors[i].load.remote(state)] for i in pending}
    for index, calls in pending.items():
        try:
            ray.get(calls)
        except ray.exceptions.RayError as error:
            raise WorkerFailed(f"colocated generation instance {index} did not take version 0: "
                               f"{cause(error)}") from None
