"""Fakes for tests/test_ray_npu_placement.py that run in Ray actors: a learner whose train call
blocks until a weight transfer happens meanwhile, and the rendezvous where both sides of a transfer
group meet when they join. A module of its own, importing neither torch nor the backends, so that
the actors that unpickle them start quickly."""
import threading

RENDEZVOUS = "fake-hccl-join"


class Rendezvous:
    """Where the two sides of an instance's transfer group meet when they join, as HCCL's
    rendezvous: each waits for the other (up to 300 s, longer than the tests take)."""

    def __init__(self):
        self.cond, self.arrived = threading.Condition(), {}

    def meet(self, instance):
        with self.cond:
            self.arrived[instance] = self.arrived.get(instance, 0) + 1
            self.cond.notify_all()
            return self.cond.wait_for(lambda: self.arrived[instance] >= 2, timeout=300)


def meet(instance):
    import ray

    assert ray.get(ray.get_actor(RENDEZVOUS).meet.remote(instance)), f"instance {instance}'s join timed out"


class BlockingLearner:
    """A train call that waits for a broadcast to happen while it runs (at most 30 s each way)."""

    def __init__(self):
        self.log, self.training, self.broadcast = [], threading.Event(), threading.Event()

    def train(self, rollouts):
        self.log.append("train started")
        self.training.set()
        self.log.append("train saw the broadcast" if self.broadcast.wait(30) else "train gave up")

    def send_weights(self, version, instance):
        self.training.wait(30)
        self.log.append(f"sent version {version} to instance {instance}")
        self.broadcast.set()

    def snapshot(self):
        return self.log


class BlockingExecutors:
    """The executors the learner actor builds it from (`learner_in_actor`)."""

    def trainer(self):  # built in the actor: an Event does not travel
        return BlockingLearner()

    def set_threads(self, count):
        pass

    def join_trainer_side(self, index):
        pass
