"""A megatron job's data-parallel and pipeline groups as the policy, the critic and the forward-only
passes split their work over them: each data-parallel rank takes its share of the packed
micro-batches, per-row results are gathered back in packing order, what the last pipeline stage
alone computed (values, log-probs, losses) reaches every stage, and sums are totalled over a group,
through a weight_sync Communicator (HCCL on NPUs, threads in the CPU tests). Gradients are not
reduced here: megatron's DDP averages them over the data-parallel group (finalize_model_grads, once
before each optimizer step; gradient_scaling_factor = 1 / dp), so a rank scales its summed gradients
by `gradient_scale`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from aspc.backends.ascend.packing import MicroBatch


def nothing_to_reduce() -> None:
    """A step's gradient reduction on a rank with no data-parallel peer (the CPU tests' one-rank parts)."""


@dataclass(frozen=True)
class RankGroup:
    """One of this rank's process groups (global ranks, in stage order for a pipeline group);
    `comm` None on a job of one rank."""

    comm: object = None
    group: tuple = (0,)
    device: str = "cpu"  # where collectives' tensors live (the rank's NPU under HCCL)

    @classmethod
    def of(cls, stage: dict, axis: str, comm, device="cpu") -> RankGroup:
        """This process's `axis` group ("dp", "pp", "cp") of a launch stage; `comm` spans the stage's
        groups (a stage that lists no such groups: this rank alone)."""
        if comm is None or axis not in stage["groups"]:
            return cls(device=str(device))
        return cls(comm, tuple(next(g for g in stage["groups"][axis] if comm.rank in g)), str(device))

    @property
    def size(self) -> int:
        return len(self.group)

    @property
    def index(self) -> int:
        return self.group.index(self.comm.rank) if self.comm is not None else 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    def share(self, batches: list[MicroBatch]) -> list[MicroBatch]:
        """This rank's micro-batches: every size-th from its index (pack's rows come fullest first, so
        shares stay balanced). A rank left without one runs the first row with no token counted, so
        that it still takes part in megatron's gradient all-reduce."""
        return batches[self.index::self.size] or [uncounted(batches[0])]

    def gather_rows(self, rows: torch.Tensor, count: int) -> torch.Tensor:
        """Every rank's per-position rows [its share, T] back as [count, T] in packing order (rank j's
        k-th row is micro-batch j + k·size)."""
        if self.size == 1:
            return rows
        per = -(-count // self.size)
        padded = rows.new_zeros(per, rows.shape[1])
        mine = len(range(self.index, count, self.size))
        padded[:mine] = rows[:mine]
        out = rows.new_empty(count, rows.shape[1])
        for j, part in enumerate(self.comm.all_gather(padded, list(self.group))):
            out[j::self.size] = part[:len(range(j, count, self.size))]
        return out

    def summed(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` summed over the group: on a pipeline group whose other stages hold zeros, the last
        stage's rows on every stage."""
        return rows if self.size == 1 else sum(self.comm.all_gather(rows, list(self.group)))

    def gradient_scale(self, divisor: float) -> float:
        """What this rank's summed gradients are multiplied by so that, after DDP's average over the
        group, they are the step's sum over every rank divided by `divisor`."""
        return self.size / divisor

    def total(self, value):
        """`value` (an int or a float) summed over the group."""
        if self.size == 1:
            return value
        dtype = torch.int64 if isinstance(value, int) else torch.float32
        parts = self.comm.all_gather(torch.tensor([value], dtype=dtype, device=self.device), list(self.group))
        return type(value)(sum(part.item() for part in parts))


def stage_groups(stage: dict, device) -> tuple[RankGroup, RankGroup]:
    """This rank's data-parallel and pipeline groups of a launch stage; every rank creates the stage's
    groups in the same order (TorchCommunicator), a job of one rank none."""
    groups = [g for axis in ("dp", "pp") for g in stage["groups"].get(axis, [])]
    comm = None
    if any(len(g) > 1 for g in groups):
        from aspc.backends.ascend.weight_sync import TorchCommunicator

        comm = TorchCommunicator(groups)
    return groups_over(stage, comm, device)


def groups_over(stage: dict, comm, device="cpu") -> tuple[RankGroup, RankGroup]:
    """This rank's data-parallel and pipeline groups of a launch stage over an existing communicator
    that spans them (the trainer's weight-sync one); None: a job of one rank."""
    return RankGroup.of(stage, "dp", comm, device), RankGroup.of(stage, "pp", comm, device)


def uncounted(mb: MicroBatch) -> MicroBatch:
    """`mb` with no token in the loss (a filler that runs the same shapes)."""
    return dataclasses.replace(mb, loss_mask=torch.zeros_like(mb.loss_mask))
