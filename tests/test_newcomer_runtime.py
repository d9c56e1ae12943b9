"""A newcomer's findings on `aspc run` and `aspc simulate` (issue 36): progress lines in logs, the
warm start's torch threads, a held-out verified accuracy, checkpoint size and retention, and the
size of the simulator's trace."""
import json
import os

import pytest
import torch

from aspc.accounting.trace import Span, phases, trace_events
from aspc.rl import checkpoint
from aspc.backends.cpu.executors import CpuExecutors
from aspc.cli.run import _Progress, verifier_of
from aspc.drivers.local.retention import steps_to_prune
from aspc.drivers.local.runtime import LocalRuntime, RunOptions
from aspc.cli.toolchain import compile_with_passes
from conftest import ROOT

TINY = ROOT / "pipelines" / "tiny_grpo.aspl"


def plan_of(name: str, old: str | None = None, new: str | None = None, tmp_path=None):
    file = ROOT / "pipelines" / f"{name}.aspl"
    if old is not None:
        source = file.read_text()
        assert old in source
        (tmp_path / "tiny_rewards.py").write_text((ROOT / "pipelines" / "tiny_rewards.py").read_text())
        file = tmp_path / f"{name}.aspl"
        file.write_text(source.replace(old, new))
    return compile_with_passes(file, []).plan()


# ---- 1. progress lines when stderr is not a terminal ----

class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def step_metrics(reward: float) -> dict:
    return {"reward": reward, "tokens_per_s": 250.0, "staleness_mean": 0.5, "wall_s": 1.0}


def test_without_a_terminal_a_progress_line_comes_every_interval_and_at_the_end(capsys):
    clock = FakeClock()
    progress = _Progress(steps=4, warmstart_steps=30, schedule="asp", log_every=10, clock=clock)
    for step, at in enumerate([101, 105, 111, 113]):  # the warm start's clock starts at its first step
        clock.now = at
        progress.on_warmstart(step, 2.0 - 0.1 * step)
    clock.now = 120
    progress.warm_done(19.0)
    for step, at in zip([1, 2, 3, 4], [125, 128, 131, 150]):
        clock.now = at
        progress.on_step(step, step_metrics(0.25 * step))
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "warm start: 30 supervised steps before RL",
        "warm start: step 3/30, loss 1.800, 10 s elapsed, ETA 2 min 15 s",  # 2 steps in 10 s, 27 to go
        "warm start: 4 steps in 19.0 s, loss 1.700",
        "asp: step 3/4, reward 0.750, 250 tok/s, 11 s elapsed, ETA 4 s",
        "asp: step 4/4, reward 1.000, 250 tok/s, 30 s elapsed",  # the phase's last step: always
    ]


def test_a_resumed_runs_eta_counts_only_the_steps_it_trained(capsys):
    clock = FakeClock()
    progress = _Progress(steps=20, warmstart_steps=0, schedule="sync", log_every=10, clock=clock)
    progress.warm_done(0.0)
    progress.done_before = 10
    clock.now = 105
    progress.on_step(11, step_metrics(0.5))
    clock.now = 110  # 2 steps in 10 s: 5 s a step, 8 to go
    progress.on_step(12, step_metrics(0.5))
    assert capsys.readouterr().err.splitlines() == ["sync: step 12/20, reward 0.500, 250 tok/s, 10 s elapsed, "
                                                    "ETA 40 s"]


# ---- 2. the warm start shares the cores as the RL workers do ----

class RecordingExecutors(CpuExecutors):
    """The CPU backend, recording the torch threads its warm start ran with."""

    def warm_start(self, steps: int, on_step=None) -> None:
        self.warm_threads = torch.get_num_threads()
        super().warm_start(steps, on_step)


@pytest.mark.parametrize("override", [None, 1, 3])
def test_the_warm_start_runs_with_a_workers_share_of_the_cores(monkeypatch, override):
    monkeypatch.delenv("ASPC_TORCH_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(12)), raising=False)
    before = torch.get_num_threads()
    runtime = LocalRuntime(plan_of("tiny_grpo"), TINY.parent,
                           RunOptions(steps=1, warmstart_steps=1, workers="threads", threads=override),
                           RecordingExecutors)
    try:
        runtime.build()
    finally:
        torch.set_num_threads(before)
    workers = runtime.config.instances + len(runtime.config.executors)
    assert workers > 1
    expected = override if override is not None else 12 // workers
    assert runtime.threads == expected and runtime.executors.warm_threads == expected


# ---- 3. a held-out verified accuracy at the end of `aspc run` ----

def test_the_verifier_is_the_rule_or_exact_match_beside_a_learned_reward(tmp_path):
    assert verifier_of(plan_of("tiny_grpo")) == "rule exact_match"
    assert verifier_of(plan_of("tiny_rlhf")) == "exact match with the data's answers"
    assert verifier_of(plan_of("tiny_rlaif")) == "exact match with the data's answers"
    python_only = plan_of("tiny_grpo", 'reward(gen, rule = "exact_match")',
                          'reward(gen, python = "tiny_rewards:well_formed")', tmp_path)
    assert verifier_of(python_only) is None


def test_aspc_run_prints_the_held_out_verified_accuracy_before_and_after_rl(aspc, tmp_path):
    result = aspc("run", str(TINY), "--steps", "1", "--warmstart", "5", "--metrics", str(tmp_path / "m.jsonl"))
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("held-out accuracy"))
    assert "128 prompts" in line and "verified by rule exact_match" in line
    assert "after the warm start ->" in line and line.endswith("after step 1")


def test_tiny_rlhf_is_measured_by_the_tasks_answers_not_the_reward_model(aspc, tmp_path):
    result = aspc("run", str(ROOT / "pipelines" / "tiny_rlhf.aspl"), "--steps", "1", "--warmstart", "0",
                  "--workers", "threads", "--metrics", str(tmp_path / "m.jsonl"))
    assert result.exit_code == 0, result.output
    assert "verified by exact match with the data's answers" in result.output
    assert "before RL ->" in result.output


# ---- 4. checkpoints: the frozen reference once, retention ----

def frozen_and_trained():
    torch.manual_seed(0)
    actor, reference = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(actor.parameters())
    return actor, reference, optimizer


def train_one_step(actor, optimizer):
    actor(torch.ones(2, 8)).sum().backward()
    optimizer.step()


def test_an_unchanged_reference_is_stored_once_and_each_step_folder_stays_whole(tmp_path):
    actor, reference, optimizer = frozen_and_trained()
    paths = []
    for version in (1, 2, 3):
        train_one_step(actor, optimizer)
        paths.append(checkpoint.save(tmp_path, version, {"actor": actor, "reference": reference},
                                     {"actor": optimizer}, {"config": {}}))
    inodes = {(p / "reference.safetensors").stat().st_ino for p in paths}
    assert len(inodes) == 1  # one file on disk
    assert len({(p / "actor.safetensors").stat().st_ino for p in paths}) == 3
    for path in paths[:2]:  # deleting the first folders leaves the last one whole
        for file in path.iterdir():
            file.unlink()
        path.rmdir()
    assert checkpoint.verify(paths[2]) is None
    restored = torch.nn.Linear(8, 4)
    checkpoint.load(paths[2], {"actor": torch.nn.Linear(8, 4), "reference": restored}, {})
    assert all(torch.equal(a, b) for a, b in zip(restored.state_dict().values(), reference.state_dict().values()))


def test_a_damaged_earlier_reference_is_not_linked_to(tmp_path):
    actor, reference, optimizer = frozen_and_trained()
    first = checkpoint.save(tmp_path, 1, {"actor": actor, "reference": reference}, {"actor": optimizer}, {})
    file = first / "reference.safetensors"
    data = bytearray(file.read_bytes())
    data[-1] ^= 1
    file.write_bytes(bytes(data))
    second = checkpoint.save(tmp_path, 2, {"actor": actor, "reference": reference}, {"actor": optimizer}, {})
    assert (second / "reference.safetensors").stat().st_ino != file.stat().st_ino
    assert checkpoint.verify(second) is None and "damaged" in checkpoint.verify(first)


def test_retention_keeps_the_newest_and_never_the_one_written():
    assert steps_to_prune([2, 4, 6, 8], written=8, keep=3) == [2]
    assert steps_to_prune([2, 4, 6, 8], written=8, keep=1) == [2, 4, 6]
    assert steps_to_prune([2, 4, 6, 8], written=8, keep=None) == []
    assert steps_to_prune([8], written=8, keep=1) == []
    # resumed at 4 past a damaged 8: 8 is neither counted nor deleted, 6 is being written
    assert steps_to_prune([2, 4, 6, 8], written=6, keep=2) == [2]


def step_folders(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("step-"))


def test_aspc_run_keep_prunes_old_checkpoints_and_resume_still_works(aspc, tmp_path):
    def run(*extra, steps):
        return aspc("run", str(TINY), "--steps", str(steps), "--warmstart", "0", "--workers", "threads",
                    "--checkpoint", str(tmp_path / "ck"), "--checkpoint-every", "1", "--metrics",
                    str(tmp_path / "m.jsonl"), *extra)

    first = run("--keep", "2", steps=4)
    assert first.exit_code == 0, first.output
    assert step_folders(tmp_path / "ck") == ["step-000003", "step-000004"]
    references = {(tmp_path / "ck" / f / "reference.safetensors").stat().st_ino for f in step_folders(tmp_path / "ck")}
    assert len(references) == 1
    again = run("--resume", steps=5)  # the default keeps 3
    assert again.exit_code == 0, again.output
    assert "resumed at step 4" in again.output
    assert step_folders(tmp_path / "ck") == ["step-000003", "step-000004", "step-000005"]


# ---- 5. the simulator's trace: small by default ----

def test_the_small_trace_merges_decode_segments_and_drops_per_sample_detail():
    spans = [Span("gen[0]", 0.0, 1.0, "useful", "useful"), Span("gen[0]", 1.0, 1.5, "tail", "tail"),
             Span("gen[0]", 1.5, 2.0, "useful", "useful"), Span("gen[0]", 2.0, 2.5, "sync", "sync"),
             Span("gen[0]", 2.5, 3.0, "useful", "useful"),
             Span("tools[0]", 0.0, 1.0, "tool", "calculator", "sample 0/1/2"),
             Span("tools[0]", 1.0, 2.0, "tool", "calculator", "sample 0/3/1")]
    small = [(s.track, s.start, s.end, s.category, s.label) for s in phases(spans)]
    assert small == [("gen[0]", 0.0, 2.0, "useful", "decode (useful 75%, tail 25%)"),
                     ("gen[0]", 2.0, 2.5, "sync", "sync"), ("gen[0]", 2.5, 3.0, "useful", "useful"),
                     ("tools[0]", 0.0, 2.0, "tool", "calculator")]
    full = [e["name"] for e in trace_events(spans, "asp", 1, "full") if e["ph"] == "X"]
    assert "calculator (sample 0/1/2)" in full and len(full) == len(spans)


def rows(trace: dict) -> set:
    """Perfetto's rows: (process, thread) names."""
    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    return {(processes[e["pid"]], e["args"]["name"]) for e in events if e["name"] == "thread_name"}


def test_simulate_writes_a_much_smaller_trace_by_default_with_the_same_rows(aspc, tmp_path):
    grpo = str(ROOT / "pipelines" / "grpo_7b.aspl")
    for detail in ("small", "full"):
        result = aspc("simulate", grpo, "--steps", "20", "--trace", str(tmp_path / f"{detail}.json"),
                      "--trace-detail", detail)
        assert result.exit_code == 0, result.output
    assert aspc("simulate", grpo, "--steps", "20", "--trace", str(tmp_path / "default.json")).exit_code == 0
    small, full = (tmp_path / "small.json").read_bytes(), (tmp_path / "full.json").read_bytes()
    assert (tmp_path / "default.json").read_bytes() == small
    assert len(small) * 10 < len(full)
    small_trace, full_trace = json.loads(small), json.loads(full)
    assert rows(small_trace) == rows(full_trace) and len(rows(small_trace)) > 2
    for event in small_trace["traceEvents"]:
        assert event["ph"] in ("M", "X") and {"pid", "tid", "name"} <= set(event)
        assert event["ph"] == "M" or event["dur"] >= 0
    span_ends = [max(e["ts"] + e["dur"] for e in t["traceEvents"] if e["ph"] == "X") for t in (small_trace, full_trace)]
    assert span_ends[0] == pytest.approx(span_ends[1], abs=1)
