import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from aspc.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = sorted((ROOT / "pipelines").glob("*.aspl"))
UPDATE_GOLDEN = os.environ.get("ASPC_UPDATE_GOLDEN") == "1"


@pytest.fixture
def in_root(monkeypatch):
    """Run from the repository root so that file names in output are stable relative paths."""
    monkeypatch.chdir(ROOT)
    return ROOT


@pytest.fixture
def aspc(in_root):
    """Invoke the CLI in-process: aspc("check", "x.aspl") -> click Result."""
    runner = CliRunner()

    def run(*args: str):
        return runner.invoke(main, list(args), catch_exceptions=False)

    return run


def check_golden(path: Path, actual: str) -> None:
    """Compare with a golden file; ASPC_UPDATE_GOLDEN=1 rewrites it instead."""
    if UPDATE_GOLDEN or not path.exists():
        if not UPDATE_GOLDEN:
            pytest.fail(f"golden file {path} is missing; run with ASPC_UPDATE_GOLDEN=1 to create it")
        path.write_text(actual, encoding="utf-8")
        return
    assert actual == path.read_text(encoding="utf-8"), f"output differs from {path}"


def verified_accuracy_over_a_run(pipeline: Path, steps: int = 40, warmstart: int = 200, seed: int = 0):
    """Train `pipeline` on the CPU backend: (greedy held-out accuracy by the task's verifier before
    RL, after RL, the run's result, the runtime). Each distinct warm start is made once a session."""
    from aspc.drivers.local.runtime import LocalRuntime, RunOptions
    from aspc.cli.toolchain import compile_with_passes
    from warm_starts import SharedWarmStart

    plan = compile_with_passes(pipeline, []).plan()
    runtime = LocalRuntime(plan, pipeline.parent, RunOptions(steps=steps, warmstart_steps=warmstart, seed=seed),
                           SharedWarmStart)
    runtime.build()
    before = runtime.accuracy(256)
    result = runtime.run()
    return before, runtime.accuracy(256), result, runtime
