"""One run's host side, shared by every engine: what an executor factory (backends/cpu/executors.py,
backends/ascend/run_executors.py) needs besides its engine, computed once from the plan and held by
the factory (composition: a backend is a sibling of the others, never a subclass of one).

- the data: prompts (PromptSource) in the policy's tokenizer (an hf(...) actor's checkpoint
  tokenizer, else the task's characters);
- the reward: rule(...) and python(...) sources as the learner's reward function; a stage with
  model(...) or judge(...) sources is scored on its own executor (LEARNED), and accuracy is then
  measured by the verifier (the stage's first rule, else exact match);
- the trainer's settings (TrainSettings) and overlong shaping, from the plan;
- rollouts (the driver's finished samples with their prompts, an episode's final answer and mask);
- the environment's tool runners (tool_runner.py), started when an instance first needs them.

Nothing here loads or runs a model."""
from __future__ import annotations

import concurrent.futures as futures
from functools import partial
from pathlib import Path
from typing import Any

from aspc.plan.execution_plan import ExecutionPlan, ModelPlan
from aspc.rl.data import Prompt, PromptSource
from aspc.rl.hf_tokenizer import HfTokenizer
from aspc.rl.losses import LOSS_DEFAULTS
from aspc.rl.rewards import RULES, build_reward, exact_match
from aspc.rl.rollout import Rollout, Shaping, TaskReward, TrainSettings
from aspc.rl.tokenizer import CHARS, decode

LEARNED = ("model", "judge")  # reward sources scored by a model of their own, on the stage's executor


def checkpoint_dir(model: ModelPlan, base_dir: Path | None) -> Path:
    """An hf(...) model's directory: as written, relative to the .aspl file."""
    return base_dir / model.checkpoint if base_dir is not None else Path(model.checkpoint)


class Tools:
    """The environment's tools, run on the host for every generation instance of the run: the
    driver calls `run` from one thread per runner; `threads` serve held-out evaluation."""

    def __init__(self, stage, base_dir: Path | None):
        from aspc.rl.tool_runner import ToolRunner, ToolSpec

        options = dict(stage.options)
        # absolute: the sandbox changes into a scratch folder before it looks the tool's module up
        folder = str(Path(base_dir).resolve()) if base_dir is not None else None
        self.specs = [ToolSpec(t.get("name"), t.get("python"), t.get("command"), t.get("timeout"), t.get("env"),
                               folder) for t in options["tools"]]
        self.runner = ToolRunner(self.specs, workers=options["tool_workers"])
        self.threads = futures.ThreadPoolExecutor(options["tool_workers"], thread_name_prefix="tool")

    def run(self, call):
        """Run one call to its end (a ToolResult: status "ok", "error", "timeout" or "crashed")."""
        return self.runner.run(call.tool, call.arguments)

    def close(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)
        self.runner.close()


def final_answer(response: list[int], mask: list[int]) -> str:
    """The text of the last model turn, after the last tool observation: what the reward reads."""
    tool_positions = [i for i, m in enumerate(mask) if m == 0]
    start = tool_positions[-1] + 1 if tool_positions else 0
    return decode(response[start:])


class RunHost:
    """One run's host side (module docstring). `masked_endings`: the reasons an episode ends that
    mask it (not the model's fault: the controller's episodes.MASKED, which the factory passes in)."""

    def __init__(self, plan: ExecutionPlan, base_dir: Path | None, masked_endings: tuple = ()):
        self.plan, self.base_dir, self.masked_endings = plan, base_dir, masked_endings
        self.gen_stage, self.train_stage = plan.stages_of("generate")[0], plan.stages_of("train")[0]
        self.data = plan.dataset_of(self.gen_stage)
        actor = self.actor_plan()
        self.tokenizer = HfTokenizer(checkpoint_dir(actor, base_dir)) if actor.preset == "hf" else CHARS
        self.prompts = PromptSource(self.data.source, self.data.location, self.data.seed,
                                    self.data.max_response, base_dir, self.tokenizer)
        sources = dict(plan.stages_of("reward")[0].options)["sources"]
        learned = any(source.func in LEARNED for source in sources)
        self.reward_fn = build_reward([] if learned else sources, base_dir)
        rules = [RULES[s.get("name")] for s in sources if s.func == "rule"]
        self.verifier = (rules[0] if rules else exact_match) if learned else None
        environments = plan.stages_of("environment")
        self.env_stage = environments[0] if environments else None
        self._tools: Tools | None = None  # built when an instance first needs them (they start processes)

    def actor_plan(self) -> ModelPlan:
        """The policy's model: the train stage's."""
        return self.plan.model_of(self.train_stage)

    def prompt(self, index: int) -> Prompt:
        return self.prompts(index)

    def measure(self):
        """What held-out accuracy is measured by: the verifier, else the reward function."""
        return self.reward_fn if self.verifier is None else self.verifier

    def rollout(self, sample, finished, prompt: Prompt) -> Rollout:
        rollout = Rollout(finished.prompt, finished.response, finished.logprobs, prompt.text, prompt.answer,
                          prompt.metadata, key=sample, policy_version=finished.version, routes=finished.routes)
        if finished.episode is not None:
            rollout.loss_mask, rollout.episode = finished.mask, finished.episode
            rollout.text = final_answer(finished.response, finished.mask)
            rollout.masked = finished.episode["ended"] in self.masked_endings
        return rollout

    def tools(self) -> Tools:
        """The environment's tool runners, shared by every generation instance of the run."""
        if self._tools is None:
            self._tools = Tools(self.env_stage, self.base_dir)
        return self._tools

    def close(self) -> None:
        """The run is over: stop the tool runners' processes."""
        if self._tools is not None:
            self._tools.close()
            self._tools = None

    def save_checkpoint(self, directory: Path, version: int, models: dict, optimizers: dict, extra: dict) -> Path:
        """checkpoint.save, with what `aspc export` needs (checkpoint_writer)."""
        return self.checkpoint_writer(extra)(directory, version, models, optimizers)

    def checkpoint_writer(self, extra: dict):
        """checkpoint.save(directory, version, models, optimizers) as a picklable function (a learner
        process writes its own state with it), its manifest holding `extra` and what `aspc export`
        needs to write an hf(...) actor back as a checkpoint directory: the source directory and
        the dtype."""
        from aspc.rl import checkpoint

        actor = self.actor_plan()
        if actor.preset == "hf":
            source = {"source": str(checkpoint_dir(actor, self.base_dir).resolve()), "dtype": actor.dtype}
            extra = {**extra, "hf": {"actor": source}}
        return partial(checkpoint.save, extra=extra)

    def settings(self) -> TrainSettings:
        t: dict[str, Any] = {**LOSS_DEFAULTS, **dict(self.train_stage.options)}  # the IR leaves these out at defaults
        adv = dict(self.plan.stages_of("advantage")[0].options)
        critic = self.plan.stages_of("critic")
        generate = dict(self.gen_stage.options)
        return TrainSettings(
            loss=t["loss"], lr=t["lr"], kl=t["kl"], clip=t["clip"], clip_high=t["clip_high"],
            value_coef=t["value_coef"], entropy_coef=t["entropy_coef"], micro_tokens=t["micro_tokens"],
            weight_decay=t["weight_decay"], grad_clip=t["grad_clip"], overlong=t["overlong"],
            max_tokens=generate["max_tokens"], estimator=adv["estimator"],
            gamma=adv["gamma"], lam=adv["lam"], normalize=adv["normalize"], group=self.data.group,
            critic_lr=dict(critic[0].options)["lr"] if critic else 1e-5, temperature=generate["temperature"],
            **{name: t[name] for name in LOSS_DEFAULTS})  # the loss options are TrainSettings' fields by name

    def shaping(self, settings: TrainSettings | None = None) -> Shaping:
        settings = settings or self.settings()
        return Shaping(settings.overlong, settings.max_tokens)

    def task_reward(self, settings: TrainSettings | None = None) -> TaskReward:
        """The learner's reward of rule and python sources on the decoded text, with overlong shaping."""
        return TaskReward(self.reward_fn, self.tokenizer.decode, self.shaping(settings))
