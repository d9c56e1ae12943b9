"""Weight-sync resharding on CPU (backends/ascend/reshard.py, weight_sync.py): megatron tensor and
pipeline layouts against Hugging Face names, MindSpeed-RL's in-place reshard and vllm-ascend's
HCCL broadcast, each rank on a thread of its own over an in-process communicator."""
import pytest
import torch

from aspc.backends.ascend import reshard
from aspc.backends.ascend.weight_sync import (coords_of, gather_hf, receive_hf, reshard_in_place, send_hf,
                                              update_info)
from aspc.ir.facts import ModelArch
from aspc.ir.graph import Parallel
from fake_comm import run_ranks

DENSE = ModelArch(layers=4, hidden=16, heads=8, kv_heads=8, head_dim=4, ffn=32, vocab=64, qkv_bias=True,
                  qk_norm=True)
MOE = ModelArch(layers=4, hidden=16, heads=4, kv_heads=4, head_dim=4, ffn=32, vocab=64, experts=8, top_k=2,
                expert_ffn=8, dense_layers=1, qk_norm=True)


def hf_weights(arch: ModelArch, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    full = {name: torch.randn(shape, generator=generator) for name, shape in reshard.full_shapes(arch).items()}
    return reshard.to_hf(arch, full)


def trainer_shards(arch: ModelArch, par: Parallel, hf: dict) -> list[dict]:
    full = reshard.from_hf(arch, hf)
    return [reshard.shard_state(arch, full, par.tp, par.pp, par.ep, coords_of(par, r)) for r in range(par.devices)]


def assert_same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("arch", [DENSE, MOE], ids=["dense", "moe"])
def test_hf_names_round_trip_through_the_megatron_layout(arch):
    hf = hf_weights(arch)
    assert_same(reshard.to_hf(arch, reshard.from_hf(arch, hf)), hf)
    full = reshard.from_hf(arch, hf)
    q, k = hf["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"]
    per = arch.heads // arch.kv_heads * arch.head_dim
    qkv = full["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(qkv[:per], q[:per])  # query group 0's heads, then its key head
    assert torch.equal(qkv[per:per + arch.head_dim], k[:arch.head_dim])


def test_a_gated_fc1_shard_holds_its_part_of_gate_and_of_up():
    hf = hf_weights(DENSE)
    shards = reshard.split(reshard.from_hf(DENSE, hf)["decoder.layers.1.mlp.linear_fc1.weight"], reshard.GATED, 4)
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    rows = DENSE.ffn // 4
    assert torch.equal(shards[1], torch.cat([gate[rows:2 * rows], up[rows:2 * rows]]))
    assert torch.equal(reshard.merge(shards, reshard.GATED), torch.cat([gate, up]))


def test_pipeline_stages_number_their_layers_from_zero():
    par = Parallel(tp=2, pp=2)
    shards = trainer_shards(DENSE, par, hf_weights(DENSE))
    last = shards[2]  # pp stage 1, tp rank 0
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in last
    assert "decoder.layers.2.self_attention.linear_qkv.weight" not in last
    assert "output_layer.weight" in last and "embedding.word_embeddings.weight" not in last


def test_tp8_pp2_to_tp4_in_place_round_trip_gives_the_original_weights():
    """MindSpeed-RL's colocated reshard: 16 training ranks (TP8 PP2) become 4 inference engines of
    TP4; the TP4 shards merge back into the original checkpoint, and cut again as TP8 PP2 they are
    the training shards."""
    par, infer_tp = Parallel(tp=8, pp=2), 4
    hf = hf_weights(DENSE)
    shards = trainer_shards(DENSE, par, hf)
    held = run_ranks(par.devices, lambda comm: reshard_in_place(DENSE, shards[comm.rank], par, infer_tp, comm))
    cuts = reshard.full_params(DENSE)
    for engine in range(par.devices // infer_tp):
        ranks = held[engine * infer_tp:(engine + 1) * infer_tp]
        full = {name: reshard.merge([r[name] for r in ranks], cut) for name, cut in cuts.items()}
        assert_same(reshard.to_hf(DENSE, full), hf)
        assert_same(trainer_shards(DENSE, par, reshard.to_hf(DENSE, full))[3], shards[3])


@pytest.mark.parametrize("infer_tp", [2, 4])
def test_moe_in_place_reshard_takes_experts_from_every_expert_parallel_rank(infer_tp):
    par = Parallel(tp=2, pp=2, dp=2, ep=2)
    hf = hf_weights(MOE, seed=1)
    shards = trainer_shards(MOE, par, hf)
    held = run_ranks(par.devices, lambda comm: reshard_in_place(MOE, shards[comm.rank], par, infer_tp, comm))
    full = reshard.from_hf(MOE, hf)
    for rank, weights in enumerate(held):
        experts = sorted({reshard.expert_of(n) for n in weights if reshard.expert_of(n) is not None})
        per = MOE.experts // infer_tp  # the experts spread over an engine's ranks
        assert experts == list(range(per * (rank % infer_tp), per * (rank % infer_tp + 1)))
        for name in weights:
            if reshard.expert_of(name) is not None:
                assert torch.equal(weights[name], full[name]), name
    # expert 7 of layer 3 lives on the last expert-parallel rank of the last stage only
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight" in shards[6]
    assert "decoder.layers.3.mlp.experts.local_experts.7.linear_fc2.weight" in held[infer_tp - 1]


@pytest.mark.parametrize("arch,par", [(DENSE, Parallel(tp=8, pp=2)), (MOE, Parallel(tp=2, pp=2, dp=2, ep=2))],
                         ids=["dense-tp8-pp2", "moe-tp2-pp2-ep2"])
def test_hccl_broadcast_hands_every_engine_worker_the_full_hf_checkpoint(arch, par):
    """vllm-ascend's HCCL transfer: trainer rank 0 assembles Hugging Face-named tensors and
    broadcasts them to the workers of a TP4 engine, which receive by `update_info` alone."""
    hf = hf_weights(arch, seed=2)
    shards = trainer_shards(arch, par, hf)
    gathered = run_ranks(par.devices, lambda comm: gather_hf(arch, shards[comm.rank], par, comm))
    assert all(g == {} for g in gathered[1:])
    assert_same(gathered[0], hf)
    info, group = update_info(gathered[0]), [0, 1, 2, 3, 4]  # the trainer, then 4 engine workers

    def transfer(comm):
        if comm.rank == 0:
            return send_hf(gathered[0], comm, group)
        loaded = {}
        receive_hf(info, comm, group, lambda pairs: loaded.update(pairs))
        return loaded

    for loaded in run_ranks(len(group), transfer)[1:]:
        assert_same(loaded, hf)


def test_layouts_that_cannot_be_cut_are_refused_with_the_reason():
    with pytest.raises(reshard.LayoutError, match="query groups"):
        reshard.check_supported(DENSE, tp=16)
    with pytest.raises(reshard.LayoutError, match="MLA"):
        reshard.check_supported(ModelArch(layers=2, hidden=8, heads=2, kv_heads=2, head_dim=4, ffn=8, vocab=8,
                                          attention="mla"), tp=1)
    with pytest.raises(reshard.LayoutError, match="must divide"):
        run_ranks(2, lambda comm: reshard_in_place(DENSE, {}, Parallel(tp=1, pp=2), 4, comm))


def test_grouped_gemm_experts_are_resharded_as_per_expert_weights():
    """GroupedMLP's weight1 [hidden, experts x 2 ffn / tp] and weight2 [experts x ffn / tp, hidden]
    (megatron's moe_grouped_gemm) convert to SequentialMLP's per-expert weights and back, and
    expert j's fc1 is what GroupedMLP.forward multiplies by: weight1.view(experts, hidden, -1)[j]."""
    par = Parallel(tp=2, pp=2, dp=2, ep=2)
    shards = trainer_shards(MOE, par, hf_weights(MOE, seed=4))
    rank = shards[6]
    grouped = reshard.sequential_to_grouped(MOE, rank, par.ep)
    per_rank = MOE.experts // par.ep
    w1 = grouped["decoder.layers.1.mlp.experts.weight1"]
    assert w1.shape == (MOE.hidden, per_rank * 2 * MOE.expert_ffn // par.tp)
    assert grouped["decoder.layers.1.mlp.experts.weight2"].shape == (per_rank * MOE.expert_ffn // par.tp, MOE.hidden)
    x = torch.randn(3, MOE.hidden)
    fc1 = rank["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"]
    assert torch.allclose(x @ w1.view(per_rank, MOE.hidden, -1)[2], x @ fc1.t())
    assert_same(reshard.grouped_to_sequential(MOE, grouped, par.ep), rank)
