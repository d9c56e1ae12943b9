"""One megatron job, many ranks: rank 0 leads, the others follow. The driver's learner actor holds
rank 0's trainer behind a `Leader`, which broadcasts every call that touches the model to the job's
other ranks before running it; those ranks `follow`, running the same calls in the same order
(megatron's collectives need every rank)."""
from __future__ import annotations

import threading

# every rank must run these (offload/onload: each rank moves its own share)
MODEL_CALLS = ("reference", "values", "train", "optimizer_step", "snapshot", "publish", "offload", "onload")
# a model call's broadcast and its collectives in one piece: colocated weight sends (weight_sync.IpcSender)
# broadcast from another thread of rank 0
CALLS = threading.RLock()


class Leader:
    """Rank 0's trainer as the driver's learner actor sees it: a call that touches the model is
    first broadcast to the job's other ranks, which run the same call (megatron's collectives need
    every rank, in the same order); host-only calls (rewards) run here alone. `prefix` names where
    the followers find the callee ("critic.": their trainer's critic)."""

    def __init__(self, trainer, broadcast=None, prefix: str = ""):
        self.trainer, self.broadcast, self.prefix = trainer, broadcast or broadcast_call, prefix

    def __getattr__(self, name):
        if name in ("trainer", "broadcast", "prefix"):  # not set yet (a copy or unpickling): no recursion
            raise AttributeError(name)
        if name not in MODEL_CALLS:
            return getattr(self.trainer, name)

        def call(*args):
            with CALLS:
                self.broadcast((self.prefix + name, args))
                return getattr(self.trainer, name)(*args)

        return call

    def close(self) -> None:
        self.broadcast(("stop", ()))


def follow(trainer, receive=None) -> int:
    """Ranks other than 0: run rank 0's calls until it stops (a dotted name is a call on a part
    of the trainer: "critic.train"); how many ran."""
    receive = receive or broadcast_call
    count = 0
    while True:
        name, args = receive(None)
        if name == "stop":
            return count
        callee = trainer
        for part in name.split("."):
            callee = getattr(callee, part)
        callee(*args)
        count += 1


def broadcast_call(call):
    """Rank 0 sends `call`, every other rank receives it (torch.distributed's default group)."""
    import torch.distributed as dist

    box = [call]
    dist.broadcast_object_list(box, src=0)
    return box[0]
