"""The Ray driver's placement of NPU actors (aspc/drivers/ray): trainer rank 0's actor on rank 0's
node, weight transfers served while a training call runs, an engine that dies while joining its
transfer group ending the run at once, and the cluster's NPUs checked instead of the driver host's.
One local Ray for the module (2 CPUs, 3 fake NPUs and a fake node resource `node:10.0.0.1` standing
for node0), with the Ascend executors' fakes of tests/test_ascend_executors.py."""
import os
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")

from aspc.drivers.local.runtime import RunOptions  # noqa: E402
from aspc.drivers.local.workers import WorkerFailed  # noqa: E402
from aspc.drivers.ray.learner_actor import ActorBuiltLearner, remote_learner_class  # noqa: E402
from aspc.drivers.ray.placement import missing_devices  # noqa: E402
from aspc.drivers.ray.runtime import RayRuntime  # noqa: E402
from aspc.controller.config import UnsupportedPlan  # noqa: E402
from aspc.cli.toolchain import compile_with_passes  # noqa: E402
from conftest import ROOT  # noqa: E402
from fake_comm import ThreadCommunicator  # noqa: E402
from ray_fakes import RENDEZVOUS, BlockingExecutors, Rendezvous, meet  # noqa: E402
from test_ascend_executors import (HUB, FakeLLM, HubActor, RayFakeAscendExecutors, RemoteHub,  # noqa: E402
                                   SamplingParams, separate_pools)

NODE0 = "10.0.0.1"
FAILING = 0  # the generation instance whose join of the transfer group fails


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    with pytest.MonkeyPatch.context() as patch:  # the actors import this module's fakes
        patch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
        ray.shutdown()
        ray.init(num_cpus=2, resources={"NPU": 3, f"node:{NODE0}": 1}, include_dashboard=False, log_to_driver=False)
    hub = ray.remote(HubActor).options(name=HUB, num_cpus=0, max_concurrency=16).remote()
    rendezvous = ray.remote(Rendezvous).options(name=RENDEZVOUS, num_cpus=0, max_concurrency=8).remote()
    yield hub, rendezvous  # held: an actor without a handle is gone
    ray.shutdown()


def npu_source(directory, instances: int = 2):
    """tiny_grpo with generation on a pool of its own, both pools of 910B3s (one NPU per instance)."""
    text = separate_pools(directory).read_text().replace("= cpu x", "= 910b3 x")
    text = text.replace("rollout = 910b3 x 2", f"rollout = 910b3 x {instances}")
    path = directory / f"npu{instances}.aspl"
    path.write_text(text.replace("instances = 2", f"instances = {instances}"))
    return path


def npu_plan(directory, instances: int = 2):
    return compile_with_passes(npu_source(directory, instances), ["schedule.staleness=0"]).plan()


# ---- fakes: a transfer group whose join meets both sides, as HCCL's rendezvous does ----
class JoiningLLM(FakeLLM):
    """FakeLLM whose init_weight_transfer_engine meets the learner's join; instance FAILING's raises
    as a broken HCCL set-up would, leaving the learner's side waiting."""

    def __init__(self, instance, generator, comm, **engine_args):
        super().__init__(generator, comm, **engine_args)
        self.instance = instance

    def init_weight_transfer_engine(self, request):
        if self.instance == FAILING:
            raise RuntimeError(f"fake HCCL: instance {self.instance} cannot reach the trainer")
        super().init_weight_transfer_engine(request)
        meet(self.instance)


class JoiningExecutors(RayFakeAscendExecutors):
    def engine_api(self, index, instances):
        generator, comm = self._cpu().generation_engine(index, instances), ThreadCommunicator(1, RemoteHub(index))
        return SimpleNamespace(LLM=lambda **args: JoiningLLM(index, generator, comm, **args),
                               SamplingParams=SamplingParams)

    def build_trainer(self):  # notes what Ray gave the learner's actor
        import ray

        context = ray.get_runtime_context()
        ray.get(ray.get_actor(HUB).note.remote(("placed", context.get_assigned_resources(),
                                                os.environ.get("ASCEND_RT_VISIBLE_DEVICES"))))
        return super().build_trainer()

    def join_trainer_side(self, index):
        super().join_trainer_side(index)
        meet(index)  # until the engine's side joins


@pytest.fixture(scope="module")
def failed_build(tmp_path_factory):
    """Builds the run with ASPC_NODES naming node0 = NODE0; instance FAILING's engine raises in its
    join. Returns (the error, the learner actor's placement note)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ASPC_NODES", f"{NODE0},10.0.0.2")
        plan = npu_plan(tmp_path_factory.mktemp("npu"), instances=1)
        runtime = RayRuntime(plan, ROOT / "pipelines", RunOptions(steps=1, warmstart_steps=0), JoiningExecutors)
        with pytest.raises(WorkerFailed) as failed:
            runtime.build()
        runtime.stop_workers()
    [placed] = [note for note in ray.get(ray.get_actor(HUB).notes.remote()) if note[0] == "placed"]
    return failed.value, placed


def test_trainer_rank0s_actor_runs_on_rank0s_node(failed_build):
    """The launch plan puts rank 0 on node0 (MASTER_ADDR, the transfer groups' master_address): the
    learner's actor holds a share of node0's `node:<ip>` resource and an NPU of its own."""
    _, (_, resources, visible) = failed_build
    assert resources.get(f"node:{NODE0}", 0) > 0
    assert resources.get("NPU") == 1 and visible is not None


def test_an_engine_that_dies_in_its_join_ends_the_run_at_once_naming_it(failed_build):
    """The learner's side still waits in its join; the driver sees the engine actor's death and
    says which instance failed and why (not the learner's timeout)."""
    error, _ = failed_build
    assert f"generation instance {FAILING}" in str(error)
    assert f"fake HCCL: instance {FAILING} cannot reach the trainer" in str(error)


def test_rank0s_node_missing_from_the_cluster_is_refused_before_any_actor_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("ASPC_NODES", "10.9.9.9,10.0.0.2")
    runtime = RayRuntime(npu_plan(tmp_path), ROOT / "pipelines", RunOptions(steps=1, warmstart_steps=0),
                         JoiningExecutors)
    with pytest.raises(UnsupportedPlan, match=r"rank 0 must run on its node 10\.9\.9\.9 .*not a node of the Ray"):
        runtime.build()


# ---- a weight transfer while a training call runs ----
def test_a_weight_transfer_is_served_while_a_training_call_runs():
    actor = remote_learner_class(ActorBuiltLearner, 2).options(num_cpus=0).remote(BlockingExecutors())
    ray.get(actor.join_transfer_group.remote(0), timeout=120)
    training = actor.run.remote("train", [])
    ray.get(actor.send_weights.remote(3, 0), timeout=60)
    ray.get(training, timeout=60)
    assert ray.get(actor.snapshot.remote()) == ["train started", "sent version 3 to instance 0",
                                                "train saw the broadcast"]
    ray.kill(actor)


def test_building_rank0_may_not_move_it_off_the_npu_ray_reserved(monkeypatch):
    """The launch plan's rank-0 environment names a device; where it is not Ray's, refuse."""
    class MovingExecutors(BlockingExecutors):
        def trainer(self):
            os.environ["ASCEND_RT_VISIBLE_DEVICES"] = "0"  # as os.environ.update(rank0.env) does
            return super().trainer()

    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "2")
    with pytest.raises(RuntimeError, match="runs on NPU 0 .* Ray reserved NPU 2"):
        ActorBuiltLearner(MovingExecutors())
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "2")
    ActorBuiltLearner(BlockingExecutors())  # kept: fine


# ---- the cluster's NPUs, not the driver host's ----
def test_a_ray_run_checks_the_clusters_npus_not_this_hosts(aspc, tmp_path):
    """This host has no NPU and no Ascend stack; the cluster (the local Ray) has 3 NPUs: enough
    for 2 engines and rank 0, too few for 3 engines and rank 0."""
    assert missing_devices(ray, npu_plan(tmp_path, 2)) is None
    result = aspc("run", str(npu_source(tmp_path, 3)), "--backend", "ascend", "--runtime", "ray", "--steps", "1",
                  "--warmstart", "0")
    assert result.exit_code == 1
    assert "the Ray cluster has 3 NPUs" in result.output and "need 4" in result.output
    assert "3 generation instances x 1 and 1 for trainer rank 0" in result.output
