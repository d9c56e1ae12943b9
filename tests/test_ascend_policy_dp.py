"""The policy trainer's data parallelism (backends/ascend/megatron_trainer.py) and where its
micro-batches go, on CPU: each data-parallel rank (a thread, fake_comm.py) trains its share of the
packed rows through a fake of megatron's schedule with DDP's gradient average, and the step equals
the one-rank step on the same batch; the policy's, the critic's and the forward-only passes' batches
reach the device of the model's parameters."""
import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from aspc.backends.ascend.critic import MegatronCritic
from aspc.backends.ascend.forward_only import PipelinedForward
from aspc.backends.ascend.megatron_trainer import MegatronTrainer
from aspc.backends.ascend.packing import pack
from aspc.backends.cpu.executors import CpuExecutors
from aspc.rl.rollout import Rollout
from aspc.backends.cpu.model import TinyQwen
from aspc.cli.toolchain import compile_with_passes
from conftest import ROOT
from fake_comm import run_ranks
from fake_pipeline import PipelineStage
from test_ascend_critic import ClippedAdamW, data_parallel_reduction, forward_backward
from test_ascend_executors import one_rank  # noqa: F401 (a fixture)

GRPO = ROOT / "pipelines" / "tiny_grpo.aspl"
TOKENS = 16
DP_STAGE = {"micro_batching": {"tokens": TOKENS}, "groups": {"dp": [[0, 1]], "pp": [[0], [1]]}}


class RecordingPolicy(PipelineStage):
    """The whole TinyQwen as one pipeline stage (megatron's GPTModel of pp = 1) with DDP's
    scale_gradients; it records the rows it was given."""

    def __init__(self, whole: TinyQwen):
        whole = copy.deepcopy(whole)
        super().__init__(whole, range(whole.arch.layers), True, True)
        self.seen: list[list[int]] = []

    def forward(self, input_ids, position_ids, attention_mask):
        self.seen.append(input_ids[0].tolist())
        return super().forward(input_ids, position_ids, attention_mask)

    def scale_gradients(self, factor):
        for p in self.parameters():
            if p.grad is not None:
                p.grad *= factor


def settings_of():
    cpu = CpuExecutors(compile_with_passes(GRPO).plan(), GRPO.parent)
    return cpu, dataclasses.replace(cpu._settings(), kl=0.0)


def rollouts(settings) -> list[Rollout]:
    """Two groups of varied lengths, rewards varied within each group (non-zero advantages)."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for i in range(2 * settings.group):
        n_prompt, n_response = 3 + i % 5, 2 + (3 * i) % 7
        prompt, response = (torch.randint(1, 32, (n,), generator=generator).tolist() for n in (n_prompt, n_response))
        r = Rollout(prompt, response, [-1.5] * n_response, "", None, key=(0, i))
        r.reward = r.task_reward = float(i % 3 == 0)
        out.append(r)
    return out


def policy_step(whole: TinyQwen, settings, comm=None) -> dict:
    model = RecordingPolicy(whole)
    reduce = None if comm is None else data_parallel_reduction(comm, [0, 1], model)
    stage = {"micro_batching": {"tokens": TOKENS}, "groups": {"dp": [[0]], "pp": [[0]]}} if comm is None else DP_STAGE
    trainer = MegatronTrainer.of_parts(stage, settings, SimpleNamespace(comm=comm), model,
                                       ClippedAdamW(model, 1e-2, settings.grad_clip), forward_backward,
                                       reduce_gradients=reduce)
    trainer.train(rollouts(settings))
    summary = trainer.optimizer_step()
    return {"summary": summary, "seen": model.seen,
            "weights": {k: v.detach().clone() for k, v in model.whole.state_dict().items()}}


def test_the_two_rank_reference_forward_runs_each_row_once_and_gives_every_rank_all_log_probs(one_rank):  # noqa: F811
    """The forward-only log-probs (the reference's) split the rows over data-parallel ranks too, and
    both ranks end with the one-rank log-probs of every sample."""
    cpu, settings = settings_of()
    whole = TinyQwen(cpu.actor.arch, seed=0).eval()

    def logprobs(comm=None):
        from aspc.backends.ascend.data_parallel import RankGroup

        model = RecordingPolicy(whole)
        dp = RankGroup(comm, (0, 1)) if comm is not None else RankGroup()
        forward = PipelinedForward(TOKENS, comm or SimpleNamespace(rank=0), [0 if comm is None else comm.rank],
                                   forward_backward, dp=dp)
        return forward.logprobs(model, rollouts(settings)), model.seen

    single, seen = logprobs()
    ranks = run_ranks(2, logprobs)
    assert sorted(x for _, s in ranks for x in s) == sorted(seen)
    for found, _ in ranks:
        assert found.keys() == single.keys()
        for key, values in single.items():
            assert found[key] == pytest.approx(values, abs=1e-5)


class MetaDeviceModel(torch.nn.Module):
    """A model whose parameters live on another device ("meta": no CUDA or NPU here)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, device="meta"))


def recording_schedule(devices: list):
    def schedule(*, forward_step_func, data_iterator, model, num_microbatches, **_):
        for mb in data_iterator:
            devices.append({t.device.type for t in (mb.input_ids, mb.position_ids, mb.attention_mask, mb.labels,
                                                    mb.loss_mask, mb.advantages)})
        return []

    return schedule


def test_every_role_feeds_its_micro_batches_on_the_device_of_the_models_parameters():
    """packing builds micro-batches on the host; the policy's train step, the critic's and the
    forward-only log-probs hand megatron's schedule each one on the model's device."""
    _, settings = settings_of()
    stage = {"micro_batching": {"tokens": TOKENS}, "groups": {"dp": [[0]], "pp": [[0]]}}
    devices: list = []
    model = MetaDeviceModel()
    trainer = MegatronTrainer.of_parts(stage, settings, SimpleNamespace(comm=None), model, None,
                                       recording_schedule(devices))
    trainer.train(rollouts(settings))
    critic = MegatronCritic(stage, settings, model, None, recording_schedule(devices))
    critic.train([dataclasses.replace(r, values=[0.0] * len(r.response)) for r in rollouts(settings)])
    PipelinedForward(TOKENS, SimpleNamespace(rank=0), [0, 1], recording_schedule(devices))._last_stage_rows(
        model, pack(rollouts(settings), TOKENS))
    assert len(devices) == 3 * len(pack(rollouts(settings), TOKENS))
    assert all(d == {"meta"} for d in devices)
