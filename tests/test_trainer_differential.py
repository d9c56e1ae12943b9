"""The trainers' differential test (issue 31, item 6), its shared samples and settings, and what the
trainers share besides the loss: the reward calls (function(prompt, response text, answer,
metadata), then DAPO's overlong shaping) and the options the megatron trainer refuses. The loss and
gradient comparison itself runs the real megatron-core (tests/test_trainer_differential_megatron.py):
before issue 31 the megatron trainer averaged GRPO over each packed row (gradient norm 0.05-0.52x the
CPU learner's), called the reward function with one argument and ignored off_policy, is_cap,
entropy_coef and overlong."""
import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from aspc.backends.ascend.megatron_trainer import MegatronTrainer
from aspc.backends.ascend.run_executors import AscendExecutors
from aspc.backends.cpu.executors import CpuExecutors
from aspc.backends.cpu.learner import Learner
from aspc.backends.cpu.model import TinyQwen
from aspc.cli.toolchain import compile_with_passes
from aspc.rl.rollout import Rollout, Shaping, TaskReward
from aspc.rl.tokenizer import decode
from conftest import ROOT
from test_ascend_critic import forward_backward
from test_ascend_executors import one_rank  # noqa: F401 (a fixture)

GRPO = ROOT / "pipelines" / "tiny_grpo.aspl"
LONGEST = 3 + 4 + 2 + 6  # prompt + response tokens of the longest sample below


def length_reward(prompt: str, response: str, answer, metadata: dict) -> float:
    """Varies within a group, from the decoded text: 1 for an even number of characters."""
    return float(len(response) % 2 == 0) + 0.25 * len(prompt) / 10


def samples(values: bool) -> list[Rollout]:
    """Two groups of four with varied lengths; behaviour log-probs away from the policy's (so the
    off-policy weights and the clip act), reference log-probs (the KL term), critic values for GAE."""
    generator = torch.Generator().manual_seed(3)
    out = []
    for i in range(8):
        n_prompt, n_response = 3 + i % 4, 2 + (3 * i) % 7
        prompt, response = (torch.randint(1, 32, (n,), generator=generator).tolist() for n in (n_prompt, n_response))
        behaviour = (-3.5 + 0.8 * torch.randn(n_response, generator=generator)).tolist()
        reference = (-3.5 + 0.5 * torch.randn(n_response, generator=generator)).tolist()
        value = torch.randn(n_response, generator=generator).tolist() if values else None
        out.append(Rollout(prompt, response, behaviour, f"p{i}", None, key=(0, i), ref_logprobs=reference,
                           values=value))
    return out


class RecordingOptimizer:
    """Both trainers' optimizer as they call it: step() keeps the gradients it would apply (after
    the trainer divided them by the step's divisor) and steps nothing; -> megatron's (ok, norm, _)."""

    def __init__(self, model, prefix: str = ""):
        self.model, self.prefix, self.gradients = model, prefix, {}

    def step(self):
        self.gradients = {name.removeprefix(self.prefix): p.grad.detach().clone()
                          for name, p in self.model.named_parameters() if p.grad is not None}
        return True, float(torch.cat([g.flatten() for g in self.gradients.values()]).norm()), None

    def zero_grad(self, set_to_none: bool = True):
        self.model.zero_grad(set_to_none=set_to_none)


def settings_for(**changes):
    base = CpuExecutors(compile_with_passes(GRPO).plan(), GRPO.parent)._settings()
    return dataclasses.replace(base, **({"grad_clip": 0.0, "temperature": 0.7, "kl": 0.05} | changes))


def task_reward(settings) -> TaskReward:
    return TaskReward(length_reward, decode, Shaping(settings.overlong, settings.max_tokens))


def cpu_step(whole: TinyQwen, settings, rollouts: list[Rollout]) -> tuple[dict, dict]:
    learner = Learner(copy.deepcopy(whole), None, None, settings, length_reward, decode)
    learner.optimizer = RecordingOptimizer(learner.actor)
    learner.reward(rollouts)
    learner.train(rollouts)
    return learner.optimizer_step(), learner.optimizer.gradients


MODES = {
    "grpo": {},
    "dapo": {"loss": "dapo", "clip_high": 0.28},
    "seq-mean-token-sum": {"loss_agg": "seq_mean_token_sum"},
    "seq-mean-token-sum-norm": {"loss_agg": "seq_mean_token_sum_norm"},
    "token-mean": {"loss_agg": "token_mean"},
    "tis": {"off_policy": "tis", "is_cap": 1.5},
    "decoupled": {"off_policy": "decoupled", "is_cap": 1.5},
    "entropy": {"entropy_coef": 0.01},
    "overlong": {"overlong": 4, "max_tokens": 8},
    "ppo-gae": {"loss": "ppo", "estimator": "gae", "normalize": True},
    "rloo-no-kl": {"estimator": "rloo", "normalize": False, "kl": 0.0},
    "k1": {"kl_estimator": "k1"},
    "k3-plus": {"kl_estimator": "k3_plus"},
    "dual-clip": {"dual_clip": 1.2, "loss_agg": "token_mean"},
    "gspo": {"ratio": "sequence"},
    "seq-tis": {"mismatch": "seq_tis"},
    "token-mis": {"mismatch": "token_mis", "mismatch_floor": 0.8, "mismatch_cap": 1.5},
    "seq-mis-with-tis": {"mismatch": "seq_mis", "off_policy": "tis", "is_cap": 1.5},
    "ppo-gae-in-8-units": {"loss": "ppo", "estimator": "gae", "normalize": True},
}
UNITS = {"ppo-gae-in-8-units": 8}  # the megatron trainer takes these modes' samples streamed in units; the CPU at once


def units(mode: str, rollouts: list[Rollout]) -> list[list[Rollout]]:
    count = UNITS.get(mode, 1)
    size = -(-len(rollouts) // count)
    return [rollouts[k:k + size] for k in range(0, len(rollouts), size)]


def test_both_trainers_call_the_reward_function_the_same_way(one_rank):  # noqa: F811
    """The host's TaskReward, the CPU learner and the megatron trainer give every sample the same
    task reward and shaped reward (function(prompt, response text, answer, metadata), then DAPO's
    overlong penalty over the tokens the model wrote)."""
    settings = settings_for(overlong=4, max_tokens=8)
    by_cpu, by_npu, by_host = samples(False), samples(False), samples(False)
    Learner(TinyQwen(CpuExecutors(compile_with_passes(GRPO).plan(), GRPO.parent).actor.arch, seed=0), None, None,
            settings, length_reward, decode).reward(by_cpu)
    trainer = MegatronTrainer.of_parts({"micro_batching": {"tokens": 64}, "groups": {"dp": [[0]], "pp": [[0]]}},
                                       settings, SimpleNamespace(comm=None), torch.nn.Linear(1, 1), None,
                                       forward_backward, task_reward(settings))
    trainer.reward(by_npu)
    task_reward(settings).score(by_host)
    rewards = [[(r.task_reward, r.reward) for r in rs] for rs in (by_cpu, by_npu, by_host)]
    assert rewards[0] == rewards[1] == rewards[2]
    assert any(r.reward < r.task_reward for r in by_cpu)  # the overlong penalty acted


def plan_with(tmp_path, options: str, tp: int = 1):
    """tiny_grpo with more options on its train stage (and its tensor parallelism)."""
    source = GRPO.read_text().replace("micro_tokens = 1k", f"micro_tokens = 1k, tp = {tp}, {options}")
    path = tmp_path / "p.aspl"
    path.write_text(source.replace("pool cpu = cpu x 2", "pool cpu = cpu x 4"))
    return compile_with_passes(path).plan()


@pytest.mark.parametrize("options, tp, option", [("epochs = 2", 1, "epochs"),
                                                 ("entropy_coef = 0.01", 2, "entropy_coef"),
                                                 ("ratio = sequence, cp = 2", 1, "ratio"),
                                                 ("mismatch = auto, cp = 2", 1, "mismatch")])
def test_what_the_megatron_trainer_cannot_honour_is_refused_at_the_option(tmp_path, options, tp, option):
    def trainers(plan):  # on 4 CPUs the placement pass gives the reference a device of its own (refused too)
        return [r for r in AscendExecutors.unsupported(plan, runtime=None) if r.stage == "update"]

    refused = trainers(plan_with(tmp_path, options, tp))
    assert [r.option for r in refused] == [option], refused
    assert trainers(plan_with(tmp_path, "entropy_coef = 0.01")) == []  # tp = 1


def test_a_launch_plan_or_dry_run_refuses_what_the_megatron_trainer_cannot_honour(aspc, tmp_path):
    """`aspc compile --backend ascend --emit launch` and `aspc run --backend ascend --dry-run` refuse
    epochs = 2 at the option's line, as a run would: no launch plan that trains something else."""
    path = tmp_path / "p.aspl"
    path.write_text(GRPO.read_text().replace("micro_tokens = 1k", "micro_tokens = 1k, epochs = 2"))
    for args in (["compile", str(path), "--backend", "ascend", "--emit", "launch"],
                 ["run", str(path), "--backend", "ascend", "--dry-run"]):
        result = aspc(*args)
        assert result.exit_code == 1, result.output
        assert "p.aspl:21:" in result.output and "the megatron trainer trains one epoch per step" in result.output
