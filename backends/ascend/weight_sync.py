"""Weight sync from megatron trainers to vLLM engines, as the Ascend stacks do it. Each function
runs on one rank (SPMD) and moves tensors only through a `Communicator`: `TorchCommunicator`
(torch.distributed, HCCL on an NPU) in a job, an in-process fake in the CPU tests.

- `reshard_in_place` — colocated pools, as MindSpeed-RL does it
  (mindspeed_rl/workers/resharding/vllm_weight_container.py, `get_infer_params`): all-gather
  each parameter over the training tensor-parallel group, cut it again for the inference
  tensor-parallel size, then broadcast every pipeline stage's parameters over the pipeline group,
  so that each device holds its inference shard of every layer. Experts are gathered over the
  expert-parallel group and each inference rank keeps its share (vLLM's expert parallelism over
  the engine's tensor-parallel ranks: `enable_expert_parallel`), so experts come from every
  expert-parallel rank, not from data-parallel rank 0 alone.
- `whole_hf_in_place` + `IpcSender` — colocated pools as vllm-ascend 0.23.0 moves them: its NPU IPC
  engine (`weight_transfer_config={"backend": "npu_ipc"}`,
  vllm_ascend/distributed/weight_transfer/npu_ipc_engine.py) has every trainer rank share its
  tensors' device memory with the engine worker on the same NPU, which loads them in checkpoint
  (Hugging Face) format. So every rank streams the whole model (hf_stream.HfStream: one parameter
  at a time gathered, as verl's per-tensor generator does, packed into one reused IPC buffer);
  no rank assembles it. (`reshard_in_place` with an inference tensor-parallel size of 1 gives the
  same tensors at once.)
- `gather_hf` + `send_hf` / `receive_hf` — separate pools, as vllm-ascend's HCCL weight transfer
  does it (vllm_ascend/distributed/weight_transfer/hccl_engine.py): trainer rank 0 assembles full
  Hugging Face-named tensors (tensor all-gather, expert all-gather, pipeline broadcast, as verl's
  megatron per-tensor generator does) and broadcasts them one by one to every engine worker, which
  knows their names, dtypes and shapes from `update_info` (`HCCLWeightTransferUpdateInfo`).

Each takes the trainer's `reshard.Layout` (`Layout.from_config` of its TransformerConfig: uneven pipeline
split, router expert bias); without one, MLA models are refused. The engine's cuts are
`reshard.engine_params` (vLLM replicates MLA's down projections, which the trainer cuts)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import torch

from aspc.backends.ascend import reshard
from aspc.backends.ascend.groups import process_groups, rank_coords
from aspc.backends.vllm import transfer
from aspc.ir.facts import ModelArch
from aspc.ir.graph import Parallel


class Communicator(Protocol):
    """Collectives over groups of global ranks (each group a sorted list of ranks)."""

    rank: int

    def all_gather(self, tensor: torch.Tensor, group: list[int]) -> list[torch.Tensor]: ...

    def broadcast(self, tensor: torch.Tensor, src: int, group: list[int]) -> torch.Tensor: ...


# ---- where a rank sits ----
def my_groups(par: Parallel, rank: int) -> dict[str, list[int]]:
    """The tp, pp and ep groups that hold `rank` (ep: its tp group alone when ep = 1)."""
    groups = process_groups(par)
    mine = {axis: next(g for g in groups[axis] if rank in g) for axis in ("tp", "pp", "dp")}
    mine["ep"] = next(g for g in groups["ep"] if rank in g) if "ep" in groups else [rank]
    return mine


def coords_of(par: Parallel, rank: int) -> dict[str, int]:
    """tp, pp, dp and the expert-parallel rank ("ep") of a rank."""
    coords = dict(rank_coords(par)[rank])
    coords["ep"] = my_groups(par, rank)["ep"].index(rank)
    return coords


# ---- colocated: MindSpeed-RL's in-place resharding ----
def reshard_in_place(arch: ModelArch, local: dict, train: Parallel, infer_tp: int, comm: Communicator,
                     layout: reshard.Layout | None = None) -> dict:
    """This rank's inference weights (megatron names, global layer and expert numbers): its
    inference tensor-parallel shard (rank % infer_tp) of every parameter, and of the experts the
    share of inference rank rank % infer_tp. `local`: this rank's megatron state dict; `layout`: the
    trainer's (reshard.Layout.from_config)."""
    _check_in_place(arch, train, infer_tp, layout)
    layout = layout or reshard.PLAIN
    groups, coords = my_groups(train, comm.rank), coords_of(train, comm.rank)
    cuts, engine_cuts = reshard.full_params(arch, layout), reshard.engine_params(arch, layout)
    infer_rank = comm.rank % infer_tp
    mine = {}
    for name in sorted(local):  # the same order on every rank of a stage: collectives pair up
        full_name = reshard.global_name(arch, name, coords["pp"], train.pp, coords["ep"], train.ep, layout)
        for gname, tensor in _gathered(arch, cuts[full_name], full_name, local[name], train, groups, comm):
            mine[gname] = _inference_shard(arch, engine_cuts[gname], gname, tensor, infer_tp, infer_rank)
    shapes = inference_shapes(arch, infer_tp, infer_rank, layout)
    return _broadcast_stages(arch, mine, shapes, train, groups["pp"], layout, comm)


def _check_in_place(arch: ModelArch, train: Parallel, infer_tp: int, layout: reshard.Layout | None) -> None:
    reshard.check_supported(arch, max(train.tp, infer_tp), train.pp, max(train.ep, infer_tp), layout)
    if (train.tp * train.dp * train.cp) % infer_tp:
        raise reshard.LayoutError(f"inference tensor-parallel size {infer_tp} must divide the ranks of a pipeline "
                                  f"stage ({train.tp * train.dp * train.cp}), as MindSpeed-RL requires")


def _gathered(arch, cut: reshard.Cut, name, tensor, train: Parallel, groups, comm) -> list[tuple[str, torch.Tensor]]:
    """A parameter made whole: tensor all-gather (`cut`: how the trainer cuts it), then for an expert
    the same local expert of every expert-parallel rank (each (global name, full tensor))."""
    full = reshard.merge(comm.all_gather(tensor, groups["tp"]), cut) if cut.dim is not None else tensor
    if reshard.expert_of(name) is None or train.ep == 1:
        return [(name, full)]
    per_rank = arch.experts // train.ep
    first = reshard.expert_of(name) % per_rank
    out = []
    for ep_rank, part in enumerate(comm.all_gather(full, groups["ep"])):
        out.append((_renumber_expert(name, first + ep_rank * per_rank), part))
    return out


def _renumber_expert(name: str, expert: int) -> str:
    parts = name.split(".")
    parts[parts.index("local_experts") + 1] = str(expert)
    return ".".join(parts)


def _inference_shard(arch, cut: reshard.Cut, name, full, infer_tp: int, infer_rank: int) -> torch.Tensor | None:
    """What inference rank `infer_rank` keeps: its tensor-parallel cut (`cut`: the engine's,
    reshard.engine_params); an expert whole on the one rank that serves it (None elsewhere)."""
    expert = reshard.expert_of(name)
    if expert is None:
        return reshard.split(full, cut, infer_tp)[infer_rank]
    return full if expert // (arch.experts // infer_tp) == infer_rank else None


def _broadcast_stages(arch, mine: dict, shapes: dict, train: Parallel, pp_group, layout, comm) -> dict:
    """Every stage's resharded parameters to every rank of the pipeline group (all of them share
    one inference rank, `_check_in_place`): receivers allocate from the known `shapes`."""
    out = {k: v for k, v in mine.items() if v is not None}
    for stage, src in enumerate(pp_group):
        for name in sorted(n for n in shapes if reshard.stage_of(arch, n, train.pp, layout) == stage):
            buffer = out[name] if comm.rank == src else torch.empty(shapes[name], dtype=_dtype(mine))
            out[name] = comm.broadcast(buffer, src, pp_group)
    return out


def inference_shapes(arch: ModelArch, infer_tp: int, infer_rank: int,
                     layout: reshard.Layout = reshard.PLAIN) -> dict[str, tuple[int, ...]]:
    """The shapes of what inference rank `infer_rank` holds (meta tensors: nothing allocated)."""
    out, cuts = {}, reshard.engine_params(arch, layout)
    for name, shape in reshard.full_shapes(arch, layout).items():
        shard = _inference_shard(arch, cuts[name], name, torch.empty(shape, device="meta"), infer_tp, infer_rank)
        if shard is not None:
            out[name] = tuple(shard.shape)
    return out


def _dtype(tensors: dict) -> torch.dtype:
    return next(t.dtype for t in tensors.values() if t is not None)


def whole_hf_in_place(arch: ModelArch, local: dict, train: Parallel, comm: Communicator,
                      layout: reshard.Layout | None = None):
    """The whole model as Hugging Face tensors on every rank, as a stream (hf_stream.HfStream: one
    parameter at a time, never the whole model at once; `dict(...)` of it assembles it): colocated
    pools, where the engine worker on each rank's NPU loads all of it in checkpoint format. Every
    rank must iterate it at the same time (it gathers as it goes)."""
    from aspc.backends.ascend.hf_stream import HfStream

    return HfStream(arch, local, train, comm, layout)


# ---- separate pools: vllm-ascend's HCCL weight transfer ----
def gather_hf(arch: ModelArch, local: dict, train: Parallel, comm: Communicator,
              layout: reshard.Layout | None = None) -> dict[str, torch.Tensor]:
    """Full Hugging Face-named tensors on trainer rank 0, in host memory (an empty dict on every other
    rank; all ranks must call it, they take part in the collectives). `layout`: the trainer's.
    Streamed: each parameter is made whole on the device (tensor, expert all-gather; the pipeline
    broadcast into a buffer on the rank's device, as HCCL needs), then moved to the host at once, so
    no rank's device ever holds more than one whole parameter beside its training state (the whole
    model, 61 GiB for Qwen2.5-32B, would not fit a 64 GiB NPU beside it)."""
    reshard.check_supported(arch, train.tp, train.pp, train.ep, layout)
    layout = layout or reshard.PLAIN
    groups, coords = my_groups(train, comm.rank), coords_of(train, comm.rank)
    cuts, whole = reshard.full_params(arch, layout), {}
    device = next(iter(local.values())).device
    for name in sorted(local):
        full_name = reshard.global_name(arch, name, coords["pp"], train.pp, coords["ep"], train.ep, layout)
        whole.update((n, t.to("cpu")) for n, t in _gathered(arch, cuts[full_name], full_name, local[name], train,
                                                            groups, comm))
    if 0 not in groups["pp"]:  # only rank 0's pipeline group assembles the model
        return {}
    shapes, dtype = reshard.full_shapes(arch, layout), _dtype(local)
    for stage, src in enumerate(groups["pp"]):
        if src == 0:  # rank 0's own stage: on its host already
            continue
        for name in sorted(n for n in shapes if reshard.stage_of(arch, n, train.pp, layout) == stage):
            sent = whole[name].to(device) if comm.rank == src else torch.empty(shapes[name], dtype=dtype, device=device)
            received = comm.broadcast(sent, src, groups["pp"])
            if comm.rank == 0:
                whole[name] = received.to("cpu")
    return reshard.to_hf(arch, whole, layout) if comm.rank == 0 else {}


def update_info(tensors: dict[str, torch.Tensor]) -> dict:
    """vllm-ascend's HCCLWeightTransferUpdateInfo fields for these tensors, in sending order: every
    backend's (aspc/backends/vllm/transfer.py), unpacked."""
    return {**transfer.update_info(tensors), "packed": False}


def send_hf(tensors: dict[str, torch.Tensor], comm: Communicator, group: list[int]) -> None:
    """The trainer side (rank group[0]): one broadcast per tensor, in `update_info` order, as
    HCCLWeightTransferEngine.trainer_send_weights does unpacked."""
    for name in update_info(tensors)["names"]:
        comm.broadcast(tensors[name], group[0], group)


def receive_hf(info: dict, comm: Communicator, group: list[int],
               load_weights: Callable[[list[tuple[str, torch.Tensor]]], None], device: str = "cpu") -> None:
    """An engine worker's side, as HCCLWeightTransferEngine.receive_weights does unpacked."""
    for name, dtype_name, shape in zip(info["names"], info["dtype_names"], info["shapes"]):
        weight = torch.empty(shape, dtype=getattr(torch, dtype_name), device=device)
        load_weights([(name, comm.broadcast(weight, group[0], group))])


def named_tensors(tensors) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in `update_info` order: the iterator trainer_send_weights takes (a colocated
    rank's HfStream streams itself)."""
    if not isinstance(tensors, dict):
        return iter(tensors)
    return ((name, tensors[name]) for name in update_info(tensors)["names"])


def on_device(tensors: dict, device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in `update_info` order, each copied to `device` as it is taken: a staged
    version's tensors reach the NPU one at a time, never the whole model at once."""
    return ((name, tensor.to(device)) for name, tensor in named_tensors(tensors))


def largest_bytes(tensors) -> int:
    """The largest tensor to send (an HfStream knows it from shapes)."""
    if not isinstance(tensors, dict):
        return tensors.largest_bytes()
    return max((t.numel() * t.element_size() for t in tensors.values()), default=0)


class TorchCommunicator:
    """The Communicator over torch.distributed (HCCL on an NPU, gloo on a CPU): one process group
    per distinct group, created on every rank in the same order (torch.distributed.new_group's rule)."""

    def __init__(self, groups: Iterable[list[int]]):
        import torch.distributed as dist

        self.dist, self.rank = dist, dist.get_rank()
        self.groups = {}
        for group in sorted({tuple(g) for g in groups}):
            self.groups[group] = dist.new_group(list(group))

    def all_gather(self, tensor, group):
        out = [torch.empty_like(tensor) for _ in group]
        self.dist.all_gather(out, tensor.contiguous(), group=self.groups[tuple(group)])
        return out

    def broadcast(self, tensor, src, group):
        self.dist.broadcast(tensor, src=src, group=self.groups[tuple(group)])
        return tensor


class StagedVersions:
    """Published versions' tensors, copied to the host (the NPU keeps its memory for training), the
    newest `keep` of them (the staleness bound says how many an instance may still ask for)."""

    def __init__(self, keep: int):
        import threading

        self.keep, self.lock, self.versions = keep, threading.Lock(), {}

    def publish(self, version: int, tensors: dict, sender):
        from aspc.backends.ascend.engine_actor import PublishedWeights

        if hasattr(tensors, "on_host"):  # a colocated rank's stream (hf_stream.HfStream): its shard only
            staged, info = tensors.on_host(), tensors.update_info()
        else:
            staged = {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}
            info = update_info(staged)
        with self.lock:
            self.versions[version] = staged
            for old in sorted(self.versions)[:-self.keep]:
                del self.versions[old]
        return PublishedWeights(version, info, sender)

    def get(self, version: int) -> dict:
        with self.lock:
            return self.versions[version]


class WeightSender:
    """Trainer rank 0's side of the weight refresh for separate pools: each published version's
    Hugging Face tensors are staged (on the host, so the NPU keeps its memory for training) and
    broadcast to one instance's group when that instance refreshes — on a thread of its own, so the
    trainer goes on training meanwhile. `send(tensors, instance)` does one broadcast: on an NPU
    HCCLWeightTransferEngine.trainer_send_weights over the instance's group (executors.py), in the
    CPU tests `send_hf` over an in-process communicator. Versions older than the newest `keep` are
    dropped (the staleness bound says how many an instance may still ask for)."""

    def __init__(self, send: Callable[[dict, int], None], keep: int = 2):
        self.send = send
        self.staged = StagedVersions(keep)

    def publish(self, version: int, tensors: dict):
        return self.staged.publish(version, tensors, self)

    def start(self, version: int, instance: int):
        tensors = self.staged.get(version)
        return transfer.send_on_thread(lambda: self.send(tensors, instance), f"send-v{version}-to-{instance}")

    wait = staticmethod(transfer.wait_sent)

    def __reduce__(self):
        """Leaving its process, a sender becomes a handle to the Ray actor that holds it (trainer rank
        0's: the driver's learner actor); outside a Ray actor it cannot leave."""
        handle = _current_actor()
        if handle is None:
            raise TypeError("a WeightSender stays on trainer rank 0: engines in other processes reach it "
                            "through the Ray actor that holds it, never a copy")
        return HandleSender, (handle,)


class HandleSender:
    """PublishedWeights' sender in an engine's actor: it asks the actor holding the trainer's
    WeightSender (`send_weights(version, instance)`: stage and broadcast, on that actor) through its
    Ray handle, and waits for the broadcast while the engine's workers receive it. The staged
    tensors never travel through Ray's object store; only the call does."""

    def __init__(self, handle):
        self.handle = handle

    def start(self, version: int, instance: int):
        return self.handle.send_weights.remote(version, instance)

    def wait(self, pending) -> None:
        import ray

        ray.get(pending)  # a failed broadcast raises here, on the engine's side


def _current_actor():
    """The handle of the Ray actor this code runs in, or None (no Ray, or not in an actor)."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return None
    return ray.get_runtime_context().current_actor


class IpcSender:
    """A trainer rank's side of the weight refresh for colocated pools. Every rank stages its
    shard on the host when a version is published (an HfStream of the whole model over it; the NPU
    goes back to the trainer's offloaded state and the engines' weights); at an instance's refresh
    every rank calls
    `send(tensors, deliver)` together, on an NPU NPUIPCWeightTransferEngine.trainer_send_weights
    in packed mode (executors.npu_ipc_sender): chunks pass through one reused IPC buffer per NPU,
    and rank 0 calls `deliver(update_info)` per chunk. `deliver` hands the chunk to the engine's
    thread (`updates`, which calls the engine's `update_weights`) and returns once it is loaded:
    the buffer is refilled only then. `before_send(version, instance)` (rank 0) makes the other
    ranks join the send (the Leader's broadcast); `lock` keeps that broadcast and the collectives
    of the send in one piece against the learner's own calls."""

    def __init__(self, send: Callable[[dict, Callable], None], before_send=None, lock=None, keep: int = 2):
        import threading

        self.send, self.before_send, self.threading = send, before_send, threading
        self.lock, self.staged = lock or threading.Lock(), StagedVersions(keep)

    def publish(self, version: int, tensors: dict):
        return self.staged.publish(version, tensors, self)

    def start(self, version: int, instance: int):
        import queue

        tensors = self.staged.get(version)
        pending = Delivery(queue.Queue(), [], self.threading.Event())

        def run():
            try:
                with self.lock:
                    if self.before_send is not None:
                        self.before_send(version, instance)
                    self.send(tensors, pending.deliver)
            except Exception as error:  # re-raised on the engine's side by wait()
                pending.errors.append(error)
            finally:
                pending.chunks.put(None)

        pending.thread = self.threading.Thread(target=run, name=f"ipc-v{version}-to-{instance}", daemon=True)
        pending.thread.start()
        return pending

    @staticmethod
    def updates(pending: Delivery) -> Iterator[dict]:
        """The engine's side: each chunk's update_info as rank 0 delivers it, until the send ends."""
        while (item := pending.chunks.get()) is not None:
            info, loaded = item
            try:
                yield info
            except GeneratorExit:
                pending.abandoned.set()
                raise
            finally:
                loaded.set()

    @staticmethod
    def wait(pending: Delivery) -> None:
        pending.abandoned.set()  # a chunk nobody takes any more fails the send instead of blocking it
        pending.thread.join()
        if pending.errors:
            raise pending.errors[0]


class Delivery:
    """One refresh in flight between trainer rank 0's send thread and the engine's thread."""

    def __init__(self, chunks, errors: list, abandoned):
        self.chunks, self.errors, self.abandoned, self.thread = chunks, errors, abandoned, None

    def deliver(self, info) -> None:
        """rank 0's `send_mode`: hand one chunk over and wait until the engine has loaded it."""
        import dataclasses
        import threading

        if self.abandoned.is_set():
            raise RuntimeError("the engine stopped taking weight chunks in the middle of a refresh")
        loaded = threading.Event()
        self.chunks.put((dataclasses.asdict(info) if dataclasses.is_dataclass(info) else dict(info), loaded))
        while not loaded.wait(0.1):
            if self.abandoned.is_set():
                raise RuntimeError("the engine stopped taking weight chunks in the middle of a refresh")
