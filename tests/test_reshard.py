"""Weight-sync resharding on CPU (backends/ascend/reshard.py, weight_sync.py): megatron tensor and
pipeline layouts against Hugging Face names, MindSpeed-RL's in-place reshard and vllm-ascend's
HCCL broadcast, each rank on a thread of its own over an in-process communicator."""
import dataclasses

import pytest
import torch

from aspc.backends.ascend import reshard
from aspc.backends.ascend.weight_sync import (coords_of, gather_hf, receive_hf, reshard_in_place, send_hf,
                                              update_info, whole_hf_in_place)
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


# ---- MLA (DeepSeek-V3), uneven pipeline stages, the critic's value head ----
MLA = ModelArch(layers=4, hidden=16, heads=4, kv_heads=4, head_dim=6, ffn=32, vocab=64, attention="mla",
                q_lora_rank=8, kv_lora_rank=6, qk_rope_dim=2, v_head_dim=4)
MLA_MOE = ModelArch(layers=4, hidden=16, heads=4, kv_heads=4, head_dim=6, ffn=32, vocab=64, attention="mla",
                    q_lora_rank=8, kv_lora_rank=6, qk_rope_dim=2, v_head_dim=4, experts=8, top_k=2, expert_ffn=8,
                    shared_experts=1, dense_layers=1)
DEEPSEEK = reshard.Layout(expert_bias=True)  # what the DeepSeek-V3 router settings ask megatron for


def random_full(arch: ModelArch, layout: reshard.Layout, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in reshard.full_shapes(arch, layout).items()}


def rank_states(arch, full, par: Parallel, layout) -> list[dict]:
    return [reshard.shard_state(arch, full, par.tp, par.pp, par.ep, coords_of(par, r), layout)
            for r in range(par.devices)]


def reassemble(arch, states: list[dict], par: Parallel, layout) -> dict:
    """The full megatron state dict from every rank's state: global names, tensor shards merged."""
    pieces, cuts = {}, reshard.full_params(arch, layout)
    for rank, state in enumerate(states):
        coords = coords_of(par, rank)
        for name, tensor in state.items():
            full_name = reshard.global_name(arch, name, coords["pp"], par.pp, coords["ep"], par.ep, layout)
            pieces.setdefault(full_name, {})[coords["tp"]] = tensor
    return {name: reshard.merge([by_tp[t] for t in range(par.tp)], cuts[name]) for name, by_tp in pieces.items()}


def test_mla_hf_names_round_trip_with_first_dense_layers_shared_experts_and_the_router_bias():
    full = random_full(MLA_MOE, DEEPSEEK)
    hf = reshard.to_hf(MLA_MOE, full, DEEPSEEK)
    assert_same(reshard.from_hf(MLA_MOE, hf, DEEPSEEK), full)
    assert torch.equal(hf["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"],
                       full["decoder.layers.1.self_attention.linear_kv_down_proj.weight"])
    assert torch.equal(hf["model.layers.2.mlp.gate.e_score_correction_bias"],
                       full["decoder.layers.2.mlp.router.expert_bias"])
    gate, up = (hf[f"model.layers.3.mlp.shared_experts.{p}_proj.weight"] for p in ("gate", "up"))
    assert torch.equal(torch.cat([gate, up]), full["decoder.layers.3.mlp.shared_experts.linear_fc1.weight"])
    assert "model.layers.0.mlp.gate_proj.weight" in hf and "model.layers.0.mlp.gate.weight" not in hf  # dense
    assert hf["model.layers.0.self_attn.q_b_proj.weight"].shape == (MLA_MOE.heads * MLA_MOE.head_dim, 8)


def test_mla_tp4_pp2_shards_reassemble_and_recut_as_tp2():
    full = random_full(MLA, reshard.PLAIN, seed=5)
    train, infer = Parallel(tp=4, pp=2), Parallel(tp=2)
    states = rank_states(MLA, full, train, reshard.PLAIN)
    assert states[1]["decoder.layers.0.self_attention.linear_q_up_proj.weight"].shape == (6, 8)  # one head
    assert states[1]["decoder.layers.0.self_attention.linear_proj.weight"].shape == (16, 4)
    whole = reassemble(MLA, states, train, reshard.PLAIN)
    assert_same(whole, full)
    assert_same(reshard.from_hf(MLA, reshard.to_hf(MLA, whole)), full)
    assert_same(reassemble(MLA, rank_states(MLA, whole, infer, reshard.PLAIN), infer, reshard.PLAIN), full)


def test_mla_moe_with_expert_parallelism_round_trips_and_keeps_shared_experts_on_every_expert_rank():
    par = Parallel(tp=2, pp=2, dp=2, ep=2)
    full = random_full(MLA_MOE, DEEPSEEK, seed=6)
    states = rank_states(MLA_MOE, full, par, DEEPSEEK)
    assert_same(reassemble(MLA_MOE, states, par, DEEPSEEK), full)
    last_stage = [s for r, s in enumerate(states) if coords_of(par, r)["pp"] == 1]
    for state in last_stage:  # layers 2, 3 as 0, 1; 4 of the 8 experts; shared experts and router whole
        bias = "mlp.router.expert_bias"
        assert torch.equal(state[f"decoder.layers.1.{bias}"], full[f"decoder.layers.3.{bias}"])
        assert state["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"].shape == (8, 16)
        assert sorted({reshard.expert_of(n) for n in state if reshard.expert_of(n) is not None}) == [0, 1, 2, 3]
    name = "decoder.layers.0.self_attention.linear_kv_down_proj.weight"
    assert reshard.full_params(MLA_MOE, DEEPSEEK)[name] == reshard.COLUMN  # megatron's local spec
    assert reshard.engine_params(MLA_MOE, DEEPSEEK)[name] == reshard.REPLICATED  # vLLM's kv_a_proj_with_mqa


def test_megatron_split_of_uneven_pipeline_stages():
    assert reshard.Layout(last_stage_layers=4).stage_layers(7, 2) == (3, 4)
    assert reshard.Layout(first_stage_layers=1, last_stage_layers=2).stage_layers(7, 3) == (1, 4, 2)
    assert reshard.Layout().stage_layers(8, 4) == (2, 2, 2, 2)
    with pytest.raises(reshard.LayoutError, match="spreads the rest evenly"):
        reshard.Layout(first_stage_layers=2).stage_layers(7, 3)
    with pytest.raises(reshard.LayoutError, match="do not split evenly into 2 pipeline stages"):
        reshard.Layout().stage_layers(7, 2)


def test_the_reshard_splits_r1_zero_671b_as_the_lowered_megatron_config_does():
    from aspc.backends.ascend.checkpoint_settings import PRESETS
    from aspc.backends.ascend.megatron_args import transformer_config
    from aspc.ir.facts import model_presets

    arch = model_presets()["deepseek-v3"]
    config = transformer_config(arch, "bf16", Parallel(tp=4, pp=6, dp=16, ep=16), False, PRESETS["deepseek-v3"])
    layout = reshard.Layout.from_config(config)
    assert layout.expert_bias and layout.stage_layers(61, 6) == (10, 10, 10, 10, 10, 11)
    assert reshard.stage_of(arch, "decoder.layers.50.input_layernorm.weight", 6, layout) == 5
    assert reshard.local_name(arch, "decoder.layers.60.input_layernorm.weight", 6, 16, layout) == \
        "decoder.layers.10.input_layernorm.weight"
    reshard.check_supported(arch, 4, 6, 16, layout)


def test_seven_layers_in_two_uneven_stages_round_trip():
    arch, layout, par = dataclasses.replace(DENSE, layers=7), reshard.Layout(last_stage_layers=4), Parallel(tp=2, pp=2)
    full = random_full(arch, layout, seed=7)
    states = rank_states(arch, full, par, layout)
    first, last = states[0], states[2]
    assert {reshard.layer_of(n) for n in first if n.startswith("decoder.layers.")} == {0, 1, 2}
    assert torch.equal(last["decoder.layers.0.input_layernorm.weight"], full["decoder.layers.3.input_layernorm.weight"])
    assert {reshard.layer_of(n) for n in last if n.startswith("decoder.layers.")} == {0, 1, 2, 3}
    assert_same(reassemble(arch, states, par, layout), full)


@pytest.mark.parametrize("arch", [DENSE, dataclasses.replace(DENSE, tied=True)], ids=["untied", "tied"])
def test_the_critic_value_head_is_whole_on_the_last_stage_and_named_score(arch):
    critic, par = reshard.Layout(value_head=True), Parallel(tp=2, pp=2)
    full = random_full(arch, critic, seed=8)
    hf = reshard.to_hf(arch, full, critic)
    assert hf["score.weight"].shape == (1, arch.hidden) and "lm_head.weight" not in hf
    assert_same(reshard.from_hf(arch, hf, critic), full)
    states = rank_states(arch, full, par, critic)
    assert all(torch.equal(s["output_layer.weight"], full["output_layer.weight"]) for s in states[2:])
    assert "output_layer.weight" not in states[0]
    assert_same(reassemble(arch, states, par, critic), full)


def test_what_remains_refused_says_what_to_pass():
    with pytest.raises(reshard.LayoutError, match=r"MLA .*pass layout=reshard.Layout.from_config"):
        run_ranks(2, lambda comm: reshard_in_place(MLA, {}, Parallel(tp=2), 2, comm))  # no trainer layout given
    with pytest.raises(reshard.LayoutError, match=r"7 layers do not split evenly .*Layout.from_config"):
        reshard.check_supported(dataclasses.replace(DENSE, layers=7), tp=1, pp=2)
    with pytest.raises(reshard.LayoutError, match=r"MLA q_lora_rank \(8\) does not split evenly over .* 16"):
        reshard.check_supported(dataclasses.replace(MLA, vocab=64, heads=16), tp=16, layout=reshard.PLAIN)
    with pytest.raises(reshard.LayoutError, match="need pipeline parallelism"):
        reshard.check_supported(DENSE, tp=1, pp=1, layout=reshard.Layout(last_stage_layers=4))


def test_megatron_core_builds_the_mla_moe_layout(monkeypatch, tmp_path):
    """megatron-core 0.16.1's local MLA spec, as the lowering asks (get_gpt_decoder_block_spec without
    Transformer Engine): its state dict is full_shapes with the router's expert bias. Its core attention
    (no parameters) rejects MLA's k_channels without Transformer Engine, so a parameter-free stand-in
    takes its place; CUDA device queries answer "cpu"."""
    pytest.importorskip("megatron.core")
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(mla, "HAVE_TE", False)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    arch = dataclasses.replace(MLA_MOE, layers=3, experts=4)
    config = MLATransformerConfig(
        num_layers=3, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32, normalization="RMSNorm",
        gated_linear_unit=True, add_bias_linear=False, qk_layernorm=True, multi_latent_attention=True,
        q_lora_rank=8, kv_lora_rank=6, qk_head_dim=4, qk_pos_emb_head_dim=2, v_head_dim=4, rope_type="rope",
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8, moe_shared_expert_intermediate_size=8,
        moe_layer_freq=[0, 1, 1], moe_token_dispatcher_type="allgather", moe_router_enable_expert_bias=True,
        moe_router_score_function="sigmoid", use_cpu_initialization=True, activation_func=torch.nn.functional.silu)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = ParameterFree
    try:
        model = GPTModel(config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=32,
                         position_embedding_type="rope")
    finally:
        parallel_state.destroy_model_parallel()
    layout = reshard.Layout.from_config({"moe_router_enable_expert_bias": True})
    built = {name: tuple(t.shape) for name, t in model.state_dict().items() if isinstance(t, torch.Tensor)}
    assert built == reshard.full_shapes(arch, layout)


class ParameterFree(torch.nn.Module):
    def __init__(self, **_):
        super().__init__()


# ---- the weight sync with the trainer's layout: MLA MoE, 3 + 4 layers over two pipeline stages ----
UNEVEN_MLA_MOE = dataclasses.replace(MLA_MOE, layers=7)
UNEVEN_DEEPSEEK = reshard.Layout(last_stage_layers=4, expert_bias=True)
SYNC_PARALLEL = Parallel(tp=2, pp=2, dp=2, ep=2)


def test_gather_hf_assembles_an_uneven_mla_moe_model_from_its_trainer_ranks():
    """vllm-ascend's HCCL path: trainer rank 0 holds the whole checkpoint (stage 1's local layers 0-3
    are global 3-6; router bias, shared experts, every expert-parallel rank's experts)."""
    arch, layout, par = UNEVEN_MLA_MOE, UNEVEN_DEEPSEEK, SYNC_PARALLEL
    full = random_full(arch, layout, seed=9)
    states = rank_states(arch, full, par, layout)
    gathered = run_ranks(par.devices, lambda comm: gather_hf(arch, states[comm.rank], par, comm, layout))
    assert all(g == {} for g in gathered[1:])
    assert_same(reshard.from_hf(arch, gathered[0], layout), full)
    assert torch.equal(gathered[0]["model.layers.6.mlp.gate.e_score_correction_bias"],
                       full["decoder.layers.6.mlp.router.expert_bias"])


def test_in_place_reshard_of_an_uneven_mla_moe_model_gives_the_engine_its_cuts():
    """MindSpeed-RL's colocated path to TP2 engines: every rank holds vLLM's cut of every layer (MLA's
    down projections whole, as deepseek_v2.py's ReplicatedLinear; the rest cut as the trainer cuts),
    and its half of the experts; an engine's two ranks merge back into the original weights."""
    arch, layout, par, infer_tp = UNEVEN_MLA_MOE, UNEVEN_DEEPSEEK, SYNC_PARALLEL, 2
    full = random_full(arch, layout, seed=10)
    states = rank_states(arch, full, par, layout)
    held = run_ranks(par.devices, lambda comm: reshard_in_place(arch, states[comm.rank], par, infer_tp, comm, layout))
    cuts = reshard.engine_params(arch, layout)
    down = "decoder.layers.5.self_attention.linear_kv_down_proj.weight"
    assert cuts[down] == reshard.REPLICATED and all(torch.equal(h[down], full[down]) for h in held)
    for engine in range(par.devices // infer_tp):
        ranks = held[engine * infer_tp:(engine + 1) * infer_tp]
        merged = {name: reshard.merge([r[name] for r in ranks], cut) for name, cut in cuts.items()
                  if reshard.expert_of(name) is None}
        experts = {name: t for r in ranks for name, t in r.items() if reshard.expert_of(name) is not None}
        assert_same(merged | experts, full)


def test_colocated_ranks_each_hold_the_whole_uneven_mla_moe_checkpoint():
    arch, layout, par = UNEVEN_MLA_MOE, UNEVEN_DEEPSEEK, SYNC_PARALLEL
    full = random_full(arch, layout, seed=11)
    states = rank_states(arch, full, par, layout)
    hf = reshard.to_hf(arch, full, layout)
    # the stream gathers as it goes: every rank iterates it at once (dict(...) on the rank's thread)
    wholes = run_ranks(par.devices, lambda comm: dict(whole_hf_in_place(arch, states[comm.rank], par, comm, layout)))
    for whole in wholes:
        assert_same(whole, hf)


def test_the_r1_zero_671b_trainer_reads_back_the_layout_megatron_builds():
    """What every trainer rank reads back from the lowered launch stage (megatron_model.layout_of) is the
    plan's architecture, and a Layout whose stage layer counts are megatron-core's for that config; the
    lowered config builds MLA's q/kv layernorms (DeepSeek's q_a_layernorm, kv_a_layernorm)."""
    pytest.importorskip("megatron.core")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_num_layers_to_build
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from aspc.backends.ascend.executors import materialize
    from aspc.backends.ascend.lowering import lower
    from aspc.backends.ascend.megatron_model import layout_of
    from aspc.cli.toolchain import compile_with_passes
    from conftest import ROOT

    plan = compile_with_passes(ROOT / "pipelines" / "r1_zero_671b.aspl").plan()
    launch = lower(plan)
    stage = next(s for s in launch.stages if s.kind == "train")
    rank0 = next(p for p in launch.processes if p.stage == stage.stage and p.rank == 0)
    arch, par, layout = layout_of(dataclasses.asdict(stage), rank0.world_size)
    assert dataclasses.replace(arch, max_seq=0) == dataclasses.replace(plan.model("actor").arch, max_seq=0)
    config = MLATransformerConfig(**materialize(stage.config), use_cpu_initialization=True)
    built = tuple(get_num_layers_to_build(config, pp_rank=r) for r in range(par.pp))
    assert layout.stage_layers(arch.layers, par.pp) == built == (10, 10, 10, 10, 10, 11)
    assert layout.expert_bias
    reshard.check_supported(arch, par.tp, par.pp, par.ep, layout)
    attention = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                           pp_rank=0).layer_specs[0].submodules.self_attention.submodules
    assert attention.q_layernorm is not IdentityOp and attention.kv_layernorm is not IdentityOp
