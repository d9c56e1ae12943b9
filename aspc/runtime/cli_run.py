"""`aspc run`: progress bars, metrics files, the final report and user-facing errors."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from aspc.backends.cpu.data import DataError
from aspc.backends.cpu.rewards import RewardError
from aspc.controller.config import UnsupportedPlan
from aspc.plan import ExecutionPlan
from aspc.runtime.accounting import bubble_shares
from aspc.runtime.local import LocalRuntime, RunOptions
from aspc.runtime.workers import WorkerFailed
from aspc.trace import write_trace


def check_cpu_plan(file: str, plan: ExecutionPlan) -> None:
    """The CPU backend runs tiny custom models on `cpu` pools; say so before building anything."""
    for pool in plan.pools:
        if pool.hardware != "cpu":
            raise click.ClickException(
                f"{file}: pool '{pool.name}' is {pool.hardware} hardware; the CPU backend runs pipelines "
                f"whose pools are `cpu`. Use `aspc simulate {file}` to predict this cluster, or a tiny "
                "pipeline such as pipelines/tiny_grpo.aspl")
    for model in plan.models:
        if model.preset != "custom":
            raise click.ClickException(f"{file}: model '{model.name}' is the preset {model.preset}; the CPU "
                                       "backend trains tiny `custom` models (no weights are downloaded)")


def run_training(file, plan, steps, warmstart_steps, seed, metrics_path, trace_path,
                 checkpoint_dir=None, checkpoint_every=10, resume=False, runtime_kind="local", address=None) -> None:
    from tqdm import tqdm

    check_cpu_plan(file, plan)
    metrics = Path(metrics_path) if metrics_path else Path("runs") / f"{plan.pipeline}-{plan.schedule}" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    if resume and checkpoint_dir is None:
        raise click.ClickException("--resume needs --checkpoint DIR (where the run saved its checkpoints)")
    if not resume:
        metrics.write_text("", encoding="utf-8")
    warm = tqdm(total=warmstart_steps, desc="warm start", unit="step", disable=None, file=sys.stderr, leave=False)
    bar = tqdm(total=steps, desc=f"{plan.schedule}", unit="step", disable=None, file=sys.stderr)
    last = {"wall": 0.0}

    def on_warmstart(step: int, loss: float) -> None:
        warm.update(1)
        warm.set_postfix(loss=f"{loss:.3f}")

    def on_step(step: int, m: dict) -> None:
        seconds = max(m["wall_s"] - last["wall"], 1e-9)
        last["wall"] = m["wall_s"]
        m["tokens_per_s"] = round(m.get("samples", 0) * m.get("response_len", 0) / seconds, 1)
        if step % 10 == 1:  # the share of worker time that was not useful, refreshed every 10 steps
            shares = bubble_shares(runtime.spans(), m["wall_s"])
            last["bubble"] = 1 - shares["useful"]
        bar.update(1)
        bar.set_postfix(reward=f"{m.get('reward', 0):.3f}", tok_s=f"{m['tokens_per_s']:.0f}",
                        stale=f"{m['staleness_mean']:.2f}", bubble=f"{100 * last.get('bubble', 0):.0f}%")

    options = RunOptions(steps, warmstart_steps, metrics, seed, on_step, on_warmstart,
                         Path(checkpoint_dir) if checkpoint_dir else None, checkpoint_every, resume)
    runtime = _runtime(runtime_kind, plan, Path(file).parent, options, address)
    try:
        runtime.build()
        warm.close()
        if runtime.start_version:
            bar.update(runtime.start_version)
            click.echo(f"resumed at step {runtime.start_version} from {checkpoint_dir}", err=True)
        result = runtime.run()
    except WorkerFailed as error:
        runtime.stop_workers()
        saved = runtime.save_now() if hasattr(runtime, "learner_worker") else None
        where = f"; checkpoint of step {saved} in {checkpoint_dir} (continue with --resume)" if saved else ""
        raise click.ClickException(f"{file}: {error}{where}") from None
    except (DataError, RewardError, UnsupportedPlan, ValueError) as error:
        raise click.ClickException(f"{file}: {error}") from None
    except KeyboardInterrupt:
        bar.close()
        runtime.stop_workers()
        saved = runtime.save_now() if hasattr(runtime, "learner_worker") else None
        where = f"; checkpoint of step {saved} in {checkpoint_dir} (continue with --resume)" if saved else ""
        click.echo(f"\nstopped by Ctrl-C; metrics in {metrics}{where}", err=True)
        sys.exit(130)
    bar.close()
    _report(result, metrics, trace_path, plan)


def _runtime(kind: str, plan, base_dir: Path, options: RunOptions, address):
    if kind == "local":
        return LocalRuntime(plan, base_dir, options)
    from aspc.runtime.ray_runtime import RayRuntime, RayUnavailable

    try:
        return RayRuntime(plan, base_dir, options, address)
    except RayUnavailable as error:
        raise click.ClickException(str(error)) from None
    except ConnectionError as error:
        raise click.ClickException(f"cannot join the Ray cluster at {address}: {error}") from None


def _report(result, metrics: Path, trace_path, plan) -> None:
    rows = result.metrics
    window = max(1, min(10, len(rows) // 4 or 1))
    first = sum(m["reward"] for m in rows[:window]) / window
    final = sum(m["reward"] for m in rows[-window:]) / window
    click.echo(f"{plan.pipeline} ({plan.schedule}): {len(rows)} steps in {result.wall_s:.1f} s; mean reward "
               f"{first:.3f} over the first {window} steps -> {final:.3f} over the last {window}")
    shares = bubble_shares(result.spans, result.wall_s)
    click.echo("worker time: " + "  ".join(f"{c} {100 * v:.1f}%" for c, v in shares.items()))
    click.echo(f"metrics: {metrics}")
    if trace_path:
        write_trace(Path(trace_path), {plan.schedule: result.spans})
        click.echo(f"trace: {trace_path}")
