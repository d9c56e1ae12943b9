"""`aspc run --backend ascend`: the Executors factory (aspc/roles.py) of a run on NPUs. The driver
and its controller are the same as every backend's; this factory hands them
- generation instances: `VllmEngine`s (engine_actor.py) with the launch plan's engine arguments,
  each joined to the trainer's weight-transfer group when built; an instance with dp > 1 (colocated
  pools) is an `EngineGroup` of its dp engine ranks (engine_group.py);
- the learner: rank 0 of the train stage's megatron job, a `MegatronTrainer` behind a `Leader`
  (megatron_trainer.py, call_broadcast.py); ranks > 0 are the processes of the launch plan (`--dry-run` prints them),
  which follow rank 0's calls. On the local runtime rank 0 is in this process; on Ray it is built
  inside the learner actor (`learner_in_actor`), and each engine's actor joins its transfer group
  with that actor (`unstarted_engine`, `transfer_info`, `join_trainer_side`);
- the weights: published by the trainer (full Hugging Face tensors on rank 0, weight_sync.py) and
  broadcast per instance by vllm-ascend's HCCL engine (executors.hccl_sender); on a time-shared
  (colocated) pool every trainer rank streams the whole model, one parameter at a time
  (hf_stream.py), to the engine worker on its NPU through vllm-ascend's NPU IPC engine
  (executors.npu_ipc_sender, weight_sync.IpcSender); several colocated instances each start on
  their own NPUs of this node (`engine_env`);
- a time-shared pool's switches (`switch_pool`): to generation, the trainer's ranks offload
  parameters, gradients and optimizer state to host memory, and each engine wakes its weights, takes
  the new version, then wakes its KV cache (the launch plan's colocated `weight_refresh`); to
  training, the engines sleep and the trainer onloads;
- prompts, rule and python rewards, the trainer's settings, rollouts and tool runners: the run's
  host side (aspc/rl/host.py, `RunHost`), held here as the CPU factory holds its own;
- agentic episodes (an environment stage): each instance an `EpisodeEngine` (episodes.py: a turn
  per vLLM request, stopped at the format's call token); the tools run on the host, as in the CPU run.

What it does not execute is refused before the run (`unsupported`). The platform pieces
(`engine_api`, `build_trainer`, `transfer_group`) are methods, so that the CPU tests put a fake vLLM
and the CPU learner in their place."""
from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

from aspc.backends.ascend.critic import PolicyWithCritic, critic_refusals
from aspc.backends.ascend.engine_actor import VllmEngine
from aspc.backends.ascend.engine_args import IPC_ENV
from aspc.backends.ascend.engine_group import EngineGroup
from aspc.backends.vllm.episodes import EpisodeEngine, EpisodeSettings, tool_format
from aspc.backends.ascend.lowering import lower
from aspc.backends.ascend.process_env import (node_address, node_addresses_from_env, resolved,
                                               socket_ifname_from_env)
from aspc.backends.ascend.routing_replay import NPU_MEGATRON, REPLAY_SINCE
from aspc.backends.ascend.scorers import close_scorers, scorer_refusals, stage_scorer
from aspc.backends.ascend.topology import NPUS_PER_NODE, device, pool_offsets
from aspc.controller.episodes import MASKED, EpisodePolicy
from aspc.rl import checkpoint
from aspc.rl.checkpoint import CheckpointError
from aspc.rl.data import DataError
from aspc.rl.mismatch import SEQUENCE_MODES
from aspc.rl.host import RunHost
from aspc.rl.rewards import RewardError
from aspc.rl.rollout import TrainSettings
from aspc.rl.threads import use_threads
from aspc.ir.facts import DTYPE_BYTES, GIB, hardware_table
from aspc.plan.execution_plan import ExecutionPlan, StageRefusal
from aspc.platforms import NPU

# several colocated engines start in this process: each engine core in a process of its own, which
# takes the engine's NPUs (vllm/envs.py; 1 is vLLM's default, set so that no inherited 0 moves them here)
COLOCATED_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
TRANSFER_PORT = 28000  # + the instance: the rendezvous of one instance's weight-transfer group


class AscendExecutors:
    """One run's executors on NPUs. Raises ValueError (reported as one message) for a launch plan
    with a placeholder checkpoint."""

    platform = "ascend"
    user_errors = (DataError, RewardError, CheckpointError, ValueError)
    checkpoint_error = CheckpointError
    set_threads = staticmethod(use_threads)  # the host's threads (a plain function: Ray actors call it)
    # megatron's rank 0 (process groups, NPU tensors, the weight sender) cannot be pickled into a Ray
    # actor: the Ray runtime's learner actor builds it from this factory, publishes version 0 there
    # and joins each engine's transfer group (aspc/drivers/ray/runtime.py, "learner_in_actor")
    learner_in_actor = True

    def __init__(self, plan: ExecutionPlan, base_dir, seed: int = 0):
        self.plan, self.base_dir, self.seed = plan, base_dir, seed
        self.gen_stage, self.train_stage = plan.stages_of("generate")[0], plan.stages_of("train")[0]
        refused = self.unsupported(plan, runtime=None)  # what no runtime runs (the CLI checks the one it runs)
        if refused:
            raise ValueError(refused[0].message)
        self.launch = lower(plan, base_dir, node_addresses_from_env(), socket_ifname_from_env())
        self.check_launch()
        stages = {s.stage: dataclasses.asdict(s) for s in self.launch.stages}
        self.gen_launch, self.train_launch = stages[self.gen_stage.name], stages[self.train_stage.name]
        # prompts, the rule and python rewards (model(...) and judge(...) sources are scored on their
        # own executors: scorers.py), rollouts, the tool runners of agentic episodes
        self.host = RunHost(plan, base_dir, MASKED)
        self.data = self.host.data
        self.tokenizer, self.prompts, self.reward_fn = self.host.tokenizer, self.host.prompts, self.host.reward_fn
        self.env_stage = self.host.env_stage  # agentic episodes: EpisodeEngines, the host's tool runners
        self.actor = None
        self.learner: Any = None  # the trainer (a Leader, or a PolicyWithCritic around one), built once
        self.episodes = self.episode_settings() if self.env_stage is not None else None  # a bad format fails here
        self.scorers: dict[tuple[str, int], Any] = {}  # (stage, instance) -> its scorer process
        self.engines: dict[int, VllmEngine | EngineGroup] = {}
        self.groups: dict[int, Any] = {}  # instance -> its weight-transfer group
        self.colocated = self.gen_stage.placement == "time_shared"
        self.initial = None  # version 0 as published (snapshot), for the engines' first refresh
        self.holder: str | None = None  # who has a time-shared pool's NPUs: "learn" | "gen"
        self.engines_elsewhere = False  # the Ray runtime's actors start the engines, on the NPUs Ray gives them

    @staticmethod
    def unsupported(plan: ExecutionPlan, runtime: str | None = "local") -> list[StageRefusal]:
        """What this factory does not run on NPUs yet, refused at the stage before anything starts
        (`runtime` None: what it runs on no runtime)."""
        found = []
        for stage in plan.stages:
            if stage.kind == "generate" and stage.placement == "time_shared":
                found += colocated_refusals(plan, stage, runtime)
            if stage.kind == "generate" and stage.placement != "time_shared":
                found += _engine_process_refusals(plan, stage, runtime)
            if stage.kind == "generate" and stage.parallel.dp > 1:
                found += data_parallel_refusals(plan, stage)
            if stage.kind == "generate" and dict(stage.options).get("engine") == "aspc":
                found.append(StageRefusal(stage.name, f"stage '{stage.name}': engine = aspc is the CPU's own "
                                                      "generator; NPUs generate with vLLM (vllm-ascend)",
                                          "remove engine = aspc, or run with --backend cpu", "engine"))
            if stage.kind == "critic":
                found += critic_refusals(plan, stage)
            if stage.kind == "reference":
                found += reference_refusals(plan, stage)
            if stage.kind == "reward":
                found += scorer_refusals(plan, stage)
            if stage.kind == "train":
                found += trainer_refusals(stage)
            if stage.kind == "environment" and plan.replays_routes():
                found.append(StageRefusal(stage.name, f"stage '{stage.name}': an episode's turns are requests of "
                                                      "their own, and the NPU path keeps the routes of a whole "
                                                      "request only, not an episode's with its tool tokens",
                                          "remove routing_replay, or run the episodes with --backend cpu"))
        return found

    # ---- the host side (aspc/rl/host.py) ----
    def prompt(self, index: int):
        return self.host.prompt(index)

    def rollout(self, sample, finished, prompt):
        return self.host.rollout(sample, finished, prompt)

    def tools(self):
        """The environment's tool runners, on the host, shared by every generation instance."""
        return self.host.tools()

    def _settings(self) -> TrainSettings:
        return self.host.settings()

    def save_checkpoint(self, directory, version: int, models: dict, optimizers: dict, extra: dict):
        return self.host.save_checkpoint(directory, version, models, optimizers, extra)

    load_checkpoint = staticmethod(checkpoint.load)
    find_resume_point = staticmethod(checkpoint.find_resume_point)
    read_manifest = staticmethod(checkpoint.read_manifest)
    step_folders = staticmethod(checkpoint.step_folders)

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

    def generation_engine(self, index: int, instances: int) -> VllmEngine | EngineGroup:
        """Instance `index`, started here: it joins the trainer's weight-transfer group (the trainer
        joins as rank 0) and loads the published version 0, since vLLM starts with dummy weights
        (the controller syncs only the versions it trains)."""
        if self.colocated:
            return self._colocated_engine(index, instances)
        engine = self.unstarted_engine(index, instances)
        self.transfer_group(engine, index)
        if self.initial is not None:
            engine.load_weights(self.initial)
        return engine

    def _colocated_engine(self, index: int, instances: int) -> VllmEngine | EngineGroup:
        """Instance `index` on the trainer's NPUs, started and asleep since the trainer was built
        (`_start_engines_asleep`). The pool goes to generation first (the controller's first mode),
        so the trainer offloads; the engine then wakes through its refresh to version 0 (NPU IPC:
        no group to join, NPUIPCWeightTransferInitInfo has no fields)."""
        refused = _engine_process_refusals(self.plan, self.gen_stage, "local")  # the CLI refused them already
        if refused:
            raise ValueError(f"{refused[0].message}: {refused[0].hint}")
        engine = self.engines.get(index) or self.unstarted_engine(index, instances)
        self._give_pool("gen")
        engine.connect(self.transfer_info(index))
        if self.initial is not None:
            engine.load_weights(self.initial)
        return engine

    def unstarted_engine(self, index: int, instances: int) -> VllmEngine | EngineGroup:
        """Instance `index` before vLLM starts and before it joins the transfer group: what the Ray
        runtime hands the instance's actor (which joins with `transfer_info`). With dp > 1 the
        instance is its dp engine ranks, each with its rank's environment (engine_group.py)."""
        dp = self.gen_stage.parallel.dp
        engine: VllmEngine | EngineGroup
        if dp > 1:
            ranks = [self._rank_engine(index, instances, rank) for rank in range(dp)]
            engine = EngineGroup(ranks, index, "VLLM_DP_SIZE" in ranks[0].env,
                                 [self.engine_address(index, rank) for rank in range(dp)])
        else:
            engine = self._rank_engine(index, instances, 0)
        self.engines[index] = engine
        return engine

    def _rank_engine(self, index: int, instances: int, rank: int) -> VllmEngine:
        api, env = self.engine_api(index, instances), self.engine_env(index, rank)
        if self.env_stage is None:
            return VllmEngine(self.gen_launch, index, api, env)
        assert self.episodes is not None, "an environment stage has its episode settings (built with the factory)"
        return EpisodeEngine(self.gen_launch, index, api, env, settings=self.episodes)

    def episode_settings(self) -> EpisodeSettings:
        """The environment's episodes on an engine: the shared policy, the call format in the
        policy's tokenizer (its stop token), the cap on a tool result's tokens."""
        assert self.env_stage is not None, "episode settings are built for an environment stage only"
        options = dict(self.env_stage.options)
        return EpisodeSettings(EpisodePolicy.of(self.env_stage), tool_format(options, self.tokenizer),
                               options["max_tool_tokens"], self.tokenizer.eos_ids)

    def engine_address(self, index: int, rank: int = 0) -> str:
        """The address of the node whose NPUs data-parallel rank `rank` of instance `index` uses
        (ASPC_NODES; a `${NODE[k]}` reference without it): where the Ray runtime starts a colocated
        engine's actor, beside the trainer ranks on the same NPUs."""
        name = f"{self.gen_stage.name}.{index}.dp{rank}"
        process = next(p for p in self.launch.processes if p.name == name)
        return node_address(process.node, node_addresses_from_env())

    def learner_address(self) -> str:
        """The address of trainer rank 0's node (MASTER_ADDR): where the Ray runtime's learner actor runs."""
        return self._rank0().env["MASTER_ADDR"]

    def engines_in_actors(self) -> None:
        """The Ray runtime starts each engine in an actor: a colocated one (asleep) on its node before
        the learner's actor builds the trainer, which then must not start them itself; a separate
        pool's on the NPUs Ray's placement gives the actor (Ray sets ASCEND_RT_VISIBLE_DEVICES)."""
        self.engines_elsewhere = True

    def engine_env(self, index: int, rank: int = 0) -> dict:
        """Instance `index`'s engine environment (that of its data-parallel rank `rank`: its NPUs,
        VLLM_DP_*) from the launch plan (VLLM_ASCEND_ENABLE_NZ=0, HCCL port ranges on shared NPUs).
        Engines started here (the local runtime) start on the launch plan's NPUs
        (ASCEND_RT_VISIBLE_DEVICES, set while its processes start: engine_actor.engine_environment,
        with vLLM's engine core in a process of its own; without it an engine would inherit rank 0's
        one NPU); in Ray's actors a separate pool's NPUs are Ray's. Colocated engines take the NPU
        IPC handles through vLLM's collective_rpc, which passes their dtypes and storage classes
        only pickled (vllm/v1/serial_utils.py: VLLM_ALLOW_INSECURE_SERIALIZATION)."""
        name = f"{self.gen_stage.name}.{index}.dp{rank}"
        process = next((p for p in self.launch.processes if p.name == name), None)
        env = resolved(process.env if process else {})
        if self.colocated:
            return env | IPC_ENV | COLOCATED_ENV
        if self.engines_elsewhere:
            env.pop(NPU.visible_devices, None)
        return env

    def trainer(self):
        if self.learner is None:
            if self.colocated:
                self._start_engines_asleep()
            self.learner = self.build_trainer()
            if self.plan.stages_of("critic"):
                self.learner = PolicyWithCritic(self.learner, self.build_critic())
            self.holder = "learn" if self.colocated else None
        return self.learner

    def _start_engines_asleep(self) -> None:
        """The launch plan's start-up order on shared NPUs (startup.py): each colocated engine starts
        while its NPUs are free (vllm-ascend's free-memory check) and sleeps before the trainer builds;
        on Ray the engines' actors did so (`engines_in_actors`)."""
        if self.engines_elsewhere:
            return
        count = len(self.gen_stage.instances)
        for index in range(count):
            self.unstarted_engine(index, count).sleep()

    def snapshot(self):
        """Version 0: the weights the trainer loaded from the checkpoint, published for the engines'
        first refresh (they start with dummy weights)."""
        self.initial = self.trainer().publish(0)
        return self.initial

    def accuracy(self, count: int = 128) -> float:
        raise ValueError("held-out accuracy decodes with the CPU policy; an NPU run reports its training "
                         "metrics only")

    def forward_model(self, stage: str, instance: int):
        """Instance `instance` of reward stage `stage` with a model(...) source: the engine-free
        RewardScorer (aspc/rl/scoring.py) whose reward-model term is a megatron forward model in its
        own process (scorers.py)."""
        key = (stage, instance)
        if key not in self.scorers:
            self.scorers[key] = stage_scorer(self, stage, instance)
        return self.scorers[key]

    def reference_model(self, stage: str, instance: int):
        """Never reached: a reference apart from the trainer's NPUs is refused before the run
        (reference_refusals)."""
        raise ValueError(reference_refusals(self.plan, self.plan.stage(stage))[0].message)

    def judge(self, stage: str, instance: int):
        """Instance `instance` of reward stage `stage` with a judge(...) source: the same scorer, its
        judge term the verdict judge over a vllm-ascend engine in its own process (scorers.py)."""
        return self.forward_model(stage, instance)

    def close(self) -> None:
        """The run is over (the driver's stop, after a failure too): the scorers' processes end, then
        the host side's (tool runners)."""
        close_scorers(self.scorers)
        self.host.close()

    def switch_pool(self, pool: str, mode: str) -> None:
        """The controller hands the time-shared pool over (it switches only when the side that
        leaves has nothing in flight)."""
        if mode not in ("gen", "learn"):
            raise ValueError(f"unknown pool mode '{mode}'")
        self._give_pool(mode)

    def _give_pool(self, mode: str) -> None:
        """To training: the engines sleep (KV cache dropped, weights to host memory: the launch
        plan's sleep level), then the trainer's ranks onload. To generation: the trainer's ranks
        offload; each engine wakes on its own thread, weights first, at the refresh that follows
        (or whole, for work without one)."""
        if self.holder == mode:
            return
        if mode == "learn":
            for index in sorted(self.engines):
                self.engines[index].sleep()
            self.trainer().onload()
        else:
            self.trainer().offload()
        self.holder = mode

    @staticmethod
    def parts(learner) -> tuple[dict, dict]:
        raise ValueError("checkpoints of an NPU run are megatron's distributed checkpoints, not written yet: "
                         "run without --checkpoint")

    # ---- the platform: vLLM, megatron, HCCL (replaced by fakes in the CPU tests) ----
    def engine_api(self, index: int, instances: int):
        """vLLM's offline API, imported by the engine when it starts (None: engine_actor.vllm_api)."""
        return None

    def transfer_group(self, engine: VllmEngine | EngineGroup, index: int) -> None:
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
        rank 0, the engine's tp·pp workers follow; a colocated engine's NPU IPC engine takes none
        (NPUIPCWeightTransferInitInfo has no fields)."""
        if self.colocated:
            return {}
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
        from aspc.backends.ascend.call_broadcast import Leader, broadcast_call
        from aspc.backends.ascend.megatron_model import import_mindspeed, initialize_parallel, layout_of
        from aspc.backends.ascend.megatron_trainer import MegatronTrainer, SyncSetup
        from aspc.backends.ascend.reference_model import frozen_reference, reference_stage
        from aspc.backends.ascend.weight_sync import TorchCommunicator

        stage, rank0 = self.train_launch, self._rank0()
        os.environ.update(resolved(rank0.env))  # RANK, WORLD_SIZE, MASTER_ADDR/PORT, HCCL_* of rank 0
        import_mindspeed(stage["builders"].get("mindspeed_argv", []))
        initialize_parallel(stage["config"])
        settings = self._settings()
        broadcast_call(settings)  # the followers' start_rank receives it
        arch, parallel, layout = layout_of(stage, rank0.world_size)
        comm = TorchCommunicator(g for axis in stage["groups"].values() for g in axis)
        sync = SyncSetup(arch, parallel, comm, self._sender(), colocated=self.colocated, layout=layout)
        stages = [dataclasses.asdict(s) for s in self.launch.stages]
        reference = frozen_reference(stage, rank0.model_args, reference_stage(stages, stage))
        task_reward = self.host.task_reward(settings)
        return Leader(MegatronTrainer(stage, rank0.model_args, settings, task_reward, sync, reference))

    def build_critic(self):
        """The critic (critic.py) beside trainer rank 0, on its NPU and megatron process groups
        (build_trainer set them up; `unsupported` refuses a critic placed anywhere else)."""
        from aspc.backends.ascend.critic import MegatronCritic

        stage = self.plan.stages_of("critic")[0].name
        launch = next(dataclasses.asdict(s) for s in self.launch.stages if s.stage == stage)
        rank0 = self._rank0()  # the critic's ranks are the trainer's (the kind table's ascend.in_trainer), same layout
        return MegatronCritic.build(launch, rank0.model_args, self._settings())

    def _sender(self):
        """Rank 0's weight sender: HCCL broadcasts to separate pools; on a colocated pool the NPU IPC
        send that every rank joins (the Leader's broadcast of `send_weights` brings the followers)."""
        from aspc.backends.ascend.executors import hccl_sender, npu_ipc_sender
        from aspc.backends.ascend.call_broadcast import CALLS, broadcast_call
        from aspc.backends.ascend.weight_sync import IpcSender, WeightSender

        if not self.colocated:
            return WeightSender(hccl_sender(self.groups))

        def followers_join(version: int, instance: int) -> None:
            broadcast_call(("send_weights", (version, instance)))

        return IpcSender(npu_ipc_sender(self.gen_launch["micro_batching"]["weight_refresh"]["bucket_bytes"]),
                         followers_join, CALLS)

    def _rank0(self):
        return next(p for p in self.launch.processes if p.stage == self.train_stage.name and p.rank == 0)


def reference_refusals(plan: ExecutionPlan, stage) -> list[StageRefusal]:
    """The NPU reference is a megatron forward built in the train stage's processes (lowering's
    in_trainer): it must share the train stage's pool and NPUs."""
    if plan.beside_trainer(stage):
        return []
    train = plan.stages_of("train")[0]
    return [StageRefusal(stage.name, f"stage '{stage.name}': the NPU reference is computed in the train stage's "
                                     "processes, on their NPUs, but the plan places it elsewhere",
                         f"put the reference on the train stage's pool '{train.pool}' (the same NPUs), or run "
                         "with --backend cpu", "placement")]


def trainer_refusals(stage) -> list[StageRefusal]:
    """What the megatron trainer cannot honour, refused at the option: several epochs a step (each
    sample is trained once, as on the CPU) and an entropy bonus over a vocabulary that tensor
    parallelism splits across ranks (forward_only.token_entropy reads the whole vocabulary)."""
    options, found = dict(stage.options), []
    if options.get("epochs", 1) != 1:
        found.append(StageRefusal(stage.name, f"stage '{stage.name}': the megatron trainer trains one epoch per "
                                              "step", "set epochs = 1", "epochs"))
    if options.get("entropy_coef") and stage.parallel.tp > 1:
        found.append(StageRefusal(stage.name, f"stage '{stage.name}': an entropy bonus needs the whole vocabulary's "
                                              f"logits, and tp = {stage.parallel.tp} splits them across ranks",
                                  "set entropy_coef = 0, or tp = 1", "entropy_coef"))
    if stage.replays_routes():
        found += _routing_replay_refusals(stage, options)
    return found + _sequence_level_refusals(stage, options)


def _routing_replay_refusals(stage, options: dict) -> list[StageRefusal]:
    """The megatron trainer replays routes (routing_replay.py) through megatron-core's RouterReplay,
    which the pinned NPU megatron-core lacks, on a rank that holds its rows' every token: not split
    by sequence parallelism (tp > 1) or context parallelism, and with each micro-batch's recompute
    right after its forward (no recompute under pipeline parallelism)."""
    par, found = stage.parallel, []
    if NPU_MEGATRON < REPLAY_SINCE:
        found.append(StageRefusal(stage.name, f"stage '{stage.name}': routing_replay needs megatron-core's "
                                              "RouterReplay (megatron-core 0.16 on), and the NPU install pins "
                                              f"{'.'.join(map(str, NPU_MEGATRON))}, MindSpeed's pair",
                                  "remove routing_replay, or run with --backend cpu", "routing_replay"))
    for degree, name in ((par.tp, "tp"), (par.cp, "cp")):
        if degree > 1:
            found.append(StageRefusal(stage.name, f"stage '{stage.name}': routing_replay needs each rank's "
                                                  f"routers to see whole rows, and {name} = {degree} splits them",
                                      f"set {name} = 1 (ep and dp shard the experts and the rows), or remove "
                                      "routing_replay", "routing_replay"))
    if options.get("recompute") and par.pp > 1:
        found.append(StageRefusal(stage.name, f"stage '{stage.name}': routing_replay with recompute needs each "
                                              f"micro-batch's backward right after its forward, and pp = {par.pp} "
                                              "interleaves them", "set recompute = false or pp = 1, or remove "
                                              "routing_replay", "routing_replay"))
    return found


def _sequence_level_refusals(stage, options: dict) -> list[StageRefusal]:
    """A sequence-level ratio (GSPO) or mismatch correction (seq_tis, seq_mis, auto) sums over a
    sequence's every token; context parallelism splits each sequence across ranks."""
    if stage.parallel.cp == 1:
        return []
    found = []
    if options.get("ratio") == "sequence":
        found.append(StageRefusal(stage.name, f"stage '{stage.name}': ratio = sequence needs each sequence's every "
                                              f"token on one rank, and cp = {stage.parallel.cp} splits it",
                                  "set cp = 1, or ratio = token", "ratio"))
    if options.get("mismatch") in SEQUENCE_MODES:
        found.append(StageRefusal(stage.name, f"stage '{stage.name}': mismatch = {options['mismatch']} needs each "
                                              f"sequence's every token on one rank, and cp = {stage.parallel.cp} "
                                              "splits it", "set cp = 1, or mismatch = token_tis or token_mis",
                                  "mismatch"))
    return found


def colocated_refusals(plan: ExecutionPlan, stage, runtime: str | None) -> list[StageRefusal]:
    """What the colocated path (vllm-ascend's NPU IPC engine) cannot run: one engine process per
    instance (per data-parallel rank), each on its own NPUs: on the local runtime in the trainer's
    process, on this node; on Ray in an actor on the node of its NPUs (aspc/drivers/ray/colocated.py);
    every engine worker loads the whole model from the trainer rank on its NPU, so each of its NPUs
    needs a trainer rank, whose streamed refresh (hf_stream.py) must fit beside the engine's woken weights."""
    found = []
    if runtime not in ("local", "ray", None):
        found.append(StageRefusal(stage.name, f"stage '{stage.name}': colocated engines run on the local or the Ray "
                                  f"runtime, not '{runtime}'",
                                  "run it with --runtime local or --runtime ray", "placement"))
    found += _engine_process_refusals(plan, stage, runtime)
    if stage.partial_rollout:
        found.append(StageRefusal(stage.name, f"stage '{stage.name}': partial rollout on a time-shared pool carries "
                                  "the requests in flight over the learner's turn, but a colocated vllm-ascend engine "
                                  "sleeps with its pool and drops their KV cache",
                                  "remove partial_rollout from the schedule, or give generation a pool of its own"))
    train = plan.stages_of("train")[0]
    uncovered = engine_devices(stage) - engine_devices(train) if train.pool == stage.pool else engine_devices(stage)
    if uncovered:
        found.append(StageRefusal(stage.name, f"stage '{stage.name}': devices {sorted(uncovered)} of pool "
                                  f"'{stage.pool}' hold engine workers but no trainer rank to hand them weights "
                                  "(vllm-ascend's NPU IPC transfer is from the trainer rank on the same NPU)",
                                  "give the train stage at least as many devices as generation", "placement"))
    return found + _refresh_memory_refusals(plan, stage, train)


def data_parallel_refusals(plan: ExecutionPlan, stage) -> list[StageRefusal]:
    """An instance with dp > 1 runs as its dp engine ranks (engine_group.py) on a time-shared pool,
    where every rank's workers take the weights from the trainer ranks on their NPUs; on a pool of
    its own the HCCL transfer group (`transfer_info`) holds one engine's workers, and agentic
    episodes (EpisodeEngine) run on one engine."""
    dp, found = stage.parallel.dp, []
    if stage.placement != "time_shared":
        found.append(StageRefusal(stage.name, f"stage '{stage.name}': an instance with dp = {dp} on a pool of its own: "
                                  "the HCCL weight transfer reaches one engine per instance, not its data-parallel "
                                  "ranks", "give each instance dp = 1 (more instances instead), or colocate "
                                  "generation with training", "dp"))
    if plan.stages_of("environment"):
        found.append(StageRefusal(stage.name, f"stage '{stage.name}': agentic episodes run on one engine per "
                                  f"instance, not on dp = {dp} engine ranks", "give each instance dp = 1 (more "
                                  "instances instead)", "dp"))
    return found


def _engine_process_refusals(plan: ExecutionPlan, stage, runtime: str | None = "local") -> list[StageRefusal]:
    """The local runtime starts every engine (each data-parallel rank's) on this node (node 0), on the
    launch plan's NPUs (`engine_env`)."""
    found = []
    offset = pool_offsets(plan.pools)[stage.pool]
    remote = sorted({device(offset, d).node for d in engine_devices(stage)} - {0})
    if remote and runtime == "local":
        nodes = f"{remote[0]}-{remote[-1]}" if len(remote) > 2 else ", ".join(map(str, remote))
        found.append(StageRefusal(stage.name, f"stage '{stage.name}': instances on node(s) {nodes}: the local "
                                  f"runtime starts engines on this node only ({NPUS_PER_NODE} NPUs)",
                                  f"run with --runtime ray (an engine actor on each node), or fit generation on one "
                                  f"node ({NPUS_PER_NODE} NPUs)", "instances"))
    return found


def _refresh_memory_refusals(plan: ExecutionPlan, stage, train) -> list[StageRefusal]:
    """At a refresh an NPU holds the engine's woken weights and the streamed refresh's peak
    (hf_stream.stream_peak_bytes: the IPC buffer, the engine's copy of a chunk, one parameter being
    gathered); the trainer is offloaded and the KV cache not yet woken."""
    from aspc.backends.ascend.engine_args import WEIGHT_BUCKET_BYTES
    from aspc.backends.ascend.hf_stream import stream_peak_bytes
    from aspc.ir.memory import generation_need

    model, hardware = plan.model(stage.model), hardware_table().get(plan.pool(stage.pool).hardware)
    if hardware is None:
        return []
    weights = generation_need(model.arch, model.dtype, stage.parallel, 0).total
    peak = stream_peak_bytes(model.arch, DTYPE_BYTES[model.dtype], train.parallel, WEIGHT_BUCKET_BYTES)
    if weights + peak <= hardware.hbm_gib * GIB:
        return []
    return [StageRefusal(stage.name, f"stage '{stage.name}': a colocated refresh needs {(weights + peak) / GIB:.1f} "
                         f"GiB on each NPU (the engine's weights {weights / GIB:.1f} GiB, the streamed transfer "
                         f"{peak / GIB:.1f} GiB), more than one {hardware.name}'s {hardware.hbm_gib:g} GiB",
                         "raise generation's tp (or ep), or give generation a pool of its own (HCCL transfer)",
                         "placement")]


def engine_devices(stage) -> set[int]:
    return {device for instance in stage.instances for device in instance.devices}
