"""An in-process Communicator (backends/ascend/weight_sync.py) for the CPU tests: each rank a
thread, collectives met in a shared hub, as HCCL would meet them across processes."""
import threading
from concurrent.futures import ThreadPoolExecutor


class ThreadCommunicator:
    """Collectives among threads, one per rank: the n-th call of each rank on a group meets the
    n-th call of the others; a broadcast copies into the receivers' buffers, as HCCL does."""

    def __init__(self, rank: int, hub: "Hub"):
        self.rank, self.hub, self.calls = rank, hub, {}

    def _exchange(self, group, value):
        key = (tuple(group), self.calls.setdefault(tuple(group), 0))
        self.calls[tuple(group)] += 1
        return self.hub.exchange(key, group.index(self.rank), len(group), value)

    def all_gather(self, tensor, group):
        # what was sent, as sent: a rank may write into its tensor once the collective is over
        return [t.clone() for t in self._exchange(group, tensor.clone())]

    def broadcast(self, tensor, src, group):
        sent = self._exchange(group, tensor if self.rank == src else None)[group.index(src)]
        assert sent.shape == tensor.shape and sent.dtype == tensor.dtype, "receiver's buffer mismatches"
        return tensor if self.rank == src else tensor.copy_(sent)


class Hub:
    def __init__(self):
        self.cond, self.slots = threading.Condition(), {}

    def exchange(self, key, index, size, value):
        with self.cond:
            slot = self.slots.setdefault(key, [None] * size + [0])
            slot[index] = value
            slot[-1] += 1
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: slot[-1] >= size, timeout=20), f"collective {key} never completed"
            return slot[:size]


def run_ranks(world: int, body):
    hub = Hub()
    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(lambda r: body(ThreadCommunicator(r, hub)), range(world)))
