"""Real RL training on the CPU backend: it learns, staleness 0 equals sync, and asp converges
like sync. These run for a few minutes in CI.

Learning is asserted for more than one seed (the seed stands in for a machine's floating-point
differences), with the margins the seed sweeps in bench/RESULTS.md justify (`python
bench/bench_seeds.py`): the sampled reward rises in every run, the held-out accuracy on average.
ASPC_TRAINING_SEEDS=0,1,2,... runs these tests for other seeds."""
import os

import pytest

from aspc.drivers.local.runtime import LocalRuntime, RunOptions
from aspc.cli.toolchain import compile_with_passes
from conftest import ROOT
from warm_starts import SharedWarmStart


RL_STEPS = 100
SEEDS = [int(s) for s in os.environ.get("ASPC_TRAINING_SEEDS", "0,4").split(",")]
MARGIN = 0.02  # the mean rise over the runs must exceed it (the sweep's mean: over +0.1)
NOISE = 0.05  # two standard errors of a greedy accuracy near 0.2 on 256 prompts (sqrt(.2 * .8 / 256))


def train(pipeline, steps, schedule=None, overrides=(), evaluate=False, seed=0, workers="processes"):
    """A run as `aspc run` makes it (process workers, its default), from a shared warm start."""
    plan = compile_with_passes(ROOT / "pipelines" / pipeline, list(overrides), schedule).plan()
    options = RunOptions(steps=steps, warmstart_steps=200, seed=seed, workers=workers)
    runtime = LocalRuntime(plan, ROOT / "pipelines", options, SharedWarmStart)
    runtime.build()
    before = runtime.accuracy(256) if evaluate else None
    result = runtime.run()
    after = runtime.accuracy(256) if evaluate else None
    return result, before, after


@pytest.mark.parametrize("workers", ["processes", "threads"])
def test_asp_with_staleness_zero_trains_identically_to_sync(workers):
    asp, _, _ = train("tiny_grpo.aspl", 3, "asp", ["schedule.staleness=0"], workers=workers)
    sync, _, _ = train("tiny_grpo.aspl", 3, "sync", workers=workers)
    assert [m["samples"] for m in asp.metrics] == [m["samples"] for m in sync.metrics] == [64, 64, 64]
    assert [m["reward"] for m in asp.metrics] == [m["reward"] for m in sync.metrics]
    for a, s in zip(asp.metrics, sync.metrics):
        assert a["loss"] == pytest.approx(s["loss"], abs=1e-5)
        assert a["staleness_mean"] == s["staleness_mean"] == 0.0
    for row in asp.metrics + sync.metrics:  # each row: the workers' time since the previous row, by category
        assert sum(row["bubbles"].values()) == pytest.approx(1.0, abs=1e-3) and row["bubbles"]["useful"] > 0


@pytest.fixture(scope="module")
def trained():
    return {(seed, schedule): train("tiny_grpo.aspl", RL_STEPS, schedule, evaluate=True, seed=seed)
            for seed in SEEDS for schedule in ("sync", "asp")}


def test_grpo_learns_over_the_warm_start_for_every_seed(trained):
    """Every run's sampled reward rises; held-out greedy accuracy rises over the runs on average and
    falls in none by more than NOISE. One run's greedy accuracy on 256 prompts is a noisy, chaotic
    figure: a change that only moved float rounding (the output head over response positions only)
    turned seed 4's sync run from +0.066 into -0.039 while its sampled reward still rose 0.117 ->
    0.167 (bench/RESULTS.md, the seed sweep)."""
    changes = []
    for (seed, schedule), (result, before, after) in trained.items():
        first = sum(m["reward"] for m in result.metrics[:10]) / 10
        last = sum(m["reward"] for m in result.metrics[-10:]) / 10
        assert last > first, f"seed {seed}, {schedule}: sampled reward {first:.3f} -> {last:.3f}"
        assert after > before - NOISE, f"seed {seed}, {schedule}: greedy accuracy {before:.3f} -> {after:.3f}"
        changes.append(after - before)
    assert sum(changes) / len(changes) > MARGIN, f"mean held-out change {sum(changes) / len(changes):+.3f}"


def test_asp_with_staleness_one_converges_like_sync(trained):
    """The published claim, unchanged convergence: over the same samples, asp's final held-out
    accuracy is not worse than sync's by more than 0.1 (the sweep: -0.05 at worst)."""
    for seed in SEEDS:
        (_, _, sync_after), (asp_result, _, asp_after) = trained[seed, "sync"], trained[seed, "asp"]
        assert asp_after >= sync_after - 0.1, f"seed {seed}: asp {asp_after:.3f}, sync {sync_after:.3f}"
        assert max(m["staleness_mean"] for m in asp_result.metrics) <= 1.0


def test_ppo_with_a_critic_learns():
    """The sweep (tiny_ppo, seeds 0-7, sync and asp): the sampled reward rose by 0.11 to 0.22
    between the first and the last 10 of 100 steps."""
    result, _, _ = train("tiny_ppo.aspl", RL_STEPS, seed=SEEDS[-1])
    assert len(result.metrics) == RL_STEPS
    assert all(m["grad_norm"] == m["grad_norm"] for m in result.metrics)  # no NaN
    assert all(m["samples"] == 32 for m in result.metrics)
    first = sum(m["reward"] for m in result.metrics[:10]) / 10
    last = sum(m["reward"] for m in result.metrics[-10:]) / 10
    assert last > first + 0.05, f"sampled reward {first:.3f} -> {last:.3f}"


def test_aspc_run_command(aspc, tmp_path):
    metrics = tmp_path / "m.jsonl"
    result = aspc("run", "pipelines/tiny_grpo.aspl", "--steps", "3", "--warmstart", "20",
                  "--metrics", str(metrics), "--trace", str(tmp_path / "t.json"))
    assert result.exit_code == 0, result.output
    assert "3 steps" in result.stdout
    assert len(metrics.read_text().splitlines()) == 3
    assert (tmp_path / "t.json").exists()


def test_run_refuses_an_npu_pipeline_with_a_clear_message(aspc):
    result = aspc("run", "pipelines/grpo_7b.aspl", "--steps", "1")
    assert result.exit_code == 1
    assert "aspc simulate" in result.output and "Traceback" not in result.output
    ascend = aspc("run", "pipelines/tiny_grpo.aspl", "--backend", "ascend")
    assert ascend.exit_code == 1 and "--backend cpu" in ascend.output


def test_a_raising_user_reward_ends_the_run_with_the_sample_named(aspc, tmp_path, monkeypatch):
    (tmp_path / "badreward.py").write_text("def score(prompt, response, answer, metadata):\n"
                                           "    raise ValueError('no score for ' + prompt)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    source = (ROOT / "pipelines" / "tiny_grpo.aspl").read_text().replace(
        'reward(gen, rule = "exact_match")', 'reward(gen, python = "badreward:score")')
    pipeline = tmp_path / "p.aspl"
    pipeline.write_text(source)
    result = aspc("run", str(pipeline), "--steps", "2", "--warmstart", "0", "--metrics", str(tmp_path / "m.jsonl"))
    assert result.exit_code == 1
    assert 'python("badreward:score") failed' in result.output
    assert "ValueError: no score for" in result.output and "Traceback" not in result.output
