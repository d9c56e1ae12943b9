"""This rank's megatron-core model from a launch stage: MindSpeed's adaptor, megatron's process
groups, the GPTModel of the stage's config and layer spec, its share of the Hugging Face checkpoint,
the ModelArch and parallel layout read back from the config, and forward-only models compiled with
torchair. Every platform import is inside the function that needs it; `build_gpt` builds on CPU
(gloo, one rank).

Followed: megatron-core 0.16.1 (`get_gpt_layer_local_spec`, `get_gpt_decoder_block_spec`,
`GPTModel(pre_process, post_process)`) and MindSpeed-RL's actor worker
(mindspeed_rl/workers/actor_hybrid_worker.py: the MindSpeed adaptor imported first)."""
from __future__ import annotations

import functools

import torch

from aspc.backends.ascend.reshard import Layout
from aspc.platforms import NPU

DTYPE_FIELDS = ("params_dtype", "pipeline_dtype")


def materialize(config: dict) -> dict:
    """The launch plan's JSON config with dtype names turned into torch dtypes."""
    return {k: getattr(torch, v) if k in DTYPE_FIELDS else v for k, v in config.items()}


def import_mindspeed(argv: list[str]) -> None:
    """MindSpeed's adaptor patches megatron for NPUs and parses sys.argv when imported; its features
    (context parallelism among them) switch on from the flags the launch plan gives
    (`builders.mindspeed_argv`, backends/ascend/megatron_args.py)."""
    import sys

    saved, sys.argv = sys.argv, ["aspc", *argv]
    try:
        import mindspeed.megatron_adaptor  # noqa: F401
    finally:
        sys.argv = saved


def build_gpt(stage: dict, rank_args: dict, use_cpu_initialization: bool = False):
    """This rank's GPTModel (model-parallel state already initialised) as the launch plan says:
    `builders.config_class` (MLATransformerConfig for MLA), `builders.layer_spec` (the block spec
    for MoE and MLA models, the local spec with RMSNorm and q/k norm otherwise), the stage's
    model_args and this rank's `rank_args` (pre_process / post_process of its pipeline stage)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_config

    builders = stage["builders"]
    config_cls = getattr(transformer_config, builders["config_class"])
    config = config_cls(**materialize(stage["config"]), activation_func=torch.nn.functional.silu,
                        use_cpu_initialization=use_cpu_initialization)
    spec = builders["layer_spec"]
    if spec["function"] == "get_gpt_decoder_block_spec":
        # this rank's pipeline stage from megatron's parallel state (0.12.1, MindSpeed's megatron, takes no pp_rank)
        layers = gpt_layer_specs.get_gpt_decoder_block_spec(config, **spec["arguments"])
    else:
        layers = gpt_layer_specs.get_gpt_layer_local_spec(**spec["arguments"])
    return GPTModel(config, transformer_layer_spec=layers, **stage["model_args"], **rank_args)


def initialize_parallel(config: dict, backend: str = NPU.collective, seed: int = 1234) -> None:
    """torch.distributed, megatron's model-parallel groups of a launch stage's `config`, and megatron's
    RNG tracker: its attention forks the tracker's "model-parallel-rng" state on every forward
    (dot_product_attention.py) and fails unless it was seeded (Megatron-LM's `_set_random_seed`,
    default seed 1234; MindSpeed-RL's workers call it through initialize_megatron)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        dist.init_process_group(backend=backend)  # RANK, WORLD_SIZE, MASTER_ADDR/PORT from the launch plan
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config["tensor_model_parallel_size"],
        pipeline_model_parallel_size=config["pipeline_model_parallel_size"],
        context_parallel_size=config["context_parallel_size"],
        expert_model_parallel_size=config["expert_model_parallel_size"])
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def layout_of(stage: dict, world_size: int):
    """The model's shape, the job's parallel layout and the trainer's reshard.Layout (pipeline split,
    router expert bias), read back from a launch stage's megatron config (what every rank has), for
    the weight sync."""
    from aspc.ir.graph import Parallel

    c = stage["config"]
    tp, pp, cp = c["tensor_model_parallel_size"], c["pipeline_model_parallel_size"], c["context_parallel_size"]
    parallel = Parallel(tp=tp, pp=pp, cp=cp, dp=world_size // (tp * pp * cp), ep=c["expert_model_parallel_size"])
    return arch_of(stage), parallel, Layout.from_config(c)


def arch_of(stage: dict):
    """The ModelArch that a launch stage's megatron config (TransformerConfig / MLATransformerConfig
    fields, megatron_args.py) and GPTModel arguments describe."""
    from aspc.ir.facts import ModelArch

    c, m = stage["config"], stage["model_args"]
    mla = bool(c.get("multi_latent_attention"))
    rope = c.get("qk_pos_emb_head_dim", 0) if mla else 0
    expert_ffn = c.get("moe_ffn_hidden_size") or 0
    return ModelArch(
        layers=c["num_layers"], hidden=c["hidden_size"], heads=c["num_attention_heads"], kv_heads=c["num_query_groups"],
        head_dim=c["qk_head_dim"] + rope if mla else c.get("kv_channels", 0), ffn=c["ffn_hidden_size"],
        vocab=m["vocab_size"], experts=c.get("num_moe_experts") or 0, top_k=c.get("moe_router_topk", 0),
        expert_ffn=expert_ffn, shared_experts=(c.get("moe_shared_expert_intermediate_size") or 0) // (expert_ffn or 1),
        dense_layers=list(c.get("moe_layer_freq", [1])).count(0),
        tied=m.get("share_embeddings_and_output_weights", False), qkv_bias=c.get("add_qkv_bias", False),
        attention="mla" if mla else "gqa", qk_norm=c.get("qk_layernorm", False) and not mla,
        q_lora_rank=(c.get("q_lora_rank") or 0) if mla else 0, kv_lora_rank=c.get("kv_lora_rank", 0) if mla else 0,
        qk_rope_dim=rope, v_head_dim=c.get("v_head_dim", 0) if mla else 0)


def load_checkpoint(model, stage: dict, checkpoint: str | None = None, value_head: bool = False):
    """`model` (this rank's GPTModel of `stage`) with its share of the Hugging Face checkpoint
    (load_hf.py): the stage's own (`builders.checkpoint`) unless `checkpoint` names another; a
    critic's `value_head` stays freshly initialised."""
    from aspc.backends.ascend.load_hf import load_rank_weights, parallel_coords

    c = stage["config"]
    arch, parallel, _ = layout_of(stage, c["tensor_model_parallel_size"] * c["pipeline_model_parallel_size"]
                                  * c["context_parallel_size"])  # data parallelism does not cut weights
    layout = Layout.from_config(c, value_head=value_head)
    load_rank_weights(model, checkpoint or stage["builders"]["checkpoint"], arch, parallel, layout,
                      parallel_coords())
    return model


def training_parts(model, stage: dict, lr: float, weight_decay: float, grad_clip: float):
    """`model` DDP-wrapped and its optimizer (Adam), as megatron trains them: gradients reduced by
    finalize_model_grads once per step (gradient_reduction); with the stage's `distributed_optimizer`
    (the language's option, on by default as MindSpeed-RL runs: `builders.distributed_optimizer`),
    optimizer state sharded over the data-parallel group and DDP's contiguous parameter buffer
    (`param_data`) kept, which offload.py moves whole."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    distributed = bool(stage["builders"].get("distributed_optimizer", True))
    # The config's finalize_model_grads_func stays unset (None): megatron's schedule would reduce at the
    # end of each call, and a step trains several units (one schedule each): under the distributed
    # optimizer a second reduce-scatter over the same buffer sums the shards the first reduced with
    # the other ranks' local gradients. gradient_reduction reduces once, before the step.
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=distributed),
                                  module=model)
    optimizer_config = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=grad_clip,
                                       bf16=stage["config"].get("bf16", False), use_distributed_optimizer=distributed,
                                       params_dtype=materialize(stage["config"])["params_dtype"])
    return ddp, get_megatron_optimizer(optimizer_config, [ddp])


def gradient_reduction(model):
    """What reduces a step's gradients, called once before its optimizer step: megatron's
    finalize_model_grads over the DDP-wrapped `model` (the data-parallel average of DDP's buffers, a
    reduce-scatter under the distributed optimizer; the sequence-parallel norms' and tied embeddings'
    all-reduces), as Megatron-LM's schedule runs it once at the end of a step's micro-batches."""
    from megatron.core.distributed import finalize_model_grads

    return functools.partial(finalize_model_grads, [model])


def zero_gradients(model, optimizer) -> None:
    """After a step, as Megatron-LM's train_step before the next: DDP's contiguous gradient buffers
    (where backward accumulates `main_grad`; the optimizer's zero_grad does not touch them) and the
    optimizer's own gradients."""
    model.zero_grad_buffer()
    optimizer.zero_grad()


def compile_forward(model, compiler: dict):
    """torch.compile with torchair's NPU backend (GE graph mode, static shapes) for forward-only
    executors (reference, reward model) whose launch stage carries a torchair config."""
    import torchair

    from aspc.backends.ascend.compiler_options import apply_compiler_options

    config = apply_compiler_options(torchair.CompilerConfig(), compiler)
    return torch.compile(model, backend=torchair.get_npu_backend(compiler_config=config),
                         dynamic=compiler.get("dynamic", False))


def build_forward_model(stage: dict, rank_args: dict):
    """A forward-only model (reference, reward model): this rank's GPTModel in eval mode, compiled
    with torchair where the launch stage carries a `compiler` config (GE graph mode, static shapes:
    the pack pass's buckets)."""
    model = build_gpt(stage, rank_args).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return compile_forward(model, stage["compiler"]) if stage.get("compiler") else model
