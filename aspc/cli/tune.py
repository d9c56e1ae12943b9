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
from dataclasses import dataclass
from pathlib import Path

import click

from aspc.frontend import ast
from aspc.frontend.compiler import Compilation, compile_file, compile_source
from aspc.frontend.diagnostics import AsplError, render_all
from aspc.frontend.formatter import format_program
from aspc.frontend.layouts import apply_layout
from aspc.passes.auto_place import Ranked, search, written_candidate, written_estimate
from aspc.passes.base import PassError
from aspc.passes.layout_space import roles_of
from aspc.passes.schedules import SCHEDULES
from aspc.plan.toolchain import run_schedule

TUNED_SOURCE = "<tuned>"
CONFIRM_STEPS = 6  # simulated steps per confirmed candidate: enough for the overlap to settle


@dataclass
class Tried:
    ranked: Ranked
    text: str
    simulated_tps: float | None = None
    efficiency: float | None = None
    result: object | None = None  # SimResult


@dataclass
class Tuning:
    schedule: str
    tried: list[Tried]  # the confirmed candidates, best simulated first
    written: Tried | None  # None: the written layout does not fit device memory
    search_s: float
    confirm_s: float
    staleness: int | None = None  # asp: the bound the layouts were tuned under

    @property
    def best(self) -> Tried:
        return self.tried[0]


def tune(compilation: Compilation, schedule: str, confirm: int, steps: int, base_dir: Path | None,
         progress=None) -> Tuning:
    """Search the layouts of `compilation` under `schedule`, simulate the `confirm` best and the
    written one for `steps` steps, best simulated first (the written layout first if it simulates best)."""
    graph = compilation.graph
    started = time.perf_counter()
    ranked = search(graph, schedule)
    search_s = time.perf_counter() - started
    chosen = _distinct(ranked, confirm)
    tried = [Tried(r, tuned_text(compilation.program, r, schedule)) for r in chosen]
    estimate = written_estimate(graph, schedule)
    written = None
    if estimate is not None:
        ranked_written = Ranked(written_candidate(graph, roles_of(graph)), estimate)
        written = Tried(ranked_written, tuned_text(compilation.program, ranked_written, schedule))
    for t in [*tried, *([written] if written else [])]:
        _simulate(t, schedule, steps, base_dir, progress)
    tried.sort(key=lambda t: -t.simulated_tps)
    if written is not None and written.simulated_tps > tried[0].simulated_tps:
        tried.insert(0, written)  # the search's figures were off here: the written layout stays
    staleness = graph.schedule.option("staleness") if schedule == "asp" == graph.schedule.kind else None
    return Tuning(schedule, tried, written, search_s, time.perf_counter() - started - search_s, staleness)


def tuned_text(program: ast.Program, ranked: Ranked, schedule: str) -> str:
    """The program at this layout under `schedule` (the file's own block when it is that kind)."""
    written = next((d for d in program.decls if isinstance(d, ast.Schedule)), None)
    block = None if written is not None and written.kind == schedule else ast.Schedule(schedule, ())
    return format_program(apply_layout(program, ranked.layout, block))


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
    tried.simulated_tps, tried.efficiency, tried.result = result.e2e_tps, result.efficiency, result


def report(tuning: Tuning) -> str:
    """The choice, its predicted and simulated figures, the runners-up and the written layout."""
    bound = f" (staleness {tuning.staleness})" if tuning.staleness is not None else ""
    lines = [f"schedule {tuning.schedule}{bound}: searched in {tuning.search_s:.1f} s, confirmed "
             f"{len(tuning.tried)} on the simulator in {tuning.confirm_s:.1f} s"]
    written = [("written", tuning.written)] if tuning.written else []
    for label, t in [("chosen", tuning.best), *[("runner-up", t) for t in tuning.tried[1:]], *written]:
        e = t.ranked.estimate
        simulated = f"simulated {t.simulated_tps:7.1f} (efficiency {t.efficiency:.1%})" if t.result else \
            f"efficiency {e.efficiency:.1%} by the cost model, not simulated"
        lines.append(f"  {label:9}  predicted {e.tps:7.1f} tokens/s/device, {simulated}  {t.ranked.layout.describe()}")
    if tuning.written is None:
        lines.append("  written    does not fit device memory (degrees left to the search)")
    best = tuning.best.ranked.estimate
    lines.append(f"  why: {best.bound}-bound at the chosen layout (generation {best.gen_s:.1f} s, learner "
                 f"{best.learn_s:.1f} s a step by the cost model)")
    return "\n".join(lines) + "\n"


# ---- the command line ----
@click.command("tune")
@click.argument("file", type=click.Path())
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the tuned program here (default: stdout).")
@click.option("--schedule", type=click.Choice(SCHEDULES), help="Tune for this schedule (default: the file's).")
@click.option("--confirm", type=click.IntRange(0, 20), default=3, show_default=True,
              help="Simulate this many of the best predicted layouts (and the written one) and keep the best "
                   "simulated; 0 takes the cost model's best without simulating.")
@click.option("--steps", type=click.IntRange(1, 1000), default=CONFIRM_STEPS, show_default=True,
              help="Simulated steps per confirmed layout.")
@click.option("--max-staleness", type=click.IntRange(0, 8),
              help="asp: also try every staleness from the file's up to this bound (it changes how off-policy "
                   "samples may be: only as far as you allow) and keep the best simulated.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override an option, as for compile.")
def tune_command(file, output, schedule, confirm, steps, max_staleness, overrides) -> None:
    """Choose FILE's layout (device split, instances, unwritten parallel degrees) with the cost model,
    confirm the best few on the simulator, and write the program at that layout as .aspl source.
    Written tp/pp/cp/ep are constraints (docs/passes.md, "auto-place")."""
    compilation = _compile(file, overrides)
    kind = schedule or compilation.graph.schedule.kind
    tunings = [_tune(file, c, kind, confirm, steps) for c in _staleness_variants(file, compilation, kind, overrides,
                                                                                 max_staleness)]
    for tuning in tunings:
        click.echo(report(tuning), err=True, nl=False)
    tuning = max(tunings, key=lambda t: t.best.simulated_tps)
    text = tuning.best.text
    if output is None:
        click.echo(text, nl=False)
        return
    try:
        Path(output).write_text(text, encoding="utf-8")
    except OSError as error:
        raise click.ClickException(f"cannot write {output}: {error.strerror}") from None
    click.echo(f"wrote {output}", err=True)


def _staleness_variants(file, compilation: Compilation, kind: str, overrides, bound: int | None) -> list:
    """The program at each staleness from its own up to `bound` (asp only)."""
    if bound is None or kind != "asp":
        return [compilation]
    written = compilation.graph.schedule.option("staleness") if compilation.graph.schedule.kind == "asp" else None
    start = 1 if written is None else written
    if bound < start:
        raise click.UsageError(f"--max-staleness {bound} is below the file's staleness {start}")
    return [_compile(file, (*overrides, f"schedule.staleness={k}")) if k != start else compilation
            for k in range(start, bound + 1)]


def best_layout_plans(file, overrides, schedules: list[str], confirm: int, steps: int) -> list:
    """`simulate --compare --best-layout`: each schedule's plan at its own best layout."""
    compilation = _compile(file, overrides)
    plans = []
    for kind in schedules:
        tuning = _tune(file, compilation, kind, confirm, steps)
        click.echo(f"{kind}: best layout {tuning.best.ranked.layout.describe()}", err=True)
        compiled = run_schedule(compile_source(tuning.best.text, TUNED_SOURCE, None, Path(file).parent), kind)
        plans.append(compiled.plan())
    return plans


def _tune(file, compilation: Compilation, kind: str, confirm: int, steps: int) -> Tuning:
    try:
        if confirm == 0:
            return _unconfirmed(compilation, kind)
        return tune(compilation, kind, confirm, steps, Path(file).parent)
    except PassError as error:
        raise click.ClickException(f"{file}: cannot choose a layout: {error}") from None
    except AsplError as error:  # a chosen layout that fails the front end's checks is a bug of the search
        text = render_all(error.diagnostics, {TUNED_SOURCE: ""})
        raise click.ClickException(f"{file}: the chosen layout does not pass the checks (please report it):\n"
                                   f"{text}") from None


def _unconfirmed(compilation: Compilation, kind: str) -> Tuning:
    started = time.perf_counter()
    best = search(compilation.graph, kind)[0]
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
