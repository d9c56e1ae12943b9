"""The PPO critic on NPUs: a megatron-core GPTModel of the critic stage's launch plan whose output
layer has one unit (verl's value model: `verl/models/mcore/model_initializer.py` swaps
`output_layer` for `LinearForLastLayer(hidden, 1)` on the last pipeline stage), forward-only values
on the plan's packed micro-batches for GAE, and the clipped value loss (backends/cpu/losses.py
`value_loss`, verl `compute_value_loss`) with an optimizer step of its own (verl
`verl/workers/critic/megatron_critic.py`).

The critic runs in the trainer's process, on its NPUs and megatron process groups (as verl's
colocated actor and critic workers share megatron's parallel state); run_executors.unsupported
refuses the plans where that does not hold. Like the CPU learner, gradients are micro-batch sums,
divided by the step's response tokens at the optimizer step."""
from __future__ import annotations

import torch

from aspc.backends.ascend.trainer_actor import (MegatronTrainer, Offloadable, build_gpt, load_checkpoint, materialize,
                                                pack, per_sequence)
from aspc.backends.cpu.losses import gae, value_loss, whiten
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
    normalizes), and key -> their returns; as the CPU learner computes them (Learner._advantages):
    a masked sample (failed score) has advantage 0 and returns equal to its values."""
    pairs = [gae(r.reward, r.values, settings.gamma, settings.lam) if not r.masked
             else ([0.0] * len(r.values), list(r.values)) for r in rollouts]
    advantages = [a for a, _ in pairs]
    if settings.normalize:
        advantages = whiten(advantages, [r.masked for r in rollouts])
    keys = [r.key for r in rollouts]
    return dict(zip(keys, advantages)), {key: ret for key, (_, ret) in zip(keys, pairs)}


def per_position(mb, per_key: dict) -> torch.Tensor:
    """[1, T] with each sequence's per-response-token values at its label positions (mb.spans)."""
    row = torch.zeros_like(mb.loss_mask)
    for key, (first, end) in zip(mb.keys, mb.spans):
        row[0, first:end] = torch.tensor(per_key[key], dtype=row.dtype)
    return row


class MegatronCritic(Offloadable):  # leaves the NPU with the policy trainer on a time-shared pool
    """The critic's calls (values, train, optimizer_step) on one megatron rank. `model`, `optimizer`
    and `step_func` are megatron's (DDP-wrapped value model, get_megatron_optimizer,
    get_forward_backward_func) unless given (the CPU tests' fakes)."""

    def __init__(self, stage: dict, settings, model, optimizer, step_func):
        self.stage, self.settings = stage, settings
        self.model, self.optimizer, self.step_func = model, optimizer, step_func
        self.tokens, self.loss = 0, 0.0  # the step's response tokens and summed value loss
        self.offloaded: list = []  # the restore steps of what `offload` moved to host memory

    @classmethod
    def build(cls, stage: dict, rank_args: dict, settings):
        """This rank's critic from the critic stage's launch plan: the optimizer is the trainer's
        (Adam, decoupled weight decay as the CPU critic's AdamW) at the critic stage's lr."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func

        # the body from the critic model's checkpoint, the value head freshly initialised (verl)
        model = MegatronTrainer._wrapped(load_checkpoint(value_model(stage, rank_args), stage, value_head=True))
        config = OptimizerConfig(optimizer="adam", lr=settings.critic_lr, weight_decay=0.01,
                                 clip_grad=settings.grad_clip, bf16=stage["config"].get("bf16", False),
                                 params_dtype=materialize(stage["config"])["params_dtype"])
        return cls(stage, settings, model, get_megatron_optimizer(config, [model]), get_forward_backward_func())

    def _run(self, batches: list, loss_func, forward_only: bool) -> list:
        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            values = model(mb.input_ids, mb.position_ids, mb.attention_mask)[..., 0]
            return values, lambda output: loss_func(output, mb)

        return self.step_func(forward_step_func=forward_step, data_iterator=iter(batches), model=[self.model],
                              num_microbatches=len(batches), seq_length=self.stage["micro_batching"]["tokens"],
                              micro_batch_size=1, forward_only=forward_only) or []

    def values(self, rollouts: list) -> None:
        """Each rollout's values at the positions that predict its response tokens (forward only)."""
        batches = pack(rollouts, self.stage["micro_batching"]["tokens"])
        with torch.no_grad():
            found = self._run(batches, lambda out, mb: (out.sum() * 0, {"values": per_sequence(out, mb)}), True)
        merged = {key: v for stats in found for key, v in stats["values"].items()}
        for r in rollouts:
            r.values = merged[r.key]

    def train(self, rollouts: list) -> None:
        """Accumulate the value loss of one unit: value_coef * 0.5 (V - R)^2 summed over response
        tokens, clipped around the values the critic stage gave (value_clip > 0)."""
        s = self.settings
        _, returns = gae_targets(rollouts, s)
        batches = pack(rollouts, self.stage["micro_batching"]["tokens"])
        old = {r.key: r.values for r in rollouts}
        count = len(batches)

        def loss_func(output, mb):
            loss = s.value_coef * value_loss(output, per_position(mb, old), per_position(mb, returns), mb.loss_mask,
                                             s.value_clip)
            # megatron divides a 2-tuple loss by the micro-batch count; the sum is divided at the step
            return loss * count, {"value_loss": loss.detach(), "tokens": mb.loss_mask.sum()}

        for stats in self._run(batches, loss_func, False):
            self.loss += float(stats["value_loss"])
            self.tokens += int(stats["tokens"])

    def optimizer_step(self) -> dict:
        """The critic's step: the summed gradients over the step's response tokens, clipped, Adam."""
        tokens = max(self.tokens, 1)
        self.model.scale_gradients(1.0 / tokens)
        succeeded, grad_norm, _ = self.optimizer.step()
        self.optimizer.zero_grad()
        summary = {"value_loss": self.loss / tokens, "critic_grad_norm": float(grad_norm or 0.0)}
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


def critic_refusals(plan: ExecutionPlan, stage) -> list[StageRefusal]:
    """What the in-process critic cannot run: it is built on the trainer's rank 0, with its NPU and
    megatron parallel state, so it must sit on the trainer's one NPU; the ranks > 0 of a megatron job
    follow the policy's calls only (executors.run_follower builds no critic)."""
    train = plan.stages_of("train")[0]
    if stage.parallel.devices > 1 or train.parallel.devices > 1:
        return [StageRefusal(stage.name, f"stage '{stage.name}': the NPU critic runs on trainer rank 0 only "
                             f"(critic {stage.parallel.devices} NPUs, train {train.parallel.devices}); the "
                             "other ranks of a megatron job do not run the critic's calls yet",
                             "give the critic and the train stage one NPU each (tp = pp = dp = 1), or run it "
                             "with --backend cpu")]
    if (stage.pool, list(stage.instances[0].devices)) != (train.pool, list(train.instances[0].devices)):
        return [StageRefusal(stage.name, f"stage '{stage.name}': the NPU critic is built in the trainer's "
                             "process, on its NPU, but the plan places it elsewhere",
                             f"put the critic on the train stage's pool '{train.pool}' (the same NPU)", "placement")]
    return []
