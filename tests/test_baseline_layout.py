"""The fair baseline: a program colocated on all its devices (aspc/frontend/layouts.py) and the
sync@colocated row of `aspc simulate --compare` (issue 15, item 7)."""
import pytest

from conftest import ROOT

from aspc.drivers.sim.report import COLOCATED_SYNC
from aspc.frontend import layouts
from aspc.frontend.compiler import compile_file, compile_source
from aspc.frontend.formatter import format_program
from aspc.frontend.layouts import BASELINE_SOURCE, BaselineUnavailable, colocate, compile_baseline, sync_baseline
from aspc.frontend.parser import parse
from aspc.ir.graph import StageKind

GRPO_7B = ROOT / "pipelines" / "grpo_7b.aspl"


def _written(tmp_path, text: str):
    """`text` as a file in tmp_path, its data file named by absolute path."""
    path = tmp_path / "p.aspl"
    path.write_text(text.replace('"data/math.jsonl"', f'"{ROOT}/pipelines/data/math.jsonl"'))
    return path


def _mixed_hardware(tmp_path):
    return _written(tmp_path, GRPO_7B.read_text().replace("pool learner = 910b3 x 8", "pool learner = 910b2 x 8"))


def _line_of(path, text: str) -> int:
    return path.read_text().splitlines().index(text) + 1


def _baseline(path=GRPO_7B):
    return compile_baseline(compile_file(path), path.parent)


def test_grpo_7b_baseline_time_shares_all_16_devices_in_one_pool():
    derived = _baseline()
    graph = derived.graph
    assert list(graph.pools) == ["all"] and graph.pools["all"].count == 16
    assert graph.schedule.kind == "sync"
    gen, ref, train = (graph.stage(n) for n in ("gen", "ref_lp", "update"))
    assert (gen.pool, gen.instances, gen.parallel.tp) == ("all", 4, 4)
    assert (ref.parallel.tp, ref.parallel.dp) == (4, 4) and (train.parallel.tp, train.parallel.dp) == (4, 4)
    assert gen.devices == train.devices == ref.devices == 16  # generation and training on the same devices


def test_the_passes_place_the_baseline_time_shared():
    from aspc.cli.toolchain import run_schedule

    placed = run_schedule(_baseline(), "sync").graph
    kinds = {s.name: s.placement.kind for s in placed.stages() if s.kind in (StageKind.GENERATE, StageKind.TRAIN)}
    assert kinds == {"gen": "time_shared", "update": "time_shared"}


def test_the_derived_program_round_trips_through_the_formatter():
    compilation = compile_file(GRPO_7B)
    program = sync_baseline(compilation.program, compilation.graph)
    text = format_program(program)
    assert "pool all = 910b3 x 16" in text and "schedule sync" in text
    assert "stage gen = generate(actor, prompts) on all { instances = 4, tp = 4" in text
    assert parse(text, BASELINE_SOURCE).decls == program.decls
    assert format_program(parse(text, BASELINE_SOURCE)) == text


def test_the_layout_keeps_the_schedule_and_respreads_moe_and_3d_layouts():
    for name, gen_instances, train_dp in (("grpo_30b_moe", 8, 16), ("dapo_32b", 16, 2)):
        compilation = compile_file(ROOT / "pipelines" / f"{name}.aspl")
        text = format_program(colocate(compilation.program, compilation.graph))
        graph = compile_source(text, BASELINE_SOURCE, None, ROOT / "pipelines").graph
        assert graph.schedule.kind == "asp"
        assert graph.stage("gen").instances == gen_instances and graph.stage("update").parallel.dp == train_dp


def test_a_single_pool_program_keeps_its_pool_and_layout():
    derived = _baseline(ROOT / "pipelines" / "r1_zero_671b.aspl")
    assert list(derived.graph.pools) == ["npu"]
    assert derived.graph.stage("gen").instances == 6 and derived.graph.stage("update").parallel.dp == 16


def test_pools_of_different_hardware_are_refused_at_the_pool(tmp_path):
    path = _mixed_hardware(tmp_path)
    with pytest.raises(BaselineUnavailable) as caught:
        _baseline(path)
    (error,) = caught.value.diagnostics
    assert "cannot colocate on all devices: pool 'learner' is 910b2, pool 'rollout' is 910b3" in error.message
    assert (error.span.file, error.span.line) == (str(path), _line_of(path, "pool learner = 910b2 x 8"))
    assert error.notes and error.notes[0][0].line == _line_of(path, "pool rollout = 910b3 x 8")


def test_a_layout_that_fails_the_checks_is_unavailable_not_a_crash(monkeypatch):
    monkeypatch.setattr(layouts, "_data_parallel", lambda stage, devices: 64)  # 4 x 64 devices > 16
    with pytest.raises(BaselineUnavailable) as caught:
        _baseline()
    assert any("needs 256 devices" in d.message and d.span.file == BASELINE_SOURCE
               for d in caught.value.diagnostics)
    assert BASELINE_SOURCE in caught.value.sources


def test_compare_prints_the_colocated_row_and_speedups_against_it(aspc):
    result = aspc("simulate", "pipelines/grpo_7b.aspl", "--compare", "--steps", "2")
    assert result.exit_code == 0, result.output
    assert f"| vs sync | vs {COLOCATED_SYNC} | vs sync-naive |" in result.stdout
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0][2:] for r in rows[1:]] == ["sync-naive", "sync", COLOCATED_SYNC, "asp"]
    assert f"  {COLOCATED_SYNC}  all 16 dev" in result.stdout


def test_compare_says_why_the_baseline_is_missing(aspc, tmp_path):
    path = _mixed_hardware(tmp_path)
    result = aspc("simulate", str(path), "--compare", "--steps", "1")
    assert result.exit_code == 0, result.output
    assert f"| {COLOCATED_SYNC} |" not in result.stdout
    line = _line_of(path, "pool learner = 910b2 x 8")
    assert f"{COLOCATED_SYNC}: not available: {path}:{line}:16: cannot colocate on all devices" in result.stdout
    shown = aspc("simulate", str(path), "--show-baseline")
    assert shown.exit_code == 1 and f"{line} | pool learner = 910b2 x 8" in shown.output
    assert "Traceback" not in shown.output


def test_show_baseline_prints_the_program_that_compiles(aspc, tmp_path):
    result = aspc("simulate", "pipelines/grpo_7b.aspl", "--show-baseline")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("pipeline grpo_7b\npool all = 910b3 x 16\n")
    saved = _written(tmp_path, result.stdout)
    assert aspc("check", str(saved)).exit_code == 0, aspc("check", str(saved)).output


def test_simulated_colocated_sync_on_grpo_7b_completes():
    from aspc.backends.sim.pricing import RooflinePricing
    from aspc.drivers.sim.result import simulate
    from aspc.cli.toolchain import run_schedule

    plan = run_schedule(_baseline(), "sync").plan()
    result = simulate(plan, 2, RooflinePricing(plan))
    assert result.steps == 2 and result.devices == 16 and result.e2e_tps > 0
    assert list(result.pools) == ["all"] and result.staleness == {0: 2 * 256}
