"""The driver keeps only the policy versions an instance can still be asked to load (the newest and
the outstanding requests), not every version the learner ever published."""
from aspc.drivers.local.published import PublishedVersions


def test_loaded_versions_go_and_outstanding_ones_stay():
    weights = {0: "w0"}
    kept = PublishedVersions(weights)
    kept.requested(0, 0)
    kept.loaded(0, 0)
    assert weights == {0: "w0"}  # the newest stays
    weights[1], weights[2] = "w1", "w2"
    kept.requested(0, 1)  # instance 0 told to load 1; 2 published meanwhile
    kept.requested(1, 2)
    kept.loaded(1, 2)
    assert weights == {1: "w1", 2: "w2"}  # 0 went; 1 waits to be loaded
    kept.loaded(0, 1)
    assert weights == {2: "w2"}


def test_a_long_run_keeps_a_bounded_number_of_versions(tmp_path):
    from aspc.drivers.local.runtime import LocalRuntime, RunOptions
    from aspc.backends.cpu.executors import CpuExecutors
    from aspc.cli.toolchain import compile_with_passes
    from conftest import ROOT

    path = ROOT / "pipelines" / "tiny_grpo.aspl"
    runtime = LocalRuntime(compile_with_passes(path).plan(), path.parent,
                           RunOptions(steps=12, warmstart_steps=0, workers="threads"), CpuExecutors)
    runtime.build()
    metrics = runtime.run().metrics
    assert len(metrics) == 12
    assert max(runtime.weights) == 12 and len(runtime.weights) <= 1 + runtime.config.instances
