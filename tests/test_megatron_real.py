"""The megatron trainer on the real megatron-core 0.16.1 (tests/megatron_cpu.py: gloo processes, CUDA
calls answered on the host): megatron's own GPTModel, DistributedDataParallel, get_megatron_optimizer
and forward-backward schedule under backends/ascend/megatron_trainer.py, on one rank and on two
data-parallel ranks."""

import pytest
import torch

pytest.importorskip("megatron.core")

from aspc.backends.ascend import reshard  # noqa: E402
from aspc.backends.ascend.megatron_model import arch_of  # noqa: E402
from megatron_cpu import run_job  # noqa: E402
from test_ascend_load import random_full, train_stage, write_checkpoint  # noqa: E402
from test_trainer_differential import samples, settings_for, task_reward  # noqa: E402

RANK_ARGS = {"pre_process": True, "post_process": True}


def stage_on(world: int, checkpoint, bf16: bool = False, **builders) -> dict:
    """tiny_grpo's train stage (Qwen2 shape) over `world` data-parallel ranks, from `checkpoint`."""
    stage = train_stage()
    if bf16:
        stage["config"] |= {"bf16": True, "params_dtype": "bfloat16"}
    stage["builders"] |= {"checkpoint": str(checkpoint), **builders}
    stage["groups"] = {"dp": [list(range(world))], "pp": [[r] for r in range(world)]}
    return stage


def tp_stage(tp: int, checkpoint, qwen3: bool = False) -> dict:
    """The train stage over `tp` tensor-parallel ranks, without sequence parallelism (the lowering sets
    it with tp > 1, but megatron's torch norms refuse it without Apex or Transformer Engine,
    torch_norm.py:32; on NPUs MindSpeed's fused RMSNorm carries it)."""
    stage = train_stage(qwen3)
    stage["config"] |= {"tensor_model_parallel_size": tp, "sequence_parallel": False}
    stage["builders"]["checkpoint"] = str(checkpoint)
    stage["groups"] = {"dp": [[r] for r in range(tp)], "pp": [[r] for r in range(tp)]}
    return stage


def checkpoint(folder, seed: int = 3):
    arch = arch_of(train_stage())
    full = {k: 0.05 * v for k, v in random_full(arch, seed=seed).items()}  # small weights: finite logits
    write_checkpoint(folder, reshard.to_hf(arch, full))
    return folder


def trainer(stage: dict, rank: int, rank_args: dict = RANK_ARGS, **settings):
    from aspc.backends.ascend.megatron_trainer import MegatronTrainer, SyncSetup
    from aspc.backends.ascend.weight_sync import TorchCommunicator

    s = settings_for(**settings)
    comm = TorchCommunicator(g for axis in stage["groups"].values() for g in axis)  # as executors.py builds it
    return MegatronTrainer(stage, rank_args, s, task_reward(s), SyncSetup(None, None, comm))


def main_grad_norms(rank: int, stage: dict, steps: int) -> list[float]:
    """The norm of DDP's gradients as each of `steps` steps on the same samples applies them (reduced
    over the data-parallel ranks and scaled), lr 0."""
    t = trainer(stage, rank, lr=0.0)
    norms, step = [], t.optimizer.step

    def recorded():
        norms.append(float(torch.cat([p.main_grad.flatten() for p in t.model.parameters()]).norm()))
        return step()

    t.optimizer.step = recorded
    for _ in range(steps):
        rollouts = samples(False)
        t.reward(rollouts)
        t.train(rollouts)
        t.optimizer_step()
    return norms


@pytest.mark.parametrize("world", [1, 2])
def test_gradients_do_not_accumulate_across_optimizer_steps(tmp_path, world):
    stage = stage_on(world, checkpoint(tmp_path))
    for norms in run_job(world, stage["config"], main_grad_norms, stage, 3):
        assert norms[0] > 0 and norms == pytest.approx([norms[0]] * 3, rel=1e-6), norms


def step(t) -> dict:
    rollouts = samples(False)
    t.reward(rollouts)
    t.train(rollouts)
    return t.optimizer_step()


def held_weights(t) -> dict:
    """Copies of the parameters a trainer's rank holds (its megatron module's state dict, local names)."""
    return {name: tensor.clone() for name, tensor in t.model.module.state_dict().items()
            if isinstance(tensor, torch.Tensor) and "_extra_state" not in name}


def steps_around_an_offload(rank: int, stage: dict, offload: bool) -> dict:
    """Two steps; between them, with `offload`, the pool goes to generation and back (offload.py):
    -> the storage left on the device while offloaded, and the weights after the second step."""
    t = trainer(stage, rank, lr=1e-2)
    step(t)
    held = None
    if offload:
        t.offload()
        held = sum(p.untyped_storage().size() + p.main_grad.untyped_storage().size() for p in t.model.parameters())
        t.onload()
    step(t)
    return {"held": held, "weights": held_weights(t)}


@pytest.mark.parametrize("world, distributed, bf16", [(2, True, False), (1, False, False), (2, True, True)],
                         ids=["distributed-optimizer-dp2", "plain-dp1", "bf16-fp32-main-params-dp2"])
def test_a_time_shared_pool_offloads_and_trains_on_as_if_it_never_left(tmp_path, world, distributed, bf16):
    """Offload and onload (offload.py) of megatron's own DDP buffers and optimizer: with the
    distributed optimizer (parameters and their fp32 shards are views into DDP's param_data), without
    it (megatron keeps no param_data), and in bf16 (fp32 main parameters and Adam state apart)."""
    stage = stage_on(world, checkpoint(tmp_path), bf16, distributed_optimizer=distributed)
    stayed = run_job(world, stage["config"], steps_around_an_offload, stage, False)
    left = run_job(world, stage["config"], steps_around_an_offload, stage, True)
    for kept, moved in zip(stayed, left):
        assert moved["held"] == 0
        assert kept["weights"].keys() == moved["weights"].keys()
        for name, tensor in kept["weights"].items():
            assert torch.equal(tensor, moved["weights"][name]), name


def trained_in_units(rank: int, stage: dict, units: int) -> dict:
    """One step over the same samples, handed to the trainer as `units` streamed units (one
    schedule each): -> its grad norm and the weights after it."""
    t = trainer(stage, rank, lr=1e-2)
    rollouts = samples(False)
    t.reward(rollouts)
    per = len(rollouts) // units
    for first in range(0, len(rollouts), per):
        t.train(rollouts[first:first + per])
    return {"grad_norm": t.optimizer_step()["grad_norm"], "weights": held_weights(t)}


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed-optimizer", "plain"])
def test_a_step_streamed_in_units_trains_as_one_unit_over_data_parallel_ranks(tmp_path, distributed):
    """A step's gradients are reduced once, before its optimizer step: had each unit's schedule
    reduced them (megatron's finalize_model_grads at its end), the distributed optimizer's second
    reduce-scatter would sum the shards the first reduced with the other ranks' local gradients
    (grad norm 0.159 for 0.224 on these samples)."""
    stage = stage_on(2, checkpoint(tmp_path), distributed_optimizer=distributed)
    stage["micro_batching"]["tokens"] = 16  # a few rows a unit: both ranks train some
    whole = run_job(2, stage["config"], trained_in_units, stage, 1)
    streamed = run_job(2, stage["config"], trained_in_units, stage, 2)
    for one, two in zip(whole, streamed):
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
        for name, tensor in one["weights"].items():
            assert torch.allclose(tensor, two["weights"][name], atol=1e-5), name


def adam_state_numel(rank: int, stage: dict) -> tuple[int, int]:
    """(the Adam moments' elements this rank holds after a step, the model's parameter count)."""
    t = trainer(stage, rank)
    step(t)
    held = sum(v.numel() for inner in t.optimizer.chained_optimizers for state in inner.optimizer.state.values()
               for k, v in state.items() if k in ("exp_avg", "exp_avg_sq"))
    return held, sum(p.numel() for p in t.model.parameters())


@pytest.mark.parametrize("distributed", [True, False])
def test_the_distributed_optimizer_option_shards_adam_state_over_data_parallel_ranks(tmp_path, distributed):
    """The language's distributed_optimizer (default on: the memory check prices optimizer state over
    dp) reaches megatron: each of two data-parallel ranks holds half the moments, or all of them."""
    stage = stage_on(2, checkpoint(tmp_path), distributed_optimizer=distributed)
    ranks = run_job(2, stage["config"], adam_state_numel, stage)
    params = ranks[0][1]
    if distributed:  # each rank's shard of DDP's buffer: an even split up to bucket boundaries
        assert sum(held for held, _ in ranks) == 2 * params
        assert all(held == pytest.approx(params, rel=0.01) for held, _ in ranks)
    else:
        assert all(held == 2 * params for held, _ in ranks)


@pytest.mark.parametrize("name", ["grpo_7b", "dapo_32b", "grpo_30b_moe", "r1_zero_671b", "tiny_ppo"])
def test_every_trained_stage_carries_the_distributed_optimizer_option_it_was_priced_with(name):
    from aspc.backends.ascend.lowering import lower
    from aspc.cli.toolchain import compile_with_passes
    from conftest import ROOT

    for written in (None, False):
        overrides = [] if written is None else [f"train.distributed_optimizer={str(written).lower()}"]
        plan = compile_with_passes(ROOT / "pipelines" / f"{name}.aspl", overrides).plan()
        trained = [s for s in lower(plan).stages if s.kind in ("train", "critic")]
        assert trained and all(s.builders["distributed_optimizer"] is (written is None) for s in trained
                               if s.kind == "train")
        assert all(s.builders["distributed_optimizer"] for s in trained if s.kind == "critic")


# ---- load_hf into megatron against transformers' own Qwen2 ----
def hf_model(folder, qwen3: bool):
    """A random Qwen2ForCausalLM (qkv bias, untied) or Qwen3ForCausalLM (q/k norm, tied) of the train
    stage's shape, saved as transformers saves it."""
    import transformers

    family = "Qwen3" if qwen3 else "Qwen2"
    config_cls, model_cls = (getattr(transformers, f"{family}{kind}") for kind in ("Config", "ForCausalLM"))
    arch = arch_of(train_stage())
    torch.manual_seed(5)
    model = model_cls(config_cls(
        hidden_size=arch.hidden, intermediate_size=arch.ffn, num_attention_heads=arch.heads,
        num_key_value_heads=arch.kv_heads, head_dim=arch.head_dim, num_hidden_layers=arch.layers,
        vocab_size=arch.vocab, rms_norm_eps=1e-6, rope_theta=train_stage()["model_args"]["rotary_base"],
        tie_word_embeddings=qwen3, max_position_embeddings=64, attn_implementation="eager")).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def megatron_forward(rank: int, stage: dict, tokens: torch.Tensor) -> dict:
    """This rank's logits of one sequence (tp = 1) and the forward-only log-probs of packed rows."""
    from aspc.backends.ascend.forward_only import PipelinedForward
    from aspc.backends.ascend.megatron_model import build_gpt, load_checkpoint
    from aspc.backends.ascend.weight_sync import TorchCommunicator

    model = load_checkpoint(build_gpt(stage, RANK_ARGS), stage).eval()
    logits = None
    if stage["config"]["tensor_model_parallel_size"] == 1:
        with torch.no_grad():
            positions = torch.arange(tokens.shape[1])[None]
            logits = model(tokens, positions, None)
    comm = TorchCommunicator(g for axis in stage["groups"].values() for g in axis)
    return {"logits": logits, "logprobs": PipelinedForward.of(stage, comm).logprobs(model, samples(False))}


def hf_logprobs(model, rollouts) -> dict:
    out = {}
    for r in rollouts:
        ids = torch.tensor([list(r.prompt) + list(r.response)])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits.float(), -1)[0]
        n = len(r.prompt)
        out[r.key] = logp[n - 1:-1].gather(-1, torch.tensor(r.response)[:, None])[:, 0]
    return out


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("tp", [1, 2])
def test_a_transformers_checkpoint_gives_megatron_the_same_logits_and_packed_log_probs(tmp_path, tp, family):
    """load_hf.py into megatron's GPTModel (tp = 1, and cut over two tensor-parallel ranks): the logits
    of transformers' Qwen2ForCausalLM / Qwen3ForCausalLM on the same checkpoint, and
    the forward-only log-probs of packed rows (several sequences a row, block-diagonal attention)
    those of the HF model run one sequence at a time."""
    hf = hf_model(tmp_path, family == "qwen3")
    stage = tp_stage(tp, tmp_path, family == "qwen3")
    stage["micro_batching"]["tokens"] = 24
    tokens = torch.tensor([[3, 17, 5, 9, 30, 1, 12, 7]])
    ranks = run_job(tp, stage["config"], megatron_forward, stage, tokens)
    if tp == 1:
        with torch.no_grad():
            expected = hf(tokens).logits
        torch.testing.assert_close(ranks[0]["logits"], expected, rtol=1e-4, atol=1e-5)
    wanted = hf_logprobs(hf, samples(False))
    for found in ranks:
        assert found["logprobs"].keys() == wanted.keys()
        for key, values in wanted.items():
            torch.testing.assert_close(torch.tensor(found["logprobs"][key]), values, rtol=1e-4, atol=1e-5)


def logprob_errors_at_temperature(rank: int, temperature: float) -> tuple[float, float]:
    """The forward-only path's log-probs of bf16 logits at `temperature` against the fp32 computation;
    and what dividing in bf16 would give (the issue-35 finding: up to 0.10 nats at 0.7)."""
    from aspc.backends.ascend.forward_only import token_logprobs

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 16, 64, generator=g) * 6).to(torch.bfloat16)
    labels = torch.randint(0, 64, (2, 16), generator=g)

    def picked(scaled):
        return torch.log_softmax(scaled, -1).gather(-1, labels[..., None])[..., 0]

    exact = picked(logits.float() / temperature)
    ours = token_logprobs(logits, labels, temperature)
    return float((ours - exact).abs().max()), float((picked((logits / temperature).float()) - exact).abs().max())


def test_the_forward_only_path_scales_bf16_logits_by_the_temperature_in_fp32():
    [(ours, in_bf16)] = run_job(1, train_stage()["config"], logprob_errors_at_temperature, 0.7)
    assert ours < 1e-5
    assert in_bf16 > 1e-2  # what bf16 division would have cost


def auto_choices(rank: int, stage: dict) -> dict:
    """One step with mismatch = auto: this rank's counts of fresh sequences and the mode it chose next."""
    t = trainer(stage, rank, mismatch="auto")
    counts = []
    record = t._mismatch_after_step

    def recorded():
        counts.append(list(t.mismatch.counts))
        return record()

    t._mismatch_after_step = recorded
    first = t.correction.mode
    step(t)
    return {"first": first, "counts": counts[0], "next": t.correction.mode}


def test_auto_chooses_one_correction_for_every_data_parallel_rank_from_their_summed_counts(tmp_path):
    from aspc.rl.mismatch import FIRST_AUTO_CHOICE, auto_choice

    stage = stage_on(2, checkpoint(tmp_path))
    stage["micro_batching"]["tokens"] = 16  # a few rows a unit: both ranks train some
    ranks = run_job(2, stage["config"], auto_choices, stage)
    assert all(r["counts"][0] > 0 for r in ranks)  # each rank measured sequences of its own
    total = [sum(r["counts"][k] for r in ranks) for k in range(3)]
    assert {r["first"] for r in ranks} == {FIRST_AUTO_CHOICE}
    assert {r["next"] for r in ranks} == {auto_choice(*total)}
