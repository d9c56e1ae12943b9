"""`aspc run tiny_rlhf / tiny_rlaif --backend ascend` on CPU: the platform faked as in
tests/test_ascend_executors.py (vLLM over the CPU generator, the CPU learner as megatron's rank 0),
and each reward stage's learned term in a real scorer process (scorer_process.py) whose child
builds the NPU reward model over a CPU stand-in of megatron's GPTModel, or the NPU judge over a
fake vLLM serving the shipped tiny judge (tests/npu_scorer_fakes.py)."""
import json
import os

import pytest

from aspc.backends.ascend import scorers
from aspc.backends.ascend.scorer_process import ScorerProcess
from conftest import ROOT
from npu_scorer_fakes import CALLS_BEFORE_FAILING
from test_ascend_executors import fake_platform

PIPELINES = ROOT / "pipelines"


def separate_pools(tmp_path, name: str):
    """The pipeline with generation on a pool of its own (colocated engines need a checkpoint), next
    to the data and python rewards it reads."""
    text = (PIPELINES / f"{name}.aspl").read_text()
    text = text.replace("pool cpu    = cpu x 2", "pool cpu    = cpu x 1\npool rollout = cpu x 2")
    path = tmp_path / f"{name}.aspl"
    path.write_text(text.replace("generate(actor, prompts) on cpu", "generate(actor, prompts) on rollout"))
    (tmp_path / "data").symlink_to(PIPELINES / "data")
    (tmp_path / "tiny_rewards.py").write_text((PIPELINES / "tiny_rewards.py").read_text())
    return path


def scorers_in_processes(monkeypatch, path) -> list[ScorerProcess]:
    """Each learned term in a real scorer process, built by npu_scorer_fakes.build; returns them."""
    started = []

    def start_term(spec):
        env = spec["env"] | {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
        started.append(ScorerProcess(spec | {"pipeline": str(path)}, "npu_scorer_fakes:build", spec["name"], env))
        return started[-1]

    monkeypatch.setattr(scorers, "start_term", start_term)
    return started


def run(aspc, path, backend, tmp_path):
    metrics = tmp_path / f"{backend}.jsonl"
    result = aspc("run", str(path), "--backend", backend, "--steps", "2", "--warmstart", "0", "--workers", "threads",
                  "--metrics", str(metrics), "--set", "schedule.staleness=0")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if '"trained"' in line] \
        if metrics.exists() else []
    return result, rows


@pytest.mark.parametrize("name", ["tiny_rlhf", "tiny_rlaif"])
def test_aspc_run_backend_ascend_scores_and_trains_as_the_cpu_backend(aspc, tmp_path, monkeypatch, name):
    """The same samples per step as `--backend cpu`, and the first step's mean reward within 1e-4:
    the reward model reads one sequence per forward where the CPU one pads a batch (float32 rounding,
    up to 2e-5 a sequence); the judge's engine returns the top-5 log-probs only, so a "1" outside
    them reads 0.0 where the CPU judge reads its probability (at most 8e-5 there, the shipped
    judge). Every scorer process has ended when the run returns."""
    fake_platform(monkeypatch)
    path = separate_pools(tmp_path, name)
    started = scorers_in_processes(monkeypatch, path)
    npu_result, npu = run(aspc, path, "ascend", tmp_path)
    assert npu_result.exit_code == 0, npu_result.output
    cpu_result, cpu = run(aspc, path, "cpu", tmp_path)
    assert cpu_result.exit_code == 0, cpu_result.output
    assert len(npu) == len(cpu) == 2
    assert [m["trained"] for m in npu] == [m["trained"] for m in cpu]
    assert npu[0]["reward"] == pytest.approx(cpu[0]["reward"], abs=1e-4)
    [process] = started
    assert process.next_id > 0 and process.child.poll() is not None  # it scored the run's units, then ended


def test_a_run_that_fails_ends_its_scorer_processes(aspc, tmp_path, monkeypatch):
    """The reward model's process fails its second call (an NPU error) and stays up: the run stops
    with the error, named, and the driver's stop closes the process."""
    fake_platform(monkeypatch)
    path = separate_pools(tmp_path, "tiny_rlhf")
    started = scorers_in_processes(monkeypatch, path)
    os.environ[CALLS_BEFORE_FAILING] = "1"  # fake_platform made os.environ this test's own copy
    result, _ = run(aspc, path, "ascend", tmp_path)
    assert result.exit_code == 1 and "507015" in result.output and "Traceback" not in result.output
    assert len(started) == 1 and started[0].child.poll() is not None
