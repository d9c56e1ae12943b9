"""`aspc run` under bad input and damaged state: one clear message and the documented exit code,
never a traceback, a hang or lost data (issue 10). Interruptions: tests/test_chaos.py."""
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from aspc.drivers.local.metrics_file import MetricsFile, read_rows
from aspc.drivers.local.threads import threads_per_worker
from conftest import ROOT

TINY = ROOT / "pipelines" / "tiny_grpo.aspl"


def pipeline(tmp_path, old=None, new=None, name="p.aspl"):
    source = TINY.read_text()
    if old is not None:
        assert old in source
        source = source.replace(old, new)
    path = tmp_path / name
    path.write_text(source)
    return path


def run(aspc, tmp_path, *extra, file=None, steps=2):
    return aspc("run", str(file or TINY), "--steps", str(steps), "--warmstart", "0",
                "--metrics", str(tmp_path / "m.jsonl"), *extra)


def checkpointed(aspc, tmp_path, *extra, steps=2, file=None):
    return run(aspc, tmp_path, "--checkpoint", str(tmp_path / "ck"), "--checkpoint-every", "1", *extra,
               steps=steps, file=file)


def steps_of(path):
    return [row["step"] for row in read_rows(path)]


def assert_one_message(result, code, *needles):
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in result.output, result.output


# ---- data ----

def jsonl_pipeline(tmp_path, rows: str):
    (tmp_path / "d.jsonl").write_text(rows)
    return pipeline(tmp_path, 'synthetic("arith")', 'jsonl("d.jsonl")')


def test_a_broken_jsonl_line_is_one_message_with_its_file_and_line(aspc, tmp_path):
    file = jsonl_pipeline(tmp_path, '{"prompt": "1+2=", "answer": "3"}\n{"prompt": "4+\n')
    assert_one_message(run(aspc, tmp_path, file=file), 1, "d.jsonl:2: not valid JSON")


def test_a_row_without_a_prompt_is_one_message(aspc, tmp_path):
    file = jsonl_pipeline(tmp_path, '{"answer": "3"}\n')
    assert_one_message(run(aspc, tmp_path, file=file), 1, 'd.jsonl:1: each line needs a string "prompt"')


def test_a_missing_data_file_is_one_message(aspc, tmp_path):
    file = jsonl_pipeline(tmp_path, '{"prompt": "1+2=", "answer": "3"}\n')
    (tmp_path / "d.jsonl").unlink()
    result = run(aspc, tmp_path, file=file)
    assert_one_message(result, 1, "d.jsonl")


def test_a_failed_start_leaves_an_existing_metrics_file_alone(aspc, tmp_path):
    (tmp_path / "m.jsonl").write_text('{"step": 1, "reward": 0.5}\n')
    file = jsonl_pipeline(tmp_path, "not json\n")
    assert_one_message(run(aspc, tmp_path, file=file), 1, "d.jsonl:1")
    assert (tmp_path / "m.jsonl").read_text() == '{"step": 1, "reward": 0.5}\n'


# ---- metrics ----

def test_a_fresh_run_moves_old_metrics_aside_instead_of_overwriting_them(aspc, tmp_path):
    (tmp_path / "m.jsonl").write_text('{"step": 1, "reward": 0.5}\n')
    result = run(aspc, tmp_path)
    assert_one_message(result, 0, "moved to")
    assert (tmp_path / "m.1.jsonl").read_text() == '{"step": 1, "reward": 0.5}\n'
    rows = read_rows(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["tokens_per_s"] > 0 for r in rows)  # documented in docs/runtime.md, written to the file


def test_a_torn_last_line_is_skipped_and_the_next_row_starts_a_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "rew')
    metrics = MetricsFile(path, resume_version=1)
    metrics.open()
    metrics.append({"step": 2})
    assert steps_of(path) == [1, 2]
    path.write_text('{"step": 1}\n{"step": 2, "rew')
    MetricsFile(path, resume_version=None).append({"step": 3})
    assert steps_of(path) == [1, 3]


# ---- resume ----

@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """One run of 4 steps with a checkpoint after each, made once: each test damages a copy."""
    folder = tmp_path_factory.mktemp("four_steps")
    old = os.getcwd()
    os.chdir(ROOT)
    try:
        from click.testing import CliRunner

        from aspc.cli.main import main

        result = CliRunner().invoke(main, ["run", str(TINY), "--steps", "4", "--warmstart", "0", "--metrics",
                                           str(folder / "m.jsonl"), "--checkpoint", str(folder / "ck"),
                                           "--checkpoint-every", "1"], catch_exceptions=False)
    finally:
        os.chdir(old)
    assert result.exit_code == 0, result.output
    return folder


@pytest.fixture
def copied(four_steps, tmp_path):
    """tmp_path holds a copy of the 4-step run's checkpoints (ck/) and metrics (m.jsonl)."""
    shutil.copytree(four_steps / "ck", tmp_path / "ck")
    shutil.copy(four_steps / "m.jsonl", tmp_path / "m.jsonl")
    return tmp_path


def test_resuming_a_complete_run_says_so_and_exits_0_without_hanging(copied):
    """Used to print `resumed at step N` and idle forever; a subprocess with a timeout fails
    instead of hanging the suite."""
    for steps in ("4", "1"):
        again = subprocess.run([sys.executable, "-m", "aspc.cli.main", "run", str(TINY), "--steps", steps,
                                "--warmstart", "0", "--checkpoint", str(copied / "ck"), "--metrics",
                                str(copied / "m.jsonl"), "--resume"], capture_output=True, text=True, timeout=120)
        assert again.returncode == 0, again.stderr
        assert "already complete" in again.stderr and "Traceback" not in again.stderr
    assert steps_of(copied / "m.jsonl") == [1, 2, 3, 4]


def test_resume_walks_back_past_damaged_checkpoints_and_says_why(aspc, copied):
    tmp_path = copied
    ck = tmp_path / "ck"
    actor = ck / "step-000004" / "actor.safetensors"
    actor.write_bytes(actor.read_bytes()[: actor.stat().st_size // 2])  # truncated
    (ck / "step-000003" / "actor.optimizer.pt").write_bytes(b"")  # emptied
    result = checkpointed(aspc, tmp_path, "--resume", steps=5)
    assert_one_message(result, 0, "skipped step-000004: actor.safetensors is damaged",
                       "skipped step-000003: actor.optimizer.pt is damaged", "resumed at step 2")
    assert steps_of(tmp_path / "m.jsonl") == [1, 2, 3, 4, 5]


def test_a_bad_latest_pointer_or_a_deleted_step_folder_does_not_restart_from_zero(aspc, copied):
    tmp_path = copied
    ck = tmp_path / "ck"
    (ck / "latest").write_text("step-000099")
    shutil.rmtree(ck / "step-000004")
    result = checkpointed(aspc, tmp_path, "--resume", steps=5)
    assert_one_message(result, 0, "resumed at step 3", "latest: it names 'step-000099'")
    assert steps_of(tmp_path / "m.jsonl") == [1, 2, 3, 4, 5]


def test_resume_with_no_intact_checkpoint_refuses(aspc, tmp_path):
    assert checkpointed(aspc, tmp_path, steps=1).exit_code == 0
    (tmp_path / "ck" / "step-000001" / "manifest.json").write_text("{")
    result = checkpointed(aspc, tmp_path, "--resume", steps=2)
    assert_one_message(result, 1, "no intact checkpoint", "manifest.json is unreadable", "without --resume")


def test_resume_refuses_a_checkpoint_of_another_configuration(aspc, copied):
    tmp_path = copied
    other_seed = checkpointed(aspc, tmp_path, "--resume", "--seed", "3", steps=2)
    assert_one_message(other_seed, 1, "belongs to another run", "seed: 0 in the checkpoint, 3 now")
    other_pipeline = checkpointed(aspc, tmp_path, "--resume", file=pipeline(tmp_path, "tiny_grpo", "other"))
    assert_one_message(other_pipeline, 1, "belongs to another run", "pipeline: 'tiny_grpo'")


def test_resume_without_a_checkpoint_says_so_and_does_not_duplicate_rows(aspc, tmp_path):
    assert run(aspc, tmp_path).exit_code == 0  # a run without checkpoints
    result = checkpointed(aspc, tmp_path, "--resume", steps=2)
    assert_one_message(result, 0, "no checkpoint in", "starting from step 0", "moved to")
    assert steps_of(tmp_path / "m.jsonl") == [1, 2]


# ---- threads, rewards, timing ----

def test_each_worker_gets_a_share_of_the_cores(monkeypatch):
    monkeypatch.delenv("ASPC_TORCH_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1, 2, 3, 4, 5, 6, 7}, raising=False)
    assert threads_per_worker(3) == 2 and threads_per_worker(1) == 8 and threads_per_worker(16) == 1
    assert threads_per_worker(3, override=5) == 5
    monkeypatch.setenv("ASPC_TORCH_THREADS", "3")
    assert threads_per_worker(1) == 3
    monkeypatch.setenv("ASPC_TORCH_THREADS", "many")
    with pytest.raises(ValueError, match="ASPC_TORCH_THREADS"):
        threads_per_worker(1)


def test_worker_threads_run_torch_with_their_share(monkeypatch):
    from aspc.backends.cpu.executors import CpuExecutors
    from aspc.drivers.local.runtime import LocalRuntime, RunOptions
    from aspc.cli.toolchain import compile_with_passes

    monkeypatch.delenv("ASPC_TORCH_THREADS", raising=False)
    plan = compile_with_passes(TINY, []).plan()
    for threads in (1, 2):
        runtime = LocalRuntime(plan, TINY.parent, RunOptions(steps=1, warmstart_steps=0, threads=threads), CpuExecutors)
        runtime.build()
        runtime.run()
        workers = [runtime.learner_worker, *runtime.gen_workers]
        assert [w.torch_threads for w in workers] == [threads] * len(workers)


def test_dapo_reports_the_task_reward_and_the_shaped_reward_apart(aspc, tmp_path):
    file = pipeline(tmp_path, "loss = grpo,", "loss = dapo, overlong = 20,")
    assert_one_message(run(aspc, tmp_path, file=file, steps=3), 0)
    for row in read_rows(tmp_path / "m.jsonl"):
        assert 0.0 <= row["reward"] <= 1.0
        assert row["shaped_reward"] <= row["reward"]


def test_the_warm_start_is_its_own_phase_in_the_output_and_the_trace(aspc, tmp_path):
    result = aspc("run", str(TINY), "--steps", "2", "--warmstart", "5", "--metrics", str(tmp_path / "m.jsonl"),
                  "--trace", str(tmp_path / "t.json"))
    assert_one_message(result, 0, "warm start: 5 steps in", "after a")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(processes.values()) == ["asp", "warm start"]
    warm = [e for e in events if e["ph"] == "X" and processes[e["pid"]] == "warm start"]
    rl = [e for e in events if e["ph"] == "X" and processes[e["pid"]] == "asp"]
    assert len(warm) == 1 and min(e["ts"] for e in rl) >= warm[0]["ts"] + warm[0]["dur"]


def test_ctrl_c_during_the_warm_start_is_one_line_and_exit_130(tmp_path):
    (tmp_path / "m.jsonl").write_text('{"step": 1}\n')
    process = subprocess.Popen([sys.executable, "-m", "aspc.cli.main", "run", str(TINY), "--warmstart", "100000",
                                "--metrics", str(tmp_path / "m.jsonl")], stderr=subprocess.PIPE, text=True)
    first = process.stderr.readline()  # printed when the warm start's first step is done
    assert first.startswith("warm start:"), first
    process.send_signal(signal.SIGINT)
    err = first + process.stderr.read()
    assert process.wait(timeout=120) == 130
    assert "stopped by Ctrl-C during the warm start" in err and "Traceback" not in err
    assert (tmp_path / "m.jsonl").read_text() == '{"step": 1}\n'  # nothing trained, nothing touched


def test_a_directory_given_as_the_file_is_exit_1(aspc):
    assert_one_message(aspc("run", "pipelines"), 1, "this is a directory")


def test_any_flipped_byte_in_a_checkpoint_is_caught_before_loading(tmp_path):
    import random

    import torch

    from aspc.rl import checkpoint

    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    path = checkpoint.save(tmp_path, 1, {"actor": model}, {"actor": optimizer}, {"config": {}})
    assert checkpoint.verify(path) is None
    rng = random.Random(0)
    files = sorted(p for p in path.iterdir() if p.name != "manifest.json")
    for _ in range(20):
        file = rng.choice(files)
        data = bytearray(file.read_bytes())
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
        original = file.read_bytes()
        file.write_bytes(bytes(data))
        assert "damaged" in checkpoint.verify(path), (file.name, at)
        file.write_bytes(original)
    assert checkpoint.find_resume_point(tmp_path).version == 1


def test_a_fresh_run_refuses_a_folder_with_another_runs_checkpoints(aspc, tmp_path):
    assert checkpointed(aspc, tmp_path, steps=1).exit_code == 0
    before = (tmp_path / "m.jsonl").read_text()
    assert_one_message(checkpointed(aspc, tmp_path, steps=1), 1, "already holds checkpoints", "--resume")
    assert (tmp_path / "m.jsonl").read_text() == before


def test_what_the_cpu_backend_cannot_execute_is_refused_at_its_line(aspc, tmp_path):
    judged = pipeline(tmp_path, 'reward(gen, rule = "exact_match")',
                      'reward(gen, sources = [rule("exact_match"), model(ref)])', name="judged.aspl")
    assert_one_message(run(aspc, tmp_path, file=judged), 1, "judged.aspl:", "stage 'score'",
                       "reward model 'ref' has no weights", "aspc train-rm")
    epochs = run(aspc, tmp_path, "--set", "update.epochs=2")
    assert_one_message(epochs, 1, "<--set>:1:", "trains one epoch per step", "set epochs = 1")
    assert not (tmp_path / "m.jsonl").exists()  # refused before the run


def test_an_unexpected_error_stops_the_worker_processes_before_its_traceback(tmp_path, monkeypatch):
    """A bug raised after the workers started (here in the held-out evaluation before RL) used to
    leave the worker processes up, and the process hung at exit after printing the traceback."""
    from click.testing import CliRunner

    from aspc.cli.main import main
    from aspc.drivers.local.runtime import LocalRuntime

    built = []
    build = LocalRuntime.build
    monkeypatch.setattr(LocalRuntime, "build", lambda self: built.append(self) or build(self))

    def broken(self, count=128):
        raise RuntimeError("a bug in the evaluation")

    monkeypatch.setattr(LocalRuntime, "accuracy", broken)
    result = CliRunner().invoke(main, ["run", str(TINY), "--steps", "2", "--warmstart", "0",
                                       "--metrics", str(tmp_path / "m.jsonl")])
    assert isinstance(result.exception, RuntimeError), result.output
    assert built and built[0].stopped
    assert not any(w.generator.child.process.is_alive() for w in built[0].gen_workers)
