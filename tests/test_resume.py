"""A run killed with SIGKILL mid-step and resumed loses and duplicates no sample."""
import json
import os
import signal
import subprocess
import sys
import time

from conftest import ROOT

STEPS = 10


def metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def command(tmp_path, *extra, steps=STEPS, every=2):
    return [sys.executable, "-m", "aspc.cli.main", "run", str(ROOT / "pipelines" / "tiny_grpo.aspl"),
            "--steps", str(steps), "--warmstart", "20", "--checkpoint", str(tmp_path / "ck"),
            "--checkpoint-every", str(every), "--metrics", str(tmp_path / "m.jsonl"), *extra]


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


def _descendants(pid: int) -> list[int]:
    """Children, their children, ...: the worker processes are the fork server's children."""
    found = _children(pid)
    for child in list(found):
        found += _descendants(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_sigkill_mid_run_then_resume_trains_every_sample_exactly_once(tmp_path):
    path = tmp_path / "m.jsonl"
    process = subprocess.Popen(command(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while len(metrics(path)) < 5 and time.time() < deadline and process.poll() is None:
        time.sleep(0.05)
    assert process.poll() is None, "the run ended before it could be killed"
    workers = _descendants(process.pid)  # the instances', the learner's, the fork server's processes
    assert len(workers) >= 3
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    deadline = time.time() + 30
    while any(_alive(pid) for pid in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers), "worker processes outlived the killed run"
    killed_at = len(metrics(path))
    assert 5 <= killed_at < STEPS
    resumed = subprocess.run(command(tmp_path, "--resume"), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at step" in resumed.stderr
    rows = metrics(path)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        expected = {(r["step"] - 1, p, g) for p in range(16) for g in range(4)}
        assert [tuple(s) for s in r["trained"]] == sorted(expected)


def signalled_after_three_steps(tmp_path, signum) -> tuple[int, str]:
    """A long run sent `signum` once three steps are recorded: (exit code, stderr)."""
    process = subprocess.Popen(command(tmp_path, steps=100_000, every=1000),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while len(metrics(tmp_path / "m.jsonl")) < 3 and time.time() < deadline and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signum)
    try:
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, err


def test_ctrl_c_stops_cleanly_with_a_final_checkpoint(tmp_path):
    code, err = signalled_after_three_steps(tmp_path, signal.SIGINT)
    assert code == 130
    assert "stopped by Ctrl-C" in err and "--resume" in err
    saved = (tmp_path / "ck" / "latest").read_text().strip()
    assert int(saved.split("-")[1]) >= 3  # the last finished step, not a multiple of 1000


def test_sigterm_saves_the_last_finished_step_and_exits_143(tmp_path):
    """SIGTERM (`kill`, a scheduler's stop) is handled as Ctrl-C is, with 128 + 15 as the exit code."""
    code, err = signalled_after_three_steps(tmp_path, signal.SIGTERM)
    assert code == 143, err
    assert "Traceback" not in err, err
    done = len(metrics(tmp_path / "m.jsonl"))
    assert f"stopped by SIGTERM after step {done}" in err and "--resume" in err
    assert (tmp_path / "ck" / "latest").read_text().strip() == f"step-{done:06d}"  # the last finished step


def test_an_error_the_sigterm_caused_still_saves_the_steps_and_exits_143(tmp_path, monkeypatch):
    """A SIGTERM that cuts a call short can surface as another error (a reply read half-way, the
    workers' teardown failing after it): the run still keeps its finished steps and exits 143 with
    its message, naming the error (CI saw exit 130 and no checkpoint once)."""
    from click.testing import CliRunner

    from aspc.cli import interrupts
    from aspc.cli.main import main
    from aspc.drivers.local.runtime import LocalRuntime

    record = LocalRuntime._record

    def record_then_sigterm(self, step):
        record(self, step)
        if step == 2:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises KeyboardInterrupt in here
            except KeyboardInterrupt:
                raise RuntimeError("a reply read half-way") from None

    monkeypatch.setattr(LocalRuntime, "_record", record_then_sigterm)
    monkeypatch.setattr(interrupts, "_interrupts", interrupts._Interrupts())  # the SIGTERM's mark stays here
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # an earlier test may have replaced it
    try:
        result = CliRunner().invoke(main, command(tmp_path, steps=10, every=1000)[3:])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert result.exit_code == 143, (result.output, result.exception)
    assert "SIGTERM cut a call short (RuntimeError: a reply read half-way)" in result.output
    assert "stopped by SIGTERM after step 3" in result.output and "--resume" in result.output
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-000003"
    assert [row["step"] for row in metrics(tmp_path / "m.jsonl")] == [1, 2, 3]
