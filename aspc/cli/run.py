"""`aspc run`: progress bars, metrics files, the final report and user-facing errors.

Exit codes: 0 the run finished (or a resumed run was already complete); 1 an error the user can
fix (data, reward module, checkpoint, a checkpoint that could not be written, a worker that died,
a dynamic sampling step at its bound with at_oversample_bound = stop), with one message; 130 Ctrl-C
and 143 SIGTERM (128 + the signal, the shell's convention), each after the metrics of every
finished step and, with --checkpoint, a checkpoint of the last one are saved. A worker process
that died (the learner's) took its state with it: nothing is saved after it, and the message
names the last intact checkpoint, the one --resume continues from.
"""
from __future__ import annotations

import errno
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

from aspc.controller.config import UnsupportedPlan
from aspc.controller.dynamic_sampling import OversampleBoundReached
from aspc.plan.execution_plan import ExecutionPlan
from aspc.accounting.measured import bubble_shares
from aspc.drivers.local.runtime import LocalRuntime, RunOptions
from aspc.drivers.local.run_lock import FolderInUse, RunLock
from aspc.roles import ExecutorsFactory
from aspc.drivers.local.workers import WorkerFailed
from aspc.accounting.trace import Span, shifted, write_trace
from aspc.drivers.local.metrics_file import check_can_write
from aspc.cli.interrupts import interrupt_seen, note_sigterm


def check_cpu_plan(file: str, plan: ExecutionPlan) -> None:
    """The CPU backend runs tiny custom models and hf("DIR") checkpoints on `cpu` pools; say so
    before building anything."""
    for pool in plan.pools:
        if pool.hardware != "cpu":
            raise click.ClickException(
                f"{file}: pool '{pool.name}' is {pool.hardware} hardware; the CPU backend runs pipelines "
                f"whose pools are `cpu`. Use `aspc simulate {file}` to predict this cluster, or a tiny "
                "pipeline such as pipelines/tiny_grpo.aspl")
    for model in plan.models:
        if model.preset not in ("custom", "hf"):
            raise click.ClickException(f"{file}: model '{model.name}' is the preset {model.preset}; the CPU "
                                       "backend trains tiny `custom` models and checkpoint directories "
                                       "(`hf(\"DIR\")`; no weights are downloaded)")


@dataclass
class RunRequest:
    """What `aspc run` was asked for (the CLI's options, with defaults)."""

    file: str
    steps: int
    warmstart_steps: int = 200
    seed: int = 0
    metrics_path: str | None = None
    trace_path: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 10
    resume: bool = False
    runtime_kind: str = "local"
    address: str | None = None
    threads: int | None = None
    workers: str = "processes"
    keep: int | None = 3  # step checkpoints kept (the newest); None: all


def run_training(request: RunRequest, plan: ExecutionPlan, executors: ExecutorsFactory) -> None:
    """Train `plan` with the backend's executors (the CLI passes the CPU or the Ascend factory),
    its metrics and checkpoint folders locked against a second run (aspc/drivers/local/run_lock.py)."""
    metrics = Path(request.metrics_path) if request.metrics_path else \
        Path("runs") / f"{plan.pipeline}-{plan.schedule}" / "metrics.jsonl"
    _refuse_unrunnable(request, plan, executors)
    _check_outputs(request, metrics)  # before the lock, which makes its file in the metrics folder
    folders = [metrics.parent] + ([Path(request.checkpoint_dir)] if request.checkpoint_dir else [])
    lock = RunLock(folders)
    try:
        lock.acquire()
    except FolderInUse as error:
        raise click.ClickException(f"{request.file}: {error}") from None
    except OSError as error:
        raise click.ClickException(f"{request.file}: cannot lock the run's folder: {error}") from None
    for note in lock.notes:
        click.echo(note, err=True)
    try:
        _train(request, plan, executors, metrics)
    finally:
        lock.release()


def _refuse_unrunnable(request: RunRequest, plan: ExecutionPlan, executors: ExecutorsFactory) -> None:
    if getattr(executors, "platform", "cpu") == "cpu":
        check_cpu_plan(request.file, plan)
    if request.resume and request.checkpoint_dir is None:
        raise click.ClickException("--resume needs --checkpoint DIR (where the run saved its checkpoints)")
    environments = plan.stages_of("environment")
    if environments and request.runtime_kind != "local":
        raise click.ClickException(f"{request.file}: stage '{environments[0].name}' runs agentic episodes, which "
                                   "the Ray runtime does not drive yet (their tool calls run on the local runtime's "
                                   "tool runners); run it with --runtime local")


def _train(request: RunRequest, plan: ExecutionPlan, executors: ExecutorsFactory, metrics: Path) -> None:
    progress = _Progress(request.steps, request.warmstart_steps, plan.schedule)
    options = RunOptions(request.steps, request.warmstart_steps, metrics, request.seed, progress.on_step,
                         progress.on_warmstart, Path(request.checkpoint_dir) if request.checkpoint_dir else None,
                         request.checkpoint_every, request.resume, request.threads, request.workers,
                         keep=request.keep)
    options.on_warning = progress.warn  # aspc/controller/health.py's checks, printed as they fire
    session = _Session(request, plan, options, progress, executors)
    terminate = _SigtermAsCtrlC()
    try:
        with terminate:
            result = session.train()
    except (WorkerFailed, OversampleBoundReached) as error:  # the finished steps are kept, and where is said
        where = _salvaged(session)
        raise click.ClickException(f"{request.file}: {error}{where}") from None
    except (*executors.user_errors, UnsupportedPlan) as error:
        _salvaged(session)
        raise click.ClickException(f"{request.file}: {error}") from None
    except OSError as error:  # a metrics row or the trace could not be written (full disk, ulimit -f)
        where = _salvaged(session)
        raise click.ClickException(f"{request.file}: {file_error(error)}{where}") from None
    except KeyboardInterrupt:
        _stop_interrupted(session, terminate)
    except Exception as error:  # noqa: BLE001 -- re-raised unless an interruption caused it
        if not (terminate.received or interrupt_seen()):
            _salvaged(session)  # a bug: its traceback, after the workers stopped (they kept the process alive)
            raise
        _stop_interrupted(session, terminate, error)
    if result is not None:
        progress.close()
        _report(result, session.runtime, metrics, request.trace_path, plan, session.held_out_line())


def _stop_interrupted(session: _Session, terminate: _SigtermAsCtrlC, error: Exception | None = None) -> None:
    """Keep every finished step, say so, and exit 130 (Ctrl-C) or 143 (SIGTERM). `error`: what the
    interruption broke on its way out (a reply read half-way, the workers' teardown), named in one
    line; the work is saved all the same."""
    session.cause = "SIGTERM" if terminate.received else "Ctrl-C"
    if error is not None:
        click.echo(f"\n{session.cause} cut a call short ({type(error).__name__}: {error}); keeping the finished "
                   "steps", err=True)
    session.interrupted()
    sys.exit(143 if terminate.received else 130)


def _check_outputs(request: RunRequest, metrics: Path) -> None:
    """A metrics or trace path that cannot be written is refused before the warm start, not found
    after training."""
    for option, path in (("--metrics", metrics), ("--trace", request.trace_path)):
        if path is None:
            continue
        try:
            check_can_write(Path(path))
        except OSError as error:
            raise click.ClickException(f"{request.file}: {option} {path} cannot be written ({error.strerror}): "
                                       f"give {option} a file in a folder that can be written") from None


def _salvaged(session: _Session) -> str:
    """`session.salvage()`, whose own writes may fail on the disk that just filled: then the message
    says so (the rows and checkpoints written before are on disk)."""
    try:
        return session.salvage()
    except OSError as error:
        return f"; saving the finished steps failed too: {file_error(error)}"


NO_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)  # a full disk, a file size limit (ulimit -f), a quota


def file_error(error: OSError) -> str:
    """`cannot write runs/x/metrics.jsonl: No space left on device (...)`: the path, why, what to do."""
    what = f"cannot write {error.filename}: {error.strerror or error}" if error.filename else str(error)
    if error.errno in NO_SPACE:
        return f"{what} (the disk is full, or a file size limit such as `ulimit -f` was reached: free space or " \
               "raise the limit)"
    return what


class _SigtermAsCtrlC:
    """While inside, SIGTERM (`kill`, a scheduler's stop) is a Ctrl-C: the handler raises SIGINT, so
    it lands where a Ctrl-C would (held while a metrics row is written, ignored while the last
    checkpoint is saved) and the run saves its work; `received` tells the two apart."""

    def __init__(self):
        self.received = False
        self.previous = None

    def __enter__(self):
        self.previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *_):
        signal.signal(signal.SIGTERM, self.previous)

    def _on_sigterm(self, _signum, _frame) -> None:
        self.received = True
        note_sigterm()
        signal.raise_signal(signal.SIGINT)


class _Session:
    """One `aspc run`: builds the runtime, trains, and on any interruption keeps what was done."""

    def __init__(self, request: RunRequest, plan, options: RunOptions, progress, executors: ExecutorsFactory):
        self.request, self.plan, self.options, self.progress = request, plan, options, progress
        self.executors = executors
        self.runtime = None
        self.phase = "starting"
        self.verifier = None  # what decides a held-out answer is right (None: no held-out figure)
        self.accuracy_before = None
        self.cause = "Ctrl-C"  # what interrupted the run: "Ctrl-C" or "SIGTERM"

    def train(self):
        self.runtime = _runtime(self.request.runtime_kind, self.plan, Path(self.request.file).parent,
                                self.options, self.executors, self.request.address)
        self.progress.runtime = self.runtime
        self.phase = "the warm start" if self.request.warmstart_steps and not self.request.resume else "start-up"
        self.runtime.build()
        self.progress.warm_done(self.runtime.warmstart_s)
        for note in self.runtime.resume_notes:
            click.echo(f"resume: {note}", err=True)
        for note in self.runtime.notes:
            click.echo(note, err=True)
        if self.runtime.resumed is not None:
            self.progress.done_before = self.runtime.start_version
            click.echo(f"resumed at step {self.runtime.start_version} from {self.runtime.resumed}", err=True)
        if self.runtime.complete:
            self.progress.close()
            click.echo(f"{self.request.file}: already complete: the checkpoint is at step "
                       f"{self.runtime.start_version} and --steps is {self.request.steps}; nothing to train "
                       "(raise --steps to continue training)", err=True)
            return None
        self._measure_before()
        self.phase = "training"
        return self.runtime.run()

    def _measure_before(self) -> None:
        """The held-out verified accuracy the RL steps start from (after the warm start, or at
        the resumed checkpoint), on the CPU backend's local runtime only (Ray actors keep the trained
        weights). Agentic episodes run their calls on the tools, made anew after the run closed them."""
        cpu = getattr(self.executors, "platform", "cpu") == "cpu"
        if not cpu or self.request.runtime_kind != "local":
            return
        self.verifier = verifier_of(self.plan)
        if self.verifier is not None:
            self.phase = "the held-out evaluation"
            self.accuracy_before = self.runtime.accuracy(HELD_OUT_PROMPTS)

    def held_out_line(self) -> str | None:
        """`held-out accuracy ...: 0.242 after the warm start -> 0.305 after step 20`, measured now."""
        if self.verifier is None:
            return None
        try:
            after = self.runtime.accuracy(HELD_OUT_PROMPTS)
        finally:
            close = getattr(self.runtime.executors, "close", None)  # the tool runners an agentic evaluation made
            if close is not None:
                close()
        start = self.runtime.start_version
        before = f"at step {start}" if start else "after the warm start" if self.request.warmstart_steps else \
            "before RL"
        return (f"held-out accuracy (greedy, up to {HELD_OUT_PROMPTS} prompts no step trains on, verified by "
                f"{self.verifier}): {self.accuracy_before:.3f} {before} -> {after:.3f} after step "
                f"{self.request.steps}")

    def salvage(self) -> str:
        """Stop the workers and keep every finished step (metrics rows, a checkpoint); returns
        where the run can be resumed from, for the message."""
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not tear the save
        try:
            if self.runtime is None:
                return ""
            self.runtime.stop_workers()
            where = self._keep_checkpoint()
            self._write_trace()
        finally:
            signal.signal(signal.SIGINT, previous)
        return where

    def _keep_checkpoint(self) -> str:
        """A checkpoint of the learner's last finished step; where --resume continues from, in words.
        A learner whose process died left nothing to save: the last intact checkpoint is named."""
        try:
            saved = self.runtime.save_now()
        except self.executors.checkpoint_error as error:
            return f"; {error}{self._intact_checkpoint()}"
        if saved is not None:
            return f"; checkpoint of step {saved} in {self.request.checkpoint_dir} (continue with --resume)"
        if getattr(self.runtime, "learner_lost", None):
            return self._intact_checkpoint()
        return ""

    def _intact_checkpoint(self) -> str:
        if self.request.checkpoint_dir is None:
            return ""
        point = self.runtime.last_intact_checkpoint()
        if point is None:
            return f"; no checkpoint of this run is in {self.request.checkpoint_dir}: a new run starts from step 0"
        return (f"; its last checkpoint, step {point.version} in {self.request.checkpoint_dir}, is intact: "
                "continue with --resume")

    def interrupted(self) -> None:
        try:
            self.progress.close()
        except Exception:  # noqa: BLE001 -- a bar the interruption left half-drawn must not lose the steps
            pass
        where = self.salvage()
        if self.phase != "training":
            click.echo(f"\nstopped by {self.cause} during {self.phase}; no RL step was trained, nothing was "
                       "written", err=True)
            return
        done = getattr(self.runtime, "recorded", 0)
        click.echo(f"\nstopped by {self.cause} after step {done}; metrics in {self.options.metrics_path}{where}",
                   err=True)

    def _write_trace(self) -> None:
        """The trace of the steps run so far; one that cannot be written is a line, not the run's end."""
        runtime = self.runtime
        if self.request.trace_path and getattr(runtime, "result", None) is not None:
            try:
                write_trace(Path(self.request.trace_path), _trace_runs(runtime, runtime.spans(), self.plan))
            except OSError as error:
                click.echo(f"trace: {file_error(error)}; no trace was written", err=True)


HELD_OUT_PROMPTS = 128  # greedy answers for the held-out accuracy (a second or two on a tiny model)


def verifier_of(plan: ExecutionPlan) -> str | None:
    """What the CPU backend's held-out accuracy (`accuracy`) counts a right answer by, in words:
    the reward's rules, or beside a learned reward or a judge its first rule, else exact match
    with the data's answers. None: a python(...) source is part of the reward, which need not
    know a right answer."""
    sources = dict(plan.stages_of("reward")[0].options)["sources"]
    rules = [f"rule {s.get('name')}" for s in sources if s.func == "rule"]
    if any(s.func in ("model", "judge") for s in sources):
        return rules[0] if rules else "exact match with the data's answers"
    return " + ".join(rules) if rules and len(rules) == len(sources) else None


LOG_EVERY_S = 10.0  # without a bar (stderr is not a terminal): a progress line this often


class _Progress:
    """The warm start's bar, then the RL steps' bar with reward, tokens/s, staleness and bubbles.
    Without a terminal (a log file) the bars are off: a line every `log_every` seconds instead,
    and one at the end of each phase."""

    def __init__(self, steps: int, warmstart_steps: int, schedule: str, log_every: float = LOG_EVERY_S,
                 clock=time.monotonic):
        from tqdm import tqdm

        self.steps, self.schedule = steps, schedule
        self.log_every, self.clock = log_every, clock
        self.phase_start = self.last_line = clock()
        self.warm = tqdm(total=warmstart_steps, desc="warm start", unit="step", disable=None, file=sys.stderr,
                         leave=False)
        self.bar = None
        self.done_before = 0  # steps a resumed run had finished
        self.make_bar = lambda: tqdm(total=steps, initial=self.done_before, desc=schedule, unit="step", disable=None,
                                     file=sys.stderr)
        self.last_loss, self.warm_steps = None, 0
        self.bubble = 0.0
        self.runtime = None

    def on_warmstart(self, step: int, loss: float) -> None:
        if step == 0:  # the phase's clock starts at its first step (building the runtime came before)
            self.phase_start = self.last_line = self.clock()
        if step == 0 and self.warm.disable:  # a line for logs, where there is no bar
            click.echo(f"warm start: {self.warm.total} supervised steps before RL", err=True)
        self.last_loss, self.warm_steps = loss, step + 1
        self.warm.update(1)
        self.warm.set_postfix(loss=f"{loss:.3f}")
        if self.warm.disable and self._line_due():  # its last line: warm_done's
            self._log_line("warm start", step + 1, self.warm.total, 1, f"loss {loss:.3f}")

    def warm_done(self, seconds: float) -> None:
        self.warm.close()
        self.phase_start = self.last_line = self.clock()  # the RL phase's clock starts
        if self.last_loss is not None:
            click.echo(f"warm start: {self.warm_steps} steps in {seconds:.1f} s, loss {self.last_loss:.3f}", err=True)

    def on_step(self, step: int, m: dict) -> None:
        if self.bar is None:
            self.bar = self.make_bar()
        if step % 10 == 1 and self.runtime is not None:  # the share of worker time that was not useful
            self.bubble = 1 - bubble_shares(self.runtime.spans(), m["wall_s"])["useful"]
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{m.get('reward', 0):.3f}", tok_s=f"{m.get('tokens_per_s', 0):.0f}",
                             stale=f"{m['staleness_mean']:.2f}", bubble=f"{100 * self.bubble:.0f}%")
        if self.bar.disable and self._line_due(step == self.steps):
            self._log_line(self.schedule, step, self.steps, self.done_before,
                           f"reward {m.get('reward', 0):.3f}, {m.get('tokens_per_s', 0):.0f} tok/s")

    def _line_due(self, last: bool = False) -> bool:
        """A log line is due: `log_every` seconds since the last one, or the phase's last step."""
        return last or self.clock() - self.last_line >= self.log_every

    def _log_line(self, phase: str, done: int, total: int, before: int, figures: str) -> None:
        """`asp: step 12/100, reward 0.412, 1234 tok/s, 30 s elapsed, ETA 3 min 40 s`."""
        now = self.clock()
        self.last_line = now
        elapsed = now - self.phase_start
        rate = (done - before) / elapsed if elapsed > 0 else 0.0
        eta = f", ETA {_duration((total - done) / rate)}" if rate > 0 and done < total else ""
        click.echo(f"{phase}: step {done}/{total}, {figures}, {_duration(elapsed)} elapsed{eta}", err=True)

    def warn(self, message: str) -> None:
        """A warning of the run's health checks, printed above the bar (or as a plain line in logs)."""
        from tqdm import tqdm

        tqdm.write(message, file=sys.stderr)

    def close(self) -> None:
        self.warm.close()
        if self.bar is not None:
            self.bar.close()


def _duration(seconds: float) -> str:
    """42 s, 3 min 05 s, 1 h 02 min."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


def _runtime(kind: str, plan, base_dir: Path, options: RunOptions, executors: ExecutorsFactory, address):
    if kind == "local":
        return LocalRuntime(plan, base_dir, options, executors)
    return _ray_runtime(plan, base_dir, options, executors, address)


def _ray_runtime(plan, base_dir: Path, options: RunOptions, executors: ExecutorsFactory, address):
    from aspc.drivers.ray.runtime import RayRuntime, RayUnavailable

    try:
        return RayRuntime(plan, base_dir, options, executors, address)
    except RayUnavailable as error:
        raise click.ClickException(str(error)) from None
    except ConnectionError as error:
        raise click.ClickException(f"cannot join the Ray cluster at {address}: {error}") from None


def _trace_runs(runtime, spans, plan) -> dict:
    """The warm start as its own phase, then the RL steps after it on the same time axis."""
    warm = runtime.warmstart_s
    if not warm:
        return {plan.schedule: spans}
    return {"warm start": [Span("main", 0.0, warm, "warmstart", "supervised warm start")],
            plan.schedule: shifted(spans, warm)}


def _report(result, runtime, metrics: Path, trace_path, plan, held_out: str | None = None) -> None:
    rows = result.metrics
    if not rows:
        return
    window = max(1, min(10, len(rows) // 4 or 1))
    first = sum(m["reward"] for m in rows[:window]) / window
    final = sum(m["reward"] for m in rows[-window:]) / window
    warm = f" after a {runtime.warmstart_s:.1f} s warm start" if runtime.warmstart_s else ""
    click.echo(f"{plan.pipeline} ({plan.schedule}): {len(rows)} steps in {result.wall_s:.1f} s{warm}; mean reward "
               f"{first:.3f} over the first {window} steps -> {final:.3f} over the last {window}")
    shares = bubble_shares(result.spans, result.wall_s)
    agentic = bool(plan.stages_of("environment"))
    shown = {c: v for c, v in shares.items() if c != "tool_wait" or agentic}
    click.echo("worker time: " + "  ".join(f"{c} {100 * v:.1f}%" for c, v in shown.items()))
    if held_out:
        click.echo(held_out)
    failed = sum(m.get("score_failed", 0) for m in rows)
    if failed:
        click.echo(f"judge: {failed} of {sum(m.get('samples', 0) for m in rows)} samples had a failed call "
                   "(fallback reward, masked from their groups; `score_failed` per step in the metrics)")
    click.echo(f"metrics: {metrics}")
    if trace_path:
        try:
            write_trace(Path(trace_path), _trace_runs(runtime, result.spans, plan))
        except OSError as error:
            raise click.ClickException(f"{file_error(error)}: the run finished but its trace was not written; "
                                       f"the metrics are in {metrics}") from None
        click.echo(f"trace: {trace_path}")
