"""Reward stages with model(...) or judge(...) sources on NPUs: the ForwardModel and Judge roles of
AscendExecutors. A stage instance is the engine-free `RewardScorer` (aspc/rl/scoring.py, as on the CPU: the
exact weighted sum of the stage's sources, the learner's overlong shaping), so the controller, the
driver and the combination of sources are the CPU run's; only the learned term differs:

- model(NAME): a megatron-core reward model (reward_model.py) in a process of its own (rank 0 of
  the instance; its other tensor-parallel ranks are the launch plan's `reward` processes),
- judge(NAME): the CPU judge over a vllm-ascend engine (judge.py) in a process of its own,

each started on this host with the launch plan's environment of the instance's first process
(scorer_process.py); rule(...) and python(...) terms run on the host, as on the CPU.

What this cannot serve is refused at the stage (`scorer_refusals`) before anything starts."""
from __future__ import annotations

import dataclasses

from aspc.backends.ascend.process_env import node_addresses_from_env, resolved
from aspc.backends.ascend.scorer_process import ScorerFailed, ScorerProcess
from aspc.rl.host import checkpoint_dir
from aspc.rl.rewards import RewardError
from aspc.rl.scoring import RewardScorer, function_term
from aspc.rl.rollout import Shaping
from aspc.plan.execution_plan import ExecutionPlan, StageRefusal

LEARNED = ("model", "judge")
FACTORY = "aspc.backends.ascend.scorers:build_term"
CPU_VOCABULARY = "custom"  # the preset whose models read the CPU judge's character vocabulary


def stage_scorer(executors, stage: str, instance: int) -> RewardScorer:
    """Instance `instance` of reward stage `stage`: its sources in order, the learned one in its process."""
    settings = executors._settings()
    terms = []
    for source in dict(executors.plan.stage(stage).options)["sources"]:
        if source.func in LEARNED:
            terms.append((start_term(scorer_spec(executors, stage, instance, source)), source.get("weight")))
        elif source.func in ("rule", "python"):
            terms.append((function_term(source, executors.base_dir), source.get("weight")))
        else:  # the message the CPU backend's build_terms gave, when this path shared it
            raise RewardError(f"the CPU backend does not execute {source.func}(...) sources yet")
    return RewardScorer(terms, Shaping(settings.overlong, settings.max_tokens))


def scorer_spec(executors, stage: str, instance: int, source) -> dict:
    """What the scorer's process builds: the launch stage, the environment of the instance's first
    process, the model's sequence limit and vocabulary; a judge's rubric and read, a reward model's
    rank arguments (the last pipeline stage with its head: reward_model.py)."""
    launch = executors.launch
    process = first_process(launch, stage, instance)
    check_on_this_node(process, stage, instance)
    arch = executors.plan.model(source.get("model")).arch
    spec = {"role": source.func, "name": f"{source.func}({source.get('model')}) of stage '{stage}', "
                                         f"instance {instance}",
            "stage": next(dataclasses.asdict(s) for s in launch.stages if s.stage == stage),
            "model": source.get("model"), "env": resolved(process.env), "max_seq": arch.max_seq, "vocab": arch.vocab}
    if source.func == "judge":
        tokenizers = judge_tokenizers(executors, source, spec["stage"])
        return spec | {"rubric": source.get("prompt"), "read": source.get("read")} | tokenizers
    return spec | {"rank_args": {**process.model_args, "post_process": True}}


def judge_tokenizers(executors, source, launch_stage: dict) -> dict:
    """Where the judge's prompt is built (judge.judge_prompt): a custom judge's in the character
    vocabulary (None); a checkpoint judge's in the tokenizer of its vLLM model directory, with the
    responses decoded by the policy's tokenizer (its checkpoint directory; None: the characters)."""
    if executors.plan.model(source.get("model")).preset == CPU_VOCABULARY:
        return {"tokenizer": None, "policy_tokenizer": None}
    actor = executors.plan.model(executors.train_stage.model)
    policy = str(checkpoint_dir(actor, executors.base_dir)) if actor.preset == "hf" else None
    return {"tokenizer": launch_stage["config"]["model"], "policy_tokenizer": policy}


def first_process(launch, stage: str, instance: int):
    """The launch plan's process of the instance: the engine's data-parallel rank 0, or rank 0 of
    the megatron job (named without the instance when the stage has one)."""
    names = {f"{stage}.{instance}.dp0", f"{stage}.{instance}.rank0"}
    mine = [p for p in launch.processes if p.stage == stage]
    return next(p for p in mine if p.name in names or (p.name == f"{stage}.rank0" and instance == 0))


def check_on_this_node(process, stage: str, instance: int) -> None:
    """The scorer's process starts on this host (node0 of ASPC_NODES): its NPUs must be there."""
    addresses = node_addresses_from_env()
    if addresses is None or process.node == 0 or addresses[process.node] == addresses[0]:
        return
    raise ScorerFailed(f"stage '{stage}': instance {instance}'s NPUs are on node{process.node} "
                       f"({addresses[process.node]}), but aspc starts reward models and judges on this host "
                       f"({addresses[0]}); scorers on other nodes (Ray actors) are not built: give the score "
                       "stage's pool NPUs of this node")


def start_term(spec: dict):
    """The learned term, in its own process (replaced by an in-process fake in the CPU tests)."""
    return ScorerProcess(spec, FACTORY, spec["name"], spec["env"])


def close_scorers(scorers: dict) -> None:
    """The run is over (finished or failed): every scorer's process ends; each is asked, then waited for."""
    for scorer in scorers.values():
        for term, _ in scorer.terms:
            if isinstance(term, ScorerProcess):
                term.close()
    scorers.clear()


def build_term(spec: dict):
    """In the scorer's process: the reward model or the judge the spec names."""
    if spec["role"] == "judge":
        from aspc.backends.ascend.judge import build
    else:
        from aspc.backends.ascend.reward_model import build
    return build(spec)


# ---- what is refused before the run ----
def scorer_refusals(plan: ExecutionPlan, stage) -> list[StageRefusal]:
    """A reward stage's model(...) and judge(...) sources that the NPU scorers cannot serve."""
    learned = [s for s in dict(stage.options)["sources"] if s.func in LEARNED]
    if not learned:
        return []
    if len(learned) > 1:
        return [StageRefusal(stage.name, f"stage '{stage.name}': {len(learned)} model(...)/judge(...) sources; the "
                             "launch plan lowers one learned scorer per reward stage",
                             "give each reward model or judge a reward stage of its own, or keep one")]
    source = learned[0]
    if source.func == "judge":
        return _judge_refusals(plan, stage, source)
    return _reward_model_refusals(plan, stage, source)


def _judge_refusals(plan: ExecutionPlan, stage, source) -> list[StageRefusal]:
    model, policy = plan.model(source.get("model")), plan.model(plan.stages_of("train")[0].model)
    if model.preset == CPU_VOCABULARY and policy.preset != CPU_VOCABULARY:
        return [StageRefusal(stage.name, f"stage '{stage.name}': judge '{model.name}' is a custom model, which reads "
                             "the task's character vocabulary (backends/cpu/judge.py), but the policy "
                             f"'{policy.name}' writes its checkpoint's tokens",
                             "judge with a checkpoint model (its prompt is built in its own tokenizer)")]
    if stage.parallel.dp > 1:
        return [StageRefusal(stage.name, f"stage '{stage.name}': a judge instance with dp = {stage.parallel.dp} "
                             "is several vLLM processes; the NPU judge starts one engine per instance",
                             "use instances instead of dp on the score stage", "dp")]
    return []


def _reward_model_refusals(plan: ExecutionPlan, stage, source) -> list[StageRefusal]:
    model, policy = plan.model(source.get("model")), plan.model(plan.stages_of("train")[0].model)
    found = []
    if model.arch.vocab != policy.arch.vocab:
        found.append(StageRefusal(stage.name, f"stage '{stage.name}': reward model '{model.name}' has a vocabulary "
                                  f"of {model.arch.vocab}, the policy '{policy.name}' {policy.arch.vocab}; the NPU "
                                  "reward model reads the policy's token ids (re-tokenising is not built)",
                                  "use a reward model with the policy's tokenizer"))
    beyond_tp = {axis: getattr(stage.parallel, axis) for axis in ("pp", "cp", "dp", "ep")
                 if getattr(stage.parallel, axis) > 1}
    if beyond_tp:
        axis, size = next(iter(beyond_tp.items()))
        found.append(StageRefusal(stage.name, f"stage '{stage.name}': a reward-model instance with {axis} = {size}; "
                                  "the NPU reward model runs one sequence per forward on its tensor-parallel ranks "
                                  "(no pipeline schedule, no split of the calls over data-parallel ranks)",
                                  "split each instance with tp only (pp = cp = dp = ep = 1), and add instances",
                                  axis))
    return found

