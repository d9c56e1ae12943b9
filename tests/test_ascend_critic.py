"""The PPO critic on NPUs (backends/ascend/critic.py) on CPU: its value head in a real megatron-core
GPTModel built from the lowered critic stage; its values and clipped value loss on packed rows
against the CPU learner's on a fixed batch; and `aspc run tiny_ppo --backend ascend` with the
platform faked (megatron's forward needs CUDA/NPU: a packed-row model over the CPU critic's
layers stands for the GPTModel, under the real ValueHead)."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from aspc.backends.ascend.critic import MegatronCritic, PolicyWithCritic, ValueHead
from aspc.backends.ascend.data_parallel import RankGroup
from aspc.backends.ascend.lowering import lower
from aspc.backends.ascend.run_executors import AscendExecutors
from aspc.backends.ascend.packing import pack
from aspc.backends.cpu.executors import CpuExecutors
from aspc.backends.cpu.learner import Learner
from aspc.rl.rollout import Rollout
from aspc.cli.toolchain import compile_with_passes
from conftest import ROOT
from fake_comm import run_ranks
from fake_pipeline import PipelineStage, pipeline_schedule
from npu_scorer_fakes import GptStandIn
from test_ascend_conformance import megatron_012  # noqa: F401 (a fixture)
from test_ascend_executors import fake_platform, npu_trains_as_cpu, one_rank  # noqa: F401 (a fixture)

PPO = ROOT / "pipelines" / "tiny_ppo.aspl"


class PackedValueModel(GptStandIn):
    """The GPTModel's place on CPU: the CPU critic's layers over megatron's packed row (per-sequence
    positions, block-diagonal mask, True where masked), then the real ValueHead as megatron calls
    its output layer ([T, B, H] in, ([T, B, 1], None) out); the reward model's stand-in, trained."""

    def scale_gradients(self, factor):  # megatron DDP's
        for p in self.parameters():
            if p.grad is not None:
                p.grad *= factor

    def zero_grad_buffer(self):  # megatron DDP's, after each optimizer step (its gradients: .grad here)
        self.zero_grad(set_to_none=True)


class ClippedAdamW:
    """megatron's optimizer as the critic calls it: step() clips and steps, -> (ok, grad norm, _)."""

    def __init__(self, model, lr, clip):
        self.model, self.clip, self.adam = model, clip, torch.optim.AdamW(model.parameters(), lr=lr)

    def step(self):
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip if self.clip > 0 else float("inf"))
        self.adam.step()
        return True, float(norm), None

    def zero_grad(self):
        self.adam.zero_grad(set_to_none=True)


def forward_backward(forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
                     forward_only):
    """megatron's no-pipelining schedule on one CPU rank: a 2-tuple loss is divided by the
    micro-batch count before its backward; the loss functions' dicts are returned."""
    found = []
    for _ in range(num_microbatches):
        output, loss_func = forward_step_func(data_iterator, model[0])
        loss, stats = loss_func(output)
        if not forward_only:
            (loss / num_microbatches).backward()
        found.append(stats)
    return found


def data_parallel_reduction(comm, group: list, model):
    """megatron DDP's gradient all-reduce over the data-parallel group, as the trainers call it once
    before each optimizer step (megatron_model.gradient_reduction: finalize_model_grads, the average,
    1 / dp)."""

    def reduce() -> None:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.copy_(sum(comm.all_gather(p.grad, group)) / len(group))

    return reduce


def fake_critic(cpu_critic, stage: dict, settings, comm=None, group=(0,)) -> MegatronCritic:
    """The critic over PackedValueModel, one rank or a data-parallel rank of `group`."""
    model = PackedValueModel(cpu_critic)
    reduce = None if comm is None else data_parallel_reduction(comm, list(group), model)
    return MegatronCritic(stage, settings, model, ClippedAdamW(model, settings.critic_lr, settings.grad_clip),
                          forward_backward, (RankGroup(comm, tuple(group)), RankGroup()), reduce)


class PackedValueStage(PipelineStage):
    """A pipeline stage of a PackedValueModel (its own copy of the weights): layers `layers` of the
    CPU critic's body; the last stage's output layer is the ValueHead."""

    def __init__(self, cpu_critic, layers: range, pre_process: bool, post_process: bool):
        whole = PackedValueModel(cpu_critic)
        super().__init__(whole.body, layers, pre_process, post_process)
        self.output_layer = whole.output_layer if post_process else None

    def head(self, hidden):
        values, _ = self.output_layer(hidden.transpose(0, 1))
        return values.transpose(0, 1)

    scale_gradients = PackedValueModel.scale_gradients


def pipelined_critic(cpu_critic, stage: dict, settings, comm) -> MegatronCritic:
    """Pipeline stage comm.rank of two (one layer each) of the critic."""
    model = PackedValueStage(cpu_critic, range(comm.rank, comm.rank + 1), comm.rank == 0, comm.rank == 1)
    schedule = pipeline_schedule(comm, [0, 1], cpu_critic.arch.hidden)
    return MegatronCritic(stage, settings, model, ClippedAdamW(model, settings.critic_lr, settings.grad_clip),
                          schedule, (RankGroup(), RankGroup(comm, (0, 1))))


def critic_launch(plan) -> dict:
    launch = lower(plan, PPO.parent)
    return dataclasses.asdict(next(s for s in launch.stages if s.kind == "critic"))


def fixed_rollouts(generator) -> list[Rollout]:
    out = []
    for i, (n_prompt, n_response) in enumerate([(5, 7), (9, 3), (4, 11), (6, 6), (8, 2)]):
        prompt = torch.randint(1, 32, (n_prompt,), generator=generator).tolist()
        response = torch.randint(1, 32, (n_response,), generator=generator).tolist()
        r = Rollout(prompt, response, [-1.0] * n_response, "", None, key=(0, i))
        r.reward = r.task_reward = float(i % 2)
        out.append(r)
    return out


def test_the_value_head_and_clipped_value_loss_match_the_cpu_learner_on_a_fixed_batch():
    """Same critic weights, same rollouts: the packed rows' values, the summed value loss (value
    clip acting) and the value head's gradients equal the CPU learner's within 1e-6."""
    plan = compile_with_passes(PPO).plan()
    cpu = CpuExecutors(plan, PPO.parent)
    settings = dataclasses.replace(cpu._settings(), value_clip=0.01)
    cpu_critic = cpu._critic()
    learner = Learner(cpu.actor, cpu._reference(), cpu_critic, settings, cpu.reward_fn)
    stage = critic_launch(plan)
    stage["micro_batching"]["tokens"] = 16  # several packed rows
    critic = fake_critic(cpu_critic, stage, settings)
    ours, theirs = fixed_rollouts(torch.Generator().manual_seed(0)), fixed_rollouts(torch.Generator().manual_seed(0))
    critic.values(ours)
    learner.values(theirs)
    assert len(pack(ours, 16)) > 1
    for a, b in zip(ours, theirs):
        assert a.values == pytest.approx(b.values, abs=1e-6) and len(a.values) == len(a.response)
    for r in ours + theirs:  # old values away from the new ones, so that the clip acts
        r.values = [v + 0.05 * (-1) ** t for t, v in enumerate(r.values)]
    critic.train(ours)
    learner.train(theirs)
    assert critic.loss == pytest.approx(learner.step_stats.value_loss, abs=1e-6)
    head = critic.model.output_layer
    assert torch.allclose(head.weight.grad, cpu_critic.value.weight.grad, atol=1e-6)
    assert torch.allclose(head.bias.grad, cpu_critic.value.bias.grad, atol=1e-6)
    unclipped = fake_critic(cpu_critic, stage, dataclasses.replace(settings, value_clip=0.0))
    unclipped.train(ours)
    assert abs(unclipped.loss - critic.loss) > 1e-4  # the clip changed the loss
    summary = critic.optimizer_step()
    tokens = sum(len(r.response) for r in theirs)  # the learner counts them at its step (GAE whitened over it)
    assert summary["value_loss"] == pytest.approx(learner.step_stats.value_loss / tokens)
    assert critic.tokens == 0 and head.weight.grad is None


def critic_step(critic, generator_seed: int = 0) -> dict:
    """values, then (old values moved off, so that the value clip acts) train and the optimizer step;
    what each gave."""
    rollouts = fixed_rollouts(torch.Generator().manual_seed(generator_seed))
    critic.values(rollouts)
    values = {r.key: list(r.values) for r in rollouts}
    for r in rollouts:
        r.values = [v + 0.05 * (-1) ** t for t, v in enumerate(r.values)]
    critic.train(rollouts)
    head = getattr(critic.model, "output_layer", None)
    grads, step = {}, critic.optimizer.step

    def recorded():  # the gradients the step applies: reduced over data-parallel ranks, scaled
        grads.update({name: p.grad.clone() for name, p in critic.model.named_parameters() if p.grad is not None})
        return step()

    critic.optimizer.step = recorded
    summary = critic.optimizer_step()
    return {"values": values, "grads": grads, "summary": summary,
            "head": head.weight.detach().clone() if head is not None else None}


def test_a_two_rank_data_parallel_critic_trains_as_the_one_rank_critic_on_the_same_batch():
    """Each rank takes every other packed row: the values gathered on both ranks, the step's value
    loss, the gradients the step applies (DDP's average over two ranks, scaled back to the sum) and
    the head after the step equal the one-rank critic's on the same rollouts."""
    plan = compile_with_passes(PPO).plan()
    cpu = CpuExecutors(plan, PPO.parent)
    settings = dataclasses.replace(cpu._settings(), value_clip=0.01)
    cpu_critic = cpu._critic()
    stage = critic_launch(plan)
    stage["micro_batching"]["tokens"] = 16  # five rows: three on rank 0, two on rank 1
    assert len(pack(fixed_rollouts(torch.Generator().manual_seed(0)), 16)) == 5
    one = critic_step(fake_critic(cpu_critic, stage, settings))
    ranks = run_ranks(2, lambda comm: critic_step(fake_critic(cpu_critic, stage, settings, comm, (0, 1))))
    for two in ranks:
        assert two["values"].keys() == one["values"].keys()
        for key, values in one["values"].items():
            assert two["values"][key] == pytest.approx(values, abs=1e-6)
        assert two["summary"]["value_loss"] == pytest.approx(one["summary"]["value_loss"], abs=1e-7)
        assert two["summary"]["critic_grad_norm"] == pytest.approx(one["summary"]["critic_grad_norm"], rel=1e-5)
        assert two["grads"].keys() == one["grads"].keys()
        for name, grad in one["grads"].items():
            assert torch.allclose(two["grads"][name], grad, atol=1e-6), name
        assert torch.allclose(two["head"], one["head"], atol=1e-6)


def test_a_two_stage_pipelined_critic_trains_as_the_one_rank_critic_on_the_same_batch():
    """Stage 0 embeds and runs layer 0, stage 1 layer 1, the norm and the value head; megatron's
    schedule hands hidden states on and input gradients back. The values and the step's value loss
    reach both stages, and every parameter's gradient (each on the stage that holds it) equals the
    one-rank critic's."""
    plan = compile_with_passes(PPO).plan()
    cpu = CpuExecutors(plan, PPO.parent)
    settings = dataclasses.replace(cpu._settings(), value_clip=0.01, grad_clip=0.0)  # clip norms are per stage here
    cpu_critic = cpu._critic()
    assert cpu_critic.arch.layers == 2
    stage = critic_launch(plan)
    stage["micro_batching"]["tokens"] = 16
    one = critic_step(fake_critic(cpu_critic, stage, settings))
    first, last = run_ranks(2, lambda comm: critic_step(pipelined_critic(cpu_critic, stage, settings, comm)))
    for ranked in (first, last):
        for key, values in one["values"].items():
            assert ranked["values"][key] == pytest.approx(values, abs=1e-6)
        assert ranked["summary"]["value_loss"] == pytest.approx(one["summary"]["value_loss"], abs=1e-7)
    held = {**first["grads"], **last["grads"]}
    assert not first["grads"].keys() & last["grads"].keys()
    assert {n.replace("whole.", "body.") for n in held} == one["grads"].keys()
    for name, grad in held.items():
        assert torch.allclose(grad, one["grads"][name.replace("whole.", "body.")], atol=1e-6), name


def test_a_rank_without_a_row_of_its_own_runs_a_filler_that_counts_no_token():
    """Fewer rows than data-parallel ranks: the last rank still runs one micro-batch (megatron's
    gradient all-reduce needs every rank), with nothing in its loss."""
    rows = pack(fixed_rollouts(torch.Generator().manual_seed(0)), 64)
    [filler] = RankGroup(SimpleNamespace(rank=3), (0, 1, 2, 3)).share(rows)
    assert len(rows) < 4 and float(filler.loss_mask.sum()) == 0.0 and filler.keys == rows[0].keys


def test_the_policy_trainer_packs_the_gae_advantages_the_cpu_learner_computes():
    """PPO's policy update on NPUs reads each response token's GAE advantage (whitened) from the
    critic's values, at the label position of that token, as the CPU learner computes them."""
    from types import SimpleNamespace

    from aspc.backends.ascend.megatron_trainer import MegatronTrainer
    from aspc.backends.ascend.packing import per_sequence

    cpu = CpuExecutors(compile_with_passes(PPO).plan(), PPO.parent)
    settings = dataclasses.replace(cpu._settings(), normalize=True)
    assert settings.estimator == "gae"
    rollouts = fixed_rollouts(torch.Generator().manual_seed(1))
    for r in rollouts:
        r.values = torch.randn(len(r.response), generator=torch.Generator().manual_seed(len(r.prompt))).tolist()
    rollouts[1].masked = True
    expected, _ = Learner(cpu.actor, None, None, settings, cpu.reward_fn)._advantages(rollouts)
    advantages = MegatronTrainer._advantages(SimpleNamespace(settings=settings), rollouts)
    packed = {k: v for mb in pack(rollouts, 16, advantages) for k, v in per_sequence(mb.advantages, mb).items()}
    for r, tokens in zip(rollouts, expected):
        assert packed[r.key] == pytest.approx(tokens, abs=1e-6)
    assert packed[rollouts[1].key] == [0.0] * len(rollouts[1].response)


def test_the_critic_stage_builds_a_megatron_gpt_model_with_a_one_unit_output_layer(one_rank):  # noqa: F811
    """value_model on the lowered critic stage: untied embeddings (the output layer is the value
    head), one unit over the hidden size, values in fp32 as megatron calls its output layer."""
    from aspc.backends.ascend.critic import value_model

    plan = compile_with_passes(PPO).plan()
    stage = critic_launch(plan)
    assert stage["model_args"]["share_embeddings_and_output_weights"] is False
    model = value_model(stage, {"pre_process": True, "post_process": True}, use_cpu_initialization=True)
    head = model.output_layer
    assert isinstance(head, ValueHead) and tuple(head.weight.shape) == (1, stage["config"]["hidden_size"])
    values, bias = head(torch.randn(7, 1, stage["config"]["hidden_size"]))
    assert values.shape == (7, 1, 1) and values.dtype == torch.float32 and bias is None
    first = value_model(stage, {"pre_process": True, "post_process": False}, use_cpu_initialization=True)
    assert not isinstance(getattr(first, "output_layer", None), ValueHead)  # not the last pipeline stage


def test_the_methods_the_critic_calls_on_megatron_objects_exist_in_both_versions(megatron_012):  # noqa: F811
    """What the conformance AST check cannot follow (objects returned by megatron_model.training_parts:
    get_megatron_optimizer): DDP.scale_gradients, the optimizer's step/zero_grad, GPTModel.output_layer."""
    pytest.importorskip("megatron.core")
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer

    old = megatron_012
    for cls, names in ((DistributedDataParallel, ("scale_gradients", "zero_grad_buffer")),
                       (MegatronOptimizer, ("step", "zero_grad"))):
        for name in names:
            assert hasattr(cls, name) and name in old.members(cls.__name__), (cls.__name__, name)
    assert "output_layer" in old.members("GPTModel")
    # OptimizerConfig is a dataclass (no __init__ for the conformance check's keyword test): its fields
    import ast
    import inspect

    from megatron.core.optimizer import OptimizerConfig

    from megatron.core.distributed import DistributedDataParallelConfig

    from aspc.backends.ascend import megatron_model
    from wheel_sources import dataclass_fields

    tree = ast.parse(inspect.getsource(megatron_model))  # training_parts: the trainer's and the critic's
    for cls, module in ((OptimizerConfig, "megatron.core.optimizer.optimizer_config"),
                        (DistributedDataParallelConfig, "megatron.core.distributed.distributed_data_parallel_config")):
        [call] = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == cls.__name__]
        used = {k.arg for k in call.keywords}
        assert used and used <= set(inspect.signature(cls).parameters)
        assert used <= dataclass_fields(old, module, cls.__name__)


# ---- `aspc run tiny_ppo --backend ascend`, the platform faked ----
def separate_ppo(tmp_path):
    """tiny_ppo with generation on a pool of its own (two instances) and the trainer, reference and
    critic time-sharing one device."""
    text = PPO.read_text().replace("pool cpu = cpu x 2", "pool cpu = cpu x 1\npool rollout = cpu x 2")
    path = tmp_path / "tiny_ppo_separate.aspl"
    path.write_text(text.replace("generate(actor, prompts) on cpu", "generate(actor, prompts) on rollout"))
    return path


def fake_ppo_platform(monkeypatch):
    """fake_platform, with the policy the CPU learner without its critic and the critic the
    MegatronCritic over the same initial critic weights as the CPU run's."""
    built = fake_platform(monkeypatch)
    original = AscendExecutors.build_trainer

    def build_trainer(self):
        leader = original(self)  # fake_platform's: the CPU learner behind the trainer's WeightSender
        c = self.cpu
        leader.learner = Learner(c.actor, c._reference(), None, c._settings(), c.reward_fn, c.tokenizer.decode)
        return leader

    def build_critic(self):
        stage = next(dataclasses.asdict(s) for s in self.launch.stages if s.kind == "critic")
        return fake_critic(self.cpu._critic(), stage, self._settings())

    monkeypatch.setattr(AscendExecutors, "build_trainer", build_trainer)
    monkeypatch.setattr(AscendExecutors, "build_critic", build_critic)
    return built


def test_aspc_run_tiny_ppo_backend_ascend_trains_the_critic_as_the_cpu_backend(aspc, tmp_path, monkeypatch):
    """The controller's critic units reach the NPU critic (values for GAE), its train units both
    the policy and the critic, each step both optimizers: the same samples per step as `--backend
    cpu`, and the first step's value loss equal to the CPU learner's (same weights, same rollouts)."""
    built = fake_ppo_platform(monkeypatch)
    npu, cpu = npu_trains_as_cpu(aspc, separate_ppo(tmp_path), tmp_path)
    assert all("value_loss" in m and "critic_grad_norm" in m for m in npu)
    assert npu[0]["value_loss"] == pytest.approx(cpu[0]["value_loss"], abs=1e-6)
    [executors] = built
    assert isinstance(executors.learner, PolicyWithCritic) and executors.learner.policy.learner.critic is None


def laid_out(tmp_path, critic: str, train: str):
    """separate_ppo with the trainer's pool of two NPUs and the critic's and train stage's layouts."""
    text = separate_ppo(tmp_path).read_text().replace("pool cpu = cpu x 1", "pool cpu = cpu x 2")
    text = text.replace("on cpu { lr = 1e-3 }", f"on cpu {{ lr = 1e-3, {critic} }}")
    path = tmp_path / "laid_out.aspl"
    path.write_text(text.replace("loss = ppo,", f"loss = ppo, {train},"))
    return AscendExecutors.unsupported(compile_with_passes(path, ["schedule.staleness=0"]).plan())


def test_critics_the_npu_run_cannot_place_are_refused_at_the_critic_stage(tmp_path):
    """The critic is built on the trainer's ranks: on a pool of its own, with a layout other than
    the train stage's, or with context parallelism, it is refused at the option that causes it;
    tiny_ppo's critic (the trainer's NPU) and a critic with the trainer's data, tensor or pipeline
    parallelism are not."""
    plan = compile_with_passes(separate_ppo(tmp_path), ["schedule.staleness=0"]).plan()
    assert AscendExecutors.unsupported(plan) == []
    elsewhere = separate_ppo(tmp_path).read_text().replace("pool cpu = cpu x 1", "pool cpu = cpu x 1\npool v = cpu x 1")
    path = tmp_path / "elsewhere.aspl"
    path.write_text(elsewhere.replace("critic(value, gen) on cpu", "critic(value, gen) on v"))
    [refused] = AscendExecutors.unsupported(compile_with_passes(path).plan())
    assert refused.stage == "values" and "pool 'cpu'" in refused.hint
    for layout in ("dp = 2", "tp = 2", "pp = 2"):
        assert laid_out(tmp_path, layout, layout) == [], layout
    [other] = laid_out(tmp_path, "dp = 1", "dp = 2")
    assert other.option == "dp" and "dp = 2 as the train stage" in other.hint
    [split] = laid_out(tmp_path, "cp = 2", "cp = 2")
    assert split.option == "cp" and "context-parallel" in split.message
