"""The CPU backend behind the executor roles (aspc/roles.py): from an execution plan, the
policy and its warm start, generation engines, the trainer, prompts, checkpoints and evaluation.
The local and Ray drivers reach the CPU backend only through this object, which the CLI (or a
test) hands them; they import no backend module."""
from __future__ import annotations

import copy
from pathlib import Path

from aspc.backends.cpu import checkpoint
from aspc.backends.cpu.checkpoint import CheckpointError
from aspc.backends.cpu.data import DataError, Prompt, PromptSource
from aspc.backends.cpu.generator import BatchGenerator
from aspc.backends.cpu.learner import Learner, Rollout, TrainSettings
from aspc.backends.cpu.model import TinyQwen
from aspc.backends.cpu.reward_model import (TRAIN_HINT, RewardScorer, Shaping, build_terms, checkpoint_path,
                                            load_reward_model)
from aspc.backends.cpu.rewards import RewardError, build_reward, exact_match
from aspc.algorithms.slots import default_slots
from aspc.backends.cpu.threads import use_threads
from aspc.backends.cpu.warmstart import warm_start
from aspc.plan.execution_plan import ExecutionPlan, StageRefusal


class CpuExecutors:
    """One run's CPU executors. Raises DataError (the data file) or ValueError (a plan shape the
    CPU backend does not execute) when built."""

    platform = "cpu"
    user_errors = (DataError, RewardError, CheckpointError, ValueError)
    checkpoint_error = CheckpointError
    set_threads = staticmethod(use_threads)  # a plain function: Ray actors call it after unpickling

    def __init__(self, plan: ExecutionPlan, base_dir: Path | None, seed: int = 0):
        self.plan, self.base_dir, self.seed = plan, base_dir, seed
        self.gen_stage, self.train_stage = plan.stages_of("generate")[0], plan.stages_of("train")[0]
        self.data = plan.dataset(self.gen_stage.data)
        refused = unsupported_stages(plan)
        if refused:
            raise ValueError(refused[0].message)
        self.prompts = PromptSource(self.data.source, self.data.location, self.data.seed,
                                    self.data.max_response, base_dir)
        self.actor = TinyQwen(plan.model(self.train_stage.model).arch, seed=seed)
        sources = dict(plan.stages_of("reward")[0].options)["sources"]
        self.reward_models = self._load_reward_models()  # fails early: a missing checkpoint, a bad file
        # A rule or python reward runs in the learner; a stage with model(...) sources runs on its own
        # executor (forward_model), and the task's verifier measures accuracy, never the learned reward.
        learned = any(source.func == "model" for source in sources)
        self.reward_fn = build_reward([] if learned else sources, base_dir)
        self.verifier = build_reward([s for s in sources if s.func != "model"], base_dir) if learned else None
        self.scorers: dict[tuple[str, int], RewardScorer] = {}
        self.learner = None

    @staticmethod
    def unsupported(plan: ExecutionPlan) -> list[StageRefusal]:
        return unsupported_stages(plan)

    # ---- the policy ----
    def prompt(self, index: int) -> Prompt:
        return self.prompts(index)

    def warm_start(self, steps: int, on_step=None) -> None:
        warm_start(self.actor, self.prompts, steps, on_step=on_step)

    def snapshot(self) -> dict:
        return copy.deepcopy(self.actor.state_dict())

    def generation_engine(self, index: int, instances: int) -> BatchGenerator:
        """Instance `index` of `instances` (all alike on a CPU)."""
        options = dict(self.gen_stage.options)
        slots = default_slots(self.data.samples_per_step, instances, self.data.group)
        return BatchGenerator(copy.deepcopy(self.actor).eval(), slots, options["max_tokens"],
                              options["temperature"], options["top_p"],
                              static=self.gen_stage.batching != "continuous")

    def trainer(self) -> Learner:
        """The learner (reward, reference, critic, policy update) over the same actor; built after
        the warm start, since the reference is a frozen copy of the warm-started actor."""
        if self.learner is None:
            self.learner = Learner(self.actor, self._reference(), self._critic(), self._settings(), self.reward_fn)
        return self.learner

    def forward_model(self, stage: str, instance: int) -> RewardScorer:
        """Instance `instance` of reward stage `stage` (model(...) sources): its own copy of each reward
        model, so instances on different threads share no module."""
        key = (stage, instance)
        if key not in self.scorers:
            sources = dict(self.plan.stage(stage).options)["sources"]
            models = {name: copy.deepcopy(model) for name, model in self.reward_models.items()}
            settings = self._settings()
            shaping = Shaping(settings.overlong if settings.loss == "dapo" else 0, settings.max_tokens)
            self.scorers[key] = RewardScorer(build_terms(sources, models, self.base_dir), shaping)
        return self.scorers[key]

    def switch_pool(self, pool: str, mode: str) -> None:
        """A time-shared pool changes hands: CPU threads share memory, so nothing moves."""

    def rollout(self, sample, finished, prompt: Prompt) -> Rollout:
        return Rollout(finished.prompt, finished.response, finished.logprobs, prompt.text, prompt.answer,
                       prompt.metadata, key=sample)

    def accuracy(self, count: int = 128) -> float:
        """Greedy reward of the current policy on held-out prompts: of the stage's rule and python
        sources; with a learned reward (model(...) sources), of its rule and python sources if it has
        any, else of the task's verifier (exact match with the data's answers)."""
        from aspc.backends.cpu.evaluate import greedy_accuracy

        measure = self.reward_fn if self.verifier is None else (self.verifier if self.verifier.sources
                                                                 else exact_match)
        return greedy_accuracy(self.actor, self.prompts, measure, count, dict(self.gen_stage.options)["max_tokens"])

    # ---- checkpoints ----
    @staticmethod
    def parts(learner) -> tuple[dict, dict]:
        return ({"actor": learner.actor, "reference": learner.ref, "critic": learner.critic},
                {"actor": learner.optimizer, "critic": learner.critic_optimizer})

    save_checkpoint = staticmethod(checkpoint.save)
    load_checkpoint = staticmethod(checkpoint.load)
    find_resume_point = staticmethod(checkpoint.find_resume_point)
    read_manifest = staticmethod(checkpoint.read_manifest)
    step_folders = staticmethod(checkpoint.step_folders)

    # ---- building ----
    def _load_reward_models(self) -> dict:
        """The reward models model(...) sources name, each loaded once from its checkpoint."""
        models = {}
        for stage in self.plan.stages_of("reward"):
            for source in dict(stage.options)["sources"]:
                name = source.get("model") if source.func == "model" else None
                if name is not None and name not in models:
                    model = self.plan.model(name)
                    models[name] = load_reward_model(model.arch, checkpoint_path(model.checkpoint, self.base_dir), name)
        return models

    def _reference(self):
        stages = self.plan.stages_of("reference")
        if not stages:
            return None
        model = self.plan.model(stages[0].model)
        if model.frozen_of == self.train_stage.model:
            return copy.deepcopy(self.actor).eval()
        return TinyQwen(model.arch, seed=self.seed + 1).eval()

    def _critic(self):
        stages = self.plan.stages_of("critic")
        if not stages:
            return None
        return TinyQwen(self.plan.model(stages[0].model).arch, seed=self.seed + 2, value_head=True)

    def _settings(self) -> TrainSettings:
        t = dict(self.train_stage.options)
        adv = dict(self.plan.stages_of("advantage")[0].options)
        critic = self.plan.stages_of("critic")
        return TrainSettings(
            loss=t["loss"], lr=t["lr"], kl=t["kl"], clip=t["clip"], clip_high=t["clip_high"],
            value_coef=t["value_coef"], entropy_coef=t["entropy_coef"], micro_tokens=t["micro_tokens"],
            weight_decay=t["weight_decay"], grad_clip=t["grad_clip"], overlong=t["overlong"],
            max_tokens=dict(self.gen_stage.options)["max_tokens"], estimator=adv["estimator"],
            gamma=adv["gamma"], lam=adv["lam"], normalize=adv["normalize"], group=self.data.group,
            critic_lr=dict(critic[0].options)["lr"] if critic else 1e-5)


def unsupported_stages(plan: ExecutionPlan) -> list[StageRefusal]:
    """What the CPU backend cannot execute, refused before the run (the CLI points at each)."""
    found = []
    for stage in plan.stages:
        if stage.kind == "train" and dict(stage.options).get("epochs", 1) != 1:
            found.append(StageRefusal(stage.name, f"stage '{stage.name}': the CPU backend trains one epoch per "
                                                  "step", "set epochs = 1", "epochs"))
        if stage.kind == "environment":
            found.append(StageRefusal(stage.name, f"stage '{stage.name}': the CPU backend does not execute "
                                                  "environment stages (agentic RL) yet",
                                      "run the pipeline without the environment stage"))
        for source in dict(stage.options).get("sources", ()) if stage.kind == "reward" else ():
            if source.func not in ("rule", "python", "model"):
                found.append(StageRefusal(stage.name, f"stage '{stage.name}': the CPU backend does not execute "
                                                      f"{source.func}(...) sources yet",
                                          "use rule(...), python(...) or model(...) sources"))
            elif source.func == "model" and not plan.model(source.get("model")).checkpoint:
                found.append(StageRefusal(stage.name, f"stage '{stage.name}': reward model "
                                                      f"'{source.get('model')}' has no weights: the CPU backend "
                                                      "scores with a trained reward model only",
                                          f"add checkpoint = \"PATH\" to model {source.get('model')}; "
                                          f"{TRAIN_HINT}"))
    return found
