"""Rollout routing replay (R3) in the megatron trainer, on the real megatron-core (tests/megatron_cpu.py):
a tiny MoE policy's samples come from an engine whose router had moved (as a trainer step moves
it), with each position's experts recorded; megatron's GPTModel, loaded from the policy's Hugging
Face checkpoint with `moe_enable_routing_replay` as the lowering sets it, replays them through
megatron's RouterReplay and gives the CPU learner's loss and gradient under the same replay, where
routing by its own router gives another. Then what the NPU path sets and refuses for it."""
import copy
import dataclasses

import numpy
import pytest
import torch

pytest.importorskip("megatron.core")

from aspc.backends.ascend import reshard  # noqa: E402
from aspc.backends.ascend.lowering import lower  # noqa: E402
from aspc.backends.ascend.megatron_model import arch_of  # noqa: E402
from aspc.backends.ascend.packing import pack  # noqa: E402
from aspc.backends.cpu import hf_weights  # noqa: E402
from aspc.backends.cpu.executors import CpuExecutors  # noqa: E402
from aspc.backends.cpu.generator import BatchGenerator  # noqa: E402
from aspc.backends.cpu.model import TinyQwen  # noqa: E402
from aspc.cli.toolchain import compile_with_passes  # noqa: E402
from aspc.rl.rollout import Rollout  # noqa: E402
from conftest import ROOT  # noqa: E402
from megatron_cpu import run_job  # noqa: E402
from test_ascend_load import write_checkpoint  # noqa: E402
from test_trainer_differential import cpu_step, task_reward  # noqa: E402
from test_trainer_differential_megatron import recording  # noqa: E402

MODEL = "max_seq = 64, seed = 1"
TRAIN = "loss = grpo, lr = 3e-4, kl = 0.01, micro_tokens = 1k"
CPU_MOE = {"moe_grouped_gemm": False, "moe_token_dispatcher_type": "allgather"}  # megatron's CPU-capable MoE parts


def moe_pipeline(folder, replay: str = "rollout", train: str = ""):
    path = folder / "moe.aspl"
    path.write_text((ROOT / "pipelines" / "tiny_grpo.aspl").read_text()
                    .replace(MODEL, f"{MODEL}, experts = 4, top_k = 2, expert_ffn = 32")
                    .replace(TRAIN, f"{TRAIN}, routing_replay = {replay}{train}"))
    return path


def settings_of(path, replay: str):
    base = CpuExecutors(compile_with_passes(path).plan(), path.parent)._settings()
    return dataclasses.replace(base, grad_clip=1e9, lr=0.0, kl=0.0, temperature=1.0, routing_replay=replay)


def engine_samples(policy: TinyQwen) -> list[Rollout]:
    """Two groups of four from an engine whose routers moved from the policy's, with their routes."""
    engine = copy.deepcopy(policy).eval()
    with torch.no_grad():
        for block in engine.blocks:
            w = block.mlp.router.weight
            w.add_(0.5 * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(7)))
    generator = BatchGenerator(engine, slots=8, max_tokens=6, record_routes=True)
    for i in range(8):
        generator.add(i, [1, 5 + i // 4, 9, 4 + i // 4], seed=i)
    done = []
    while generator.busy:
        done += generator.step()
    return [Rollout(f.prompt, f.response, f.logprobs, f"p{f.key // 4}", None, key=(0, f.key), routes=f.routes)
            for f in sorted(done, key=lambda f: f.key)]


def megatron_step(rank: int, stage: dict, settings, rollouts: list) -> tuple[dict, dict]:
    from aspc.backends.ascend.megatron_trainer import MegatronTrainer, SyncSetup

    trainer = MegatronTrainer(stage, {"pre_process": True, "post_process": True}, settings, task_reward(settings),
                              SyncSetup(None, None, None))
    grads: dict = {}
    trainer.optimizer.step = recording(trainer, grads)
    trainer.reward(rollouts)
    trainer.train(rollouts)
    stats = trainer.optimizer_step()
    routers = len(trainer.routers)
    return stats | {"routers": routers}, reshard.to_hf(arch_of(stage), dict(grads))


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe")
    path = moe_pipeline(folder)
    plan = compile_with_passes(path).plan()
    policy = TinyQwen(plan.model_of(plan.stages_of("train")[0]).arch, seed=0)
    write_checkpoint(folder, hf_weights.to_hf(policy.state_dict()))
    stage = copy.deepcopy(dataclasses.asdict(next(s for s in lower(plan, folder).stages if s.kind == "train")))
    stage["builders"]["checkpoint"] = str(folder)
    stage["groups"] = {"dp": [[0]], "pp": [[0]]}
    stage["config"] |= CPU_MOE
    stage["micro_batching"]["tokens"] = 24  # two samples a row: routes laid out after another sample's
    settings = settings_of(path, "rollout")
    rollouts = engine_samples(policy)
    [(npu, npu_grads)] = run_job(1, stage["config"], megatron_step, stage, settings, copy.deepcopy(rollouts))
    return policy, settings, rollouts, npu, npu_grads, stage


def test_the_lowering_turns_on_megatrons_router_replay(replayed):
    *_, stage = replayed
    assert stage["config"]["moe_enable_routing_replay"] is True


def test_megatron_replays_the_engines_experts_as_the_cpu_learner_does(replayed):
    policy, settings, rollouts, npu, npu_grads, stage = replayed
    assert npu["routers"] == 2  # one per MoE layer of this rank
    assert any(len(mb.keys) > 1 for mb in pack(rollouts, stage["micro_batching"]["tokens"]))
    cpu, cpu_grads = cpu_step(policy, settings, copy.deepcopy(rollouts))
    cpu_grads = hf_weights.to_hf(cpu_grads)
    assert npu["loss"] == pytest.approx(cpu["loss"], rel=1e-5, abs=1e-8)
    assert cpu_grads.keys() == npu_grads.keys()
    assert any(".mlp.gate." in name for name in cpu_grads)  # the routers train under replay too
    for name, gradient in cpu_grads.items():
        scale = float(gradient.norm()) or 1.0
        assert float((npu_grads[name] - gradient).norm()) <= 1e-4 * scale + 1e-8, name
    assert npu["grad_norm"] == pytest.approx(cpu["grad_norm"], rel=1e-5)
    for key in ("mismatch_abs", "mismatch_max"):  # the trainer's log-probs against the engine's, alike
        assert npu[key] == pytest.approx(cpu[key], abs=1e-6), key  # |d| of ~1e-4: float rounding
    routed, _ = cpu_step(policy, dataclasses.replace(settings, routing_replay="none"), copy.deepcopy(rollouts))
    assert routed["mismatch_max"] > 2 * cpu["mismatch_max"]  # its own router sends tokens elsewhere


def test_a_model_built_without_router_replay_is_refused_rather_than_routing_on_its_own(replayed):
    _, settings, rollouts, _, _, stage = replayed
    stage = copy.deepcopy(stage)
    stage["config"]["moe_enable_routing_replay"] = False  # a launch plan lowered before routing_replay was set
    with pytest.raises(AssertionError, match="needs moe_enable_routing_replay"):
        run_job(1, stage["config"], megatron_step, stage, settings, rollouts)


def test_vllm_ascend_is_asked_for_the_routes_and_the_engine_passes_them_on(tmp_path):
    from types import SimpleNamespace

    from aspc.backends.vllm.engine import VllmEngine

    path = moe_pipeline(tmp_path)
    path.write_text(path.read_text().replace("pool cpu = cpu x 2", "pool cpu = 910b3 x 2"))
    launch = lower(compile_with_passes(path).plan(), tmp_path)
    gen = next(s for s in launch.stages if s.kind == "generate")
    assert gen.config.get("enable_return_routed_experts") is True  # the LLM(...) arguments
    engine = VllmEngine.__new__(VllmEngine)
    engine.launch = {"config": {"enable_return_routed_experts": True}}
    routed = [[[0, 1], [2, 3]]] * 5  # CompletionOutput.routed_experts: a numpy array [positions, layers, top_k]
    found = engine._routes(SimpleNamespace(routed_experts=numpy.array(routed)))
    assert found.dtype == torch.int16 and tuple(found.shape) == (5, 2, 2)


@pytest.mark.parametrize("layout, said", [
    ("", "the NPU install pins 0.12.1"),
    (", tp = 2", "tp = 2 splits them"),
    (", recompute = true, pp = 2", "pp = 2 interleaves them"),
])
def test_the_npu_trainer_refuses_what_its_replay_cannot_follow(tmp_path, layout, said):
    from aspc.backends.ascend.run_executors import trainer_refusals

    path = moe_pipeline(tmp_path, train=layout)
    train = compile_with_passes(path).plan().stages_of("train")[0]
    found = [r.message for r in trainer_refusals(train) if r.option == "routing_replay"]
    assert len(found) == (1 if not layout else 2) and any(said in message for message in found), found


def test_the_pin_the_refusal_reads_is_the_npu_installs():
    from aspc.backends.ascend.routing_replay import NPU_MEGATRON
    from aspc.cli.npu_install import MEGATRON

    assert MEGATRON == "core_v" + ".".join(map(str, NPU_MEGATRON))



