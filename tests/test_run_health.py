"""A run that cannot learn says so at once (aspc/controller/health.py): a tool that fails every call
warns, then stops the run with the tool's own error; a reward that never changes while the
responses do warns. And the README's agentic pipeline finds its tool from a relative path."""
import re
from pathlib import Path

import pytest

from aspc.controller.health import ConstantReward, ToolHealth, ToolsFailing
from conftest import ROOT

PIPELINE = ROOT / "pipelines" / "tiny_agentic.aspl"


def test_a_tool_failing_in_a_row_warns_once_with_its_error_then_stops_the_run():
    warnings = []
    health = ToolHealth(warnings.append, warn_after=3, stop_after=5)
    for _ in range(4):
        health.record("calc", "error", "error: cannot find Python module 'tiny_tools'\nmore")
    assert len(warnings) == 1 and "tool 'calc' failed its last 3 calls" in warnings[0]
    assert "cannot find Python module 'tiny_tools'" in warnings[0] and "none has succeeded" in warnings[0]
    with pytest.raises(ToolsFailing, match="failed its last 5 calls.*cannot find Python module"):
        health.record("calc", "timeout", "error: cannot find Python module 'tiny_tools'")


def test_one_success_resets_the_count_and_tools_are_counted_apart():
    warnings = []
    health = ToolHealth(warnings.append, warn_after=3, stop_after=4)
    for _ in range(3):
        health.record("calc", "error", "error: ValueError: no operator")
        health.record("calc", "ok", "6")
        health.record("search", "crashed", "error: the tool's process died")
    assert len(warnings) == 1 and "'search'" in warnings[0]
    with pytest.raises(ToolsFailing, match="'search'"):
        health.record("search", "crashed", "")
    health.record("calc", "error", "error")  # calc: one failure since its last success
    health.record("calc", "error", "error")
    health.record("calc", "error", "error")
    assert "calc" in warnings[-1] and "none has succeeded" not in warnings[-1]  # it did succeed before


def _step(reward: float, spread: float = 0.0, distinct: int = 64) -> dict:
    return {"reward": reward, "reward_spread": spread, "responses_distinct": distinct}


def test_a_constant_reward_over_varying_responses_warns_once():
    warnings = []
    watch = ConstantReward(warnings.append, steps=3)
    for step, metrics in enumerate([_step(0.0), _step(0.0), _step(0.5, spread=1.0), _step(0.0), _step(0.0)], 1):
        watch.record(step, metrics)
    assert warnings == []  # a step with varying rewards broke the row
    watch.record(6, _step(0.0))
    watch.record(7, _step(0.0))
    assert len(warnings) == 1 and "last 3 steps (to step 6)" in warnings[0] and "0.000" in warnings[0]


def test_a_constant_reward_of_identical_responses_or_changing_values_is_no_warning():
    warnings = []
    watch = ConstantReward(warnings.append, steps=2)
    for step in range(1, 5):
        watch.record(step, _step(1.0, distinct=1))  # one response for all: nothing to tell apart
    for step, value in enumerate([0.0, 1.0, 0.0, 1.0], 5):
        watch.record(step, _step(value))  # every sample equal within a step, but it changes between steps
    watch.record(9, {"reward": 0.0})  # a trainer that does not report the spread: not judged
    assert warnings == []


def test_the_agentic_pipelines_tool_is_found_from_a_relative_path(monkeypatch):
    """The README runs `aspc run pipelines/tiny_agentic.aspl`: the .aspl's folder is relative, and
    the sandbox looks the tool's module up from a scratch folder."""
    from aspc.rl.host import Tools
    from aspc.rl.tool_calls import Call
    from aspc.cli.toolchain import compile_with_passes

    monkeypatch.chdir(ROOT)
    relative = Path("pipelines/tiny_agentic.aspl")
    plan = compile_with_passes(relative, []).plan()
    tools = Tools(plan.stages_of("environment")[0], relative.parent)
    try:
        result = tools.run(Call("calc", "417*63"))
    finally:
        tools.close()
    assert (result.status, result.observation) == ("ok", "26271")


BROKEN_TOOL = '''
def calc(expression):
    raise RuntimeError("the calculator's backend is down")
'''


def test_a_run_whose_tool_fails_every_call_warns_and_stops_with_the_tools_error(aspc, tmp_path):
    (tmp_path / "tiny_tools.py").write_text(BROKEN_TOOL)
    (tmp_path / "p.aspl").write_text(PIPELINE.read_text())
    result = aspc("run", str(tmp_path / "p.aspl"), "--steps", "3", "--warmstart", "100", "--workers", "threads",
                  "--metrics", str(tmp_path / "m.jsonl"))
    assert result.exit_code == 1, result.output
    assert "warning: tool 'calc' failed its last 8 calls" in result.output
    counts = [int(n) for n in re.findall(r"failed its last (\d+) calls", result.output)]
    assert max(counts) >= 64, result.output  # under load, calls in flight on the other instance may fail first
    assert "the calculator's backend is down" in result.output
    assert "Traceback" not in result.output
