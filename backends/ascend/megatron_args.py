"""megatron-core arguments of a train / reference / critic / reward-model stage: the TransformerConfig
(MLATransformerConfig for MLA models) fields, which layer-spec function builds the layers, the
GPTModel arguments of the stage and of each pipeline rank, and the command-line flags that switch
MindSpeed's features on. Pure data; checked against megatron-core in tests/test_ascend_conformance.py.

Followed: megatron-core 0.16.1 `models/gpt/gpt_layer_specs.py` (the local spec builds LayerNorm
unless told `normalization="RMSNorm"`; `get_gpt_decoder_block_spec` builds MoE layers after
`moe_layer_freq`'s dense ones and MLA attention from the config), `models/gpt/gpt_model.py`
(`pre_process`/`post_process` per pipeline stage), MindSpeed `mindspeed/args_utils.py` (the adaptor
parses sys.argv at import) and `features_manager/context_parallel/context_parallel_feature.py`
(ring attention is patched in from `--context-parallel-size`/`--context-parallel-algo`; megatron_cp_algo
needs the sequence length divisible by 2 x cp and turns on flash attention)."""
from __future__ import annotations

from typing import Any

from aspc.backends.ascend.checkpoint_settings import CheckpointSettings
from aspc.ir.facts import ModelArch

TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
CP_ALGORITHM = "megatron_cp_algo"  # MindSpeed's ring attention: what MindSpeed-RL's long-sequence configs use


def transformer_config(arch: ModelArch, dtype: str, par, recompute: bool,
                       settings: CheckpointSettings) -> dict[str, Any]:
    """Fields of megatron-core's TransformerConfig (MLATransformerConfig for MLA models)."""
    config = {
        "num_layers": arch.layers, "hidden_size": arch.hidden, "num_attention_heads": arch.heads,
        "num_query_groups": arch.kv_heads, "kv_channels": arch.head_dim, "ffn_hidden_size": arch.ffn,
        "normalization": "RMSNorm", "layernorm_epsilon": settings.norm_eps, "qk_layernorm": settings.qk_norm,
        "gated_linear_unit": True, "add_bias_linear": False,
        "add_qkv_bias": arch.qkv_bias, "bf16": dtype == "bf16", "fp16": dtype == "fp16",
        "tensor_model_parallel_size": par.tp, "pipeline_model_parallel_size": par.pp,
        "context_parallel_size": par.cp, "expert_model_parallel_size": par.ep,
        "sequence_parallel": par.tp > 1, "params_dtype": TORCH_DTYPES[dtype],
        # no dropout (megatron-core's defaults are 0.1): the RL layer's learner, the spec this trainer is
        # held to, has none, and the engine samples without it, so the first step's ratios would not be 1
        "hidden_dropout": 0.0, "attention_dropout": 0.0,
    }
    config |= _pipeline_split(arch.layers, par.pp, dtype)
    if recompute:
        config |= {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if arch.experts:
        config |= _moe_fields(arch) | settings.router
    if arch.attention == "mla":
        # qk_layernorm: the local spec's MLA builds q_layernorm/kv_layernorm (DeepSeek's q_a_layernorm,
        # kv_a_layernorm) only when it is set (megatron-core 0.12.1 gpt_layer_specs.py; verl's
        # hf_to_mcore_config_dpskv3 and MindSpeed-RL's configs/model/deepseekv3_671b.yaml set it).
        # q_lora_rank None: megatron's MLA projects the query from the hidden state (linear_q_proj).
        config |= {"multi_latent_attention": True, "qk_layernorm": True, "q_lora_rank": arch.q_lora_rank or None,
                   "kv_lora_rank": arch.kv_lora_rank, "qk_head_dim": arch.head_dim - arch.qk_rope_dim,
                   "qk_pos_emb_head_dim": arch.qk_rope_dim, "v_head_dim": arch.v_head_dim,
                   "rotary_base": settings.rope_base} | settings.yarn
        config.pop("kv_channels")
    return config


def _pipeline_split(layers: int, pp: int, dtype: str) -> dict[str, Any]:
    """Pipeline stages hold layers / pp layers each; where that does not divide (DeepSeek's 61 over
    6), the last stage takes the remainder, as megatron-core's num_layers_in_last_pipeline_stage does."""
    if pp == 1:
        return {}
    split = {"pipeline_dtype": TORCH_DTYPES[dtype]}
    if layers % pp:
        split["num_layers_in_last_pipeline_stage"] = layers - (pp - 1) * (layers // pp)
    return split


def _moe_fields(arch: ModelArch) -> dict[str, Any]:
    fields = {"num_moe_experts": arch.experts, "moe_router_topk": arch.top_k, "moe_ffn_hidden_size": arch.expert_ffn,
              "moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall"}
    if arch.shared_experts:
        fields["moe_shared_expert_intermediate_size"] = arch.shared_experts * arch.expert_ffn
    if arch.dense_layers:
        fields["moe_layer_freq"] = [0] * arch.dense_layers + [1] * (arch.layers - arch.dense_layers)
    return fields


def config_class(arch: ModelArch) -> str:
    return "MLATransformerConfig" if arch.attention == "mla" else "TransformerConfig"


def layer_spec(arch: ModelArch, settings: CheckpointSettings) -> dict[str, Any]:
    """Which function of megatron.core.models.gpt.gpt_layer_specs builds the layers, with its arguments
    (the executor passes the TransformerConfig as `config` to the block spec)."""
    if arch.experts or arch.attention == "mla":
        return {"function": "get_gpt_decoder_block_spec",
                "arguments": {"use_transformer_engine": False, "normalization": "RMSNorm"}}
    return {"function": "get_gpt_layer_local_spec",
            "arguments": {"normalization": "RMSNorm", "qk_layernorm": settings.qk_norm}}


def model_args(arch: ModelArch, settings: CheckpointSettings, tied: bool) -> dict[str, Any]:
    """GPTModel's arguments shared by every rank. MLA models apply RoPE (YaRN) inside their attention
    from the config's rope fields; "rope" here only keeps learned position embeddings out, as
    Megatron-LM's DeepSeek recipes pass it."""
    return {"vocab_size": arch.vocab, "max_sequence_length": arch.max_seq, "position_embedding_type": "rope",
            "rotary_base": int(settings.rope_base), "share_embeddings_and_output_weights": tied}


def rank_model_args(pp_rank: int, pp: int, post_process: bool = True) -> dict[str, bool]:
    """GPTModel's per-rank arguments: the first pipeline stage embeds, the last one has the output
    layer (a reward model has none: hidden states out)."""
    return {"pre_process": pp_rank == 0, "post_process": post_process and pp_rank == pp - 1}


def mindspeed_argv(par, seq_length: int) -> list[str]:
    """The flags the executor puts in sys.argv before `import mindspeed.megatron_adaptor`."""
    argv = ["--tensor-model-parallel-size", str(par.tp), "--pipeline-model-parallel-size", str(par.pp),
            "--context-parallel-size", str(par.cp), "--expert-model-parallel-size", str(par.ep),
            "--seq-length", str(seq_length), "--use-flash-attn", "--use-fused-rmsnorm", "--use-fused-swiglu",
            "--use-fused-rotary-pos-emb"]
    if par.tp > 1:
        argv.append("--sequence-parallel")
    if par.cp > 1:
        if seq_length % (2 * par.cp):
            raise ValueError(f"context parallelism {par.cp} needs micro-batches of a multiple of {2 * par.cp} "
                             f"tokens (MindSpeed's ring attention), not {seq_length}: set micro_tokens accordingly")
        argv += ["--context-parallel-algo", CP_ALGORITHM]
    return argv
