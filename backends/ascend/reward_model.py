"""A reward model on NPUs (RLHF): a sequence classifier, the checkpoint's decoder with a scalar score
head read at the last token of prompt + response, forward only, in megatron-core, as the launch plan
lowers the score stage ("megatron-forward": the reward model's TransformerConfig, layer spec,
MindSpeed flags, torchair compiler options, packing "none").

Followed: verl's megatron reward model (verl/workers/reward_model/megatron/reward_model.py: the value
model of verl/models/mcore/model_initializer.py, i.e. GPTModel whose output layer is
`LinearForLastLayer(hidden, 1)`, read at each sequence's last token) and the CPU backend's
backends/cpu/reward_model.py (same reading, same truncation), whose scores these must equal. The
head is the checkpoint's `score.weight` (transformers' `*ForSequenceClassification(num_labels=1)`,
no bias), the body as the trainer loads it (load_hf.py).

The launch plan gives the reward model's ranks `post_process=False` ("hidden states out"), but
megatron builds the final layernorm only on a post_process stage (transformer_block.py,
`has_final_layernorm_in_this_stage`, megatron-core 0.12.1 and 0.16.1), and the score head reads the
normed hidden states (transformers' `score(model.norm(h))`), so the last stage is built with
post_process and the one-unit head, as verl builds it.

Several ranks (an instance with tp > 1; pp, cp and dp stay 1: `scorers.scorer_refusals`): rank 0
is the scorer's process, the other ranks are the launch plan's `reward` processes
(`python -m aspc.backends.ascend.executors reward ... --rank R`, `run_rank`); every rank builds its
tensor-parallel share of the same model (load_hf.py cuts the checkpoint by megatron's parallel
state; the one-unit head is replicated, as the critic's), and rank 0 broadcasts each call's
sequences before running it (`RankLeader`), which the others follow (call_broadcast.follow), as
the trainer's ranks follow its leader: megatron's tensor-parallel layers need every rank in each
forward. With sequence parallelism a sequence is padded at its end to a multiple of tp (causal:
the last real token's value is unchanged)."""
from __future__ import annotations

import sys
import threading

import torch

from aspc.backends.ascend.load_hf import CheckpointError, LazyCheckpoint
from aspc.backends.ascend.reshard import VALUE_HEAD


class NpuRewardModel:
    """Called as backends/cpu/reward_model.RewardModel is: (prompt ids, response ids) pairs -> [B]
    scores. `model`: megatron's GPTModel with the one-unit head (or a CPU stand-in in the tests);
    one sequence per forward (the launch plan's packing "none", torchair with dynamic shapes), padded
    at its end to a multiple of `pad_to` (tp under sequence parallelism)."""

    def __init__(self, model, max_seq: int, device=None, pad_to: int = 1):
        self.model, self.max_seq, self.device, self.pad_to = model, max_seq, device, pad_to

    def fitted(self, pairs) -> list[tuple[list[int], list[int]]]:
        """What the CPU reward model reads: each response cut to fit max_seq."""
        return [(list(p), list(r[:max(0, self.max_seq - len(p))])) for p, r in pairs]

    @torch.no_grad()
    def __call__(self, pairs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
        return self.score_pairs(self.fitted(pairs))

    @torch.no_grad()
    def score_pairs(self, pairs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
        """[B] values of pairs that fit (the call every rank runs)."""
        return torch.tensor([self.last_value(p + r) for p, r in pairs])

    def scores(self, items: list) -> list[float]:
        """The reward-source term (scoring.py's model term): items with .prompt and .response."""
        return self([(i.prompt, i.response) for i in items]).tolist()

    def last_value(self, ids: list[int]) -> float:
        """The head's value at the last token: megatron's causal mask (True where masked), positions from 0."""
        length = len(ids)
        padded = length + (-length) % self.pad_to
        tokens = torch.tensor([ids + [0] * (padded - length)], device=self.device)
        positions = torch.arange(padded, device=self.device)[None]
        masked = ~torch.tril(torch.ones(padded, padded, dtype=torch.bool, device=self.device))[None, None]
        values = self.model(tokens, positions, masked)[..., 0]  # [1, T]: GPTModel's [B, T, 1] from the head
        return float(values[0, length - 1])


class RankLeader:
    """Rank 0 of a reward model on several ranks, as the scorer's term: each call's sequences go to
    the other ranks first (`broadcast`: call_broadcast.broadcast_call over the job's default group),
    then every rank runs the same forward; one call at a time (the scorer process answers calls on
    threads of their own). `close` stops the followers."""

    def __init__(self, model: NpuRewardModel, broadcast=None):
        from aspc.backends.ascend.call_broadcast import broadcast_call

        self.model, self.broadcast, self.lock = model, broadcast or broadcast_call, threading.Lock()

    def scores(self, items: list) -> list[float]:
        pairs = self.model.fitted([(i.prompt, i.response) for i in items])
        with self.lock:
            self.broadcast(("score_pairs", (pairs,)))
            return self.model.score_pairs(pairs).tolist()

    def close(self) -> None:
        with self.lock:
            self.broadcast(("stop", ()))


@torch.no_grad()
def load_score_head(head: torch.nn.Linear, checkpoint_dir) -> None:
    """The checkpoint's `score.weight` [1, hidden] into the one-unit head; its bias 0 (the sequence
    classifier has none)."""
    weight = LazyCheckpoint(checkpoint_dir)[VALUE_HEAD]
    if tuple(weight.shape) != tuple(head.weight.shape):
        raise CheckpointError(f"{checkpoint_dir}: '{VALUE_HEAD}' is {tuple(weight.shape)}, but a reward model's "
                              f"score head is {tuple(head.weight.shape)}: is it a reward model (a sequence "
                              "classifier with one label)?")
    head.weight.copy_(weight.to(dtype=head.weight.dtype))
    if head.bias is not None:
        head.bias.zero_()


def build(spec: dict):
    """In the reward model's own process (scorer_process.py), on its NPU: rank 0 of the instance's
    megatron job (`build_rank`); with more ranks, behind the RankLeader that the launch plan's other
    processes of the instance follow."""
    from aspc.backends.ascend.executors import require_npu

    require_npu()
    model = build_rank(spec["stage"], spec["rank_args"], spec["max_seq"])
    return RankLeader(model) if world_size(spec["stage"]) > 1 else model


def build_rank(stage: dict, rank_args: dict, max_seq: int) -> NpuRewardModel:
    """This rank's share of the reward model: MindSpeed's adaptor with the plan's flags, the process
    groups, the value model loaded from the checkpoint (body and score head), frozen, compiled with
    torchair where the launch stage carries a compiler config. Built with its head (post_process:
    pp is 1, see the module's docstring)."""
    from aspc.backends.ascend.critic import value_model
    from aspc.backends.ascend.megatron_model import (compile_forward, import_mindspeed, initialize_parallel,
                                                     load_checkpoint)

    import_mindspeed(stage["builders"].get("mindspeed_argv", []))
    initialize_parallel(stage["config"])
    model = load_checkpoint(value_model(stage, {**rank_args, "post_process": True}), stage, value_head=True)
    load_score_head(model.output_layer, stage["builders"]["checkpoint"])
    model = model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    device = next(model.parameters()).device
    compiled = compile_forward(model, stage["compiler"]) if stage.get("compiler") else model
    config = stage["config"]
    pad_to = config["tensor_model_parallel_size"] if config.get("sequence_parallel") else 1
    return NpuRewardModel(compiled, max_seq, device, pad_to)


def world_size(stage: dict) -> int:
    c = stage["config"]
    return c["tensor_model_parallel_size"] * c["pipeline_model_parallel_size"] * c["context_parallel_size"]


def run_rank(launch: dict, stage_name: str, instance: int, rank: int, follow=None) -> int:
    """`python -m aspc.backends.ascend.executors reward`: a rank > 0 of a reward-model instance
    builds its share and follows rank 0's calls until it stops (exit code 0); rank 0 is the scorer
    process that `aspc run --backend ascend` starts (exit code 2, with that message)."""
    if rank == 0:
        print(f"aspc: reward rank 0 of stage {stage_name} runs in the scorer process that `aspc run FILE --backend "
              "ascend` starts; start only the ranks > 0 here", file=sys.stderr)
        return 2
    from aspc.backends.ascend.call_broadcast import follow as follow_rank0

    stage = next(s for s in launch["stages"] if s["stage"] == stage_name)
    names = {f"{stage_name}.{instance}.rank{rank}", *([f"{stage_name}.rank{rank}"] if instance == 0 else [])}
    process = next(p for p in launch["processes"] if p["stage"] == stage_name and p["name"] in names)
    model = build_rank(stage, process["model_args"], stage["model_args"]["max_sequence_length"])
    ran = (follow or follow_rank0)(model)
    print(f"aspc: reward rank {rank} of stage {stage_name}, instance {instance}, ran {ran} calls and stopped",
          file=sys.stderr)
    return 0
