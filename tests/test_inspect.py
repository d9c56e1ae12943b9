"""`aspc inspect`, --emit-after, --schedule and -p on the command line."""
import json
import shutil

import pytest


def test_inspect_shows_each_pass_with_its_diff(aspc, tmp_path):
    result = aspc("inspect", "pipelines/tiny_grpo.aspl", "-o", str(tmp_path))
    assert result.exit_code == 0, result.output
    out = result.stdout
    for header in ("== 1. continuous-batching", "== 2. place", "== 3. async-decouple",
                   "== 4. queue-aware-dispatch", "== 5. stream", "== 6. pack"):
        assert header in out
    assert "+stage gen.channel = CHANNEL" in out
    assert "-flow gen -> score : responses" in out
    assert (tmp_path / "tiny_grpo.asp.dot").read_text().startswith('digraph "tiny_grpo"')


def test_inspect_without_graphviz_says_how_to_get_pictures(aspc, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    result = aspc("inspect", "pipelines/tiny_grpo.aspl", "-o", str(tmp_path))
    assert result.exit_code == 0
    assert "Graphviz is not installed" in result.stderr
    assert not (tmp_path / "tiny_grpo.asp.svg").exists()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
def test_inspect_with_graphviz_writes_svg_and_png(aspc, tmp_path):
    result = aspc("inspect", "pipelines/grpo_7b.aspl", "--schedule", "sync", "-o", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "grpo_7b.sync.svg").read_text().lstrip().startswith(("<?xml", "<svg"))
    assert (tmp_path / "grpo_7b.sync.png").read_bytes()[:4] == b"\x89PNG"


def test_emit_after_stops_after_that_pass(aspc):
    out = aspc("compile", "pipelines/tiny_grpo.aspl", "--emit-after", "async-decouple").stdout
    assert "gen.channel = CHANNEL" in out
    assert "gen.dispatch" not in out and "micro_batching:" not in out


def test_emit_after_an_absent_pass_is_an_error(aspc):
    result = aspc("compile", "pipelines/tiny_grpo.aspl", "--schedule", "sync", "--emit-after", "stream")
    assert result.exit_code == 1
    assert "no such pass in the pipeline" in result.stderr


def test_schedule_flag_overrides_the_file(aspc):
    plan = json.loads(aspc("compile", "pipelines/tiny_grpo.aspl", "--schedule", "sync-naive",
                           "--emit", "plan").stdout)
    assert plan["schedule"] == "sync-naive" and plan["passes"] == "place" and plan["channels"] == []
    assert plan["stages"][0]["batching"] == "static"


def test_failing_pass_is_named_with_the_passes_before_it(aspc):
    result = aspc("compile", "pipelines/tiny_grpo.aspl", "-p", "continuous-batching,place,stream{micro=3}")
    assert result.exit_code == 1
    assert "pass 'stream' failed" in result.stderr
    assert "passes before it: continuous-batching, place" in result.stderr


def test_declared_pass_order_is_checked_before_any_pass_runs(aspc):
    result = aspc("compile", "pipelines/tiny_grpo.aspl", "-p", "continuous-batching,stream,place,pack,"
                  "partial-rollout,async-decouple")
    assert result.exit_code == 1
    assert "pass 'stream' must run after 'place'" in result.stderr
    assert "pass 'partial-rollout' must run after 'async-decouple'" in result.stderr
    assert "pass 'pack' must run after" not in result.stderr  # pack follows stream here
    assert "failed" not in result.stderr
    every_schedule = [aspc("compile", "pipelines/grpo_7b.aspl", "--schedule", s) for s in ("asp", "sync", "sync-naive")]
    assert all(r.exit_code == 0 for r in every_schedule)


def test_plan_without_place_is_a_clear_error(aspc):
    result = aspc("compile", "pipelines/tiny_grpo.aspl", "-p", "continuous-batching", "--emit", "plan")
    assert result.exit_code == 1
    assert "needs the `place` pass" in result.stderr


def test_verify_flag_verifies_the_ir_after_every_pass(aspc, monkeypatch):
    from aspc.passes import manager
    from aspc.cli.toolchain import compile_with_passes

    checked, real = [], manager.verify
    monkeypatch.setattr(manager, "verify", lambda graph: (checked.append(graph), real(graph))[1])
    assert aspc("compile", "pipelines/dapo_32b.aspl", "--emit", "plan").exit_code == 0
    assert checked == [], "without --verify the verifier does not run"
    assert aspc("compile", "pipelines/dapo_32b.aspl", "--verify", "--emit", "plan").exit_code == 0
    steps = compile_with_passes("pipelines/dapo_32b.aspl", verify_each=False).run.steps
    assert len(steps) >= 3 and checked == [step.after for step in steps]


def test_verify_flag_catches_a_pass_that_breaks_the_ir(aspc, monkeypatch):
    from aspc.ir.graph import Flow
    from aspc.passes.continuous_batching import ContinuousBatching

    real = ContinuousBatching.apply
    monkeypatch.setattr(ContinuousBatching, "apply",
                        lambda self, graph: real(self, graph).with_flow(Flow("score", "update", ("advantages",))))
    result = aspc("compile", "pipelines/tiny_grpo.aspl", "--verify", "--emit", "ir")
    assert result.exit_code == 1
    assert "pass 'continuous-batching' broke an IR invariant (a compiler bug)" in result.stderr
    assert "carries ['advantages']" in result.stderr


def test_staleness_zero_is_on_policy_in_the_plan(aspc):
    plan = json.loads(aspc("compile", "pipelines/tiny_grpo.aspl", "--set", "schedule.staleness=0",
                           "--emit", "plan").stdout)
    assert plan["staleness"] == 0
    assert plan["channels"][0]["capacity"] == plan["channels"][0]["samples_per_step"]
    assert plan["weight_syncs"][0]["staleness"] == 0


def test_passes_doc_covers_every_pass_and_option():
    import dataclasses

    from aspc.passes.registry import PASSES
    from conftest import ROOT

    doc = (ROOT / "docs" / "passes.md").read_text()
    for name, cls in PASSES.items():
        assert f"### `{name}" in doc
        for field in dataclasses.fields(cls):
            assert f"`{field.name}`" in doc, f"docs/passes.md lacks option {field.name} of {name}"


def test_the_pipelines_printed_in_the_passes_doc_compile_and_keep_the_streaming_rule(aspc):
    """Every `-p '...'` command in docs/passes.md compiles with --verify, and no stage that
    time-shares its devices with generation is streamed (the rule of `stream`)."""
    import re

    from conftest import ROOT

    doc = (ROOT / "docs" / "passes.md").read_text()
    commands = re.findall(r"^aspc compile (\S+) -p '([^']*)'$", doc, re.MULTILINE)
    assert commands
    for source, pipeline in commands:
        result = aspc("compile", source, "-p", pipeline, "--verify", "--emit", "json")
        assert result.exit_code == 0, result.output
        for line in aspc("compile", source, "-p", pipeline).stdout.splitlines():
            if "placement: time_shared" in line and "GENERATE" not in line:
                assert "streaming:" not in line, f"{pipeline}: {line}"
    shown = [line for line in doc.splitlines() if line.startswith("stage ") and "streaming:" in line]
    assert shown and all("placement: time_shared" not in line for line in shown)

