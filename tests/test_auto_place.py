"""Automatic placement: `placement = auto` (the auto-place pass), `aspc tune` and
`aspc simulate --compare --best-layout` on a small pipeline of 8 NPUs."""
import re
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
from aspc.passes.layout_search import search
from aspc.ir.layout_space import candidates, roles_of, unpinned
from aspc.cli.toolchain import compile_with_passes, run_schedule

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
    """With the written degrees pinned, tune's choice is auto-place's (the search's best, confirmed)."""
    path = write(tmp_path)
    out = tmp_path / "tuned.aspl"
    result = cli("tune", str(path), "-o", str(out), "--pin", "tp")
    assert result.exit_code == 0, result.output
    assert "chosen" in result.stderr and "written" in result.stderr
    tuned = compile_file(out)
    assert tuned.graph.schedule.option("placement") is None  # the layout is written now
    plan = run_schedule(tuned, "asp").plan()
    chosen = next(line for line in result.stderr.splitlines() if line.strip().startswith("chosen"))
    steps = int(re.search(r"over +(\d+) steps", chosen).group(1))
    assert steps in (CONFIRM_STEPS, 2 * CONFIRM_STEPS, 4 * CONFIRM_STEPS)
    simulated = simulate(plan, steps, simulator_pricing(plan))
    assert f"simulated {simulated.e2e_tps:7.1f} over {steps:2} steps" in chosen  # the figure tune printed
    best = search(compile_file(path).graph, "asp")[0]
    assert layout_of(run_schedule(tuned, "asp").graph) == layout_of(compile_with_passes(path).graph)
    assert simulated.e2e_tps == pytest.approx(best.estimate.tps, rel=TOLERANCE)


def test_tune_searches_the_written_degrees_of_generation_and_training_unless_pinned(tmp_path):
    """auto-place keeps what a file writes; `aspc tune` starts from it and searches the generate and
    train stages' tp/pp/ep (the written layout is still confirmed beside the chosen one), but a --pin."""
    graph = compile_file(write(tmp_path)).graph  # gen tp = 2, update tp = 4 written

    def tried(pins=()):
        free = unpinned(graph, pins)
        found = candidates(free, roles_of(free))
        return ({c.layout.stage("gen").parallel.tp for c in found},
                {c.layout.stage("update").parallel.tp for c in found})

    gen_tp, train_tp = tried()
    assert gen_tp > {2} and train_tp > {4}
    assert tried(["gen.tp"])[0] == {2} and tried(["gen.tp"])[1] > {4}
    assert tried(["tp"]) == ({2}, {4})
    assert graph.stage("gen").option_span("tp") is not None  # the file's graph is left as it was
    result = cli("tune", str(write(tmp_path)), "--confirm", "0", "--pin", "gen.dp")
    assert result.exit_code == 2 and "no degree gen.dp to pin" in result.output and "gen.tp" in result.output


def test_tune_confirms_the_leaders_at_twice_the_steps_until_the_best_holds(monkeypatch):
    """The leaders are simulated again at 12, then 24 steps; the best at the longest length decides,
    and the report says whether it held."""
    from aspc.cli import tune as tuning

    def figures(by_steps):
        def simulated(tried, schedule, steps, base_dir, progress):
            tried.simulated_tps, tried.efficiency, tried.result, tried.steps = by_steps[tried.text][steps], 0.5, \
                object(), steps
        return simulated

    def confirmed(by_steps):
        monkeypatch.setattr(tuning, "_simulate", figures(by_steps))
        candidates = [tuning.Tried(None, name) for name in by_steps]
        stable = tuning._confirm(candidates, "asp", 6, None, None)
        return stable, {t.text: t.steps for t in candidates}, max(candidates, key=lambda t: t.simulated_tps).text

    # "b" leads at 6 steps; "a" overtakes at 12 and stays ahead at 24; "c" is no leader (over 5% behind)
    stable, steps, best = confirmed({"a": {6: 99.0, 12: 110.0, 24: 111.0}, "b": {6: 100.0, 12: 105.0, 24: 106.0},
                                     "c": {6: 80.0}})
    assert (stable, steps, best) == ((12, 24), {"a": 24, "b": 24, "c": 6}, "a")
    stable, _, best = confirmed({"a": {6: 100.0, 12: 101.0}, "b": {6: 90.0, 12: 100.0}})
    assert (stable, best) == ((6, 12), "a")
    stable, _, best = confirmed({"a": {6: 100.0, 12: 99.0, 24: 101.0}, "b": {6: 99.0, 12: 100.0, 24: 100.0}})
    assert (stable, best) == (None, "a")  # still changing at 24 steps: the longest run decides


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


def test_best_layout_gives_sync_its_fastest_mini_batching_at_its_layout(tmp_path):
    """The sync plan --compare --best-layout hands on has mini_batches written: the fastest of 1 and 2
    (asp's staleness 1 + 1) at its layout."""
    from aspc.cli.mini_batching import with_mini_batches
    from aspc.cli.tune import best_layout_plans

    path = write(tmp_path, SMALL.replace("placement = auto, ", ""))
    sync = best_layout_plans(str(path), [], ["sync"], confirm=2, steps=3)[0]
    chosen = dict(sync.stages_of("train")[0].options)["mini_batches"]
    tps = {m: simulate(with_mini_batches(sync, m), 3, simulator_pricing(sync)).e2e_tps for m in (1, 2)}
    assert tps[chosen] == max(tps.values())


def test_tune_for_sync_writes_its_fastest_mini_batching_within_the_staleness_allowed(tmp_path):
    """`aspc tune --schedule sync` on a file whose asp allows staleness 1 tries mini_batches 1 and 2 at
    each confirmed layout and writes the faster (1: left unwritten); a file written sync is tuned
    on-policy unless --max-staleness allows more."""
    from aspc.cli.mini_batching import with_mini_batches

    path, out = write(tmp_path, SMALL.replace("placement = auto, ", "")), tmp_path / "tuned.aspl"
    result = cli("tune", str(path), "--schedule", "sync", "--confirm", "2", "--steps", "3", "-o", str(out))
    assert result.exit_code == 0, result.output
    plan = run_schedule(compile_file(out), "sync").plan()
    chosen = dict(plan.stages_of("train")[0].options).get("mini_batches", 1)
    steps = int(re.search(r"over +(\d+) steps", result.stderr).group(1))
    tps = {m: simulate(with_mini_batches(plan, m), steps, simulator_pricing(plan)).e2e_tps for m in (1, 2)}
    assert tps[chosen] == max(tps.values())
    assert ("mini-batching: mini_batches = 2" in result.stderr) == (chosen == 2)
    on_policy = write(tmp_path, SMALL.replace("schedule asp { placement = auto, staleness = 1, stream = 16 }",
                                              "schedule sync"))
    result = cli("tune", str(on_policy), "--confirm", "1", "--steps", "3")
    assert result.exit_code == 0, result.output
    assert "mini-batching" not in result.stderr and "mini_batches" not in result.stdout


def test_a_program_outside_the_search_space_is_refused_at_check(tmp_path):
    text = SMALL.replace('stage score', 'stage gen2   = generate(actor, prompts) on rollout { tp = 2 }\nstage score')
    result = cli("check", str(write(tmp_path, text)))
    assert result.exit_code == 1
    assert "automatic placement handles one generate" in result.stderr
    assert "small.aspl:10:" in result.stderr  # the second generate stage
    assert "Traceback" not in result.output


def test_check_refuses_a_program_no_layout_fits(tmp_path):
    """2 devices cannot hold a 7B model's training state at the pinned tp = 1: check says so, at the
    schedule, as compile would (the front end leaves these pools' fit to the search); 4 can."""
    text = SMALL.replace("910b3 x 4", "910b3 x 1")
    result = cli("check", str(write(tmp_path, text, "tp = 1")))
    assert result.exit_code == 1
    assert "small.aspl:13:" in result.stderr and "no layout of the pools fits" in result.stderr
    assert "tp = 1 is pinned here" in result.stderr
    roomier = SMALL.replace("910b3 x 4", "910b3 x 2")  # 4 devices: tp 1 x dp 4 shards the optimizer enough
    assert cli("check", str(write(tmp_path, roomier, "tp = 1"))).exit_code == 0


KNOBS = SMALL.replace("staleness = 1, stream = 16", "max_staleness = 2, max_pack = 8k, max_buckets = 4, stream = 16")
KNOB_TRAIN = "tp = 4"  # micro_tokens unwritten: `pack` is the search's


def knobs_program(tmp_path: Path) -> Path:
    return write(tmp_path, KNOBS.replace(", micro_tokens = 4k", ""), KNOB_TRAIN)


def test_schedule_settings_are_searched_within_their_bounds_and_applied(tmp_path):
    path = knobs_program(tmp_path)
    ranked = search(compile_file(path).graph)
    best = ranked[0].knobs
    assert best.staleness in (0, 1, 2) and best.pack in (2048, 4096, 8192) and best.buckets in (1, 2, 3, 4)
    compiled = compile_with_passes(path)
    assert f"async-decouple{{staleness={best.staleness}}}" in compiled.passes
    assert f"pack{{tokens={best.pack},buckets={best.buckets}}}" in compiled.passes
    [channel] = compiled.graph.stages_of(StageKind.CHANNEL)
    assert channel.channel.staleness == best.staleness
    shape = compiled.graph.stage("update").micro_batching
    assert shape.tokens == best.pack and 1 <= len(shape.buckets) <= best.buckets
    choice = compiled.graph.stage("gen").layout
    assert choice.chosen == ranked[0].describe() and f"staleness={best.staleness}" in choice.chosen
    assert "searched staleness 0..2, pack 2048..8192, buckets 1..4" in choice.why
    assert choice.runners_up and all(" ".join(r.split()[:-1]) != choice.chosen for r in choice.runners_up)
    assert f"staleness={best.staleness}" in print_ir(compiled.graph)


def test_the_simplest_setting_within_half_a_percent_wins(tmp_path):
    ranked = search(compile_file(knobs_program(tmp_path)).graph)
    top = max(r.estimate.tps for r in ranked)
    chosen = ranked[0]
    assert chosen.estimate.tps >= 0.995 * top
    simpler = [r for r in ranked if r.layout == chosen.layout and r.estimate.tps >= 0.995 * top
               and (r.staleness, r.packing[1]) < (chosen.staleness, chosen.packing[1])]
    assert not simpler


def test_tune_writes_the_chosen_settings_in_place_of_their_bounds(tmp_path):
    path = knobs_program(tmp_path)
    result = cli("tune", str(path), "--confirm", "0", "--pin", "tp")  # the written tp, as auto-place keeps it
    assert result.exit_code == 0, result.output
    best = search(compile_file(path).graph)[0].knobs
    lines = result.stdout.splitlines()
    schedule = next(line for line in lines if line.startswith("schedule"))
    assert f"staleness = {best.staleness}" in schedule and f"buckets = {best.buckets}" in schedule
    assert "max_" not in schedule and "placement" not in schedule
    assert f"micro_tokens = {best.pack}" in next(line for line in lines if line.startswith("stage update"))
    tuned = run_schedule(compile_source(result.stdout, "tuned.aspl", None, tmp_path), "asp").graph
    auto = compile_with_passes(path).graph
    assert layout_of(tuned) == layout_of(auto)
    assert tuned.stage("update").micro_batching == auto.stage("update").micro_batching
    assert tuned.stage("gen.channel").channel == auto.stage("gen.channel").channel


@pytest.mark.parametrize("edit, message", [
    (("max_staleness = 2,", "max_staleness = 2, staleness = 1,"), "but `staleness` is written"),
    (("max_buckets = 4,", "max_buckets = 4, buckets = 2,"), "but `buckets` is written"),
    (("max_pack = 8k,", "max_pack = 1k,"), "max_pack = 1024 cannot hold one sequence"),
    (("placement = auto, ", ""), "max_staleness bounds the automatic placement's search"),
])
def test_a_search_bound_beside_a_pin_or_without_auto_is_refused(tmp_path, edit, message):
    result = cli("check", str(write(tmp_path, KNOBS.replace(*edit), KNOB_TRAIN)))
    assert result.exit_code == 1 and message in result.stderr and "small.aspl:13:" in result.stderr


def test_a_written_micro_tokens_pins_pack(tmp_path):
    result = cli("check", str(write(tmp_path, KNOBS, KNOB_TRAIN)))  # KNOBS keeps micro_tokens = 4k
    assert result.exit_code == 1 and "but `micro_tokens` is written" in result.stderr
def test_tune_tries_staleness_only_within_the_bound_given(tmp_path):
    path, out = write(tmp_path), tmp_path / "tuned.aspl"
    result = cli("tune", str(path), "-o", str(out), "--confirm", "2", "--steps", "3", "--max-staleness", "2")
    assert result.exit_code == 0, result.output
    assert "staleness=1" in result.stderr or "staleness=2" in result.stderr
    assert "staleness=0" not in result.stderr and "staleness=3" not in result.stderr
    assert compile_file(out).graph.schedule.option("staleness") in (1, 2)
    assert cli("tune", str(path), "--max-staleness", "0").exit_code == 2  # below the file's


def test_sync_is_compared_at_its_own_micro_batch_budget(tmp_path):
    path = knobs_program(tmp_path)
    best = search(compile_file(path).graph, "sync")[0].knobs
    assert best.pack in (2048, 4096, 8192) and best.staleness is None and best.buckets is None
    compiled = compile_with_passes(path, schedule="sync")
    assert compiled.graph.stage("update").micro_batching.tokens == best.pack
    assert compiled.graph.stage("update").micro_batching.buckets == ()  # sync keeps dynamic shapes
