"""Golden tests: the printed IR, JSON and DOT of every bundled pipeline."""
import os
import subprocess
import sys

import pytest

from conftest import PIPELINES, ROOT, check_golden

GOLDEN = ROOT / "tests" / "golden"


@pytest.mark.parametrize("emit", ["ir", "json", "dot"])
@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.stem)
def test_emit_matches_golden(aspc, pipeline, emit):
    """The stage graph after the file's schedule's passes."""
    result = aspc("compile", f"pipelines/{pipeline.name}", "--emit", emit)
    assert result.exit_code == 0, result.output
    check_golden(GOLDEN / f"{pipeline.stem}.{emit}", result.stdout)


@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.stem)
def test_lowered_ir_matches_golden(aspc, pipeline):
    """The stage graph as the front end lowers it, before any pass (-p '')."""
    result = aspc("compile", f"pipelines/{pipeline.name}", "-p", "")
    assert result.exit_code == 0, result.output
    check_golden(GOLDEN / f"{pipeline.stem}.lowered.ir", result.stdout)


@pytest.mark.parametrize("schedule", ["asp", "sync", "sync-naive"])
@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.stem)
def test_plan_matches_golden(aspc, pipeline, schedule):
    result = aspc("compile", f"pipelines/{pipeline.name}", "--schedule", schedule, "--emit", "plan")
    assert result.exit_code == 0, result.output
    check_golden(GOLDEN / f"{pipeline.stem}.{schedule}.plan.json", result.stdout)


@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.stem)
def test_bundled_pipeline_checks_clean(aspc, pipeline):
    result = aspc("check", f"pipelines/{pipeline.name}")
    assert result.exit_code == 0
    assert result.stderr == "", "bundled pipelines compile without warnings"


@pytest.mark.parametrize("emit", ["json", "plan"])
def test_output_is_deterministic_across_processes(emit):
    """Two fresh interpreters with different hash seeds (set and dict order of strings differ)
    print the same bytes: no state carried within one process can hide an unstable order."""
    def compile_in_a_new_process(seed: str) -> str:
        result = subprocess.run([sys.executable, "-m", "aspc.cli.main", "compile", "pipelines/grpo_7b.aspl",
                                 "--emit", emit],
                                cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr
        return result.stdout

    first, second = compile_in_a_new_process("1"), compile_in_a_new_process("2")
    assert first and first == second


def test_bundled_set_covers_the_paper_workloads():
    names = {p.stem for p in PIPELINES}
    assert {"tiny_grpo", "tiny_ppo", "grpo_7b", "dapo_32b", "grpo_30b_moe", "r1_zero_671b"} <= names
