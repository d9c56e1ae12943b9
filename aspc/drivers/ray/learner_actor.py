"""The learner's Ray actor. Training calls run one at a time (the actor's default concurrency
group), while the weight transfer to the engines has a concurrency group of its own, so that an
engine's refresh is served while a training call runs, as the controller's plan assumes (weight
sync overlapping training). What a transfer reads is a published snapshot, never the weights being
trained: the Ascend backend's WeightSender stages a host copy of each version when it is published
(`publish`, a training-group call) and `send_weights` broadcasts that copy.

Ray (2.40+) gives a threaded actor named concurrency groups: `ray.remote(concurrency_groups=...)`
on the class, `@ray.method(concurrency_group=...)` on the method (ray/actor.py: `.options()` cannot
set them, so `remote_learner_class` builds the remote class per run)."""
from __future__ import annotations

import dataclasses
import itertools
import os
import threading

import ray

from aspc.platforms import NPU

TRANSFER_GROUP = "weight_transfer"
JOIN_WAIT_S = 600  # a refresh waits at most this long for the learner's side of its group
VISIBLE_DEVICES: str = NPU.visible_devices or ""  # the learner in an actor is megatron's rank 0 on an NPU


def remote_learner_class(cls, instances: int):
    """`cls` as a Ray actor class whose transfer group serves every generation instance at once
    (each refresh blocks one of its threads until its broadcast is done, as the local runtime's
    sender threads do)."""
    # ray's stub overloads leave out concurrency_groups, which ray.remote takes (Ray's actor docs)
    return ray.remote(concurrency_groups={TRANSFER_GROUP: max(1, instances)})(cls)  # type: ignore[call-overload]


class LearnerActor:
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

    @ray.method(concurrency_group=TRANSFER_GROUP)
    def send_weights(self, version, instance):
        """An engine's refresh asks the learner to send it a published version (backends whose
        published weights stay with the learner: the Ascend backend's HandleSender); it reads the
        version's staged copy, so it may run while a training call updates the weights."""
        return self.learner.send_weights(version, instance)

    def snapshot(self):
        return self.learner.snapshot()

    def offload(self):
        """A time-shared pool goes to generation (the driver carries out the controller's switch)."""
        self.learner.offload()

    def onload(self):
        """A time-shared pool comes back to training, after every engine on it sleeps."""
        self.learner.onload()

    def parts(self):
        learner = self.learner
        return ({"actor": learner.actor, "reference": learner.ref, "critic": learner.critic},
                {"actor": learner.optimizer, "critic": learner.critic_optimizer})


class ActorBuiltLearner(LearnerActor):
    """A learner that cannot leave its process (executors' `learner_in_actor`: megatron's rank 0 on
    an NPU, with its process groups and weight sender): built in this actor from the executors, which
    publish version 0 here and join each engine's weight-transfer group from here."""

    def __init__(self, executors):
        self.executors = executors
        self.joined: dict[int, threading.Event] = {}  # instance -> the learner's side of its group is in
        self.lock = threading.Lock()
        self.streamer = None  # a colocated pool's sender (chunks streamed per refresh: colocated.py)
        self.streams: dict[int, tuple] = {}  # stream id -> (its pending send, its chunks)
        self.stream_ids = itertools.count()
        assigned = os.environ.get(VISIBLE_DEVICES)  # Ray's, for this actor's NPU bundle
        super().__init__(executors.trainer(), executors.set_threads)
        check_devices_kept(assigned, os.environ.get(VISIBLE_DEVICES))

    def initial_weights(self):
        return self._relayed(self.executors.snapshot())

    def snapshot(self):
        return self._relayed(super().snapshot())

    def _relayed(self, published):
        """A published version whose sender streams chunks to the engine (a colocated pool's NPU IPC
        send: `updates`) leaves this actor with a StreamRelay to it in the sender's place; others
        (the HCCL sender) leave as they pickle themselves."""
        from aspc.drivers.ray.colocated import StreamRelay

        sender = getattr(published, "sender", None)
        if not hasattr(sender, "updates"):
            return published
        import ray

        self.streamer = sender
        return dataclasses.replace(published, sender=StreamRelay(ray.get_runtime_context().current_actor))

    @ray.method(concurrency_group=TRANSFER_GROUP)
    def start_stream(self, version: int, instance: int) -> int:
        """An engine's refresh begins: every trainer rank starts the send (the sender's broadcast
        brings ranks > 0, on every node); returns the stream's id."""
        assert self.streamer is not None, "a stream starts after a colocated snapshot set its sender (_relayed)"
        pending = self.streamer.start(version, instance)
        key = next(self.stream_ids)
        self.streams[key] = (pending, self.streamer.updates(pending))
        return key

    @ray.method(concurrency_group=TRANSFER_GROUP)
    def next_chunk(self, key: int):
        """The next chunk's update_info, once the engine has loaded the one before (asking again says
        so: the ranks then refill their buffers); None when the send is over."""
        return next(self.streams[key][1], None)

    @ray.method(concurrency_group=TRANSFER_GROUP)
    def end_stream(self, key: int) -> None:
        """The engine's refresh is over (or failed): the send ends; its error, if any, raises here."""
        pending, chunks = self.streams.pop(key)
        chunks.close()
        assert self.streamer is not None, "a stream ends after it started (start_stream)"
        self.streamer.wait(pending)

    def join_transfer_group(self, index: int) -> None:
        joined = self._group(index)
        joined.clear()  # a restarted engine's actor joins a fresh group
        self.executors.join_trainer_side(index)
        joined.set()

    @ray.method(concurrency_group=TRANSFER_GROUP)
    def send_weights(self, version, instance):
        """As LearnerActor's, once this side of the instance's group is in: the engine's side may
        return from the join and ask for its first weights before this side has recorded the group."""
        if not self._group(instance).wait(JOIN_WAIT_S):
            raise RuntimeError(f"the learner has not joined generation instance {instance}'s weight-transfer group")
        return super().send_weights(version, instance)  # type: ignore[operator]  # ray's stub types the method

    def _group(self, index: int) -> threading.Event:
        with self.lock:
            return self.joined.setdefault(index, threading.Event())


def check_devices_kept(assigned: str | None, used: str | None) -> None:
    """Rank 0 must run on the NPU Ray reserved for it: building it applies the launch plan's rank-0
    environment, whose ASCEND_RT_VISIBLE_DEVICES names the device the launch plan gave rank 0 (the
    job's other ranks, started by the launch script, hold the node's other devices). Where the two
    differ, another actor may get that device from Ray; refuse, saying how to make them agree."""
    if assigned is None or used == assigned:
        return
    raise RuntimeError(f"trainer rank 0 runs on NPU {used} (the launch plan's ASCEND_RT_VISIBLE_DEVICES), but Ray "
                       f"reserved NPU {assigned} for the learner's actor; start Ray on rank 0's node with rank 0's "
                       f"device only (ASCEND_RT_VISIBLE_DEVICES={used} ray start ..., docs/ascend.md) so both agree")
