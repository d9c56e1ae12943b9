"""Automatic placement: `placement = auto` (the auto-place pass), `aspc tune` and
`aspc simulate --compare --best-layout` on a small pipeline of 8 NPUs."""
from pathlib import Path

import pytest
from click.testing import CliRunner

from aspc.cli.backends import simulator_pricing
from aspc.cli.main import main
from aspc.cli.tune import CONFIRM_STEPS
from aspc.drivers.sim.result import simulate
from aspc.frontend.compiler import compile_file, compile_source
from aspc.ir.graph import LayoutChoice, Parallel, StageKind
from aspc.ir.memory import USABLE_HBM_FRACTION, training_need
from aspc.ir.printer import print_ir
from aspc.passes.auto_place import search
from aspc.passes.layout_space import candidates, roles_of
from aspc.plan.toolchain import compile_with_passes, run_schedule

SMALL = """\
pipeline small
pool rollout = 910b3 x 4
pool learner = 910b3 x 4
model actor = qwen2.5-7b { dtype = bf16 }
data prompts = synthetic("arith") {
  prompts_per_step = 16, group = 4, max_prompt = 256, max_response = 1k
  response_lengths = lognormal(mean = 300, sigma = 0.8, group_corr = 0.5)
}
stage gen    = generate(actor, prompts) on rollout { instances = 2, tp = 2 }
stage score  = reward(gen, rule = "exact_match")
stage adv    = advantage(score) { estimator = grpo }
stage update = train(actor, gen, adv) on learner { TRAIN_SHAPE, micro_tokens = 4k }
schedule asp { placement = auto, staleness = 1, stream = 16 }
"""
TOLERANCE = 0.15  # the cost model's figure against the simulator's (bench/RESULTS.md: within 4% here)


def write(tmp_path: Path, text: str = SMALL, train: str = "tp = 4") -> Path:
    path = tmp_path / "small.aspl"
    path.write_text(text.replace("TRAIN_SHAPE", train), encoding="utf-8")
    return path


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def layout_of(graph) -> dict:
    pools = {name: p.count for name, p in graph.pools.items()}
    stages = {s.name: (s.pool, s.instances, s.parallel) for s in graph.stages() if s.pool is not None}
    return {"pools": pools, "stages": stages}


def test_auto_place_applies_the_best_predicted_layout_and_records_why(tmp_path):
    path = write(tmp_path)
    compiled = compile_with_passes(path)
    assert compiled.passes.startswith("auto-place,")
    [gen] = compiled.graph.stages_of(StageKind.GENERATE)
    choice = gen.layout
    assert isinstance(choice, LayoutChoice)
    ranked = search(compile_file(path).graph, "asp")
    assert choice.chosen == ranked[0].layout.describe()
    assert choice.predicted_tps == round(ranked[0].estimate.tps, 1) >= choice.written_tps > 0
    assert len(choice.runners_up) == min(3, len(ranked) - 1)
    assert "bound" in choice.why and "pinned: gen.tp, update.tp" in choice.why
    assert sum(p.count for p in compiled.graph.pools.values()) == 8  # the devices are the program's
    assert "layout: auto " in print_ir(compiled.graph)


def test_written_parallel_degrees_are_constraints(tmp_path):
    graph = compile_file(write(tmp_path, train="tp = 4, pp = 1")).graph
    found = candidates(graph, roles_of(graph))
    assert found
    for candidate in found:
        update, gen = candidate.layout.stage("update"), candidate.layout.stage("gen")
        assert (update.parallel.tp, update.parallel.pp, gen.parallel.tp) == (4, 1, 2)


def test_unwritten_degrees_are_searched_and_every_candidate_fits_memory(tmp_path):
    """tp = 1 cannot hold a 7B model's training state: without `placement = auto` the front end
    refuses it; with it the degree is the search's, and only fitting layouts are tried."""
    path = write(tmp_path, train="recompute = false")
    graph = compile_file(path).graph
    found = candidates(graph, roles_of(graph))
    assert {c.layout.stage("update").parallel.tp for c in found} > {4}
    arch, hbm = graph.models["actor"].arch, graph.pools["learner"].hardware.hbm_bytes
    needs = [training_need(arch, "bf16", c.layout.stage("update").parallel, True).total for c in found]
    assert max(needs) <= USABLE_HBM_FRACTION * hbm
    assert training_need(arch, "bf16", Parallel(), True).total > hbm  # one device alone cannot hold it
    tuned = compile_source(cli("tune", str(path), "--confirm", "0").stdout, "tuned.aspl", None, tmp_path)
    assert tuned.graph.schedule.option("placement") is None  # checked at its layout by the front end's rules
    fixed = path.read_text().replace("placement = auto, ", "")
    result = cli("check", str(write(tmp_path, fixed, "recompute = false")))
    assert result.exit_code == 1 and "needs" in result.stderr and "per device" in result.stderr


def test_tuned_source_is_the_pass_layout_and_simulates_to_its_figure(tmp_path):
    path = write(tmp_path)
    out = tmp_path / "tuned.aspl"
    result = cli("tune", str(path), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "chosen" in result.stderr and "written" in result.stderr
    tuned = compile_file(out)
    assert tuned.graph.schedule.option("placement") is None  # the layout is written now
    plan = run_schedule(tuned, "asp").plan()
    simulated = simulate(plan, CONFIRM_STEPS, simulator_pricing(plan))
    assert f"simulated {simulated.e2e_tps:7.1f}" in result.stderr  # the figure tune printed
    best = search(compile_file(path).graph, "asp")[0]
    assert layout_of(run_schedule(tuned, "asp").graph) == layout_of(compile_with_passes(path).graph)
    assert simulated.e2e_tps == pytest.approx(best.estimate.tps, rel=TOLERANCE)


def test_every_schedule_gets_its_own_layout(tmp_path):
    path = write(tmp_path)
    for schedule in ("sync", "sync-naive"):
        compiled = compile_with_passes(path, schedule=schedule)
        assert compiled.passes.startswith("auto-place,")
        best = search(compile_file(path).graph, schedule)[0]
        assert compiled.graph.stage("gen").layout.chosen == best.layout.describe()


def test_compare_best_layout_simulates_each_schedule_at_its_best_layout(tmp_path):
    path = write(tmp_path, SMALL.replace("placement = auto, ", ""))
    result = cli("simulate", str(path), "--compare", "--best-layout", "--steps", "3")
    assert result.exit_code == 0, result.output
    for schedule in ("sync-naive", "sync", "asp"):
        assert f"{schedule}: best layout " in result.stderr
        assert f"| {schedule} |" in result.stdout
    assert cli("simulate", str(path), "--best-layout").exit_code == 2  # needs --compare


def test_a_program_outside_the_search_space_is_refused_at_the_schedule(tmp_path):
    text = SMALL.replace('stage score', 'stage gen2   = generate(actor, prompts) on rollout { tp = 2 }\nstage score')
    result = cli("compile", str(write(tmp_path, text)))
    assert result.exit_code == 1
    assert "pass 'auto-place' failed: automatic placement handles one generate" in result.stderr
    assert "small.aspl:14:" in result.stderr  # the schedule block's line
    assert "Traceback" not in result.output


def test_tune_tries_staleness_only_within_the_bound_given(tmp_path):
    path, out = write(tmp_path), tmp_path / "tuned.aspl"
    result = cli("tune", str(path), "-o", str(out), "--confirm", "1", "--steps", "3", "--max-staleness", "2")
    assert result.exit_code == 0, result.output
    assert "(staleness 1)" in result.stderr and "(staleness 2)" in result.stderr
    assert "(staleness 3)" not in result.stderr
    assert compile_file(out).graph.schedule.option("staleness") in (1, 2)
    assert cli("tune", str(path), "--max-staleness", "0").exit_code == 2  # below the file's
