"""`aspc tune FILE` and `aspc simulate --compare --best-layout`: the automatic placement's choice,
confirmed on the simulator and written back as .aspl source.

The search (passes/auto_place.py) ranks every layout with the closed-form cost model; here the
best few are simulated for a few steps and the best simulated one is kept, so the written file
simulates to the figure printed. The layout goes back into the user's program through the front
end's AST (aspc/frontend/layouts.py) and the formatter, and is checked like any file.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import click

from aspc.cli.output import write_output
from aspc.controller.config import UnsupportedPlan
from aspc.controller.dynamic_sampling import OversampleBoundReached
from aspc.frontend import ast
from aspc.frontend.compiler import Compilation, compile_file, compile_source
from aspc.frontend.diagnostics import AsplError, render_all
from aspc.frontend.formatter import format_program
from aspc.frontend.layouts import apply_layout
from aspc.frontend.parser import parse
from aspc.frontend.relocate import modules_left_behind, relocate
from aspc.frontend.schema import SEARCH_BOUNDS
from aspc.ir.layout import Knobs
from aspc.ir.layout_space import pin_names, unpinned
from aspc.passes.layout_search import Ranked, search, written_ranked
from aspc.passes.base import PassError
from aspc.passes.knob_space import knob_space
from aspc.passes.schedules import SCHEDULES, schedule_for
from aspc.cli.toolchain import run_schedule

TUNED_SOURCE = "<tuned>"
CONFIRM_STEPS = 6  # simulated steps per confirmed candidate at first (docs/passes.md, "aspc tune")
LONGEST_CONFIRM = 4  # the leaders are simulated again at twice the steps, up to this many times CONFIRM_STEPS
LEADERS_WITHIN = 0.05  # a candidate this close to the best simulated one is a leader (at least two are)


@dataclass
class Tried:
    ranked: Ranked
    text: str
    simulated_tps: float | None = None
    efficiency: float | None = None
    result: object | None = None  # SimResult
    steps: int = 0  # simulated over this many steps


@dataclass
class Tuning:
    schedule: str
    tried: list[Tried]  # the confirmed candidates, best simulated first
    written: Tried | None  # None: the written layout does not fit device memory
    search_s: float
    confirm_s: float
    stable_steps: tuple[int, int] | None = None  # the best stayed the best from the first to the second

    @property
    def longest(self) -> int:
        """The most steps a confirmed candidate was simulated over."""
        return max(t.steps for t in self.tried)

    @property
    def best(self) -> Tried:
        return self.tried[0]


def tune(compilation: Compilation, schedule: str, confirm: int, steps: int, base_dir: Path | None,
         progress=None, staleness: tuple[int, ...] | None = None, pins: tuple[str, ...] = ()) -> Tuning:
    """Search the layouts (and the schedule settings the program bounds) of `compilation` under
    `schedule`, simulate the `confirm` best and the written one for `steps` steps, best simulated
    first (the written layout first if it simulates best). `staleness`: the values to try instead of
    the program's; the generate and train stages' tp/pp/ep are searched, written or not, but `pins`."""
    graph = compilation.graph
    started = time.perf_counter()
    free = unpinned(graph, pins)
    ranked = search(free, schedule, knob_space(free, schedule, staleness))
    search_s = time.perf_counter() - started
    chosen = _distinct(ranked, confirm)
    tried = [Tried(r, tuned_text(compilation.program, r, schedule)) for r in chosen]
    ranked_written = written_ranked(graph, schedule, knob_space(graph, schedule, staleness))
    written = None
    if ranked_written is not None:
        written = Tried(ranked_written, tuned_text(compilation.program, ranked_written, schedule))
    stable = _confirm([*tried, *([written] if written else [])], schedule, steps, base_dir, progress)
    tried.sort(key=lambda t: -t.simulated_tps)
    if written is not None and written.simulated_tps > tried[0].simulated_tps:
        tried.insert(0, written)  # the search's figures were off here: the written layout stays
    return Tuning(schedule, tried, written, search_s, time.perf_counter() - started - search_s, stable)


def _confirm(candidates: list[Tried], schedule: str, steps: int, base_dir: Path | None,
             progress) -> tuple[int, int] | None:
    """Simulate every candidate for `steps`, then the leaders (within LEADERS_WITHIN of the best, at
    least two) again at twice the steps, until the best is the same at two lengths in a row: a short
    run understates the settings that overlap more (asp fills its pipeline for `staleness` steps
    first). -> (steps, twice that) where the best held; None if it still changed at LONGEST_CONFIRM
    times `steps` (the last length decides)."""
    for t in candidates:
        _simulate(t, schedule, steps, base_dir, progress)
    length = steps
    while len(candidates) > 1 and 2 * length <= LONGEST_CONFIRM * steps:
        ranked = sorted(candidates, key=lambda t: -t.simulated_tps)
        best = ranked[0]
        leaders = [t for t in ranked if t.simulated_tps >= (1 - LEADERS_WITHIN) * best.simulated_tps]
        leaders = leaders if len(leaders) > 1 else ranked[:2]  # the best is always among them
        for t in leaders:
            _simulate(t, schedule, 2 * length, base_dir, progress)
        if max(leaders, key=lambda t: t.simulated_tps) is best:
            return length, 2 * length
        length *= 2
    return None


def tuned_text(program: ast.Program, ranked: Ranked, schedule: str) -> str:
    """The program at this layout under `schedule` (the file's own block when it is that kind), with
    the schedule settings the search chose written in place of their bounds."""
    written = next((d for d in program.decls if isinstance(d, ast.Schedule)), None)
    block = written if written is not None and written.kind == schedule else ast.Schedule(schedule, ())
    placed = apply_layout(program, ranked.layout, _tuned_schedule(block, ranked.knobs))
    return format_program(_with_micro_tokens(placed, ranked.knobs.pack))


def _tuned_schedule(block: ast.Schedule, knobs: Knobs) -> ast.Schedule:
    """The block without `placement = auto` and the search bounds (the choice is written now), each
    chosen setting but the token budget (the train stage's micro_tokens) in place of its written value
    or added at the end."""
    chosen = {k: v for k, v in knobs.options().items() if k != "pack"}
    dropped = ("placement", *SEARCH_BOUNDS)
    options = [replace(o, value=ast.Int(chosen.pop(o.name))) if o.name in chosen else o
               for o in block.options if o.name not in dropped]
    options += [ast.Option(name, ast.Int(value)) for name, value in chosen.items()]
    return replace(block, options=tuple(options))


def _distinct(ranked: list[Ranked], count: int) -> list[Ranked]:
    """The best `count` with different predictions (near-equal layouts would simulate alike)."""
    out: list[Ranked] = []
    for r in ranked:
        if all(abs(r.estimate.tps - o.estimate.tps) > 1e-3 * o.estimate.tps for o in out):
            out.append(r)
        if len(out) == count:
            break
    return out


def _simulate(tried: Tried, schedule: str, steps: int, base_dir: Path | None, progress) -> None:
    from aspc.cli.backends import simulator_pricing
    from aspc.drivers.sim.result import simulate

    compiled = run_schedule(compile_source(tried.text, TUNED_SOURCE, None, base_dir), schedule)
    plan = compiled.plan()
    result = simulate(plan, steps, simulator_pricing(plan), progress)
    tried.simulated_tps, tried.efficiency, tried.result, tried.steps = result.e2e_tps, result.efficiency, result, steps


def report(tuning: Tuning) -> str:
    """The choice, its predicted and simulated figures, the runners-up and the written layout."""
    lines = [f"schedule {tuning.schedule}: searched in {tuning.search_s:.1f} s, confirmed "
             f"{len(tuning.tried)} on the simulator in {tuning.confirm_s:.1f} s{_stability(tuning)}"]
    written = [("written", tuning.written)] if tuning.written else []
    for label, t in [("chosen", tuning.best), *[("runner-up", t) for t in tuning.tried[1:]], *written]:
        e = t.ranked.estimate
        simulated = f"simulated {t.simulated_tps:7.1f} over {t.steps:2} steps (efficiency {t.efficiency:.1%})" \
            if t.result else f"efficiency {e.efficiency:.1%} by the cost model, not simulated"
        lines.append(f"  {label:9}  predicted {e.tps:7.1f} tokens/s/device, {simulated}  {t.ranked.describe()}")
    if tuning.written is None:
        lines.append("  written    does not fit device memory (degrees left to the search)")
    best = tuning.best.ranked.estimate
    lines.append(f"  why: {best.bound}-bound at the chosen layout (generation {best.gen_s:.1f} s, learner "
                 f"{best.learn_s:.1f} s a step by the cost model)")
    return "\n".join(lines) + "\n"


def _stability(tuning: Tuning) -> str:
    if tuning.stable_steps is not None:
        return " (the best held from {} to {} steps)".format(*tuning.stable_steps)
    steps = {t.steps for t in tuning.tried if t.result}
    return f" (the best still changed at {max(steps)} steps: the longest run decides)" if len(steps) > 1 else ""


def _with_micro_tokens(program: ast.Program, budget: int | None) -> ast.Program:
    """The chosen micro-batch budget as each train stage's micro_tokens (what `pack` defaults to under
    asp, and what sync packs to)."""
    return program if budget is None else _with_train_option(program, "micro_tokens", budget)


def _with_train_option(program: ast.Program, name: str, value: int) -> ast.Program:
    """Each train stage with `name = value` written last (in place of what it wrote)."""
    decls = [replace(d, options=(*(o for o in d.options if o.name != name), ast.Option(name, ast.Int(value))))
             if isinstance(d, ast.Stage) and d.kind == "train" else d for d in program.decls]
    return replace(program, decls=tuple(decls))


# ---- the command line ----
@click.command("tune")
@click.argument("file", type=click.Path())
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the tuned program here (default: stdout).")
@click.option("--schedule", type=click.Choice(SCHEDULES), help="Tune for this schedule (default: the file's).")
@click.option("--confirm", type=click.IntRange(0, 20), default=3, show_default=True,
              help="Simulate this many of the best predicted layouts (and the written one) and keep the best "
                   "simulated; 0 takes the cost model's best without simulating.")
@click.option("--steps", type=click.IntRange(1, 1000), default=CONFIRM_STEPS, show_default=True,
              help="Simulated steps per confirmed layout; the leaders are simulated again at twice as many until "
                   f"the best holds (up to {LONGEST_CONFIRM}x).")
@click.option("--max-staleness", type=click.IntRange(0, 8),
              help="asp: try every staleness from the file's up to this bound (it changes how off-policy "
                   "samples may be: only as far as you allow); in the file: `max_staleness`. sync: try "
                   "mini_batches up to this bound + 1.")
@click.option("--pin", "pins", multiple=True, metavar="DEGREE",
              help="Keep a written parallel degree instead of searching it: tp, pp or ep (every stage's), or "
                   "one stage's (gen.tp). Repeatable.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override an option, as for compile.")
def tune_command(file, output, schedule, confirm, steps, max_staleness, pins, overrides) -> None:
    """Choose FILE's layout (device split, instances, the generate and train stages' tp/pp/ep) with
    the cost model, confirm the best few on the simulator, and write the program at that layout as
    .aspl source. A written tp/pp/ep is searched too unless --pin keeps it; cp and the other stages'
    degrees stay as written. sync also gets its fastest mini_batches within the staleness the file's asp
    schedule (or --max-staleness) allows (docs/passes.md, "aspc tune")."""
    compilation = _compile(file, overrides)
    _check_pins(file, compilation, pins)
    move = _move(file, output)
    if move is not None:
        _refuse_modules_left_behind(file, compilation.program, *move)
    kind = schedule or compilation.graph.schedule.kind
    tuning = _tune(file, compilation, kind, confirm, steps, _staleness_values(compilation, kind, max_staleness),
                   tuple(pins))
    click.echo(report(tuning), err=True, nl=False)
    text = tuning.best.text
    bound = _sync_staleness(compilation, kind, max_staleness)
    if bound and confirm > 0:
        text = _mini_batched_text(tuning, bound, Path(file).parent)
    text, rewritten = _relocated(text, move)
    write_output(text, output)
    if output is not None:
        moved = f" ({rewritten} relative path{'s' if rewritten != 1 else ''} rewritten to be relative to " \
                f"{Path(output).parent}/)" if rewritten else ""
        click.echo(f"wrote {output}{moved}", err=True)


def _sync_staleness(compilation: Compilation, kind: str, max_staleness: int | None) -> int:
    """How stale sync's mini-batches may make its samples: --max-staleness, else the staleness of the
    file's asp schedule; 0 (mini_batches not searched) for a file written sync."""
    if kind != "sync":
        return 0
    if max_staleness is not None:
        return max_staleness
    return _asp_staleness(compilation) if compilation.graph.schedule.kind == "asp" else 0


def _mini_batched_text(tuning: Tuning, staleness: int, base_dir: Path) -> str:
    """sync: the confirmed layouts each with mini_batches 1 .. staleness + 1; the best pair's text."""
    tried, m, _, tps = best_mini_batching(tuning, staleness, base_dir)
    if m == 0:
        return tried.text
    length = tuning.longest
    click.echo(f"  mini-batching: mini_batches = {m} at {tried.ranked.describe()}, simulated {tps:7.1f} over "
               f"{length} steps (1 to {staleness + 1} tried: samples at most {staleness} step{'s' * (staleness > 1)} "
               "stale)", err=True)
    return _with_mini_batches_text(tried.text, m)


def _check_pins(file, compilation: Compilation, pins) -> None:
    known = pin_names(compilation.graph)
    unknown = [p for p in pins if p not in known]
    if unknown:
        raise click.BadParameter(f"{file}: no degree {', '.join(unknown)} to pin; pin one of "
                                 f"{', '.join(sorted(known))}", param_hint="--pin")


def _move(file, output) -> tuple[Path, Path] | None:
    """(the source's folder, the output's folder) when `-o` writes into another folder, else None."""
    if output is None:
        return None
    source, target = Path(file).parent, Path(output).parent
    return None if source.resolve() == target.resolve() else (source, target)


def _refuse_modules_left_behind(file, program: ast.Program, source: Path, target: Path) -> None:
    """A module beside the source cannot be named from the new folder: say so before tuning."""
    found = modules_left_behind(program, source, target)
    if not found:
        return
    sources = {}
    try:
        sources[file] = Path(file).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError):
        pass
    click.echo(render_all(found, sources), err=True)
    sys.exit(1)


def _relocated(text: str, move: tuple[Path, Path] | None) -> tuple[str, int]:
    """The tuned text with its relative paths rewritten for the output's folder (and how many were)."""
    if move is None:
        return text, 0
    program, count = relocate(parse(text, TUNED_SOURCE), *move)
    return format_program(program), count


def _staleness_values(compilation: Compilation, kind: str, bound: int | None) -> tuple[int, ...] | None:
    """Every staleness from the file's up to `--max-staleness` (asp only); None: the file's own."""
    if bound is None or kind != "asp":
        return None
    written = compilation.graph.schedule.option("staleness") if compilation.graph.schedule.kind == "asp" else None
    start = 1 if written is None else written
    if bound < start:
        raise click.UsageError(f"--max-staleness {bound} is below the file's staleness {start}")
    return tuple(range(start, bound + 1))


def best_layout_plans(file, overrides, schedules: list[str], confirm: int, steps: int) -> list:
    """`simulate --compare --best-layout`: each schedule's plan at its own best layout; sync's at its
    best layout and mini-batching together (each confirmed layout with each mini-batching)."""
    compilation = _compile(file, overrides)
    plans = []
    for kind in schedules:
        tuning = _tune(file, compilation, kind, confirm, steps)
        if kind == "sync":
            plans.append(_best_mini_batched(file, compilation, tuning))
            continue
        click.echo(f"{kind}: best layout {tuning.best.ranked.describe()}", err=True)
        compiled = run_schedule(compile_source(tuning.best.text, TUNED_SOURCE, None, Path(file).parent), kind)
        plans.append(compiled.plan())
    return plans


def _best_mini_batched(file, compilation: Compilation, tuning: Tuning):
    """Sync's plan at the best pair of a confirmed layout and a mini-batching from 1 to asp's
    staleness + 1 (aspc/cli/mini_batching.py); its train stage's mini_batches written, so that
    --compare keeps it."""
    tried, m, plan, _ = best_mini_batching(tuning, _asp_staleness(compilation), Path(file).parent)
    mini = f" with mini_batches = {m}" if m else ""
    click.echo(f"sync: best layout {tried.ranked.describe()}{mini}", err=True)
    return plan


def best_mini_batching(tuning: Tuning, staleness: int, base_dir: Path | None) -> tuple[Tried, int, object, float]:
    """The best pair of a confirmed sync layout and a mini-batching from 1 to `staleness` + 1, each
    simulated over as many steps as the longest confirmation: (the layout, its mini_batches -- 0 where
    the file writes it, then kept --, the plan with it written, its simulated tokens/s/device)."""
    from aspc.cli.backends import simulator_pricing
    from aspc.cli.mini_batching import with_mini_batches, written
    from aspc.drivers.sim.result import simulate

    best = None
    length = tuning.longest
    for tried in tuning.tried:
        plan = run_schedule(compile_source(tried.text, TUNED_SOURCE, None, base_dir), "sync").plan()
        for m in [0] if written(plan) else range(1, staleness + 2):
            candidate = plan if m == 0 else with_mini_batches(plan, m)
            confirmed = m in (0, 1) and tried.steps == length  # as written, or at 1: simulated already
            tps = tried.simulated_tps if confirmed else \
                simulate(candidate, length, simulator_pricing(candidate)).e2e_tps
            if best is None or tps > best[3]:
                best = (tried, m, candidate, tps)
    assert best is not None, "no confirmed sync layout"
    return best


def _with_mini_batches_text(text: str, mini_batches: int) -> str:
    """The tuned program with its train stage's mini_batches written."""
    return format_program(_with_train_option(parse(text, TUNED_SOURCE), "mini_batches", mini_batches))


def _asp_staleness(compilation: Compilation) -> int:
    """The staleness asp runs (or may choose, up to its bound): sync's mini-batches stay within it."""
    o = schedule_for(compilation.graph, "asp").option
    return o("max_staleness") if o("max_staleness") is not None else (o("staleness") or 0)


def _tune(file, compilation: Compilation, kind: str, confirm: int, steps: int,
          staleness: tuple[int, ...] | None = None, pins: tuple[str, ...] = ()) -> Tuning:
    try:
        if confirm == 0:
            return _unconfirmed(compilation, kind, staleness, pins)
        return tune(compilation, kind, confirm, steps, Path(file).parent, staleness=staleness, pins=pins)
    except PassError as error:
        raise click.ClickException(f"{file}: cannot choose a layout: {error}") from None
    except (UnsupportedPlan, OversampleBoundReached) as error:  # as `aspc simulate` says it
        raise click.ClickException(f"{file}: cannot simulate: {error}") from None
    except AsplError as error:  # a chosen layout that fails the front end's checks is a bug of the search
        text = render_all(error.diagnostics, {TUNED_SOURCE: ""})
        raise click.ClickException(f"{file}: the chosen layout does not pass the checks (please report it):\n"
                                   f"{text}") from None


def _unconfirmed(compilation: Compilation, kind: str, staleness: tuple[int, ...] | None,
                 pins: tuple[str, ...]) -> Tuning:
    started = time.perf_counter()
    free = unpinned(compilation.graph, pins)
    best = search(free, kind, knob_space(free, kind, staleness))[0]
    tried = Tried(best, tuned_text(compilation.program, best, kind), best.estimate.tps, best.estimate.efficiency)
    return Tuning(kind, [tried], None, time.perf_counter() - started, 0.0)


def _compile(file, overrides) -> Compilation:
    try:
        return compile_file(file, list(overrides))
    except AsplError as error:
        from aspc.frontend.overrides import SOURCE, overrides_source

        sources = {SOURCE: overrides_source(overrides)}
        try:
            sources[file] = Path(file).read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError):
            pass
        click.echo(render_all(error.diagnostics, sources), err=True)
        sys.exit(1)
