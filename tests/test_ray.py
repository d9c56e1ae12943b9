"""The Ray runtime (a local Ray with 2 CPUs): the local runtime's samples, and a generation actor
killed mid-run without losing or duplicating a sample."""
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from aspc.backends.cpu.executors import CpuExecutors  # noqa: E402
from aspc.drivers.local.runtime import LocalRuntime, RunOptions  # noqa: E402
from aspc.drivers.ray.runtime import RayRuntime  # noqa: E402
from aspc.cli.toolchain import compile_with_passes  # noqa: E402
from conftest import ROOT  # noqa: E402


def plan(overrides=()):
    return compile_with_passes(ROOT / "pipelines" / "tiny_grpo.aspl", list(overrides)).plan()


def expected(step):
    return [[step - 1, p, g] for p in range(16) for g in range(4)]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    yield
    ray.shutdown()


def test_ray_gives_the_local_runtimes_samples_per_step():
    options = RunOptions(steps=3, warmstart_steps=50)
    local = LocalRuntime(plan(["schedule.staleness=0"]), ROOT / "pipelines", options, CpuExecutors)
    local.build()
    on_ray = RayRuntime(plan(["schedule.staleness=0"]), ROOT / "pipelines", RunOptions(steps=3, warmstart_steps=50),
                        CpuExecutors)
    on_ray.build()
    a, b = local.run().metrics, on_ray.run().metrics
    assert [m["trained"] for m in a] == [m["trained"] for m in b]
    assert [list(map(list, m["trained"])) for m in b] == [expected(s) for s in (1, 2, 3)]
    # the first step starts from identical weights: identical responses and rewards; later steps
    # differ by float rounding (Ray workers run torch with other thread counts)
    assert a[0]["reward"] == b[0]["reward"]


def run_killing_the_first_actor(runtime, after_steps: int = 2, wait_s: float = 120):
    """Build and run `runtime`, killing gen[0]'s actor (no restart by Ray: the runtime's own) once
    `after_steps` steps finished (or `wait_s` passed); the run's result."""
    runtime.build()
    victim = runtime.gen_workers[0].generator.actor

    def kill_after_steps():
        deadline = time.time() + wait_s
        while len(runtime.step_metrics) < after_steps and time.time() < deadline:
            time.sleep(0.01)
        ray.kill(victim, no_restart=True)

    killer = threading.Thread(target=kill_after_steps, daemon=True)
    killer.start()
    result = runtime.run()
    killer.join()
    return result


def test_a_killed_generation_actor_is_restarted_and_no_sample_is_lost_or_duplicated():
    runtime = RayRuntime(plan(), ROOT / "pipelines", RunOptions(steps=6, warmstart_steps=20), CpuExecutors)
    result = run_killing_the_first_actor(runtime)
    assert runtime.restarts.get(0) == 1
    assert [m["step"] for m in result.metrics] == [1, 2, 3, 4, 5, 6]
    for m in result.metrics:
        assert [list(s) for s in m["trained"]] == expected(m["step"])


def test_run_command_on_ray(aspc, tmp_path):
    result = aspc("run", "pipelines/tiny_grpo.aspl", "--runtime", "ray", "--steps", "2", "--warmstart", "10",
                  "--metrics", str(tmp_path / "m.jsonl"))
    assert result.exit_code == 0, result.output
    assert "2 steps" in result.stdout


def test_without_ray_the_message_says_how_to_install_it(tmp_path):
    import subprocess
    import sys

    code = ("import sys; sys.modules['ray'] = None; from aspc.cli.main import main; "
            f"main(['run', r'{ROOT / 'pipelines' / 'tiny_grpo.aspl'}', '--runtime', 'ray', '--steps', '1', "
            f"'--warmstart', '0', '--metrics', r'{tmp_path / 'm.jsonl'}'])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "pip install 'aspc[ray]'" in result.stderr and "Traceback" not in result.stderr


def test_actors_sit_in_the_pools_placement_group():
    runtime = RayRuntime(plan(), ROOT / "pipelines", RunOptions(steps=1, warmstart_steps=0), CpuExecutors)
    runtime.build()
    table = ray.util.placement_group_table(runtime.placement)
    assert table["strategy"] == "STRICT_PACK"
    assert len(table["bundles"]) == len(runtime.gen_workers) + 1
    runtime.run()
    assert runtime.placement is None  # removed at the end of the run


def test_a_learner_checkpoint_comes_back_from_the_actor(tmp_path):
    options = RunOptions(steps=2, warmstart_steps=0, checkpoint_dir=tmp_path / "ck", checkpoint_every=1)
    runtime = RayRuntime(plan(), ROOT / "pipelines", options, CpuExecutors)
    runtime.build()
    runtime.run()
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-000002"
    assert (tmp_path / "ck" / "step-000002" / "actor.safetensors").exists()


def test_an_instance_that_keeps_failing_ends_the_run_with_a_clear_message():
    """Generation instance 0's actor is killed each time it is (re)started: after MAX_RESTARTS
    restarts the run ends with WorkerFailed naming the instance, and frees its actors."""
    from aspc.drivers.ray.runtime import MAX_RESTARTS
    from aspc.drivers.local.workers import WorkerFailed

    runtime = RayRuntime(plan(), ROOT / "pipelines", RunOptions(steps=10_000, warmstart_steps=0), CpuExecutors)
    runtime.build()
    killed = []

    def kill_every_incarnation_of_instance_0():
        deadline = time.time() + 120
        while not runtime.stopped and time.time() < deadline:
            actor = runtime.gen_workers[0].generator.actor
            if actor not in killed:
                ray.kill(actor, no_restart=True)
                killed.append(actor)
            time.sleep(0.01)

    killer = threading.Thread(target=kill_every_incarnation_of_instance_0, daemon=True)
    killer.start()
    with pytest.raises(WorkerFailed, match=f"generation instance 0 failed {MAX_RESTARTS + 1} times; giving up"):
        runtime.run()
    killer.join(timeout=30)
    assert runtime.restarts == {0: MAX_RESTARTS + 1}
    assert len(killed) == MAX_RESTARTS + 1  # the first actor and each of its MAX_RESTARTS replacements
    assert runtime.stopped and runtime.placement is None


def test_ray_run_errors_and_ctrl_c_are_one_message(tmp_path):
    """Under --runtime ray as under the local runtime: a bad data row is one located message (exit
    1); Ctrl-C mid-training saves the finished steps and a checkpoint (exit 130); no traceback."""
    import signal
    import subprocess
    import sys

    (tmp_path / "d.jsonl").write_text('{"prompt": 3}\n')
    bad = tmp_path / "bad.aspl"
    source = (ROOT / "pipelines" / "tiny_grpo.aspl").read_text()
    bad.write_text(source.replace('synthetic("arith")', 'jsonl("d.jsonl")'))
    base = [sys.executable, "-m", "aspc.cli.main", "run", "--runtime", "ray", "--warmstart", "0",
            "--metrics", str(tmp_path / "m.jsonl")]
    failed = subprocess.run([*base, str(bad)], capture_output=True, text=True, timeout=300)
    assert failed.returncode == 1 and "d.jsonl:1" in failed.stderr and "Traceback" not in failed.stderr
    process = subprocess.Popen([*base, str(ROOT / "pipelines" / "tiny_grpo.aspl"), "--steps", "100000",
                                "--checkpoint", str(tmp_path / "ck"), "--checkpoint-every", "1000"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None and not (
            (tmp_path / "m.jsonl").exists() and len((tmp_path / "m.jsonl").read_text().splitlines()) >= 2):
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=180)
    assert process.returncode == 130, err
    assert "stopped by Ctrl-C after step" in err and "Traceback" not in err
    assert (tmp_path / "ck" / "latest").exists()
