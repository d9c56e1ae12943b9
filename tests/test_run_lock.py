"""One run per folder (aspc/drivers/local/run_lock.py): a second run or resume on a folder that a
live run holds is refused; a lock whose owner is gone is taken over."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from aspc.drivers.local.run_lock import LOCK_NAME, FolderInUse, RunLock
from conftest import ROOT


def _write_lock(folder, pid: int, started: str, host: str | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    path.write_text(json.dumps({"pid": pid, "started": started, "host": host or socket.gethostname()}))
    return path


def test_a_held_folder_is_refused_and_free_again_after_release(tmp_path):
    with RunLock([tmp_path / "run", tmp_path / "ck"]):
        in_use = rf"{tmp_path / 'run'} is in use by another aspc run \(pid {os.getpid()}\)"
        with pytest.raises(FolderInUse, match=in_use):
            RunLock([tmp_path / "run"]).acquire()
        with pytest.raises(FolderInUse):
            RunLock([tmp_path / "other", tmp_path / "ck"]).acquire()  # the checkpoint folder alone is enough
        assert not (tmp_path / "other" / LOCK_NAME).exists()  # taken together or not at all
    assert not (tmp_path / "run" / LOCK_NAME).exists() and not (tmp_path / "ck" / LOCK_NAME).exists()
    with RunLock([tmp_path / "run"]):
        pass


def test_the_lock_of_a_dead_process_or_a_reused_pid_is_taken_over(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    _write_lock(tmp_path / "a", gone.pid, "12345")
    _write_lock(tmp_path / "b", os.getpid(), "not my start time")  # the pid now belongs to another process
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / LOCK_NAME).write_text('{"pid": 1')  # torn by a kill while it was written
    lock = RunLock([tmp_path / "a", tmp_path / "b", tmp_path / "c"]).acquire()
    assert len(lock.notes) == 3 and f"pid {gone.pid}, which is gone" in lock.notes[0]
    assert json.loads((tmp_path / "a" / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_another_hosts_lock_is_refused_with_the_file_to_remove(tmp_path):
    path = _write_lock(tmp_path, 1, "1", host="elsewhere.example")
    with pytest.raises(FolderInUse, match=rf"on host elsewhere.example.*remove {path}"):
        RunLock([tmp_path]).acquire()


def test_release_leaves_a_lock_that_another_run_took_over(tmp_path):
    lock = RunLock([tmp_path]).acquire()
    _write_lock(tmp_path, 1, "7")  # as if another run had taken it over
    lock.release()
    assert (tmp_path / LOCK_NAME).exists()


def test_a_second_run_on_a_running_runs_folder_is_refused_and_a_killed_runs_lock_is_stale(aspc, tmp_path):
    metrics = tmp_path / "run" / "metrics.jsonl"
    args = ["pipelines/tiny_grpo.aspl", "--steps", "200", "--warmstart", "5", "--metrics", str(metrics),
            "--checkpoint", str(tmp_path / "ck")]
    first = subprocess.Popen([sys.executable, "-m", "aspc", "run", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ck" / LOCK_NAME).exists() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.1)
        assert (tmp_path / "ck" / LOCK_NAME).exists(), "the first run never locked its folders"
        second = aspc("run", *args[:-2], "--steps", "1")  # the same metrics folder
        resumed = aspc("run", *args, "--resume")
        for result in (second, resumed):
            assert result.exit_code == 1 and "is in use by another aspc run" in result.output, result.output
            assert f"pid {first.pid}" in result.output and "Traceback" not in result.output
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # as a crash would: its locks stay behind
        first.wait()
    after = aspc("run", "pipelines/tiny_grpo.aspl", "--steps", "1", "--warmstart", "2", "--workers", "threads",
                 "--metrics", str(metrics))
    assert after.exit_code == 0 and "took over the stale lock" in after.output, after.output
    assert not (tmp_path / "run" / LOCK_NAME).exists()
