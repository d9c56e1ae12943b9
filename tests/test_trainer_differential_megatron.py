"""The trainers' differential test on the real megatron-core (issue 33, item 3): the same samples
through the CPU learner (the spec: padded rows, its TinyQwen) and through the megatron trainer as it
runs on NPUs -- megatron's GPTModel loaded from the TinyQwen's Hugging Face checkpoint (load_hf.py),
megatron's DDP, distributed optimizer and forward-backward schedule, on a gloo rank
(tests/megatron_cpu.py) -- give the same step loss, the same gradient (DDP's main_grad, compared
under Hugging Face names) and the same gradient norm (megatron's own), for every loss mode, one
sequence a row and packed. tests/test_trainer_differential.py holds the same comparison on the
trainer's loss path alone (a TinyQwen pipeline stage) and the reward calls."""
import copy
import functools

import pytest

pytest.importorskip("megatron.core")

from aspc.backends.ascend import reshard  # noqa: E402
from aspc.backends.ascend.megatron_model import arch_of  # noqa: E402
from aspc.backends.ascend.packing import pack  # noqa: E402
from aspc.backends.cpu import hf_weights  # noqa: E402
from aspc.backends.cpu.executors import CpuExecutors  # noqa: E402
from aspc.backends.cpu.model import TinyQwen  # noqa: E402
from aspc.backends.ascend.lowering import lower  # noqa: E402
from aspc.cli.toolchain import compile_with_passes  # noqa: E402
from megatron_cpu import run_job  # noqa: E402
from test_ascend_load import write_checkpoint  # noqa: E402
from test_trainer_differential import (GRPO, LONGEST, MODES, cpu_step, samples, settings_for, task_reward,  # noqa: E402
                                      units)

PACKINGS = {"one-a-row": LONGEST, "packed-24": 24, "packed-64": 64}
NO_CLIP = {"grad_clip": 1e9, "lr": 0.0}  # the norm is computed, nothing clipped; the weights stay


def policy() -> TinyQwen:
    return TinyQwen(CpuExecutors(compile_with_passes(GRPO).plan(), GRPO.parent).actor.arch, seed=0)


def megatron_stage(folder) -> dict:
    """tiny_grpo's lowered train stage (the TinyQwen's shape: tied, no qkv bias), from `folder`."""
    import dataclasses

    launch = lower(compile_with_passes(GRPO).plan(), GRPO.parent)
    stage = copy.deepcopy(dataclasses.asdict(next(s for s in launch.stages if s.kind == "train")))
    stage["builders"]["checkpoint"] = str(folder)
    stage["groups"] = {"dp": [[0]], "pp": [[0]]}
    return stage


def recording(trainer, found: dict):
    """The real optimizer's step, keeping DDP's main_grad (after the trainer's scaling) first."""
    step = trainer.optimizer.step

    @functools.wraps(step)
    def record():
        found.clear()
        found.update({name.removeprefix("module."): p.main_grad.detach().clone()
                      for name, p in trainer.model.named_parameters()})
        return step()

    return record


def every_mode(rank: int, stage: dict) -> dict:
    """(mode, packing) -> the megatron trainer's step stats and gradients under Hugging Face names."""
    from aspc.backends.ascend.megatron_trainer import MegatronTrainer, SyncSetup
    from aspc.rl.mismatch import MismatchCorrection

    base = settings_for(**NO_CLIP)
    t = MegatronTrainer(stage, {"pre_process": True, "post_process": True}, base, task_reward(base),
                        SyncSetup(None, None, None))
    grads: dict = {}
    t.optimizer.step = recording(t, grads)
    arch = arch_of(stage)
    out = {}
    for mode, changes in MODES.items():
        t.settings = settings_for(**NO_CLIP, **changes)
        t.correction, t.mismatch = MismatchCorrection(t.settings.mismatch), t._new_mismatch()
        t.task_reward = task_reward(t.settings)
        for packing, tokens in PACKINGS.items():
            t.stage["micro_batching"]["tokens"] = tokens
            rollouts = samples(t.settings.estimator == "gae")
            t.reward(rollouts)
            for unit in units(mode, rollouts):  # GAE whitened over the step whatever the units
                t.train(unit)
            stats = t.optimizer_step()
            out[mode, packing] = stats, reshard.to_hf(arch, dict(grads))
    return out


@pytest.fixture(scope="module")
def megatron_results(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("tiny_policy")
    write_checkpoint(folder, hf_weights.to_hf(policy().state_dict()))
    stage = megatron_stage(folder)
    [results] = run_job(1, stage["config"], every_mode, stage)
    return results


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("mode", MODES)
def test_the_real_megatron_trainer_gives_the_cpu_learners_loss_and_gradient(megatron_results, mode, packing):
    settings = settings_for(**NO_CLIP, **MODES[mode])
    cpu, cpu_grads = cpu_step(policy(), settings, samples(settings.estimator == "gae"))
    npu, npu_grads = megatron_results[mode, packing]
    if packing != "one-a-row":  # some row holds several sequences
        assert any(len(mb.keys) > 1 for mb in pack(samples(False), PACKINGS[packing]))
    cpu_grads = hf_weights.to_hf(cpu_grads)
    assert npu["loss"] == pytest.approx(cpu["loss"], rel=1e-5, abs=1e-8)
    assert cpu_grads.keys() == npu_grads.keys() and cpu_grads
    for name, gradient in cpu_grads.items():
        scale = float(gradient.norm()) or 1.0
        assert float((npu_grads[name] - gradient).norm()) <= 1e-4 * scale + 1e-8, name
    assert npu["grad_norm"] == pytest.approx(cpu["grad_norm"], rel=1e-5)
    assert not npu["update_skipped"]
    # the training-inference mismatch (aspc/rl/mismatch.py): the same tokens compared, the same figures
    assert cpu["mismatch_tokens"] == npu["mismatch_tokens"] > 0
    for key in ("mismatch_abs", "mismatch_max", "mismatch_kl", "mismatch_sequences_outside"):
        assert npu[key] == pytest.approx(cpu[key], rel=1e-5, abs=1e-9), key
    corrected = [k for k in ("mismatch_weight_mean", "mismatch_weight_max", "mismatch_weight_changed") if k in cpu]
    assert bool(corrected) == (settings.mismatch != "none")
    assert npu.get("mismatch_correction") == cpu.get("mismatch_correction")
    for key in corrected:
        assert npu[key] == pytest.approx(cpu[key], rel=1e-5, abs=1e-9), key
