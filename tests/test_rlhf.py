"""RLHF on the CPU backend: a learned reward model (backends/cpu/reward_model.py) fitted by
`aspc train-rm` on preference pairs, scoring a reward stage on its own pool, and a policy that
learns the task from it (the verifier measures, never rewards)."""
from pathlib import Path

import pytest
from click.testing import CliRunner

from aspc.rl.checkpoint import CheckpointError
from aspc.backends.cpu.executors import CpuExecutors
from aspc.rl.rollout import Rollout
from aspc.backends.cpu.preferences import arith_pairs, wrong_answer
from aspc.backends.cpu.reward_model import load_reward_model, pairwise_accuracy, read_pairs, split
from aspc.rl.rewards import exact_match
from aspc.rl.tokenizer import BOS, EOS, encode
from aspc.cli.main import main
from aspc.cli.toolchain import compile_with_passes
from conftest import ROOT, verified_accuracy_over_a_run

PIPELINE = ROOT / "pipelines" / "tiny_rlhf.aspl"
DATA = ROOT / "pipelines" / "data"


def rlhf_plan(tmp_path: Path, score: str | None = None, checkpoint: str | None = None):
    """tiny_rlhf.aspl copied to tmp_path with another score stage or rm checkpoint."""
    text = PIPELINE.read_text()
    if score is not None:
        text = text.replace("stage score  = reward(gen, model = rm) on judges", score)
    text = text.replace('checkpoint = "data/tiny_rm.safetensors"',
                        f'checkpoint = "{checkpoint or DATA / "tiny_rm.safetensors"}"')
    (tmp_path / "p.aspl").write_text(text)
    return tmp_path / "p.aspl", compile_with_passes(tmp_path / "p.aspl", []).plan()


def test_the_preference_pairs_prefer_the_verified_answer():
    rows = [r for r in (ROOT / "pipelines/data/arith_prefs.jsonl").read_text().splitlines() if r]
    assert 1000 <= len(rows) <= 5000
    import json

    for row in map(json.loads, rows):
        assert row["chosen"] != row["rejected"]
        assert exact_match(row["prompt"], row["chosen"], str(eval(row["prompt"][:-1])), {}) == 1.0
    import random

    rng = random.Random(0)
    assert all(wrong_answer(rng, "37+5=", "42") != "42" for _ in range(200))
    assert arith_pairs(40, sampled=0.0) == arith_pairs(40, sampled=0.0)  # seeded: the same file again


def test_the_shipped_reward_model_ranks_held_out_pairs_it_never_trained_on():
    """The checkpoint `aspc train-rm` wrote (the command in docs/runtime.md), on the pairs it held out."""
    plan = compile_with_passes(PIPELINE, []).plan()
    model = load_reward_model(plan.model("rm").arch, DATA / "tiny_rm.safetensors")
    train, held_out = split(read_pairs(DATA / "arith_prefs.jsonl"))
    assert len(held_out) == 300
    assert pairwise_accuracy(model, held_out) >= 0.85
    assert (DATA / "tiny_rm.safetensors").stat().st_size < 1_000_000


def test_train_rm_fits_bradley_terry_and_writes_a_checkpoint_the_pipeline_loads(tmp_path):
    lines = (DATA / "arith_prefs.jsonl").read_text().splitlines()[:400]
    (tmp_path / "prefs.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "rm.safetensors"
    result = CliRunner().invoke(main, ["train-rm", str(PIPELINE), "--model", "rm", "--data",
                                       str(tmp_path / "prefs.jsonl"), "-o", str(out), "--steps", "120",
                                       "--sft-steps", "20"])
    assert result.exit_code == 0, result.output
    assert "held-out pairwise accuracy:" in result.output and out.is_file()
    first, last = [float(line.split("loss ")[1].split()[0]) for line in result.output.splitlines()
                   if line.startswith("step ")][::9]
    assert last < first
    _, plan = rlhf_plan(tmp_path, checkpoint=str(out))
    CpuExecutors(plan, tmp_path).forward_model("score", 0)  # loads


def test_train_rm_errors_name_the_problem(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1=", "chosen": "2"}\n')
    result = CliRunner().invoke(main, ["train-rm", str(PIPELINE), "--model", "rm", "--data",
                                       str(tmp_path / "bad.jsonl"), "-o", str(tmp_path / "x.safetensors")])
    assert result.exit_code == 1 and "bad.jsonl:1:" in result.output and '"rejected"' in result.output
    result = CliRunner().invoke(main, ["train-rm", str(PIPELINE), "--model", "nope", "--data",
                                       str(tmp_path / "bad.jsonl"), "-o", str(tmp_path / "x.safetensors")])
    assert result.exit_code == 1 and "no model 'nope'" in result.output


def test_a_stage_score_is_the_exact_weighted_sum_of_its_sources(tmp_path):
    _, plan = rlhf_plan(tmp_path, 'stage score = reward(gen) on judges { sources = [model(rm, weight = 0.5), '
                                  'rule("exact_match", weight = 2.0)] }')
    executors = CpuExecutors(plan, tmp_path)
    scorer = executors.forward_model("score", 0)
    rollouts = []
    for prompt, answer, response in [("37+5=", "42", "42"), ("37+5=", "42", "43"), ("9+9=", "18", "18"),
                                     ("9+9=", "18", ""), ("120+3=", "123", "1231")]:
        rollouts.append(Rollout([BOS] + encode(prompt), encode(response) + [EOS], [0.0] * (len(response) + 1),
                                prompt, answer))
    scorer.score(rollouts)
    rm = load_reward_model(plan.model("rm").arch, DATA / "tiny_rm.safetensors")
    rm_scores = rm([(r.prompt, r.response) for r in rollouts]).tolist()
    for r, rm_score in zip(rollouts, rm_scores):
        rule = exact_match(r.prompt_text, _text(r), r.answer, {})
        assert r.reward == r.task_reward == 0.5 * rm_score + 2.0 * rule
    assert [exact_match(r.prompt_text, _text(r), r.answer, {}) for r in rollouts] == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert rollouts[0].reward > rollouts[1].reward  # the right answer outscores the near miss
    assert executors.forward_model("score", 0) is scorer and executors.forward_model("score", 1) is not scorer


def _text(rollout):
    from aspc.rl.tokenizer import decode

    return decode(rollout.response)


def test_a_missing_reward_model_checkpoint_is_a_clear_error(tmp_path):
    file, plan = rlhf_plan(tmp_path, checkpoint="nowhere/rm.safetensors")
    with pytest.raises(CheckpointError, match=r"nowhere/rm.safetensors does not exist; .*aspc train-rm"):
        CpuExecutors(plan, tmp_path)
    result = CliRunner().invoke(main, ["run", str(file), "--steps", "1", "--warmstart", "0",
                                       "--metrics", str(tmp_path / "m.jsonl")])
    assert result.exit_code == 1 and "nowhere/rm.safetensors does not exist" in result.output
    (tmp_path / "nowhere").mkdir()
    (tmp_path / "nowhere/rm.safetensors").write_text("not weights")
    with pytest.raises(CheckpointError, match="reward model: cannot load the checkpoint"):
        CpuExecutors(rlhf_plan(tmp_path, checkpoint="nowhere/rm.safetensors")[1], tmp_path)


def test_a_reward_model_needs_weights(tmp_path):
    from aspc.backends.cpu.executors import unsupported_stages

    text = PIPELINE.read_text().replace('  checkpoint = "data/tiny_rm.safetensors"\n', "")
    (tmp_path / "p.aspl").write_text(text)
    [refusal] = unsupported_stages(compile_with_passes(tmp_path / "p.aspl", []).plan())
    assert "reward model 'rm' has no weights" in refusal.message and "aspc train-rm" in refusal.hint


def test_rlhf_from_the_learned_reward_raises_verified_accuracy():
    """The acceptance test: the policy is rewarded by the reward model alone, and its greedy
    held-out accuracy by the task's verifier (which it never sees) rises over the warm start — on
    average over three seeds, and no seed collapses. One seed is not enough: the warm-started model
    differs by machine, and on an AMD EPYC machine seed 0 alone went 0.355 -> 0.238 at temperature
    1.0 (seeds 1, 2: +0.012, -0.055); at the pipeline's 0.7, seeds 0-2 rose by +0.031, +0.215 and
    -0.004 (bench/RESULTS.md, "Learning on an AMD EPYC machine")."""
    runs = [verified_accuracy_over_a_run(PIPELINE, steps=40, seed=seed) for seed in (0, 1, 2)]
    shown = ", ".join(f"{before:.3f} -> {after:.3f}" for before, after, _, _ in runs)
    for _, _, result, runtime in runs:
        assert runtime.executors.reward_fn.sources == ()  # the learner holds no reward: the judges pool scores
        assert len(result.metrics) == 40
    gain = sum(after - before for before, after, _, _ in runs) / len(runs)
    assert gain > 0.03, f"greedy verified accuracy per seed: {shown}"
    assert all(after > before - 0.05 for before, after, _, _ in runs), f"a seed collapsed: {shown}"
