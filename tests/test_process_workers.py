"""Process workers (aspc/drivers/local/processes.py): the same run as with threads, and a worker
process that dies ends the run with a message naming it."""
import os
import signal

import pytest

from aspc.backends.cpu.executors import CpuExecutors
from aspc.drivers.local.processes import ChildProcess, start_fork_server
from aspc.drivers.local.runtime import LocalRuntime, RunOptions
from aspc.drivers.local.workers import WorkerFailed
from aspc.cli.toolchain import compile_with_passes
from conftest import ROOT


def runtime(workers: str, steps: int = 3, pipeline: str = "tiny_grpo") -> LocalRuntime:
    path = ROOT / "pipelines" / f"{pipeline}.aspl"
    plan = compile_with_passes(path, [], "sync").plan()
    run = LocalRuntime(plan, path.parent, RunOptions(steps=steps, warmstart_steps=20, workers=workers), CpuExecutors)
    run.build()
    return run


def test_processes_train_exactly_as_threads():
    """Under sync (no timing in the schedule's choices) the two kinds of workers generate the same
    samples, score them alike and make the same updates; the trained weights come back."""
    rows = {}
    for workers in ("threads", "processes"):
        run = runtime(workers)
        rows[workers] = run.run().metrics
        rows[workers + " weights"] = {k: v.clone() for k, v in run.executors.actor.state_dict().items()}
    for a, b in zip(rows["threads"], rows["processes"]):
        assert a["trained"] == b["trained"] and a["reward"] == b["reward"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    for name, tensor in rows["threads weights"].items():
        assert (tensor - rows["processes weights"][name]).abs().max() < 1e-4, name


def test_a_killed_generation_process_ends_the_run_naming_the_instance():
    run = runtime("processes")
    os.kill(run.gen_workers[0].generator.child.process.pid, signal.SIGKILL)
    with pytest.raises(WorkerFailed, match="generation instance 0 failed"):
        run.run()


def test_a_killed_learner_process_ends_the_run_naming_it():
    run = runtime("processes", steps=50)
    os.kill(run.learner_worker.learner.child.process.pid, signal.SIGKILL)
    with pytest.raises(WorkerFailed, match="learner.*died"):
        run.run()


class _Probe:
    """A worker's server that reports what its process sees."""

    def modules(self) -> list[str]:
        return []

    def seen(self, name: str) -> tuple:
        return os.environ.get(name), os.getcwd()


def _keep_threads(count: int) -> int:
    return count


def test_a_worker_process_has_the_environment_and_directory_of_its_start(monkeypatch, tmp_path):
    """Children fork from a fork server started earlier, with the environment of then; a child
    still takes the main process's environment and working directory as they are at its start."""
    start_fork_server([])
    monkeypatch.setenv("ASPC_PROBE", "set after the fork server started")
    monkeypatch.chdir(tmp_path)
    child = ChildProcess("probe", _Probe(), 1, _keep_threads, [])
    try:
        assert child.call("seen", "ASPC_PROBE") == ("set after the fork server started", str(tmp_path))
    finally:
        child.stop()
        child.join()
    assert child.process.exitcode == 0


def test_a_learner_process_writes_its_own_checkpoints_equal_to_one_saved_from_threads(tmp_path, monkeypatch):
    """Its state stays in its process (pulling it to the driver took ~20 s and 4 GB a save on a 135M
    model): only the run's end brings it back. The checkpoints equal those of a thread learner."""
    from aspc.drivers.local.processes import ProcessLearner
    from aspc.rl.checkpoint import load, read_manifest

    pulled = []
    parts, adopt_into = ProcessLearner.parts, ProcessLearner.adopt_into
    monkeypatch.setattr(ProcessLearner, "parts", lambda self: pulled.append("parts") or parts(self))
    monkeypatch.setattr(ProcessLearner, "adopt_into", lambda self, *a: pulled.append("end") or adopt_into(self, *a))
    saved = {}
    for workers in ("threads", "processes"):
        path = ROOT / "pipelines" / "tiny_grpo.aspl"
        plan = compile_with_passes(path, [], "sync").plan()
        options = RunOptions(steps=3, warmstart_steps=20, workers=workers, checkpoint_dir=tmp_path / workers,
                             checkpoint_every=1)
        run = LocalRuntime(plan, path.parent, options, CpuExecutors)
        run.build()
        run.run()
        saved[workers] = tmp_path / workers / "step-000002"
    assert pulled == ["end"]  # at the end, for the held-out evaluation: not once per checkpoint
    manifests = [read_manifest(saved[w]) for w in ("threads", "processes")]
    assert [m["version"] for m in manifests] == [2, 2] and manifests[0]["config"] == manifests[1]["config"]
    models = [CpuExecutors.parts(CpuExecutors(plan, path.parent).trainer()) for _ in range(2)]
    for (m, o), where in zip(models, saved.values()):
        load(where, m, o)
    for name, tensor in models[0][0]["actor"].state_dict().items():
        assert (tensor - models[1][0]["actor"].state_dict()[name]).abs().max() < 1e-4, name


def test_an_engine_that_cannot_go_to_its_process_starts_none_and_leaves_none_running(monkeypatch):
    """Instance 1 cannot be pickled: the build fails naming why, and instance 0's process, already
    started, ends (before, it waited on its pipe and Python's exit waited on it forever)."""
    engine_of = CpuExecutors.generation_engine

    def second_unpicklable(self, index: int, instances: int):
        engine = engine_of(self, index, instances)
        if index == 1:
            engine.unpicklable = lambda: None
        return engine

    monkeypatch.setattr(CpuExecutors, "generation_engine", second_unpicklable)
    path = ROOT / "pipelines" / "tiny_grpo.aspl"  # two instances
    run = LocalRuntime(compile_with_passes(path, [], "sync").plan(), path.parent,
                       RunOptions(steps=1, warmstart_steps=1, workers="processes"), CpuExecutors)
    with pytest.raises((AttributeError, TypeError), match="pickle"):
        run.build()
    first = run.gen_workers[0].generator.child.process
    first.join(timeout=60)
    assert first.exitcode is not None
    assert not hasattr(run.gen_workers[1].generator, "child")  # its process never started


def test_the_runs_end_brings_back_what_the_learner_changed_and_not_the_frozen_reference():
    from aspc.drivers.local.processes import _LearnerServer

    path = ROOT / "pipelines" / "tiny_grpo.aspl"
    learner = CpuExecutors(compile_with_passes(path, [], "sync").plan(), path.parent).trainer()
    server = _LearnerServer(learner)
    trained, stepped = server.trained_parts()
    assert trained == ["actor"] and stepped == ["actor"]  # tiny_grpo: no critic; the reference is frozen
    assert server.part("model", "actor").keys() == learner.actor.state_dict().keys()
