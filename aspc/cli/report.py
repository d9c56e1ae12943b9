"""`aspc report`: compile FILE under sync-naive, sync and asp, simulate each (and the
sync@colocated baseline) for as many steps as `aspc simulate` does, and write one self-contained
HTML page (aspc/report/)."""
from __future__ import annotations

import os
from pathlib import Path

import click

TIMELINES = ("sync-naive", "sync", "asp")  # a timeline each, in this order
STEPS = 20  # as `aspc simulate`'s --steps, so that both print the same speed-ups for a file


@click.command("report")
@click.argument("file", type=click.Path())
@click.option("-o", "--output", type=click.Path(dir_okay=False), default="report.html", show_default=True,
              help="The HTML file to write.")
@click.option("--steps", type=click.IntRange(1, 10_000), default=STEPS, show_default=True,
              help="Training steps to simulate per schedule (the default of `aspc simulate`, so the speed-ups "
                   "agree).")
@click.option("--run", "run_path", type=click.Path(exists=True, dir_okay=False),
              help="A measured run's metrics (the metrics.jsonl of `aspc run`), shown beside the prediction of "
                   "the schedule it used (its rows' \"schedule\" or its folder runs/PIPELINE-SCHEDULE/ say which).")
@click.option("--run-schedule", type=click.Choice(TIMELINES),
              help="The schedule the --run used, where neither its rows nor its folder's name say.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override an option, as for `aspc simulate` (repeatable).")
def report(file, output, steps, run_path, run_schedule, overrides) -> None:
    """Write one HTML page of FILE: its three schedules' simulated timelines (each fitted to its own
    length, or on one time axis), the bubble breakdown, predicted throughput, the source with the
    passes' decisions at their lines, the schedule graph, and (with --run) a measured run beside the
    prediction of its schedule. The page loads nothing from the network."""
    from aspc.report.model import ReportInput
    from aspc.report.page import build_page

    if str(file).endswith(".json"):
        raise click.UsageError("aspc report compiles an .aspl file; a .json plan has no source to show")
    if not Path(output).resolve().parent.is_dir():  # before minutes of simulation, not after
        raise click.ClickException(f"cannot write {output}: its folder does not exist")
    rows = _run_rows(run_path) if run_path else []
    schedules, baselines, note = _simulated(file, tuple(overrides), steps)
    used, said_by = _run_schedule(run_path, rows, run_schedule, schedules[-1].graph.pipeline)
    page = build_page(ReportInput(file, _source(file), schedules, baselines, note, run_path or "", rows, used, said_by))
    _write(Path(output), page)
    click.echo(f"wrote {output} ({len(page.encode('utf-8')) / 1e6:.2f} MB)")
    click.echo(_speedups([s.result for s in schedules], steps))


def _speedups(results, steps: int) -> str:
    """The speed-ups of the page, with the step count they hold for (as `aspc simulate --compare` prints them)."""
    by = {r.schedule: r for r in results}
    last = results[-1]
    versus = ", ".join(f"{last.e2e_tps / by[b].e2e_tps:.2f}x vs {b}" for b in TIMELINES[:-1] if by[b].e2e_tps)
    return f"{last.schedule}: {versus} (e2e_tps over {steps} simulated steps)"


def _simulated(file, overrides, steps):
    """The three schedules compiled and simulated, the colocated baseline's result (or why not)."""
    from aspc.cli import main as cli
    from aspc.controller.kinds import refusals
    from aspc.report.model import CompiledSchedule

    compiled = [cli._compile(file, overrides, kind, None, None, False) for kind in TIMELINES]
    plans = [cli._plan(c, None) for c in compiled]
    cli._refuse_at_stages(file, overrides, compiled[-1], refusals(plans[-1]))
    results = cli._simulate_plans(file, plans, steps)
    baseline = cli._colocated_baseline(file, overrides, None, compiled[-1])
    colocated = cli._simulate_baseline(baseline, steps) if baseline.plan is not None else []
    # the sync rows at their best mini-batching, as `aspc simulate --compare` shows them
    both, said = cli._sync_at_best_mini_batching(file, results + colocated, plans, baseline.plan, steps)
    results, colocated = both[:len(results)], both[len(results):]
    note = "; ".join(said + ([f"sync@colocated: not available: {baseline.reason}"] if baseline.reason else []))
    schedules = [CompiledSchedule(c.graph, _changes(c), r) for c, r in zip(compiled, results)]
    return schedules, colocated, note


def _changes(compiled) -> list:
    from aspc.report.model import PassChange

    return [PassChange(step.spec.instance.spec(), step.spec.instance.name, step.spec.instance.bubble or "",
                       step.before, step.after) for step in compiled.run.steps]


def _source(file) -> str:
    return Path(file).read_text(encoding="utf-8-sig")  # compiled already: it is readable


def _run_schedule(path, rows: list[dict], given, pipeline: str) -> tuple[str, str]:
    """The schedule the run used and what says so: --run-schedule, the rows' "schedule", or the
    folder `aspc run` names runs/PIPELINE-SCHEDULE/; ("", "") if nothing does (or there is no run)."""
    if not path:
        return "", ""
    if given:
        return given, "given with --run-schedule"
    named = {r["schedule"] for r in rows if r.get("schedule") in TIMELINES}
    if len(named) == 1:
        return named.pop(), "its metrics rows say so"
    folder = Path(path).resolve().parent.name
    for schedule in sorted(TIMELINES, key=len, reverse=True):  # sync-naive before sync
        if folder.endswith(f"-{schedule}"):
            other = "" if folder == f"{pipeline}-{schedule}" else f", though it names another pipeline than {pipeline}"
            return schedule, f"from its folder's name {folder}{other}"
    return "", ""


def _run_rows(path) -> list[dict]:
    from aspc.drivers.local.metrics_file import read_rows

    rows = [r for r in read_rows(Path(path)) if isinstance(r.get("step"), int)]
    if not rows:
        raise click.ClickException(f"{path}: no metrics rows (JSON lines with a \"step\"); give the "
                                   "metrics.jsonl that `aspc run --metrics` wrote")
    return rows


def _write(path: Path, page: str) -> None:
    """Written beside and renamed into place: an interrupted write leaves no half page."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as error:
        raise click.ClickException(f"cannot write {path}: {error.strerror}") from None
