"""Nothing a run trained is lost or mislabelled (issue 37 items 1, 2): a worker process that dies
stops the run naming it, and nothing is saved from a copy that is not the learner's latest state
(a dead learner's last intact checkpoint stays the resume point); a checkpoint that cannot be
written is an error naming its path (exit 1, no traceback), the final one included."""
import errno
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from aspc.cli.main import main
from conftest import ROOT

STEPS = 40


def command(tmp_path, *extra) -> list[str]:
    return [sys.executable, "-m", "aspc.cli.main", "run", str(ROOT / "pipelines" / "tiny_grpo.aspl"), "--steps",
            str(STEPS), "--warmstart", "20", "--checkpoint", str(tmp_path / "ck"), "--checkpoint-every", "2",
            "--metrics", str(tmp_path / "m.jsonl"), *extra]


def steps_saved(folder: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*")) if folder.is_dir() else []


def worker_process(pid: int, name: str) -> int | None:
    """The descendant of `pid` whose /proc/PID/comm is `name` (processes.py names its children)."""
    for child in descendants(pid):
        try:
            if Path(f"/proc/{child}/comm").read_text().strip() == name:
                return child
        except OSError:
            continue
    return None


def descendants(pid: int) -> list[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            found += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        return found
    return found + [d for child in found for d in descendants(child)]


def kill_worker_after_a_checkpoint(tmp_path, name: str) -> tuple[int, str]:
    """Start the run, SIGKILL its worker process `name` once a checkpoint of step >= 4 exists;
    returns (exit code, stderr)."""
    return kill_worker_once_saved(command(tmp_path), tmp_path / "ck", 4, name)


def kill_worker_once_saved(run: list[str], checkpoints: Path, step: int, name: str, start_s: float = 240,
                           end_s: float = 120, cwd=None) -> tuple[int, str]:
    """Start `run`, SIGKILL its worker process `name` once a checkpoint of step >= `step` is in
    `checkpoints` (within `start_s`); returns (exit code, stderr) of the run, which has `end_s` to end."""
    process = subprocess.Popen(run, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd)
    try:
        deadline = time.time() + start_s
        while max(steps_saved(checkpoints), default=0) < step and time.time() < deadline and process.poll() is None:
            time.sleep(0.02)
        worker = worker_process(process.pid, name)
        assert process.poll() is None and worker is not None, "the run ended before its worker was killed"
        os.kill(worker, signal.SIGKILL)
        _, err = process.communicate(timeout=end_s)
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, err


def actor_and_reference(step_folder: Path) -> tuple[dict, dict]:
    return load_file(str(step_folder / "actor.safetensors")), load_file(str(step_folder / "reference.safetensors"))


def trained(step_folder: Path) -> bool:
    """The actor's weights differ from the frozen reference's (the warm start's weights)."""
    actor, reference = actor_and_reference(step_folder)
    return any(not torch.equal(actor[k], reference[k]) for k in actor)


def test_a_killed_learner_keeps_its_last_intact_checkpoint_and_resume_continues_from_it(tmp_path):
    code, err = kill_worker_after_a_checkpoint(tmp_path, "aspc learner")
    assert code == 1, err
    assert "Traceback" not in err, err
    found = re.search(r"the learner process died \(signal 9\); its last checkpoint, step (\d+) in (\S+), is intact: "
                      r"continue with --resume", err)
    assert found, err
    step = int(found.group(1))
    assert found.group(2) == str(tmp_path / "ck")
    assert step >= 4 and steps_saved(tmp_path / "ck")[-1] == step  # nothing saved after the learner died
    assert trained(tmp_path / "ck" / f"step-{step:06d}")  # not the warm start's weights
    resumed = subprocess.run(command(tmp_path, "--resume"), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed at step {step} from" in resumed.stderr
    assert trained(tmp_path / "ck" / f"step-{STEPS:06d}")


def test_a_killed_generation_process_stops_the_run_naming_it_with_a_checkpoint_of_the_learner(tmp_path):
    code, err = kill_worker_after_a_checkpoint(tmp_path, "aspc gen[0]")
    assert code == 1, err
    assert "Traceback" not in err, err
    found = re.search(r"generation instance 0 failed: the process of gen\[0\] died \(signal 9\); checkpoint of "
                      r"step (\d+) in \S+ \(continue with --resume\)", err)
    assert found, err
    step = int(found.group(1))
    assert steps_saved(tmp_path / "ck")[-1] == step and trained(tmp_path / "ck" / f"step-{step:06d}")


def run_in_process(tmp_path, steps: int, every: int):
    args = ["run", str(ROOT / "pipelines" / "tiny_grpo.aspl"), "--steps", str(steps), "--warmstart", "5",
            "--checkpoint", str(tmp_path / "ck"), "--checkpoint-every", str(every), "--metrics",
            str(tmp_path / "m.jsonl"), "--workers", "threads"]
    return CliRunner().invoke(main, args)


@pytest.fixture
def full_disk(monkeypatch, tmp_path):
    """Renames into the checkpoint folder fail as on a full disk (we run as root: chmod stops nothing)."""
    real = os.replace
    folder = str(tmp_path / "ck")

    def replace(src, dst, *args, **kwargs):
        if str(dst).startswith(folder):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("steps, every", [(2, 10), (4, 2)], ids=["only-the-final-save", "a-mid-run-save"])
def test_a_checkpoint_that_cannot_be_written_is_an_error_naming_its_path(tmp_path, full_disk, steps, every):
    result = run_in_process(tmp_path, steps, every)
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception  # a message, not a traceback
    first = every if every < steps else steps
    assert f"cannot write the checkpoint of step {first} to {tmp_path / 'ck' / f'step-{first:06d}'}" in result.output
    assert "No space left on device" in result.output
    assert steps_saved(tmp_path / "ck") == [] and not list((tmp_path / "ck").glob(".tmp-*"))
