"""`aspc run --backend ascend`: the Executors factory (aspc/roles.py) of a run on NPUs. The driver
and its controller are the same as every backend's; this factory hands them
- generation instances: `VllmEngine`s (engine_actor.py) with the launch plan's engine arguments,
  each joined to the trainer's weight-transfer group when built;
- the learner: rank 0 of the train stage's megatron job, a `MegatronTrainer` behind a `Leader`
  (trainer_actor.py); ranks > 0 are the processes of the launch plan (`--dry-run` prints them),
  which follow rank 0's calls. On the local runtime rank 0 is in this process; on Ray it is built
  inside the learner actor (`learner_in_actor`), and each engine's actor joins its transfer group
  with that actor (`unstarted_engine`, `transfer_info`, `join_trainer_side`);
- the weights: published by the trainer (full Hugging Face tensors on rank 0, weight_sync.py) and
  broadcast per instance by vllm-ascend's HCCL engine (executors.hccl_sender);
- prompts, rule and python rewards and rollouts: the CPU backend's host side.

What it does not execute is refused before the run (`unsupported`). The platform pieces
(`engine_api`, `build_trainer`, `transfer_group`) are methods, so that the CPU tests put a fake vLLM
and the CPU learner in their place."""
from __future__ import annotations

import dataclasses
import os
import threading

from aspc.backends.ascend.engine_actor import VllmEngine
from aspc.backends.ascend.lowering import lower
from aspc.backends.ascend.process_env import node_addresses_from_env
from aspc.backends.cpu.data import PromptSource
from aspc.backends.cpu.executors import CpuExecutors, checkpoint_dir
from aspc.backends.cpu.hf_tokenizer import HfTokenizer
from aspc.backends.cpu.rewards import build_reward
from aspc.backends.cpu.tokenizer import CHARS
from aspc.plan.execution_plan import ExecutionPlan, StageRefusal

TRANSFER_PORT = 28000  # + the instance: the rendezvous of one instance's weight-transfer group


class AscendExecutors(CpuExecutors):
    """One run's executors on NPUs. Raises ValueError (reported as one message) for a launch plan
    with a placeholder checkpoint."""

    platform = "ascend"
    # megatron's rank 0 (process groups, NPU tensors, the weight sender) cannot be pickled into a Ray
    # actor: the Ray runtime's learner actor builds it from this factory, publishes version 0 there
    # and joins each engine's transfer group (aspc/drivers/ray/runtime.py, "learner_in_actor")
    learner_in_actor = True

    def __init__(self, plan: ExecutionPlan, base_dir, seed: int = 0):  # not super().__init__: it builds CPU models
        self.plan, self.base_dir, self.seed = plan, base_dir, seed
        self.gen_stage, self.train_stage = plan.stages_of("generate")[0], plan.stages_of("train")[0]
        self.data = plan.dataset(self.gen_stage.data)
        refused = self.unsupported(plan)
        if refused:
            raise ValueError(refused[0].message)
        self.launch = lower(plan, base_dir, node_addresses_from_env())
        self.check_launch()
        stages = {s.stage: dataclasses.asdict(s) for s in self.launch.stages}
        self.gen_launch, self.train_launch = stages[self.gen_stage.name], stages[self.train_stage.name]
        actor = plan.model(self.train_stage.model)
        self.tokenizer = HfTokenizer(checkpoint_dir(actor, base_dir)) if actor.preset == "hf" else CHARS
        self.prompts = PromptSource(self.data.source, self.data.location, self.data.seed, self.data.max_response,
                                    base_dir, self.tokenizer)
        sources = dict(plan.stages_of("reward")[0].options)["sources"]
        self.reward_fn, self.verifier = build_reward(sources, base_dir), None
        self.actor = self.learner = self._tools = self.env_stage = None
        self.scorers, self.engines, self.groups = {}, {}, {}

    @staticmethod
    def unsupported(plan: ExecutionPlan) -> list[StageRefusal]:
        """What this factory does not run on NPUs yet, refused at the stage before anything starts."""
        found = []
        for stage in plan.stages:
            if stage.kind == "generate" and stage.placement == "time_shared":
                found.append(StageRefusal(stage.name, f"stage '{stage.name}': colocated engines take their weights "
                                          "through vllm-ascend's npu_ipc sender, which the NPU run does not have yet",
                                          "give generation a pool of its own, or print the launch plan with "
                                          "--dry-run", "placement"))
            if stage.kind in ("critic", "environment"):
                found.append(StageRefusal(stage.name, f"stage '{stage.name}': the NPU run has no {stage.kind} "
                                          "executor yet", "run it with --backend cpu, or remove the stage"))
            for source in dict(stage.options).get("sources", ()) if stage.kind == "reward" else ():
                if source.func in ("model", "judge"):
                    found.append(StageRefusal(stage.name, f"stage '{stage.name}': {source.func}(...) rewards need "
                                              "a forward model or judge on NPUs, not built yet",
                                              "score with rule(...) or python(...) sources"))
        return found

    def check_launch(self) -> None:
        """vLLM and megatron load the models from checkpoint directories (none may be a placeholder);
        the rendezvous addresses must be real ones (ASPC_NODES)."""
        missing = self.launch.placeholders()
        if missing:
            raise ValueError(f"the NPU run loads every model from a Hugging Face checkpoint directory; "
                             f"give {', '.join(missing)} one (model NAME = hf(\"DIR\"))")
        if node_addresses_from_env() is None:
            raise ValueError(f"set ASPC_NODES to the {self.launch.nodes} node addresses, node0 (this one) first, "
                             "comma-separated: the trainer's ranks and the engines meet there")

    # ---- the roles ----
    def warm_start(self, steps: int, on_step=None) -> None:
        if steps:
            raise ValueError("a warm start trains the CPU backend's tiny models; on NPUs the policy starts from "
                             "its checkpoint: run with --warmstart 0")

    def generation_engine(self, index: int, instances: int) -> VllmEngine:
        """Instance `index`: vLLM starts inside the engine on first use; it joins the trainer's
        weight-transfer group now, while the trainer joins as rank 0."""
        engine = self.unstarted_engine(index, instances)
        self.transfer_group(engine, index)
        return engine

    def unstarted_engine(self, index: int, instances: int) -> VllmEngine:
        """Instance `index` before vLLM starts and before it joins the transfer group: what the Ray
        runtime hands the instance's actor (which joins with `transfer_info`)."""
        engine = VllmEngine(self.gen_launch, index, self.engine_api(index, instances))
        self.engines[index] = engine
        return engine

    def trainer(self):
        if self.learner is None:
            self.learner = self.build_trainer()
        return self.learner

    def snapshot(self):
        """Version 0: the weights the trainer loaded from the checkpoint, published for the engines'
        first refresh (they start with dummy weights)."""
        return self.trainer().publish(0)

    def accuracy(self, count: int = 128) -> float:
        raise ValueError("held-out accuracy decodes with the CPU policy; an NPU run reports its training "
                         "metrics only")

    def switch_pool(self, pool: str, mode: str) -> None:
        raise RuntimeError("time-shared pools are refused before an NPU run starts (unsupported)")

    @staticmethod
    def parts(learner) -> tuple[dict, dict]:
        raise ValueError("checkpoints of an NPU run are megatron's distributed checkpoints, not written yet: "
                         "run without --checkpoint")

    # ---- the platform: vLLM, megatron, HCCL (replaced by fakes in the CPU tests) ----
    def engine_api(self, index: int, instances: int):
        """vLLM's offline API, imported by the engine when it starts (None: engine_actor.vllm_api)."""
        return None

    def transfer_group(self, engine: VllmEngine, index: int) -> None:
        """Instance `index`'s weight-transfer group (vllm-ascend's HCCL engine): the engine's workers
        join from its side while trainer rank 0 joins as rank 0, both blocking until all are in."""
        trainer_side = threading.Thread(target=self.join_trainer_side, args=(index,), daemon=True)
        trainer_side.start()
        engine.connect(self.transfer_info(index))
        trainer_side.join()
        if index not in self.groups:
            raise RuntimeError(f"trainer rank 0 did not join instance {index}'s weight-transfer group")

    def transfer_info(self, index: int) -> dict:
        """Instance `index`'s weight-transfer group (HCCLWeightTransferInitInfo): rank 0 is trainer
        rank 0, the engine's tp·pp workers follow."""
        parallel = self.gen_stage.parallel
        return {"master_address": self._rank0().env["MASTER_ADDR"], "master_port": TRANSFER_PORT + index,
                "rank_offset": 1, "world_size": 1 + parallel.tp * parallel.pp}

    def join_trainer_side(self, index: int) -> None:
        """Trainer rank 0 joins instance `index`'s group (in the process that holds the trainer: this
        one on the local runtime, the learner actor on Ray), blocking until the engine's workers join."""
        from aspc.backends.ascend.executors import join_transfer_group

        self.groups[index] = join_transfer_group(self.transfer_info(index))

    def build_trainer(self):
        """Rank 0 of the megatron job, in this process: MindSpeed's adaptor with the plan's flags, the
        process groups (the job's other ranks start from the launch plan and wait for the settings
        broadcast), the model, and the HCCL sender of the published weights."""
        from aspc.backends.ascend.executors import hccl_sender
        from aspc.backends.ascend.trainer_actor import (Leader, MegatronTrainer, SyncSetup, broadcast_call,
                                                        import_mindspeed, initialize_parallel, layout_of)
        from aspc.backends.ascend.weight_sync import TorchCommunicator, WeightSender

        stage, rank0 = self.train_launch, self._rank0()
        os.environ.update(rank0.env)  # RANK, WORLD_SIZE, MASTER_ADDR/PORT, HCCL_* of rank 0
        import_mindspeed(stage["builders"].get("mindspeed_argv", []))
        initialize_parallel(stage["config"])
        settings = self._settings()
        broadcast_call(settings)  # the followers' start_rank receives it
        arch, parallel = layout_of(stage, rank0.world_size)
        comm = TorchCommunicator(g for axis in stage["groups"].values() for g in axis)
        sync = SyncSetup(arch, parallel, comm, WeightSender(hccl_sender(self.groups)))
        return Leader(MegatronTrainer(stage, rank0.model_args, settings, self.reward_fn, sync))

    def _rank0(self):
        return next(p for p in self.launch.processes if p.stage == self.train_stage.name and p.rank == 0)
