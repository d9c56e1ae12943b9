"""A reference stage on devices of its own (the generation pool, whose core idles between bursts):
the runtime runs it over the learner's frozen reference and trains exactly as with the
reference beside the trainer; a critic there is refused at its line."""
import pytest

from aspc.backends.cpu.executors import CpuExecutors, unsupported_stages
from aspc.backends.ascend.run_executors import AscendExecutors
from aspc.cli.toolchain import compile_with_passes
from aspc.drivers.local.runtime import LocalRuntime, RunOptions
from conftest import ROOT

SPLIT = (ROOT / "pipelines" / "tiny_grpo_split.aspl").read_text()
BESIDE = "stage ref_lp = reference(ref, gen) on learner"


def plan_of(tmp_path, text: str, name: str):
    path = tmp_path / f"{name}.aspl"
    path.write_text(text)
    return compile_with_passes(path, [], "sync").plan(), path


def trained(tmp_path, pool: str, workers: str) -> tuple[list[dict], dict]:
    """A 2-step sync run's metrics, and each trained sample's reference log-probs."""
    plan, path = plan_of(tmp_path, SPLIT.replace(BESIDE, f"stage ref_lp = reference(ref, gen) on {pool}"), pool)
    run = LocalRuntime(plan, ROOT / "pipelines", RunOptions(steps=2, warmstart_steps=20, workers=workers),
                       CpuExecutors)
    run.build()
    rows = run.run().metrics
    return rows, {sample: rollout.ref_logprobs for sample, rollout in run.rollouts.items()}


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_a_reference_on_the_generation_pool_trains_as_beside_the_trainer(tmp_path, workers):
    (beside, ref_beside), (apart, ref_apart) = trained(tmp_path, "learner", workers), trained(tmp_path, "rollout",
                                                                                             workers)
    assert len(apart) == 2 and ref_apart.keys() == ref_beside.keys()
    for a, b in zip(beside, apart):
        assert a["trained"] == b["trained"] and a["reward"] == b["reward"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    for sample, logprobs in ref_apart.items():
        assert logprobs is not None and logprobs == pytest.approx(ref_beside[sample], abs=1e-6), sample


def test_a_reference_apart_runs_the_learners_frozen_reference_not_its_policy(tmp_path):
    plan, path = plan_of(tmp_path, SPLIT.replace(BESIDE, "stage ref_lp = reference(ref, gen) on rollout"), "apart")
    executors = CpuExecutors(plan, ROOT / "pipelines")
    apart = executors.reference_model("ref_lp", 0)
    assert apart.model is executors.trainer().ref and apart.model is not executors.trainer().actor
    assert not any(p.requires_grad and p.grad is not None for p in apart.model.parameters())


def test_a_critic_apart_from_the_trainer_is_refused_at_its_line(tmp_path):
    text = (ROOT / "pipelines" / "tiny_ppo.aspl").read_text()
    text = text.replace("pool cpu", "pool side = cpu x 1\npool cpu", 1)
    text = "\n".join(line.replace(" on cpu", " on side") if line.startswith("stage values") else line
                     for line in text.splitlines())
    plan, _ = plan_of(tmp_path, text, "ppo")
    refused = unsupported_stages(plan)
    assert [r.stage for r in refused] == ["values"] and "put the critic on the train stage's pool" in refused[0].hint


def test_on_npus_a_reference_apart_from_the_trainer_is_refused(tmp_path):
    plan, _ = plan_of(tmp_path, SPLIT.replace(BESIDE, "stage ref_lp = reference(ref, gen) on rollout"), "npu")
    refused = [r for r in AscendExecutors.unsupported(plan) if r.stage == "ref_lp"]
    assert refused and "train stage's pool 'learner'" in refused[0].hint


def test_on_ray_a_reference_apart_copies_the_learners_warm_started_reference(tmp_path):
    ray = pytest.importorskip("ray")
    from aspc.drivers.ray.runtime import RayRuntime

    plan, _ = plan_of(tmp_path, SPLIT.replace(BESIDE, "stage ref_lp = reference(ref, gen) on rollout"), "ray")
    run = RayRuntime(plan, ROOT / "pipelines", RunOptions(steps=1, warmstart_steps=20), CpuExecutors)
    try:
        run.build()
        rows = run.run().metrics
        apart = run.executors.references[("ref_lp", 0)].model
        assert len(rows) == 1
        assert all((a == b).all() for a, b in zip(apart.parameters(), run.learner.ref.parameters()))
        assert all(r.ref_logprobs is not None for r in run.rollouts.values())
    finally:
        ray.shutdown()
