"""Forward-only log-probs on a megatron job's ranks (the frozen reference's, or the policy's when the
plan has no reference model), through megatron's schedule, so that pipeline stages work: the first
stage embeds the packed rows, the middle ones pass hidden states on, and the last stage, which alone
has logits, computes the log-probs; those are then broadcast over the pipeline group from its last
rank, so that every stage (rank 0, the leader, among them) holds them.

Followed: verl/workers/actor/megatron_actor.py `compute_log_prob` (`forward_backward_func` with
`forward_only=True`, the loss function of the last stage returning the log-probs, then
`torch.distributed.broadcast(src=get_pipeline_model_parallel_last_rank(),
group=get_pipeline_model_parallel_group())`) and megatron-core's `forward_step` (0.12.1 and 0.16.1:
on the last stage a loss function's 2-tuple is (a tensor divided in place by the micro-batch count,
what the schedule returns)). Each data-parallel rank runs its share of the packed rows
(data_parallel.py), gathered back over the data-parallel group in packing order."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from aspc.backends.ascend.data_parallel import RankGroup
from aspc.backends.ascend.packing import (MicroBatch, feed, in_row_order, model_device, on_this_cp_rank, pack,
                                         per_sequence)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(label) per position from vocabulary-parallel logits [B, T, V/tp] (megatron's
    vocab_parallel_cross_entropy is the negative log-likelihood, over [T, B])."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled = (logits.float() / (temperature or 1.0)).transpose(0, 1).contiguous()  # in fp32, as the CPU learner
    return -vocab_parallel_cross_entropy(scaled, labels.t().contiguous()).t()


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The sampling distribution's entropy per position, from the whole vocabulary's logits [B, T, V]
    (tp = 1: with tp > 1 each rank holds a slice of the vocabulary, and an entropy bonus is refused
    before the run, run_executors.trainer_refusals)."""
    logp = torch.log_softmax(logits.float() / (temperature or 1.0), -1)
    return -(logp.exp() * logp).sum(-1)


def pipeline_group(stage: dict, rank: int) -> list[int]:
    """This rank's pipeline-parallel group in a launch stage (first stage first); [rank] without one."""
    return next((g for g in stage["groups"].get("pp", []) if rank in g), [rank])


@dataclass
class PipelinedForward:
    """Forward-only passes of one rank: `schedule` is megatron's get_forward_backward_func() (the
    pipeline schedule when pp > 1), `comm` a weight_sync Communicator over the stage's groups,
    `group` this rank's pipeline group, `tokens` the pack pass's micro-batch budget, `dp` this rank's
    data-parallel group (it runs its share of the rows)."""

    tokens: int
    comm: object
    group: list
    schedule: Callable
    logprob_fn: Callable = token_logprobs
    dp: RankGroup = field(default_factory=RankGroup)
    cp: RankGroup = field(default_factory=RankGroup)  # each rank holds two chunks of every row (packing.py)

    @classmethod
    def of(cls, stage: dict, comm) -> PipelinedForward:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return cls(stage["micro_batching"]["tokens"], comm, pipeline_group(stage, comm.rank),
                   get_forward_backward_func(), dp=RankGroup.of(stage, "dp", comm), cp=RankGroup.of(stage, "cp", comm))

    def logprobs(self, model, rollouts: list) -> dict:
        """Sample key -> its response tokens' log-probs under `model` (this rank's pipeline stage of it)."""
        batches = pack(rollouts, self.tokens)
        mine = self.dp.share(batches)
        with torch.no_grad():
            rows = self._last_stage_rows(model, mine)
        if rows is not None and self.cp.size > 1:  # every context-parallel rank's chunks, in row order
            rows = in_row_order(self.cp.comm.all_gather(rows.contiguous(), list(self.cp.group)))
        rows = self.dp.gather_rows(self._delivered(rows, len(mine), model_device(model)), len(batches)).cpu()
        return {key: values for row, mb in zip(rows, batches) for key, values in per_sequence(row[None], mb).items()}

    def _last_stage_rows(self, model, batches: list[MicroBatch]) -> torch.Tensor | None:
        """[micro-batches, T] log-probs on the last pipeline stage (the loss function runs there
        only), None on the others."""
        def forward_step(data_iterator, stage_model):
            mb = next(data_iterator)
            if self.cp.size > 1:
                mb, _ = on_this_cp_rank(mb, {})
            output = stage_model(mb.input_ids, mb.position_ids, mb.attention_mask)
            # megatron divides the first element in place by the micro-batch count: a scalar of its own
            return output, lambda logits: (logits.new_zeros(()), {"logprobs": self.logprob_fn(logits, mb.labels)})

        found = self.schedule(forward_step_func=forward_step, data_iterator=feed(batches, model), model=[model],
                              num_microbatches=len(batches), seq_length=self.tokens, micro_batch_size=1,
                              forward_only=True) or []
        if self.comm.rank != self.group[-1]:
            return None
        return torch.cat([stats["logprobs"].float() for stats in found])

    def _delivered(self, rows: torch.Tensor | None, count: int, device) -> torch.Tensor:
        """The last stage's rows on every rank of the pipeline group."""
        if len(self.group) == 1:
            return rows
        buffer = rows if rows is not None else torch.empty(count, self.tokens, dtype=torch.float32, device=device)
        return self.comm.broadcast(buffer, self.group[-1], self.group)

