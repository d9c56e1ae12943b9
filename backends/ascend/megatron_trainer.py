"""The policy's learner on NPUs: a megatron-core GPTModel per rank (through the MindSpeed adaptor),
trained on the plan's packed micro-batches (packing.py) with aspc's policy loss, its weights
published for the engines (weight_sync.py), and the log-probs of the frozen reference
(reference_model.py) through megatron's forward-only schedule (forward_only.py).

Followed: megatron-core 0.16.1 (`get_forward_backward_func`, `vocab_parallel_cross_entropy`,
`get_megatron_optimizer`), MindSpeed-RL's actor worker (mindspeed_rl/workers/actor_hybrid_worker.py:
rewards and advantages on the host, one optimizer step per policy version) and verl's megatron actor
(packed rows with per-sequence positions). Each data-parallel rank trains its share of the packed
rows (data_parallel.py); as the CPU learner, the step's gradients are micro-batch sums divided by
the step's divisor (losses.step_divisor) at the optimizer step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from aspc.backends.ascend.data_parallel import RankGroup, groups_over, nothing_to_reduce
from aspc.backends.ascend.forward_only import PipelinedForward, token_entropy, token_logprobs
from aspc.backends.ascend.megatron_model import (build_gpt, gradient_reduction, load_checkpoint, training_parts,
                                                 zero_gradients)
from aspc.backends.ascend.offload import Offloadable
from aspc.backends.ascend.packing import feed, model_device, on_this_cp_rank, pack, sequence_counts
from aspc.backends.ascend.reshard import grouped_to_sequential
from aspc.backends.ascend.routing_replay import replay, replay_routers, stop_replay
from aspc.backends.ascend.weight_sync import gather_hf, whole_hf_in_place
from aspc.rl.losses import step_divisor
from aspc.rl.mismatch import Mismatch, MismatchCorrection
from aspc.rl.objective import TokenTerms, micro_batch_loss
from aspc.rl.rollout import step_advantages, token_advantages


@dataclass(frozen=True)
class SyncSetup:
    arch: object  # aspc.ir.facts.ModelArch of the policy
    parallel: object  # the train stage's aspc.ir.graph.Parallel
    comm: object  # weight_sync.TorchCommunicator over the stage's process groups
    sender: object = None  # weight_sync.WeightSender on rank 0 (separate pools); an IpcSender on every rank (colocated)
    colocated: bool = False  # the engines share the trainer's NPUs: every rank publishes the whole model (npu_ipc)
    layout: object = None  # the trainer's reshard.Layout (layout_of); None refuses MLA models


class MegatronTrainer(Offloadable):
    """The Trainer role (aspc/roles.py) on one megatron rank; every rank of the job runs the same
    calls in the same order (the driver's learner actor is rank 0, the others follow its calls:
    call_broadcast.py). `task_reward` (aspc/rl/rollout.py) scores on the host (rule and python
    rewards, overlong shaping) as the CPU learner does; the loss is aspc/rl/objective.py's, the CPU
    learner's own (tests/test_trainer_differential.py)."""

    def __init__(self, stage: dict, rank_args: dict, settings, task_reward, sync, reference=None):
        """`sync`: how weights leave (a SyncSetup: the model's shape, the stage's parallel layout, the
        communicator, and on rank 0 the WeightSender)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.stage, self.settings = stage, settings
        model, optimizer = training_parts(load_checkpoint(build_gpt(stage, rank_args), stage), stage, settings.lr,
                                          settings.weight_decay, settings.grad_clip)
        self._assemble(task_reward, sync, reference, model, optimizer, get_forward_backward_func(),
                       gradient_reduction(model))
        self.rank_args = rank_args

    @classmethod
    def of_parts(cls, stage: dict, settings, sync, model, optimizer, step_func, task_reward=None, reference=None,
                 reduce_gradients=None):
        """A trainer over given parts instead of megatron's (the CPU tests' fakes): a DDP-like `model`
        (scale_gradients), an optimizer whose step() gives (ok, grad norm, _), a schedule that
        accumulates gradients, and what reduces them over the data-parallel ranks once a step (none on
        one rank)."""
        trainer = cls.__new__(cls)
        trainer.stage, trainer.settings, trainer.rank_args = stage, settings, {}
        trainer._assemble(task_reward, sync, reference, model, optimizer, step_func,
                          reduce_gradients or nothing_to_reduce)
        return trainer

    def _assemble(self, task_reward, sync, reference, model, optimizer, step_func, reduce_gradients) -> None:
        self.task_reward, self.sync, self.reference_model = task_reward, sync, reference
        self.model, self.optimizer, self.step_func = model, optimizer, step_func
        self.reduce_gradients = reduce_gradients  # once a step: every unit's schedule only accumulates
        self.dp, self.pp = groups_over(self.stage, sync.comm, model_device(model))
        self.cp = RankGroup.of(self.stage, "cp", sync.comm, model_device(model))  # each holds part of every row
        self.critic = None  # a follower's share of the PPO critic (attach_critic)
        self.version = 0
        self.stats: list[dict] = []
        self.sequences, self.tokens, self.loss = 0, 0, 0.0  # the step's, over every data-parallel rank's rows
        self.mismatch = self._new_mismatch()  # this rank's rows (the last pipeline stage's, which has the log-probs)
        self.correction = MismatchCorrection(self.settings.mismatch)  # this step's mode (auto: chosen per step)
        self.current: set = set()  # the unit's samples generated by the weights being trained
        self.deferred: list[list] = []  # the step's units, when GAE is whitened over the step
        self.offloaded: list = []  # the restore steps of what `offload` moved to host memory
        # the routers that replay the engine's experts (routing_replay = rollout; routing_replay.py)
        replays = self.settings.routing_replay != "none"
        self.routers = replay_routers(model, self.stage["config"].get("moe_layer_freq")) if replays else []
        if replays and not self.routers and \
                any(hasattr(m, "router_replay") for m in model.modules()):  # a stage of dense layers has none
            raise ValueError("routing_replay: the policy's model has no router that replays; its megatron config "
                             "needs moe_enable_routing_replay (the lowering sets it): lower the pipeline again")

    def reward(self, rollouts: list) -> None:
        self.task_reward.score(rollouts)

    def reference(self, rollouts: list) -> None:
        """The reference's log-probs of each rollout's response tokens (the frozen reference, or the
        policy without one), forward only through megatron's schedule (pipeline stages included:
        forward_only.py); every rank of the pipeline group receives them."""
        found = PipelinedForward.of(self.stage, self.sync.comm).logprobs(self.reference_model or self.model, rollouts)
        for r in rollouts:
            r.ref_logprobs = found[r.key]

    def values(self, rollouts: list) -> None:
        raise NotImplementedError("the policy trainer has no value head: the critic's calls go to critic.py's "
                                  "MegatronCritic")

    def attach_critic(self, critic_stage: dict) -> None:
        """A rank other than 0 builds its share of the PPO critic (rank 0's MegatronCritic.build asks):
        the critic stage's model on this rank's pipeline stage (the critic has the trainer's layout,
        critic.critic_refusals); rank 0's calls to it follow as "critic.<call>"."""
        from aspc.backends.ascend.critic import MegatronCritic

        self.critic = MegatronCritic.build_rank(critic_stage, self.rank_args, self.settings)

    def train(self, rollouts: list) -> None:
        """Accumulate the summed policy loss's gradients of one unit: this data-parallel rank's share
        of the packed rows (every rank packs the whole unit, the same way); with GAE whitened over
        the step, keep it until the optimizer step has the step's every unit."""
        if self.settings.whitens_over_step:
            self.deferred.append(rollouts)
            return
        self._train_unit(rollouts, self._advantages(rollouts))

    def _train_deferred(self) -> None:
        units, self.deferred = self.deferred, []
        for unit, (advantages, _) in zip(units, step_advantages(units, self.settings)):
            self._train_unit(unit, dict(zip((r.key for r in unit), advantages)))

    def _train_unit(self, rollouts: list, advantages: dict) -> None:
        batches = pack(rollouts, self.stage["micro_batching"]["tokens"], advantages, routes=bool(self.routers))
        mine = self.dp.share(batches)
        self.current = {r.key for r in rollouts if r.policy_version == self.version}
        try:
            found = self.step_func(forward_step_func=self._forward_step(len(mine)),
                                   data_iterator=feed(mine, self.model), model=[self.model], num_microbatches=len(mine),
                                   seq_length=self.stage["micro_batching"]["tokens"], micro_batch_size=1,
                                   forward_only=False) or []
        finally:
            stop_replay(self.routers)
        self.stats += found
        self.loss += sum(float(stats["loss"]) for stats in found)  # the last pipeline stage's
        self.sequences += len(rollouts)
        self.tokens += int(sum(mb.loss_mask.sum() for mb in batches))

    def _advantages(self, rollouts: list) -> dict:
        """Sample key -> its response tokens' advantages, as every trainer computes them (the
        controller hands whole groups; with GAE, from the values the critic gave: critic.py)."""
        advantages, _ = token_advantages(rollouts, self.settings)
        return dict(zip((r.key for r in rollouts), advantages))

    def _forward_step(self, count: int):
        """megatron's forward step over this rank's `count` micro-batches: the loss is the summed
        policy loss (megatron divides it by `count`, undone here; the step divides the sum). With
        context parallelism each rank of the group takes its two chunks of the row (packing.on_this_cp_rank)
        and sums its tokens' share of the loss (megatron multiplies it by cp, which DDP's average over
        the data- and context-parallel ranks undoes), each sequence's mean over its whole length."""
        s = self.settings

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            current, counts = self._current_tokens(mb), None
            if self.cp.size > 1:
                mb, split = on_this_cp_rank(mb, {"current": current, "counts": sequence_counts(mb)})
                current, counts = split["current"], split["counts"]
            if mb.routes is not None:
                replay(self.routers, mb.routes)
            logits = model(mb.input_ids, mb.position_ids, mb.attention_mask)

            def loss_func(output):
                entropy = token_entropy(output, s.temperature) if s.entropy_coef else None
                terms = TokenTerms(token_logprobs(output, mb.labels, s.temperature), mb.old_logprobs, mb.advantages,
                                   mb.loss_mask, mb.ref_logprobs, entropy, mb.segments, counts, current)
                self.mismatch.add(terms.logp, mb.old_logprobs, mb.loss_mask * current, mb.segments)
                found = micro_batch_loss(terms, s, self.correction.mode)
                if found.mismatch is not None:
                    self.mismatch.add_weights(found.mismatch)
                return found.loss * count, {"loss": found.loss.detach(), "clipped_tokens": found.clipped_tokens}

            return logits, loss_func

        return forward_step

    def _current_tokens(self, mb) -> torch.Tensor:
        """1 on the positions of a packed row whose sample the weights being trained generated."""
        current = torch.zeros_like(mb.loss_mask)
        for key, (first, end) in zip(mb.keys, mb.spans):
            if key in self.current:
                current[0, first:end] = 1
        return current

    def optimizer_step(self) -> dict:
        """The policy's step: the summed gradients of every data-parallel rank's rows over the step's
        divisor (DDP averaged them over the ranks), clipped, Adam; the step's loss so divided."""
        self._train_deferred()
        s = self.settings
        divisor = step_divisor(s.aggregation, self.sequences, self.tokens, s.max_tokens)
        loss = self.dp.total(self.cp.total(self.pp.total(self.loss)))  # the last stage's, on every stage
        self.reduce_gradients()
        self.model.scale_gradients(self.dp.gradient_scale(divisor))
        succeeded, grad_norm, _ = self.optimizer.step()
        zero_gradients(self.model, self.optimizer)
        stats, self.stats = self.stats, []
        mismatch = self._mismatch_after_step()
        self.sequences, self.tokens, self.loss = 0, 0, 0.0
        return {"loss": loss / divisor, "grad_norm": float(grad_norm or 0.0), "update_skipped": not succeeded,
                "micro_batches": len(stats), **mismatch}

    def _new_mismatch(self) -> Mismatch:
        return Mismatch(self.settings.mismatch_cap, self.settings.mismatch_floor)

    def _mismatch_after_step(self) -> dict:
        """This rank's mismatch metrics for the step; the next step's correction chosen from counts
        summed over the data-parallel group (the last pipeline stage's), the same on every rank."""
        metrics = self.mismatch.metrics(self.correction.reported)
        if self.correction.setting == "auto":
            self.correction.after_step([self.dp.total(self.pp.total(n)) for n in self.mismatch.counts])
        self.mismatch = self._new_mismatch()
        return metrics

    def snapshot(self):
        """Publish the next version: every rank takes part in assembling full Hugging Face tensors
        on rank 0 (weight_sync.gather_hf), where the sender stages them for the engines' refreshes;
        other ranks return None."""
        self.version += 1
        return self.publish(self.version)

    def publish(self, version: int):
        """Publish the weights as `version` (0: the checkpoint's, before any step): separate pools
        assemble them on rank 0 alone, colocated pools on every rank (each feeds the engine worker
        on its NPU)."""
        local = {k: v for k, v in self.model.module.state_dict().items() if isinstance(v, torch.Tensor)}
        if self.stage["config"].get("moe_grouped_gemm"):
            local = grouped_to_sequential(self.sync.arch, local, self.sync.parallel.ep)
        assemble = whole_hf_in_place if self.sync.colocated else gather_hf
        tensors = assemble(self.sync.arch, local, self.sync.parallel, self.sync.comm, self.sync.layout)
        return self.sync.sender.publish(version, tensors) if self.sync.sender is not None else None

    def send_weights(self, version: int, instance: int) -> None:
        """Send staged version `version` to one instance. Separate pools: rank 0 alone broadcasts it
        (an engine's HandleSender asks, weight_sync.py). Colocated pools: every rank, together (rank 0's
        IpcSender broadcasts this call to the others before its NPU IPC send)."""
        self.sync.sender.wait(self.sync.sender.start(version, instance))

