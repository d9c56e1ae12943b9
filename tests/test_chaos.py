"""Chaos: `aspc run --resume` killed again and again with SIGINT or SIGKILL at random moments (the
start-up, the warm start, generation, training, a checkpoint write), or its learner process killed,
until it completes. Every step is recorded once, every sample of every step is trained exactly once,
every checkpoint holds trained weights (never the warm start's copy of a dead learner), and no
traceback is ever printed. Half the kills wait for the run's next recorded step: on 2 cores the start-up outlasts
the first seconds, and kills timed from the first line alone never reached a step."""
import os
import random
import signal
import subprocess
import sys
import threading
import time

from aspc.drivers.local.metrics_file import read_rows
from conftest import ROOT
from test_nothing_lost_run import trained, worker_process

STEPS = 6
MAX_ATTEMPTS = 14


def command(tmp_path):
    return [sys.executable, "-m", "aspc.cli.main", "run", str(ROOT / "pipelines" / "tiny_grpo.aspl"), "--steps",
            str(STEPS), "--warmstart", "40", "--checkpoint", str(tmp_path / "ck"), "--checkpoint-every", "1",
            "--metrics", str(tmp_path / "m.jsonl"), "--resume"]


def attempt(tmp_path, rng: random.Random, kill: bool | str) -> tuple[int, str]:
    """One run; when `kill`, a signal lands at a random moment after the run has started working
    (the warm start's first line, or the resume line): within 3 s of it, or within 1 s of the
    run's next recorded step (its checkpoint write, the next step). `kill="learner"`: its learner
    process is killed once two steps are recorded. Returns (exit code, stderr)."""
    process = subprocess.Popen(command(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines, started = [], threading.Event()

    def read() -> None:
        for line in process.stderr:
            lines.append(line)
            if line.startswith(("warm start:", "resumed at step", "resume:")):
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if kill == "learner" and all(next_step_recorded(process, tmp_path / "m.jsonl") for _ in range(2)):
        send(process, "learner")  # step 2 recorded: the checkpoint of step 1 is on disk
    elif kill and started.wait(timeout=180):
        if rng.random() < 0.5:
            time.sleep(rng.uniform(0.0, 3.0))
        elif next_step_recorded(process, tmp_path / "m.jsonl"):
            time.sleep(rng.uniform(0.0, 1.0))
        if process.poll() is None:
            send(process, rng.choice([signal.SIGINT, signal.SIGKILL, "learner"]))
    process.wait(timeout=600)
    reader.join(timeout=30)
    return process.returncode, "".join(lines)


def send(process, kill) -> None:
    """A signal to the run, or "learner": SIGKILL to its learner process (the run itself when the
    learner has no process yet, e.g. during the warm start)."""
    learner = worker_process(process.pid, "aspc learner") if kill == "learner" else None
    if learner is not None:
        os.kill(learner, signal.SIGKILL)
    else:
        process.send_signal(signal.SIGKILL if kill == "learner" else kill)


def next_step_recorded(process, metrics) -> bool:
    """Wait until the run's metrics file gains or loses a row (False: the run ended first)."""
    rows = len(read_rows(metrics))
    while process.poll() is None:
        if len(read_rows(metrics)) != rows:
            return True
        time.sleep(0.05)
    return False


def test_random_sigint_and_sigkill_then_resume_trains_every_sample_exactly_once(tmp_path):
    rng = random.Random(2026)
    codes = []
    for number in range(MAX_ATTEMPTS):
        code, err = attempt(tmp_path, rng, kill="learner" if number == 0 else number < MAX_ATTEMPTS - 2)
        assert "Traceback" not in err, err
        assert code in (0, 1, 130, -signal.SIGKILL), err
        if code == 130:
            assert "stopped by Ctrl-C" in err
        if code == 1:  # only a dead learner is an error, and it says where to resume from
            assert "the learner process died (signal 9); its last checkpoint, step" in err, err
        codes.append(code)
        if code == 0 and len(codes) > 3:
            break
    assert codes[-1] == 0, codes
    assert codes[0] == 1, codes  # the learner process was killed mid-run
    assert {1, 130, -signal.SIGKILL} & set(codes), codes  # it was interrupted at least once
    rows = read_rows(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        expected = {(row["step"] - 1, p, g) for p in range(16) for g in range(4)}
        assert [tuple(s) for s in row["trained"]] == sorted(expected)
    folders = sorted((tmp_path / "ck").glob("step-*"))
    assert folders and all(trained(folder) for folder in folders)  # the trained weights survived
