"""RLAIF on the CPU backend: a small LLM judge (backends/cpu/judge.py) warm-started by `aspc
train-judge`, scoring a reward stage on its own pool; a policy that learns the task from it (the
verifier measures, never rewards); and the failure policy of judge calls (aspc/controller/scoring.py)."""
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from aspc.rl.call_batching import BatchedCalls
from aspc.backends.cpu.executors import CpuExecutors, unsupported_stages
from aspc.backends.cpu.judge import CpuJudge, agreement, load_judge, save_judge
from aspc.rl.rollout import Rollout
from aspc.rl.losses import group_advantages
from aspc.backends.cpu.model import TinyQwen
from aspc.backends.cpu.reward_model import read_pairs, split
from aspc.rl.tokenizer import BOS, EOS, encode
from aspc.cli.main import main
from aspc.controller.scoring import STOP_AFTER
from aspc.drivers.local.runtime import LocalRuntime, RunOptions
from aspc.cli.toolchain import compile_with_passes
from conftest import ROOT, verified_accuracy_over_a_run

PIPELINE = ROOT / "pipelines" / "tiny_rlaif.aspl"
DATA = ROOT / "pipelines" / "data"
JUDGE_SOURCE = "judge(model = grader, read = probability, timeout = 30, concurrency = 16, fallback = 0.0)"


def rlaif_plan(tmp_path: Path, judge: str = JUDGE_SOURCE, checkpoint: str | None = None):
    """tiny_rlaif.aspl copied to tmp_path with another judge source or judge checkpoint."""
    text = PIPELINE.read_text().replace(JUDGE_SOURCE, judge)
    text = text.replace('checkpoint = "data/tiny_judge.safetensors"',
                        f'checkpoint = "{checkpoint or DATA / "tiny_judge.safetensors"}"')
    (tmp_path / "tiny_rewards.py").write_text((ROOT / "pipelines" / "tiny_rewards.py").read_text())
    (tmp_path / "p.aspl").write_text(text)
    return tmp_path / "p.aspl", compile_with_passes(tmp_path / "p.aspl", []).plan()


def rollout(prompt: str, answer: str, response: str, key=None) -> Rollout:
    return Rollout([BOS] + encode(prompt), encode(response) + [EOS], [0.0] * (len(response) + 1), prompt, answer,
                   key=key)


def test_the_shipped_judge_agrees_with_the_verifier_on_answers_it_never_trained_on():
    """The checkpoint `aspc train-judge` wrote (the command in docs/runtime.md), on the pairs it held out."""
    plan = compile_with_passes(PIPELINE, []).plan()
    model = load_judge(plan.model("grader").arch, DATA / "tiny_judge.safetensors", "grader")
    _, held_out = split(read_pairs(DATA / "arith_prefs.jsonl"))
    assert agreement(CpuJudge(model), held_out) >= 0.85
    untrained = CpuJudge(TinyQwen(plan.model("grader").arch, seed=5))
    assert agreement(untrained, held_out) < 0.65


def test_a_judge_reads_a_probability_or_a_parsed_verdict():
    plan = compile_with_passes(PIPELINE, []).plan()
    model = load_judge(plan.model("grader").arch, DATA / "tiny_judge.safetensors", "grader")
    items = [rollout("9+9=", "18", "18"), rollout("9+9=", "18", "17"), rollout("4+4=", "8", "8"),
             rollout("4+4=", "8", "9")]
    probabilities = CpuJudge(model, read="probability").scores(items)
    assert all(0.0 < p < 1.0 for p in probabilities)
    assert probabilities[0] > 0.5 > probabilities[1] and probabilities[2] > 0.5 > probabilities[3]
    assert CpuJudge(model, read="verdict").scores(items) == [1.0, 0.0, 1.0, 0.0]


def test_the_stage_score_is_the_exact_weighted_sum_of_judge_and_python_terms(tmp_path):
    _, plan = rlaif_plan(tmp_path, JUDGE_SOURCE.replace("fallback = 0.0", "fallback = 0.0, weight = 0.5"))
    executors = CpuExecutors(plan, tmp_path)
    items = [rollout("37+5=", "42", "42"), rollout("37+5=", "42", "043"), rollout("9+9=", "18", "")]
    executors.judge("score", 0).judge(items)
    judge = CpuJudge(load_judge(plan.model("grader").arch, DATA / "tiny_judge.safetensors", "grader"))
    for item, judged, well_formed in zip(items, judge.scores(items), [1.0, 0.0, 0.0]):
        assert item.reward == item.task_reward == pytest.approx(0.5 * judged + 0.1 * well_formed, abs=1e-6)
    assert executors.reward_fn.sources == ()  # nothing is scored on the learner


def test_train_judge_warm_starts_a_judge_the_pipeline_loads(tmp_path):
    lines = (DATA / "arith_prefs.jsonl").read_text().splitlines()[:300]
    (tmp_path / "prefs.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "judge.safetensors"
    result = CliRunner().invoke(main, ["train-judge", str(PIPELINE), "--model", "grader", "--data",
                                       str(tmp_path / "prefs.jsonl"), "-o", str(out), "--steps", "40",
                                       "--sft-steps", "20"])
    assert result.exit_code == 0, result.output
    assert "held-out agreement with the verifier:" in result.output and "(judging)" in result.output
    _, plan = rlaif_plan(tmp_path, checkpoint=str(out))
    CpuExecutors(plan, tmp_path).judge("score", 0)  # loads
    result = CliRunner().invoke(main, ["train-judge", str(PIPELINE), "--model", "nope", "--data",
                                       str(tmp_path / "prefs.jsonl"), "-o", str(out)])
    assert result.exit_code == 1 and "no model 'nope'" in result.output


def test_a_judge_needs_weights_and_a_rubric_in_the_task_vocabulary(tmp_path):
    rlaif_plan(tmp_path)  # the python term's module beside it
    text = PIPELINE.read_text().replace('  checkpoint = "data/tiny_judge.safetensors"\n', "")
    (tmp_path / "p.aspl").write_text(text)
    [refusal] = unsupported_stages(compile_with_passes(tmp_path / "p.aspl", []).plan())
    assert "judge 'grader' has no weights" in refusal.message and "aspc train-judge" in refusal.hint
    _, plan = rlaif_plan(tmp_path, JUDGE_SOURCE.replace("read", 'prompt = "Is it right?", read'))
    [refusal] = unsupported_stages(plan)
    assert refusal.option == "prompt" and "cannot be read by a tiny CPU judge" in refusal.message
    result = CliRunner().invoke(main, ["run", str(tmp_path / "p.aspl"), "--steps", "1"])
    assert result.exit_code == 1 and "p.aspl:" in result.output and "Traceback" not in result.output


def test_a_masked_sample_is_left_out_of_its_group_and_teaches_nothing():
    rewards, masked = [1.0, 0.0, 0.0, 0.5, 2.0, 2.0], [False, False, True, False, True, True]
    advantages = group_advantages(rewards, 3, "grpo", normalize=False, masked=masked)
    assert advantages[:3] == pytest.approx([0.5, -0.5, 0.0])  # the mean of the two scored samples
    assert advantages[3:] == [0.0, 0.0, 0.0]  # one scored sample: no spread; none scored: nothing


def test_rlaif_from_the_judge_raises_verified_accuracy():
    """The acceptance test: the policy is rewarded by the judge and a format term, and its greedy
    held-out accuracy by the task's verifier (which it never sees) rises over the warm start —
    on average over three seeds, and no seed collapses. One seed is not enough: a judge's reward is
    noisy, and on an AMD EPYC machine seed 0 alone went 0.355 -> 0.301 after 40 steps (seeds 1-3:
    +0.21, +0.07, +0.19); after 60 steps seeds 0-2 rose by +0.05, +0.25 and +0.10."""
    runs = [verified_accuracy_over_a_run(PIPELINE, steps=60, seed=seed) for seed in (0, 1, 2)]
    shown = ", ".join(f"{before:.3f} -> {after:.3f}" for before, after, _, _ in runs)
    for _, _, result, _ in runs:
        assert len(result.metrics) == 60 and not any("score_failed" in m for m in result.metrics)
    gain = sum(after - before for before, after, _, _ in runs) / len(runs)
    assert gain > 0.05, f"greedy verified accuracy per seed: {shown}"
    assert all(after > before - 0.1 for before, after, _, _ in runs), f"a seed collapsed: {shown}"


# ---- judge failures ----
class FlakyJudge:
    """Wraps the real judge: raises on some samples, hangs past the timeout on others."""

    def __init__(self, judge, fails, hangs):
        self.inner, self.fails, self.hangs = judge, fails, hangs

    def judge(self, rollouts) -> None:
        if any(self.hangs(r.key) for r in rollouts):
            time.sleep(1.0)
        if any(self.fails(r.key) for r in rollouts):
            raise ConnectionError("the judge service reset the connection")
        self.inner.judge(rollouts)


def flaky(fails, hangs=lambda key: False):
    class FlakyExecutors(CpuExecutors):
        def judge(self, stage, instance):
            return FlakyJudge(super().judge(stage, instance), fails, hangs)

    return FlakyExecutors


def test_concurrent_judge_calls_share_a_pass_and_each_fails_alone():
    """The CPU judge batches the runtime's per-sample calls (call_batching.py): calls that arrive
    while a pass is in flight share the next; a pass that fails is run again call by call."""
    passes, release = [], threading.Event()

    def score(rollouts):
        passes.append(list(rollouts))
        release.wait(10)
        if "bad" in rollouts:
            raise ValueError("not a verdict")

    calls, outcomes = BatchedCalls(score), {}

    def call(name):
        try:
            calls([name])
            outcomes[name] = "ok"
        except ValueError as error:
            outcomes[name] = str(error)

    threads = [threading.Thread(target=call, args=(name,)) for name in ("a", "b", "bad", "c")]
    threads[0].start()
    _wait_until(lambda: len(passes) == 1)
    for thread in threads[1:]:
        thread.start()
    _wait_until(lambda: len(calls.waiting) == 3)
    release.set()
    for thread in threads:
        thread.join(timeout=10)
    assert outcomes == {"a": "ok", "b": "ok", "c": "ok", "bad": "not a verdict"}
    assert passes[0] == ["a"] and sorted(passes[1]) == ["b", "bad", "c"]
    assert sorted(passes[2:]) == [["b"], ["bad"], ["c"]]


def _wait_until(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert condition()


def test_a_judge_that_fails_on_some_samples_masks_them_and_loses_none(tmp_path):
    _, plan = rlaif_plan(tmp_path, JUDGE_SOURCE.replace("timeout = 30", "timeout = 0.25"))
    fails = lambda key: (key[1] + key[2]) % 7 == 0  # noqa: E731
    hangs = lambda key: (key[1] + key[2]) % 11 == 5  # noqa: E731
    runtime = LocalRuntime(plan, tmp_path, RunOptions(steps=3, warmstart_steps=20, seed=0), flaky(fails, hangs))
    runtime.build()
    result = runtime.run()
    for m in result.metrics:
        step = m["step"] - 1
        assert len(m["trained"]) == m["samples"] == 64  # every sample trained, masked or not
        expected = sum(fails(tuple(k)) or hangs(tuple(k)) for k in m["trained"])
        assert m["score_failed"] == expected > 0, step
    masked = [r for r in runtime.rollouts.values() if r.masked]
    assert masked and all(r.reward == 0.0 and (fails(r.key) or hangs(r.key)) for r in masked)


def test_a_judge_that_always_fails_stops_the_run_with_a_message_and_a_checkpoint(tmp_path, monkeypatch):
    """An untrained judge read as a verdict answers tokens that are not verdicts: every call fails."""
    plan = compile_with_passes(PIPELINE, []).plan()
    save_judge(TinyQwen(plan.model("grader").arch, seed=11), tmp_path / "untrained.safetensors", {})
    file, _ = rlaif_plan(tmp_path, JUDGE_SOURCE.replace("probability", "verdict"),
                         checkpoint=str(tmp_path / "untrained.safetensors"))
    result = CliRunner().invoke(main, ["run", str(file), "--steps", "3", "--warmstart", "10", "--metrics",
                                       str(tmp_path / "m.jsonl"), "--checkpoint", str(tmp_path / "ckpt")])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert f"stage 'score': the judge failed its last {STOP_AFTER} calls" in result.output
    assert "JudgeCallFailed" in result.output and "continue with --resume" in result.output
    assert "checkpoint of step 0" in result.output and any((tmp_path / "ckpt").iterdir())
