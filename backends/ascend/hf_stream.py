"""The whole model as a stream of Hugging Face tensors, one parameter at a time, on every trainer
rank of a colocated pool: what each rank hands the engine worker on its NPU through vllm-ascend's
NPU IPC engine without ever assembling the whole model.

Followed: verl's megatron `per_tensor_generator` (verl/utils/megatron_utils.py, the weight sync of
its hybrid engine: every rank takes one parameter at a time, broadcast over the pipeline group and
all-gathered over its tensor- and expert-parallel groups, converts it to Hugging Face names and
yields it; here the owning stage gathers first, then broadcasts the whole tensor) feeding
vllm-ascend 0.23.0's packed NPU IPC producer (`packed_npu_ipc_producer` in
vllm_ascend/distributed/weight_transfer/packed_tensor.py: one reused IPC buffer of
`packed_buffer_size_bytes`, filled from the iterator and handed over chunk by chunk).
So a rank's extra NPU memory during a refresh is that buffer, the engine worker's clone of one
chunk (`packed_npu_ipc_consumer`) and the parameter being gathered (`stream_peak_bytes`).

Every rank yields the same names in the same order (the global parameter order, stage by stage):
rank 0's chunk descriptions hold for every rank's buffer, and the collectives pair up."""
from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from aspc.backends.ascend import reshard
from aspc.backends.ascend.weight_sync import _gathered, _renumber_expert, coords_of, my_groups
from aspc.ir.facts import ModelArch
from aspc.ir.graph import Parallel


class HfStream:
    """One rank's view of the whole Hugging Face model: iterating it yields (name, tensor) pairs,
    each made whole by collectives with the other ranks, which must iterate it at the same time.
    `local`: this rank's megatron state dict (its tensors are moved to `device` one at a time)."""

    def __init__(self, arch: ModelArch, local: dict, train: Parallel, comm, layout: reshard.Layout | None = None,
                 device: torch.device | str | None = None):
        reshard.check_supported(arch, train.tp, train.pp, train.ep, layout)
        self.arch, self.local, self.train, self.comm = arch, local, train, comm
        self.layout = layout or reshard.PLAIN
        self.dtype = next(t.dtype for t in local.values())
        self.device = device if device is not None else next(t.device for t in local.values())
        self.cuts, self.shapes = reshard.full_params(arch, self.layout), reshard.full_shapes(arch, self.layout)
        self._hf_shapes: list[tuple[str, tuple]] | None = None  # streaming order, computed once

    def on_host(self) -> HfStream:
        """The same stream over a host copy of this rank's shard (a published version stays as it
        was while the trainer trains on; the NPU keeps its memory)."""
        staged = {name: t.detach().to("cpu", copy=True) for name, t in self.local.items()}
        stream = HfStream(self.arch, staged, self.train, self.comm, self.layout, self.device)
        stream._hf_shapes = self._hf_shapes
        return stream

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        groups, coords = my_groups(self.train, self.comm.rank), coords_of(self.train, self.comm.rank)
        for stage, src in enumerate(groups["pp"]):
            for name in stage_local_names(self.arch, stage, self.train, self.layout):
                for global_name, full in self._made_whole(name, (stage, src), coords, groups):
                    yield from reshard.to_hf(self.arch, {global_name: full}, self.layout).items()

    def _made_whole(self, name: str, owner: tuple[int, int], coords: dict, groups: dict) -> Iterator[tuple]:
        """Local parameter `name` of pipeline stage `owner` = (stage, its rank in this rank's pipeline
        group) made whole: gathered by that stage's ranks, then broadcast over the pipeline group,
        one tensor at a time."""
        stage, src = owner
        names = gathered_names(self.arch, name, stage, self.train, self.layout)
        pieces = self._gathered(name, stage, coords, groups) if coords["pp"] == stage else [(n, None) for n in names]
        for global_name, (gathered_name, tensor) in zip(names, pieces, strict=True):
            assert gathered_name == global_name, (gathered_name, global_name)
            if tensor is None:
                tensor = torch.empty(self.shapes[global_name], dtype=self.dtype, device=self.device)
            if self.train.pp > 1:
                tensor = self.comm.broadcast(tensor, src, groups["pp"])
            yield global_name, tensor

    def _gathered(self, name: str, stage: int, coords: dict, groups: dict) -> list:
        global_name = reshard.global_name(self.arch, name, stage, self.train.pp, coords["ep"], self.train.ep,
                                          self.layout)
        tensor = self.local[name].to(self.device)
        return _gathered(self.arch, self.cuts[global_name], global_name, tensor, self.train, groups, self.comm)

    def update_info(self) -> dict:
        """vllm-ascend's update-info fields (names, dtypes, shapes) in streaming order, from shapes alone."""
        names, shapes = [], []
        for name, shape in self.hf_shapes():
            names.append(name)
            shapes.append(list(shape))
        dtype = str(self.dtype).removeprefix("torch.")
        return {"names": names, "dtype_names": [dtype] * len(names), "shapes": shapes, "packed": True}

    def largest_bytes(self) -> int:
        """The largest Hugging Face tensor: the IPC buffer must hold it whole."""
        size = self.dtype.itemsize
        return max(_numel(shape) * size for _, shape in self.hf_shapes())

    def hf_shapes(self) -> list[tuple[str, tuple]]:
        """(Hugging Face name, shape) in streaming order (DeepSeek-V3: 45k tensors, seconds to list)."""
        if self._hf_shapes is None:
            self._hf_shapes = list(hf_shapes(self.arch, self.train, self.layout))
        return self._hf_shapes


def stage_local_names(arch: ModelArch, stage: int, train: Parallel, layout: reshard.Layout) -> list[str]:
    """The parameter names (as its ranks number them) of pipeline stage `stage`, sorted: the same
    list on every rank, whichever stage it holds."""
    return sorted({reshard.local_name(arch, name, train.pp, train.ep, layout)
                   for name in reshard.full_params(arch, layout)
                   if reshard.stage_of(arch, name, train.pp, layout) == stage})


def gathered_names(arch: ModelArch, name: str, stage: int, train: Parallel, layout: reshard.Layout) -> list[str]:
    """The global names that gathering local parameter `name` of `stage` makes whole, in the order
    weight_sync._gathered returns them: an expert comes from every expert-parallel rank."""
    first = reshard.global_name(arch, name, stage, train.pp, 0, train.ep, layout)
    expert = reshard.expert_of(first)
    if expert is None or train.ep == 1:
        return [first]
    per_rank = arch.experts // train.ep
    return [_renumber_expert(first, expert + rank * per_rank) for rank in range(train.ep)]


def hf_shapes(arch: ModelArch, train: Parallel, layout: reshard.Layout) -> Iterator[tuple[str, tuple]]:
    """(Hugging Face name, shape) in streaming order, from meta tensors (nothing allocated)."""
    shapes = reshard.full_shapes(arch, layout)
    for stage in range(train.pp):
        for name in stage_local_names(arch, stage, train, layout):
            for global_name in gathered_names(arch, name, stage, train, layout):
                meta = torch.empty(shapes[global_name], device="meta")
                for hf_name, part in reshard.to_hf(arch, {global_name: meta}, layout).items():
                    yield hf_name, tuple(part.shape)


def stream_peak_bytes(arch: ModelArch, dtype_bytes: int, train: Parallel, bucket_bytes: int) -> int:
    """Extra NPU memory of one rank while it streams a refresh: the IPC buffer (at least the largest
    parameter), the engine worker's clone of one chunk, and the parameter being gathered (its
    shard, the all-gathered pieces and the merged tensor; an expert from every expert-parallel
    rank; a Hugging Face conversion's copy). An estimate from megatron's full shapes (a Hugging Face
    tensor is never larger), never measured on an NPU."""
    shapes = reshard.full_shapes(arch)
    largest = max(_numel(shape) for shape in shapes.values()) * dtype_bytes
    experts = [_numel(s) for n, s in shapes.items() if reshard.expert_of(n) is not None]
    dense = [_numel(s) for n, s in shapes.items() if reshard.expert_of(n) is None]
    gathering = max(3 * max(dense), (train.ep + 2) * max(experts, default=0)) * dtype_bytes
    return 2 * max(bucket_bytes, largest) + gathering


def _numel(shape) -> int:
    return math.prod(shape)
