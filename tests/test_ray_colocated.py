"""A colocated (time-shared) pool across two nodes on the Ray runtime (aspc/drivers/ray/colocated.py):
each engine's actor on the node of its NPUs beside the trainer ranks on them, the controller's pool
switches carried out on every node, the same samples trained as `--backend cpu`. One local Ray
with fake node resources `node:10.0.0.1` (node0) and `node:10.0.0.2` (node1) and one fake NPU (for
trainer rank 0's actor); the engines are test_ascend_executors' fakes of vLLM, and the NPU IPC send
of every trainer rank hands each chip's handle to the engine worker on that chip, named
"<node address>-<device>" as vllm-ascend's npu_generate_uuid names a host's physical chip."""
import json
import os
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")

from aspc.backends.ascend.weight_sync import IpcSender  # noqa: E402
from conftest import ROOT  # noqa: E402
from test_ascend_colocated import all_ranks_send  # noqa: E402
from test_ascend_engine_group import as_moe  # noqa: E402
from test_ascend_executors import (REFRESH, TINY, ColocatedLeader, IpcFakeLLM, RayFakeAscendExecutors,  # noqa: E402
                                   SamplingParams, steps_of)

NODES = ("10.0.0.1", "10.0.0.2")
LOG = "colocated-log"


class CallLog:
    """One run's calls from every actor, in the order they happen (a Ray actor: one at a time)."""

    def __init__(self):
        self.entries = []

    def append(self, entry):
        self.entries.append(entry)

    def read(self):
        return self.entries


class RemoteLog:
    """The run's CallLog from inside an actor; `prefix` tags an engine's calls ("0:sleep(1)")."""

    def __init__(self, prefix=""):
        self.prefix = prefix

    def append(self, entry):
        ray.get(ray.get_actor(LOG).append.remote(entry if isinstance(entry, tuple) else self.prefix + entry))


def assigned_node() -> str:
    """The node this actor runs on: the `node:<ip>` resource Ray gave it."""
    resources = ray.get_runtime_context().get_assigned_resources()
    [node] = [name.removeprefix("node:") for name in resources if name.startswith("node:")]
    return node


class NodeIpcLLM(IpcFakeLLM):
    """A colocated engine on its actor's node: its chips are that node's devices of the launch plan
    (ASCEND_RT_VISIBLE_DEVICES while it starts); it loads each chunk from its own chips' handles.
    A data-parallel rank (VLLM_DP_RANK while it starts) tags its calls "instance.rank:"."""

    def __init__(self, instance, generator, **engine_args):
        self.rank = os.environ.get("VLLM_DP_RANK")
        super().__init__(RemoteLog(f"{instance}:" if self.rank is None else f"{instance}.{self.rank}:"), generator,
                         **engine_args)
        self.instance, self.node = instance, assigned_node()
        self.chips = {f"{self.node}-{d}" for d in os.environ["ASCEND_RT_VISIBLE_DEVICES"].split(",")}
        dp_env = tuple(os.environ.get(f"VLLM_DP_{key}") for key in ("RANK", "SIZE", "MASTER_IP", "MASTER_PORT"))
        self.calls.append(("placed", instance, self.node, os.environ["ASCEND_RT_VISIBLE_DEVICES"], os.getpid(),
                           dp_env))

    def update_weights(self, request):
        info = request["update_info"]
        self.calls.append("update_weights")
        read = set()
        for chip in self.chips:
            sender_chip, tensors = info["ipc_handles"][chip]
            read.add(sender_chip)
            self.received.update({name: tensors[name] for name in info["names"]})
        self.calls.append(("read", self.instance, tuple(sorted(read)), self.rank))


class RayColocatedExecutors(RayFakeAscendExecutors):
    """The Ray fakes colocated: the CPU generator behind NodeIpcLLM, the CPU learner as megatron's
    rank 0 behind an IpcSender whose send stands for every rank's (all chips of both nodes)."""

    def engine_api(self, index, instances):
        generator = self._cpu().generation_engine(index, instances)
        return SimpleNamespace(LLM=lambda **args: NodeIpcLLM(index, generator, **args), SamplingParams=SamplingParams)

    def build_trainer(self):
        log = RemoteLog()
        log.append(("learner", assigned_node(), ray.get_runtime_context().get_assigned_resources().get("NPU")))
        chips = [f"{NODES[p.node]}-{d}" for p in self.launch.processes if p.stage == self.train_stage.name
                 for d in p.env["ASCEND_RT_VISIBLE_DEVICES"].split(",")]
        return LoggedLeader(self._cpu().trainer(), IpcSender(all_ranks_send(chips)), log)


class LoggedLeader(ColocatedLeader):
    def train(self, rollouts):
        self.log.append("train")
        self.learner.train(rollouts)


def two_nodes(directory, hardware):
    """tiny_grpo (8 heads) on 16 devices of `hardware`: two engines of tp = 8, one per node, and a
    trainer with a rank on every device."""
    text = TINY.read_text().replace("pool cpu = cpu x 2", f"pool cpu = {hardware} x 16")
    text = text.replace("heads = 4, kv_heads = 2", "heads = 8, kv_heads = 8")
    text = text.replace("instances = 2, temperature", "instances = 2, tp = 8, temperature")
    path = directory / f"two_nodes_{hardware}.aspl"
    path.write_text(text.replace("loss = grpo, lr = 3e-4", "dp = 16, loss = grpo, lr = 3e-4"))
    return path


def metrics(aspc, path, backend, out, *extra, steps=2):
    result = aspc("run", str(path), "--backend", backend, *extra, "--steps", str(steps), "--warmstart", "0",
                  "--metrics", str(out), "--set", "schedule.staleness=0")
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in out.read_text().splitlines() if '"trained"' in line]


def cli():
    from click.testing import CliRunner

    from aspc.cli.main import main

    return lambda *args: CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def fake_cluster():
    """One local Ray for the module's runs: the two fake nodes, one fake NPU, the fakes importable
    by the actors (PYTHONPATH before Ray starts its workers)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
        ray.shutdown()
        ray.init(num_cpus=2, resources={"NPU": 1, **{f"node:{n}": 1 for n in NODES}}, include_dashboard=False,
                 log_to_driver=False)
        try:
            yield
        finally:
            ray.shutdown()


def run_on_ray(path, out, patch=None, steps=2):
    """`aspc run --backend ascend --runtime ray` of `path` on the fake two-node cluster (`patch`: more
    monkeypatching in this process). Returns (its metrics, the call log)."""
    from aspc.backends.ascend import executors as npu_executors
    from aspc.backends.ascend import run_executors
    from aspc.cli import doctor

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(doctor, "missing_stack_message", lambda: None)
        monkeypatch.setattr(npu_executors, "require_npu", lambda: None)
        monkeypatch.setattr(run_executors, "AscendExecutors", RayColocatedExecutors)
        monkeypatch.setenv("ASPC_NODES", ",".join(NODES))
        if patch is not None:
            patch(monkeypatch)
        log = ray.remote(CallLog).options(name=LOG, num_cpus=0).remote()
        try:
            on_ray = metrics(cli(), path, "ascend", out, "--runtime", "ray", steps=steps)
            return on_ray, ray.get(log.read.remote())
        finally:
            ray.kill(log)


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory, fake_cluster):
    """`aspc run --backend ascend --runtime ray` of the two-node colocated plan, and `--backend cpu`
    of the same pipeline on CPU pools. Returns (the Ray run's metrics, the CPU run's, the call log)."""
    directory = tmp_path_factory.mktemp("colocated")
    on_ray, entries = run_on_ray(two_nodes(directory, "910b3"), directory / "ray.jsonl")
    cpu = metrics(cli(), two_nodes(directory, "cpu"), "cpu", directory / "cpu.jsonl", "--workers", "threads")
    return on_ray, cpu, entries


def test_each_engine_runs_on_its_nodes_npus_and_loads_only_the_trainer_ranks_there(ray_run):
    _, _, log = ray_run
    placed = sorted(e[1:4] for e in log if isinstance(e, tuple) and e[0] == "placed")
    assert placed == [(0, NODES[0], "0,1,2,3,4,5,6,7"), (1, NODES[1], "0,1,2,3,4,5,6,7")]
    reads = {(e[1], e[2]) for e in log if isinstance(e, tuple) and e[0] == "read"}
    assert reads == {(i, tuple(f"{NODES[i]}-{d}" for d in range(8))) for i in (0, 1)}
    [learner] = [e for e in log if isinstance(e, tuple) and e[0] == "learner"]
    assert learner == ("learner", NODES[0], 1.0)  # trainer rank 0's actor: node0, an NPU of Ray's
    pids = {e[4] for e in log if isinstance(e, tuple) and e[0] == "placed"}
    assert len(pids | {os.getpid()}) == 3  # an actor each, not this process


def engine_calls(log, instance):
    return steps_of([e.split(":", 1)[1] for e in log if isinstance(e, str) and e.startswith(f"{instance}:")])


def test_the_pool_switches_run_in_the_controllers_order_on_every_node(ray_run):
    """Both engines start and sleep before the trainer builds; every switch to generation offloads
    the trainer before any engine wakes; every switch to training sleeps both engines (on both
    nodes) before the trainer onloads."""
    _, _, log = ray_run
    built = next(at for at, e in enumerate(log) if isinstance(e, tuple) and e[0] == "learner")
    for instance in (0, 1):
        assert engine_calls(log, instance) == ["sleep(1)", "init_weight_transfer_engine", *REFRESH, "generate",
                                               "sleep(1)", *REFRESH, "generate", "sleep(1)"], log
        assert log.index(f"{instance}:sleep(1)") < built
    calls = [e for e in log if isinstance(e, str)]
    assert [e for e in steps_of(calls) if ":" not in e] == ["offload", "onload", "train", "offload", "onload",
                                                            "train"]
    for at, entry in enumerate(calls):
        switches = [e for e in calls[:at] if e in ("offload", "onload")]
        if entry.endswith("wake_up(['weights'])"):
            assert switches and switches[-1] == "offload", calls
        if entry == "onload":
            for instance in (0, 1):
                assert [e for e in calls[:at] if e.startswith(f"{instance}:")][-1] == f"{instance}:sleep(1)", calls


def test_the_samples_trained_equal_a_cpu_runs(ray_run):
    on_ray, cpu, _ = ray_run
    assert len(on_ray) == len(cpu) == 2
    assert [m["trained"] for m in on_ray] == [m["trained"] for m in cpu]
    assert on_ray[0]["reward"] == cpu[0]["reward"]


# ---- an instance with dp > 1: its engine ranks, each an actor on its NPUs' node ----
def test_r1_zero_671b_places_six_instances_of_32_engine_ranks_with_their_dp_env_on_their_nodes(monkeypatch):
    """Not refused on Ray (the local runtime still refuses its engines beyond this node); each of the
    6 x 32 ranks gets the launch plan's environment for its rank, and its actor the node of its 2 NPUs
    (8 NPUs a node: instance i's rank r holds devices 64 i + 2 r and the next, node 8 i + r // 4)."""
    from aspc.backends.ascend.run_executors import AscendExecutors
    from aspc.drivers.ray.colocated import rank_options
    from aspc.cli.toolchain import compile_with_passes

    nodes = [f"10.1.{n // 256}.{n % 256}" for n in range(48)]
    monkeypatch.setenv("ASPC_NODES", ",".join(nodes))
    monkeypatch.setattr(AscendExecutors, "check_launch", lambda self: None)  # no checkpoint here
    plan = compile_with_passes(ROOT / "pipelines" / "r1_zero_671b.aspl").plan()
    assert AscendExecutors.unsupported(plan, "ray") == []
    assert [r.option for r in AscendExecutors.unsupported(plan)] == ["instances"]
    executors = AscendExecutors(plan, ROOT / "pipelines")
    cluster = SimpleNamespace(cluster_resources=lambda: {f"node:{n}": 1.0 for n in nodes})
    ports = set()
    for instance in range(6):
        group = executors.unstarted_engine(instance, 6)
        assert group.size == 32 and group.lockstep
        pins = [next(iter(options["resources"])) for options in rank_options(cluster, group)]
        assert pins == [f"node:{nodes[8 * instance + rank // 4]}" for rank in range(32)]
        envs = [engine.env for engine in group.engines]
        ports.add(envs[0]["VLLM_DP_MASTER_PORT"])
        for rank, env in enumerate(envs):
            assert env["ASCEND_RT_VISIBLE_DEVICES"] == f"{2 * rank % 8},{2 * rank % 8 + 1}"
            assert (env["VLLM_DP_RANK"], env["VLLM_DP_RANK_LOCAL"], env["VLLM_DP_SIZE"]) == (str(rank), str(rank % 4),
                                                                                          "32")
            assert (env["VLLM_DP_MASTER_IP"], env["VLLM_DP_MASTER_PORT"]) == (nodes[8 * instance],
                                                                              envs[0]["VLLM_DP_MASTER_PORT"])
    assert len(ports) == 6  # a rendezvous per instance


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory, fake_cluster):
    """One step of one instance of tp = 8, dp = 2 over the two nodes: rank 0 on node0's NPUs, rank 1
    on node1's (the first switch to generation refreshes every rank with version 0)."""
    directory = tmp_path_factory.mktemp("colocated_dp")
    path = two_nodes(directory, "910b3")
    path.write_text(path.read_text().replace("instances = 2, tp = 8", "instances = 1, tp = 8, dp = 2"))
    return run_on_ray(path, directory / "ray.jsonl", as_moe, steps=1)


def test_each_data_parallel_rank_runs_on_its_nodes_npus_sleeps_wakes_and_refreshes(dp_run, ray_run):
    on_ray, log = dp_run
    assert [m["trained"] for m in on_ray] == [ray_run[1][0]["trained"]]  # every request answered once
    placed = sorted((e[1:4], e[5]) for e in log if isinstance(e, tuple) and e[0] == "placed")
    port = placed[0][1][3]
    assert placed == [((0, NODES[rank], "0,1,2,3,4,5,6,7"), (str(rank), "2", NODES[0], port)) for rank in (0, 1)]
    assert len({e[4] for e in log if isinstance(e, tuple) and e[0] == "placed"} | {os.getpid()}) == 3
    reads = {(e[2], e[3]) for e in log if isinstance(e, tuple) and e[0] == "read"}
    assert reads == {(tuple(f"{NODES[r]}-{d}" for d in range(8)), str(r)) for r in (0, 1)}
    for rank in (0, 1):
        assert engine_calls(log, f"0.{rank}") == ["sleep(1)", "init_weight_transfer_engine", *REFRESH, "generate",
                                                  "sleep(1)"], log
