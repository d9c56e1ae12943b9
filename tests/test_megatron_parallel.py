"""Pipeline and data parallelism on the real megatron-core 0.16.1 (tests/megatron_cpu.py: two gloo
processes, megatron's own get_forward_backward_func, p2p communication and DDP): the reference's
forward-only log-probs of packed rows over two pipeline stages equal transformers' Qwen2 one sequence
at a time, and the megatron trainer's step over two pipeline stages, or over two data-parallel ranks
(each its share of the packed rows), is the one-rank step (loss, gradient norm, the updated weights)."""
import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_cpu import run_job  # noqa: E402
from test_ascend_load import train_stage  # noqa: E402
from test_megatron_real import checkpoint, held_weights, hf_logprobs, hf_model, stage_on, step, trainer  # noqa: E402
from test_trainer_differential import samples  # noqa: E402


def pipelined(stage: dict, pp: int) -> dict:
    """`stage` over `pp` pipeline stages of one rank each (one layer each: tiny_grpo has two)."""
    stage["config"] |= {"pipeline_model_parallel_size": pp} | ({"pipeline_dtype": "float32"} if pp > 1 else {})
    stage["groups"] = {"dp": [[r] for r in range(pp)], "pp": [list(range(pp))]}
    stage["micro_batching"]["tokens"] = 24
    return stage


def rank_args() -> dict:
    """This rank's pipeline stage, from megatron's parallel state (as the launch plan's model_args say)."""
    from aspc.backends.ascend.megatron_args import rank_model_args
    from megatron.core import parallel_state

    return rank_model_args(parallel_state.get_pipeline_model_parallel_rank(),
                           parallel_state.get_pipeline_model_parallel_world_size())


def forward_logprobs(rank: int, stage: dict) -> dict:
    from aspc.backends.ascend.forward_only import PipelinedForward
    from aspc.backends.ascend.megatron_model import build_gpt, load_checkpoint
    from aspc.backends.ascend.weight_sync import TorchCommunicator

    model = load_checkpoint(build_gpt(stage, rank_args()), stage).eval()
    comm = TorchCommunicator(g for axis in stage["groups"].values() for g in axis)
    return PipelinedForward.of(stage, comm).logprobs(model, samples(False))


def test_two_pipeline_stages_give_the_hf_models_log_probs_on_every_stage(tmp_path):
    hf = hf_model(tmp_path, qwen3=False)
    stage = pipelined(train_stage(), 2)
    stage["builders"]["checkpoint"] = str(tmp_path)
    wanted = hf_logprobs(hf, samples(False))
    for found in run_job(2, stage["config"], forward_logprobs, stage):  # the last stage's, broadcast to the first
        assert found.keys() == wanted.keys()
        for key, values in wanted.items():
            torch.testing.assert_close(torch.tensor(found[key]), values, rtol=1e-4, atol=1e-5)


def one_step(rank: int, stage: dict) -> dict:
    """A step at lr 1e-2: its stats and the weights this rank holds after it (global layer numbers)."""
    from megatron.core import parallel_state

    from aspc.backends.ascend.megatron_model import arch_of
    from aspc.backends.ascend.reshard import global_name

    t = trainer(stage, rank, rank_args(), lr=1e-2)
    stats = step(t)
    stage_rank, stages = (parallel_state.get_pipeline_model_parallel_rank(),
                          parallel_state.get_pipeline_model_parallel_world_size())
    return {"stats": stats, "weights": {global_name(arch_of(stage), name, stage_rank, stages, 0, 1): tensor
                                        for name, tensor in held_weights(t).items()}}


@pytest.mark.parametrize("split", ["pp2", "dp2"])
def test_a_step_over_two_ranks_is_the_one_rank_step(tmp_path, split):
    folder = checkpoint(tmp_path)
    whole = pipelined(train_stage(), 1)
    whole["builders"]["checkpoint"] = str(folder)
    if split == "pp2":
        two_ranks = pipelined(train_stage(), 2)
        two_ranks["builders"]["checkpoint"] = str(folder)
    else:
        two_ranks = stage_on(2, folder)
        two_ranks["micro_batching"]["tokens"] = 24
    [one] = run_job(1, whole["config"], one_step, whole)
    two = run_job(2, two_ranks["config"], one_step, two_ranks)
    for rank in two:
        assert rank["stats"]["loss"] == pytest.approx(one["stats"]["loss"], rel=1e-5)
        assert rank["stats"]["grad_norm"] == pytest.approx(one["stats"]["grad_norm"], rel=1e-4)
    held = {**two[0]["weights"], **two[1]["weights"]} if split == "pp2" else two[1]["weights"]
    assert held.keys() == one["weights"].keys()
    for name, tensor in one["weights"].items():
        torch.testing.assert_close(held[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def test_a_rank_finds_its_pipeline_group_in_the_launch_stage():
    from aspc.backends.ascend.forward_only import pipeline_group

    stage = {"groups": {"tp": [[0, 1], [2, 3]], "pp": [[0, 2], [1, 3]]}}
    assert pipeline_group(stage, 3) == [1, 3] and pipeline_group({"groups": {}}, 5) == [5]


# ---- context parallelism: each of two ranks holds two chunks of every packed row ----
def context_parallel(stage: dict, cp: int, tokens: int) -> dict:
    stage["config"] |= {"context_parallel_size": cp}
    stage["groups"] = {"dp": [[r] for r in range(cp)], "pp": [[r] for r in range(cp)], "cp": [list(range(cp))]}
    stage["micro_batching"]["tokens"] = tokens
    return stage


def cp_step(rank: int, stage: dict, changes: dict) -> dict:
    """One step at lr 1e-2 with the loss `changes`, after the reference's log-probs (the KL term):
    the stats, the log-probs and the updated weights. Under cp > 1 megatron's core attention is
    tests/cp_attention.py's (megatron's local attention refuses context parallelism on CPU)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from cp_attention import with_cp_attention

    if stage["config"]["context_parallel_size"] > 1:
        local_spec = gpt_layer_specs.get_gpt_layer_local_spec
        gpt_layer_specs.get_gpt_layer_local_spec = lambda **args: with_cp_attention(local_spec(**args))
    t = trainer(stage, rank, lr=1e-2, **changes)
    rollouts = samples(False)
    t.reference(rollouts)
    logprobs = {r.key: list(r.ref_logprobs) for r in rollouts}
    t.reward(rollouts)
    t.train(rollouts)
    stats = t.optimizer_step()
    return {"stats": stats, "logprobs": logprobs, "weights": held_weights(t)}


@pytest.mark.parametrize("mode, tokens", [("grpo", 16), ("grpo", 24), ("dapo", 24), ("seq-mean-token-sum", 24),
                                          ("entropy", 24)])
def test_two_context_parallel_ranks_train_as_one_rank_on_the_same_batch(tmp_path, mode, tokens):
    """MindSpeed-RL's get_batch_on_this_cp_rank split (packing.on_this_cp_rank): the reference's
    log-probs, the step's loss, gradient norm and updated weights of cp = 2 equal cp = 1's, for the
    per-sequence means (grpo's seq_mean_token_mean over each sequence's whole length) as for the sums."""
    from test_trainer_differential import MODES

    folder = checkpoint(tmp_path)
    one_rank, two_ranks = (context_parallel(train_stage(), cp, tokens) for cp in (1, 2))
    for stage in (one_rank, two_ranks):
        stage["builders"]["checkpoint"] = str(folder)
    changes = MODES[mode] | {"kl": 0.05}
    [one] = run_job(1, one_rank["config"], cp_step, one_rank, changes)
    for rank in run_job(2, two_ranks["config"], cp_step, two_ranks, changes):
        assert rank["stats"]["loss"] == pytest.approx(one["stats"]["loss"], rel=1e-5)
        assert rank["stats"]["grad_norm"] == pytest.approx(one["stats"]["grad_norm"], rel=1e-4)
        for key, values in one["logprobs"].items():
            torch.testing.assert_close(torch.tensor(rank["logprobs"][key]), torch.tensor(values), rtol=1e-4,
                                       atol=1e-5)
        for name, tensor in one["weights"].items():
            torch.testing.assert_close(rank["weights"][name], tensor, rtol=1e-4, atol=1e-6, msg=name)
