"""Nothing bad is trained on (issue 37, items 4 and 5): a NaN or infinite reward, advantage, loss
or gradient stops the step before any weight changes, and a reward function that hangs or raises
SystemExit stops the run with one message naming it, never a hang, a silent exit or NaN weights."""
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from aspc.backends.cpu.learner import Learner
from aspc.rl.rollout import Rollout, TrainSettings
from aspc.rl.losses import NonFiniteError
from aspc.backends.cpu.model import TinyQwen
from aspc.rl.rewards import (REWARD_TIMEOUT_S, TIMEOUT_ENV, RewardError, RewardExit, RewardTimeout,
                                       WeightedReward, call_with_timeout, load_callable, reward_timeout_s)
from aspc.backends.cpu.scoring import build_terms
from aspc.rl.scoring import RewardScorer
from aspc.rl.rollout import Shaping
from aspc.rl.tokenizer import encode
from aspc.controller.scoring import CallPolicy
from aspc.drivers.local.scoring import GuardedJudge
from aspc.ir.facts import ModelArch
from aspc.ir.values import Call
from conftest import ROOT

TINY = ROOT / "pipelines" / "tiny_grpo.aspl"
ARCH = ModelArch(layers=1, hidden=16, heads=2, kv_heads=1, head_dim=8, ffn=32, vocab=32, tied=True, max_seq=32)
SAMPLES_PER_STEP = 64  # tiny_grpo: 16 prompts x group 4

NAN_AFTER_TWO_STEPS = f"""import itertools
CALLS = itertools.count(1)
def score(prompt, response, answer, metadata):
    return float("nan") if next(CALLS) > {2 * SAMPLES_PER_STEP} else float(response.strip() == answer)
"""
HANGS = "import time\ndef score(prompt, response, answer, metadata):\n    time.sleep(3600)\n"
EXITS = "def score(prompt, response, answer, metadata):\n    raise SystemExit(0)\n"


def reward_pipeline(folder, module: str, code: str):
    """tiny_grpo in `folder`, scored by python("module:score") written beside it."""
    (folder / f"{module}.py").write_text(code)
    path = folder / "p.aspl"
    path.write_text(TINY.read_text().replace('rule = "exact_match"', f'python = "{module}:score"'))
    return path


def run(aspc, path, folder, *extra):
    return aspc("run", str(path), "--steps", "3", "--warmstart", "5", "--workers", "threads",
                "--metrics", str(folder / "m.jsonl"), *extra)


def assert_one_message(result, *needles):
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in result.output, result.output


# ---- non-finite rewards, through the CLI ----
def test_a_nan_reward_stops_the_run_naming_the_reward_and_leaves_no_nan_weights(aspc, tmp_path):
    path = reward_pipeline(tmp_path, "nan_after_two_steps", NAN_AFTER_TWO_STEPS)
    result = run(aspc, path, tmp_path, "--checkpoint", str(tmp_path / "ck"))
    assert_one_message(result, 'python("nan_after_two_steps:score") returned nan', "prompt '",
                       "no weight was changed")
    saved = sorted((tmp_path / "ck").rglob("*.safetensors"))
    assert saved, "the finished steps are kept"
    for file in saved:
        for name, tensor in load_file(file).items():
            assert torch.isfinite(tensor).all(), f"{file}: {name} is not finite"


# ---- non-finite rewards, where they are computed ----
def test_an_infinite_python_reward_is_a_non_finite_error_naming_it_and_the_sample():
    reward = WeightedReward(((lambda *a: float("inf"), 1.0),))
    with pytest.raises(NonFiniteError, match="returned inf on prompt '1\\+1=', response '2'"):
        reward("1+1=", "2", "2", {})


def test_a_rule_reward_is_named_as_the_pipeline_names_it(tmp_path):
    (tmp_path / "inf_reward_module.py").write_text("def score(*args):\n    return float('-inf')\n")
    reward = WeightedReward(((load_callable("inf_reward_module:score", tmp_path), 1.0),))
    with pytest.raises(NonFiniteError, match='reward python\\("inf_reward_module:score"\\) returned -inf'):
        reward("1+1=", "2", "2", {})


def _rollout(prompt="1+1=", response="2") -> Rollout:
    return Rollout(encode(prompt), encode(response), [0.0] * len(response), prompt, "2")


def test_a_nan_reward_model_score_is_a_non_finite_error_naming_the_model():
    model = lambda pairs: torch.tensor([1.0, float("nan")])  # noqa: E731
    scorer = RewardScorer(build_terms([Call("model", (("model", "rm"), ("weight", 1.0)))], {"rm": model}, None),
                          Shaping(0, 8))
    with pytest.raises(NonFiniteError, match="reward model\\(rm\\) returned nan on prompt '3\\+4='"):
        scorer.score([_rollout(), _rollout("3+4=", "7")])


class _VirtualClock:
    virtual = True


def test_a_nan_judge_score_is_a_failed_call_whose_sample_is_masked():
    """The judge's failure policy (aspc/controller/scoring.py): the fallback reward, masked."""
    nan_judge = lambda pairs: torch.tensor([float("nan")])  # noqa: E731  (scored as a model term)
    scorer = RewardScorer(build_terms([Call("model", (("model", "j"), ("weight", 1.0)))], {"j": nan_judge}, None),
                          Shaping(0, 8))
    rollout = _rollout()
    GuardedJudge(scorer.score, "score", CallPolicy(5.0, 1, 0.25), _VirtualClock())([rollout])
    assert (rollout.masked, rollout.reward) == (True, 0.25)


# ---- the learner: nothing non-finite reaches the weights ----
def _learner(critic=None) -> Learner:
    settings = TrainSettings(loss="grpo", lr=1e-2, kl=0.05, clip=0.2, clip_high=0.2, value_coef=0.5,
                             entropy_coef=0.0, micro_tokens=64, weight_decay=0.0, grad_clip=1.0, overlong=0,
                             max_tokens=8, estimator="grpo", gamma=1.0, lam=1.0, normalize=True, group=2)
    return Learner(TinyQwen(ARCH, seed=0), None, critic, settings, lambda *a: 0.0, decode=str)


def _unit(rewards=(1.0, 0.0)) -> list[Rollout]:
    return [Rollout([1, 5, 6], [7, 8, 9], [-1.0] * 3, f"p{i}", None, reward=r, key=(0, 0, i),
                    ref_logprobs=[-1.0] * 3) for i, r in enumerate(rewards)]


def _weights(learner: Learner) -> dict:
    return {name: value.clone() for name, value in learner.actor.state_dict().items()}


def _assert_unchanged(learner: Learner, before: dict) -> None:
    after = learner.actor.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert all(p.grad is None for p in learner.actor.parameters()), "the step's gradients are discarded"
    assert not learner.optimizer.state, "the optimizer took no step"


def test_a_nan_gradient_leaves_the_weights_unchanged():
    learner = _learner()
    learner.train(_unit())
    next(learner.actor.parameters()).grad[0] = float("nan")
    before = _weights(learner)
    with pytest.raises(NonFiniteError, match="the actor's gradient norm is nan at step 1"):
        learner.optimizer_step()
    _assert_unchanged(learner, before)


def test_a_nan_reward_from_another_executor_is_never_trained_on():
    learner = _learner()
    before = _weights(learner)
    with pytest.raises(NonFiniteError, match="the reward of sample \\(0, 0, 1\\) \\(prompt 'p1'\\) is nan"):
        learner.train(_unit((1.0, float("nan"))))
    _assert_unchanged(learner, before)


def test_a_masked_sample_with_a_nan_reward_trains_with_advantage_zero():
    """A masked sample's reward is not read (its score failed): no error."""
    unit = _unit((1.0, float("nan")))
    unit[1].masked = True
    learner = _learner()
    learner.train(unit)
    assert math.isfinite(learner.optimizer_step()["grad_norm"])


def test_a_nan_loss_stops_the_unit_before_its_backward_pass():
    learner = _learner()
    unit = _unit()
    unit[0].ref_logprobs = [float("nan")] * 3  # the KL term is NaN
    before = _weights(learner)
    with pytest.raises(NonFiniteError, match="the policy loss of a micro-batch .* is nan"):
        learner.train(unit)
    _assert_unchanged(learner, before)


def test_a_finite_step_still_trains():
    learner = _learner()
    before = _weights(learner)
    learner.train(_unit())
    learner.optimizer_step()
    assert any(not torch.equal(before[n], v) for n, v in learner.actor.state_dict().items())


# ---- a reward function that hangs or exits ----
def test_a_hung_reward_call_times_out_within_its_limit():
    started = time.monotonic()
    with pytest.raises(RewardTimeout, match="0.2 s limit"):
        call_with_timeout(time.sleep, (3600,), 0.2)
    assert time.monotonic() - started < 5


def test_a_hung_reward_stops_the_run_with_a_message_naming_it_and_the_limit(tmp_path):
    path = reward_pipeline(tmp_path, "hung_reward", HANGS)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "aspc.cli.main", "run", str(path), "--steps", "3", "--warmstart",
                             "5", "--workers", "threads", "--metrics", str(tmp_path / "m.jsonl")],
                            capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env=os.environ | {TIMEOUT_ENV: "0.5"})
    assert time.monotonic() - started < 60
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert 'reward python("hung_reward:score") failed on prompt' in result.stderr, result.stderr
    assert "ran past its 0.5 s limit" in result.stderr and TIMEOUT_ENV in result.stderr


def test_a_reward_raising_system_exit_is_an_error_not_the_runs_exit(aspc, tmp_path):
    path = reward_pipeline(tmp_path, "exiting_reward", EXITS)
    assert_one_message(run(aspc, path, tmp_path), 'reward python("exiting_reward:score") failed',
                       "raised SystemExit(0)", "must return a number")


def test_generator_exit_is_a_reward_error_and_ctrl_c_passes_through():
    def raises(error):
        raise error

    with pytest.raises(RewardExit, match="GeneratorExit"):
        call_with_timeout(raises, (GeneratorExit(),), 1.0)
    with pytest.raises(KeyboardInterrupt):
        call_with_timeout(raises, (KeyboardInterrupt(),), 1.0)


def test_the_timeout_is_30_s_unless_the_environment_says_otherwise(monkeypatch):
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert reward_timeout_s() == REWARD_TIMEOUT_S == 30.0
    monkeypatch.setenv(TIMEOUT_ENV, "2.5")
    assert reward_timeout_s() == 2.5
    monkeypatch.setenv(TIMEOUT_ENV, "0")
    assert reward_timeout_s() is None
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(RewardError, match="ASPC_REWARD_TIMEOUT='soon' is not a number of seconds"):
        reward_timeout_s()
