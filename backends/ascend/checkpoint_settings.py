"""What a checkpoint's config.json fixes beyond the architecture's shapes, and what megatron-core
must be told so that the trained model computes what the checkpoint computes: RMSNorm epsilon,
RoPE base and scaling, q/k norm, and the MoE router. A model = hf("DIR") brings its own
(rope_theta, rms_norm_eps, q/k norm read from config.json); the presets carry the values of the
checkpoints they are named after."""
from __future__ import annotations

from dataclasses import dataclass, field

from aspc.plan.execution_plan import ModelPlan


@dataclass(frozen=True)
class CheckpointSettings:
    norm_eps: float = 1e-6
    rope_base: float = 10_000.0
    qk_norm: bool = False
    router: dict = field(default_factory=dict)  # megatron-core TransformerConfig moe_router_* / aux-loss fields
    yarn: dict = field(default_factory=dict)  # MLATransformerConfig rope scaling fields


# Qwen2.5 dense: Qwen/Qwen2.5-7B config.json (rms_norm_eps 1e-6, rope_theta 1e6); Qwen/Qwen2.5-32B
# config.json (rms_norm_eps 1e-5, rope_theta 1e6).
# Qwen3-30B-A3B: Qwen/Qwen3-30B-A3B config.json (rms_norm_eps 1e-6, rope_theta 1e6, q/k RMSNorm per
# head, norm_topk_prob true = softmax before top-k then renormalised, router_aux_loss_coef 0.001);
# megatron-core's defaults (softmax score, moe_router_pre_softmax False) renormalise the top-k.
# DeepSeek-V3/R1: deepseek-ai/DeepSeek-V3 config.json (rms_norm_eps 1e-6, rope_theta 1e4, scoring_func
# sigmoid, topk_method noaux_tc with e_score_correction_bias, n_group 8, topk_group 4,
# routed_scaling_factor 2.5, rope_scaling yarn factor 40 / original 4096 / beta_fast 32 / beta_slow 1 /
# mscale 1 / mscale_all_dim 1); the megatron field names follow MindSpeed-LLM's and Megatron-LM's
# DeepSeek-V3 recipes (moe_router_enable_expert_bias for the correction bias, seq_aux_loss 1e-4).
_DEEPSEEK_V3 = CheckpointSettings(
    norm_eps=1e-6, rope_base=10_000.0,
    router={"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_bias_update_rate": 1e-3, "moe_router_topk_scaling_factor": 2.5,
            "moe_router_num_groups": 8, "moe_router_group_topk": 4,
            "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 1e-4},
    # YaRN's original context (4096) is left at MLATransformerConfig's default: megatron-core 0.12.1 (what
    # MindSpeed runs on) names it max_position_embeddings, 0.16.1 original_max_position_embeddings.
    yarn={"rope_type": "yarn", "rotary_scaling_factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
          "mscale": 1.0, "mscale_all_dim": 1.0})

PRESETS = {
    "qwen2.5-7b": CheckpointSettings(norm_eps=1e-6, rope_base=1_000_000.0),
    "qwen2.5-32b": CheckpointSettings(norm_eps=1e-5, rope_base=1_000_000.0),
    "qwen3-30b-a3b": CheckpointSettings(
        norm_eps=1e-6, rope_base=1_000_000.0, qk_norm=True,
        router={"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 1e-3}),
    "deepseek-v3": _DEEPSEEK_V3,
    "deepseek-r1": _DEEPSEEK_V3,
}


def checkpoint_settings(model: ModelPlan) -> CheckpointSettings:
    """hf(...) models: what their config.json said; presets: their checkpoint's; custom models: the
    defaults of the CPU backend's decoder (RMSNorm 1e-6, RoPE base 1e4). A router whose top-k weights
    are not renormalised (Qwen3-MoE's norm_topk_prob false; custom models) takes its softmax over every
    expert before the top k: megatron's moe_router_pre_softmax (its default renormalises them)."""
    if model.preset in PRESETS:
        return PRESETS[model.preset]
    arch = model.arch
    router = {"moe_router_pre_softmax": True} if arch.experts and not arch.norm_topk else {}
    return CheckpointSettings(norm_eps=arch.norm_eps, rope_base=arch.rope_theta, qk_norm=arch.qk_norm, router=router)
