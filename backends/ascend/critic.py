"""The PPO critic on NPUs: a megatron-core GPTModel of the critic stage's launch plan whose output
layer has one unit (verl's value model: `verl/models/mcore/model_initializer.py` swaps
`output_layer` for `LinearForLastLayer(hidden, 1)` on the last pipeline stage), forward-only values
on the plan's packed micro-batches for GAE, and the clipped value loss (aspc/rl/losses.py
`value_loss`, verl `compute_value_loss`) with an optimizer step of its own (verl
`verl/workers/critic/megatron_critic.py`).

The critic runs in the trainer's processes, on their NPUs and megatron process groups (as verl's
colocated actor and critic workers share megatron's parallel state): rank 0 builds its share beside
the policy trainer and has every other rank build its own (call_broadcast.py: "attach_critic"),
then leads the critic's calls as the policy's. Each data-parallel rank runs its share of the packed
micro-batches (data_parallel.py) through megatron's schedule (pipeline stages included): the last
stage's values reach every stage and are gathered back over the data-parallel group for GAE,
megatron's DDP averages the gradients, the step's tokens and losses are summed over the groups.
`critic_refusals` refuses the plans where that does not hold. Like the CPU learner, gradients are
micro-batch sums, divided by the step's response tokens at the optimizer step."""
from __future__ import annotations

import torch

from aspc.backends.ascend.call_broadcast import CALLS, Leader, broadcast_call
from aspc.backends.ascend.data_parallel import RankGroup, nothing_to_reduce, stage_groups
from aspc.backends.ascend.megatron_model import (build_gpt, gradient_reduction, load_checkpoint, training_parts,
                                                 zero_gradients)
from aspc.backends.ascend.offload import Offloadable
from aspc.backends.ascend.packing import feed, pack, per_sequence
from aspc.rl.losses import value_loss
from aspc.rl.rollout import token_advantages
from aspc.plan.execution_plan import ExecutionPlan, StageRefusal


class ValueHead(torch.nn.Linear):
    """GPTModel's output layer with one unit (verl's LinearForLastLayer): replicated over tensor
    parallelism; called as megatron calls its output layer, it returns (values [T, B, 1] in fp32, None)."""

    def __init__(self, hidden: int, sequence_parallel: bool = False):
        super().__init__(hidden, 1)
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:
            self.weight.sequence_parallel = True

    def forward(self, input_, weight=None, runtime_gather_output=None):
        values = super().forward(input_).float()
        if self.sequence_parallel:
            from megatron.core import tensor_parallel

            values = tensor_parallel.gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


def value_model(stage: dict, rank_args: dict, use_cpu_initialization: bool = False):
    """This rank's GPTModel of the critic stage, with the value head on the last pipeline stage."""
    model = build_gpt(stage, rank_args, use_cpu_initialization)
    if rank_args.get("post_process"):
        model.output_layer = ValueHead(model.config.hidden_size, model.config.sequence_parallel)
    return model


def gae_targets(rollouts: list, settings) -> tuple[dict, dict]:
    """Sample key -> its response tokens' GAE advantages (whitened where the advantage stage
    normalizes), and key -> their returns; as every trainer computes them (rollout.token_advantages):
    a masked sample (failed score) has advantage 0 and returns equal to its values."""
    advantages, returns = token_advantages(rollouts, settings)
    keys = [r.key for r in rollouts]
    return dict(zip(keys, advantages)), dict(zip(keys, returns))


def per_position(mb, per_key: dict) -> torch.Tensor:
    """[1, T] with each sequence's per-response-token values at its label positions (mb.spans)."""
    row = torch.zeros_like(mb.loss_mask)
    for key, (first, end) in zip(mb.keys, mb.spans):
        row[0, first:end] = torch.tensor(per_key[key], dtype=row.dtype)
    return row


class MegatronCritic(Offloadable):  # leaves the NPU with the policy trainer on a time-shared pool
    """The critic's calls (values, train, optimizer_step) on one megatron rank. `model`, `optimizer`
    and `step_func` are megatron's (DDP-wrapped value model, get_megatron_optimizer,
    get_forward_backward_func, finalize_model_grads) unless given (the CPU tests' fakes); `groups`:
    this rank's data-parallel and pipeline groups (data_parallel.stage_groups; one rank without them);
    `reduce_gradients`: what reduces a step's gradients over them, once before its optimizer step."""

    def __init__(self, stage: dict, settings, model, optimizer, step_func, groups: tuple | None = None,
                 reduce_gradients=None):
        self.stage, self.settings = stage, settings
        self.model, self.optimizer, self.step_func = model, optimizer, step_func
        self.reduce_gradients = reduce_gradients or nothing_to_reduce
        self.dp, self.pp = groups or (RankGroup(), RankGroup())
        self.tokens, self.loss = 0, 0.0  # the step's response tokens and summed value loss
        self.offloaded: list = []  # the restore steps of what `offload` moved to host memory

    @classmethod
    def build(cls, stage: dict, rank_args: dict, settings):
        """The critic on rank 0 of the trainer's job (run_executors.build_critic). On a job of several
        ranks every other rank first builds its share (its trainer's `attach_critic`), and rank 0's
        critic leads their calls as the policy's Leader does."""
        import torch.distributed as dist

        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return cls.build_rank(stage, rank_args, settings)
        with CALLS:
            broadcast_call(("attach_critic", (stage,)))
            critic = cls.build_rank(stage, rank_args, settings)
        return Leader(critic, prefix="critic.")

    @classmethod
    def build_rank(cls, stage: dict, rank_args: dict, settings):
        """This rank's critic from the critic stage's launch plan: the optimizer is the trainer's
        (Adam, decoupled weight decay as the CPU critic's AdamW) at the critic stage's lr."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        # the body from the critic model's checkpoint, the value head freshly initialised (verl)
        body = load_checkpoint(value_model(stage, rank_args), stage, value_head=True)
        model, optimizer = training_parts(body, stage, settings.critic_lr, 0.01, settings.grad_clip)
        device = next(model.parameters()).device
        return cls(stage, settings, model, optimizer, get_forward_backward_func(), stage_groups(stage, device),
                   gradient_reduction(model))

    def _run(self, batches: list, loss_func, forward_only: bool) -> list:
        """megatron's schedule over `batches`; `loss_func(values [1, T], mb)` runs on the last
        pipeline stage only (the others hand hidden states on), whose results it returns."""
        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            output = model(mb.input_ids, mb.position_ids, mb.attention_mask)
            return output, lambda values: loss_func(values[..., 0], mb)

        return self.step_func(forward_step_func=forward_step, data_iterator=feed(batches, self.model),
                              model=[self.model], num_microbatches=len(batches),
                              seq_length=self.stage["micro_batching"]["tokens"], micro_batch_size=1,
                              forward_only=forward_only) or []

    def values(self, rollouts: list) -> None:
        """Each rollout's values at the positions that predict its response tokens (forward only):
        each data-parallel rank computes its share of the rows (on its last pipeline stage, which
        hands them to the other stages), then every rank gathers them all."""
        tokens = self.stage["micro_batching"]["tokens"]
        batches = pack(rollouts, tokens)
        mine = self.dp.share(batches)
        with torch.no_grad():
            found = self._run(mine, lambda out, mb: (out.sum() * 0, {"values": out}), True)
        rows = torch.cat([stats["values"].float() for stats in found]) if self.pp.last else \
            torch.zeros(len(mine), tokens, device=self.dp.device)
        rows = self.dp.gather_rows(self.pp.summed(rows), len(batches)).cpu()
        merged = {key: v for row, mb in zip(rows, batches) for key, v in per_sequence(row[None], mb).items()}
        for r in rollouts:
            r.values = merged[r.key]

    def train(self, rollouts: list) -> None:
        """Accumulate the value loss of one unit: value_coef * 0.5 (V - R)^2 summed over response
        tokens, clipped around the values the critic stage gave (value_clip > 0)."""
        s = self.settings
        _, returns = gae_targets(rollouts, s)
        batches = self.dp.share(pack(rollouts, self.stage["micro_batching"]["tokens"]))
        old = {r.key: r.values for r in rollouts}
        count = len(batches)

        def loss_func(output, mb):
            loss = s.value_coef * value_loss(output, per_position(mb, old), per_position(mb, returns), mb.loss_mask,
                                             s.value_clip)
            # megatron divides a 2-tuple loss by the micro-batch count; the sum is divided at the step
            return loss * count, {"value_loss": loss.detach()}

        for stats in self._run(batches, loss_func, False):  # the last pipeline stage's
            self.loss += float(stats["value_loss"])
        self.tokens += int(sum(mb.loss_mask.sum() for mb in batches))  # every stage's

    def optimizer_step(self) -> dict:
        """The critic's step: the summed gradients over the step's response tokens (of every
        data-parallel rank; DDP averaged the gradients over them), clipped, Adam."""
        tokens = max(self.dp.total(self.tokens), 1)
        loss = self.dp.total(self.pp.total(self.loss))  # the last stage's, on every stage
        self.reduce_gradients()
        self.model.scale_gradients(self.dp.gradient_scale(tokens))
        succeeded, grad_norm, _ = self.optimizer.step()
        zero_gradients(self.model, self.optimizer)
        summary = {"value_loss": loss / tokens, "critic_grad_norm": float(grad_norm or 0.0)}
        self.tokens, self.loss = 0, 0.0
        return summary | ({} if succeeded else {"critic_update_skipped": True})


class PolicyWithCritic:
    """The Trainer role of a run with a critic stage: the controller's critic units go to the critic
    (`values`), train units to both (the policy's GAE advantages read the values the critic gave),
    and each optimizer step steps both; everything else is the policy trainer's."""

    def __init__(self, policy, critic):
        self.policy, self.critic = policy, critic

    def __getattr__(self, name):
        if name in ("policy", "critic"):  # not set yet (a copy or unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.policy, name)

    def values(self, rollouts: list) -> None:
        self.critic.values(rollouts)

    def train(self, rollouts: list) -> None:
        self.policy.train(rollouts)
        self.critic.train(rollouts)

    def optimizer_step(self) -> dict:
        return self.policy.optimizer_step() | self.critic.optimizer_step()

    def offload(self) -> None:
        self.policy.offload()
        self.critic.offload()

    def onload(self) -> None:
        self.policy.onload()
        self.critic.onload()


AXES = ("tp", "pp", "dp", "cp")  # the layout the critic shares with the trainer's megatron parallel state


def critic_refusals(plan: ExecutionPlan, stage) -> list[StageRefusal]:
    """What the critic on the trainer's ranks cannot run: it shares their NPUs and megatron parallel
    state, so it must sit on the train stage's devices with its parallel layout; its data-parallel
    ranks split the work, pipeline stages hand on what the last computes (tensor parallelism is
    megatron's own), but values of sequences cut by context parallelism are not gathered."""
    train = plan.stages_of("train")[0]
    mine, theirs = stage.parallel, train.parallel
    differs = next((axis for axis in AXES if getattr(mine, axis) != getattr(theirs, axis)), None)
    if stage.pool != train.pool or (not differs and stage.instances[0].devices != train.instances[0].devices):
        return [StageRefusal(stage.name, f"stage '{stage.name}': the NPU critic is built in the trainer's "
                             "processes, on their NPUs, but the plan places it elsewhere",
                             f"put the critic on the train stage's pool '{train.pool}' (the same NPUs)", "placement")]
    if differs:
        return [StageRefusal(stage.name, f"stage '{stage.name}': the NPU critic runs on the trainer's megatron "
                             f"ranks and parallel state, so it needs the train stage's layout (critic {mine}, "
                             f"train {theirs})",
                             f"give the critic tp = {theirs.tp}, pp = {theirs.pp}, dp = {theirs.dp} as the train "
                             "stage", differs)]
    if mine.cp > 1:
        return [StageRefusal(stage.name, f"stage '{stage.name}': the NPU critic's values are not gathered over "
                             f"context-parallel ranks yet (cp = {mine.cp})",
                             "train with cp = 1 (data, tensor and pipeline parallelism work), or run it with "
                             "--backend cpu", "cp")]
    return []
