"""Megatron-core and Hugging Face parameter layouts, and the pure tensor steps between them.

A megatron-core GPTModel built from the local specs (megatron/core/models/gpt/gpt_layer_specs.py,
`get_gpt_layer_local_spec`, and `get_gpt_decoder_block_spec(use_transformer_engine=False)` for MoE and
MLA, what backends/ascend/megatron_args.py asks for) names its parameters
`decoder.layers.{i}.self_attention.linear_qkv.weight` and so on, with `i` the layer's index *within its
pipeline stage*. Tensor parallelism cuts column-parallel weights along dim 0 and row-parallel ones
along dim 1; the fused QKV weight is interleaved per query group ("q1 q2 k1 v1",
megatron/core/transformer/attention.py), so a plain dim-0 cut hands each rank whole groups; the gated
MLP's fc1 is [gate; up] on *every* rank, so the full tensor is not the concatenation of the shards.
Experts (SequentialMLP, `mlp.experts.local_experts.{j}`) are spread over the expert-parallel ranks
and, by megatron's default (expert_tensor_parallel_size = tensor_model_parallel_size), cut like the
dense MLP; shared experts (`mlp.shared_experts`, moe/shared_experts.py) are a gated MLP on every
expert-parallel rank; the router's weight and its `expert_bias` buffer (persistent, present with
moe_router_enable_expert_bias; moe/router.py) are whole on every rank. Layers before
`arch.dense_layers` (DeepSeek's first_k_dense_replace, megatron's moe_layer_freq) are dense.

MLA (DeepSeek-V3), megatron-core 0.12.1 and 0.16.1 transformer/multi_latent_attention.py with the
local spec: `linear_q_down_proj` [q_lora_rank, hidden], `q_layernorm` [q_lora_rank],
`linear_q_up_proj` [heads x (qk_head_dim + qk_pos_emb_head_dim), q_lora_rank] (or `linear_q_proj`
from the hidden state when q_lora_rank is unset), `linear_kv_down_proj` [kv_lora_rank + rope, hidden],
`kv_layernorm` [kv_lora_rank], `linear_kv_up_proj` [heads x (qk_head_dim + v_head_dim), kv_lora_rank],
`linear_proj` row-parallel. The local spec builds the down projections as ColumnParallelLinear (the
forward all-gathers their output), so the trainer holds them cut along dim 0; vLLM's DeepSeek model
(vllm/model_executor/models/deepseek_v2.py) holds q_a_proj and kv_a_proj_with_mqa as ReplicatedLinear:
`engine_params` gives the engine's cuts. Without Transformer Engine megatron-core's local MLA does not
construct (its DotProductAttention takes no `k_channels`; 0.16.1 also tests `isinstance(.., TELinear)`):
tests/test_reshard.py builds it with a parameter-free core attention. The Transformer Engine spec
instead duplicates the down projections and fuses the norms into the up projections
(`linear_q_up_proj.layer_norm_weight`), the names verl's converter reads
(verl/models/mcore/weight_converter.py, McoreToHFWeightConverterDpskv3); the Hugging Face names
here are those of that converter (q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa,
kv_a_layernorm, kv_b_proj, mlp.shared_experts.*, mlp.gate.e_score_correction_bias).

Pipeline stages hold arch.layers / pp layers each unless the TransformerConfig names the first or last
stage's count (`num_layers_in_first/last_pipeline_stage`, `--decoder-first/last-pipeline-num-layers`):
then the other stages share the rest evenly (transformer/transformer_block.py,
`get_num_layers_to_build`). A critic (value model) replaces the output layer by a replicated
[1, hidden] value head (verl/models/mcore/model_initializer.py, `LinearForLastLayer`), named
`score.weight` on the Hugging Face side: the head of `AutoModelForTokenClassification(num_labels=1)`,
which verl's FSDP critic loads and its megatron loader accepts (verl/models/mcore/loader.py).
`Layout` carries these trainer settings.

Here a "full" megatron state dict has every layer under its global index and no tensor cut;
`split`/`merge` go between a full tensor and its tensor-parallel shards, `to_hf`/`from_hf`
between full megatron names and Hugging Face names (Qwen2/Qwen3/Qwen3-MoE/DeepSeek-V3 checkpoints)."""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate

import torch

from aspc.ir.facts import ModelArch


@dataclass(frozen=True)
class Cut:
    """How tensor parallelism cuts a parameter: along `dim` (None: every rank holds it whole), in
    `parts` blocks that are each cut (2 for the gated MLP's [gate; up])."""

    dim: int | None
    parts: int = 1


REPLICATED, COLUMN, ROW, GATED = Cut(None), Cut(0), Cut(1), Cut(0, 2)


class LayoutError(ValueError):
    """A model or parallel layout that this resharding does not handle; the message says which."""


@dataclass(frozen=True)
class Layout:
    """What the trainer's megatron model holds beyond the architecture's shapes: the uneven pipeline
    split, the router's expert bias, the critic's value head."""

    first_stage_layers: int | None = None  # TransformerConfig.num_layers_in_first_pipeline_stage
    last_stage_layers: int | None = None  # TransformerConfig.num_layers_in_last_pipeline_stage
    expert_bias: bool = False  # moe_router_enable_expert_bias: mlp.router.expert_bias
    value_head: bool = False  # a critic: output_layer is the [1, hidden] value head

    @classmethod
    def from_config(cls, config: dict, value_head: bool = False) -> Layout:
        """The layout of a model built from these TransformerConfig fields (megatron_args.transformer_config)."""
        return cls(config.get("num_layers_in_first_pipeline_stage"), config.get("num_layers_in_last_pipeline_stage"),
                   bool(config.get("moe_router_enable_expert_bias")), value_head)

    def stage_layers(self, layers: int, pp: int) -> tuple[int, ...]:
        """Decoder layers per pipeline stage, counted as megatron-core's get_num_layers_to_build does."""
        given = {stage: n for stage, n in ((0, self.first_stage_layers), (pp - 1, self.last_stage_layers))
                 if n is not None}
        if not given:
            if layers % pp:
                raise LayoutError(f"{layers} layers do not split evenly into {pp} pipeline stages: pass the "
                                  "trainer's num_layers_in_first/last_pipeline_stage (Layout.from_config)")
            return (layers // pp,) * pp
        if pp < 2:
            raise LayoutError("num_layers_in_first/last_pipeline_stage need pipeline parallelism (pp of 2 or more)")
        rest, middle = layers - sum(given.values()), pp - len(given)
        if rest < 0 or (rest % middle if middle else rest):
            raise LayoutError(f"{layers} layers do not split into {pp} pipeline stages with {given} layers in the "
                              "first/last stage: megatron-core spreads the rest evenly over the stages between")
        return tuple(given.get(stage, rest // middle if middle else 0) for stage in range(pp))


PLAIN = Layout()


def check_supported(arch: ModelArch, tp: int, pp: int = 1, ep: int = 1, layout: Layout | None = None) -> None:
    """Refuse what these cuts cannot hold. MLA (DeepSeek) needs the trainer's `layout` (its router
    expert bias and 61-layer pipeline split live in the TransformerConfig, not in the architecture)."""
    if layout is None and arch.attention == "mla":
        raise LayoutError("resharding MLA (DeepSeek) weights needs the trainer's layout (router expert bias, "
                          "pipeline split): pass layout=reshard.Layout.from_config(<its TransformerConfig fields>)")
    (layout or PLAIN).stage_layers(arch.layers, pp)
    for what, size in _tensor_parallel_sizes(arch):
        if size % tp:
            raise LayoutError(f"the {what} ({size}) does not split evenly over tensor-parallel size {tp}")
    if arch.experts and arch.experts % ep:
        raise LayoutError(f"{arch.experts} experts do not split evenly over expert-parallel size {ep}")


def _tensor_parallel_sizes(arch: ModelArch) -> list[tuple[str, int]]:
    """The sizes that column- and row-parallel cuts divide."""
    sizes = [("vocabulary", arch.vocab)]
    if arch.layers > arch.moe_layers:
        sizes.append(("FFN", arch.ffn))
    if arch.experts:
        sizes += [("expert FFN", arch.expert_ffn), ("shared-expert FFN", arch.shared_experts * arch.expert_ffn)]
    if arch.attention != "mla":
        return sizes + [("query groups", arch.kv_heads)]
    return sizes + [("attention heads", arch.heads), ("MLA q_lora_rank", arch.q_lora_rank),
                    ("MLA kv down projection (kv_lora_rank + qk_rope_dim)", arch.kv_lora_rank + arch.qk_rope_dim)]


# ---- the megatron layout ----
def layer_params(arch: ModelArch, layer: int, layout: Layout = PLAIN) -> dict[str, Cut]:
    """One decoder layer's megatron parameters (global layer index) and how each is cut."""
    p = f"decoder.layers.{layer}."
    params = {p + "input_layernorm.weight": REPLICATED, p + "pre_mlp_layernorm.weight": REPLICATED}
    attention = _mla_params if arch.attention == "mla" else _gqa_params
    return params | attention(arch, p + "self_attention.") | _mlp_params(arch, layer, layout)


def _gqa_params(arch: ModelArch, a: str) -> dict[str, Cut]:
    params = {a + "linear_qkv.weight": COLUMN, a + "linear_proj.weight": ROW}
    if arch.qkv_bias:
        params[a + "linear_qkv.bias"] = COLUMN
    if arch.qk_norm:
        params |= {a + "q_layernorm.weight": REPLICATED, a + "k_layernorm.weight": REPLICATED}
    return params


def _mla_params(arch: ModelArch, a: str) -> dict[str, Cut]:
    if arch.q_lora_rank:
        query = {a + "linear_q_down_proj.weight": COLUMN, a + "q_layernorm.weight": REPLICATED,
                 a + "linear_q_up_proj.weight": COLUMN}
    else:
        query = {a + "linear_q_proj.weight": COLUMN}
    return query | {a + "linear_kv_down_proj.weight": COLUMN, a + "kv_layernorm.weight": REPLICATED,
                    a + "linear_kv_up_proj.weight": COLUMN, a + "linear_proj.weight": ROW}


def _mlp_params(arch: ModelArch, layer: int, layout: Layout) -> dict[str, Cut]:
    p = f"decoder.layers.{layer}.mlp."
    if not is_moe_layer(arch, layer):
        return {p + "linear_fc1.weight": GATED, p + "linear_fc2.weight": ROW}
    params = {p + "router.weight": REPLICATED}
    if layout.expert_bias:
        params[p + "router.expert_bias"] = REPLICATED
    if arch.shared_experts:
        params |= {p + "shared_experts.linear_fc1.weight": GATED, p + "shared_experts.linear_fc2.weight": ROW}
    for e in range(arch.experts):
        params |= {expert_name(layer, e, "linear_fc1"): GATED, expert_name(layer, e, "linear_fc2"): ROW}
    return params


def is_moe_layer(arch: ModelArch, layer: int) -> bool:
    return bool(arch.experts) and layer >= arch.dense_layers


def expert_name(layer: int, expert: int, linear: str) -> str:
    return f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{linear}.weight"


def full_params(arch: ModelArch, layout: Layout = PLAIN) -> dict[str, Cut]:
    """Every megatron parameter of the whole model (global layer and expert numbers), as the trainer cuts it."""
    params = {"embedding.word_embeddings.weight": COLUMN}
    for layer in range(arch.layers):
        params |= layer_params(arch, layer, layout)
    params["decoder.final_layernorm.weight"] = REPLICATED
    if layout.value_head:
        params["output_layer.weight"] = REPLICATED
    elif not arch.tied:
        params["output_layer.weight"] = COLUMN
    return params


ENGINE_REPLICATED = ("self_attention.linear_q_down_proj.weight", "self_attention.linear_kv_down_proj.weight")


def engine_params(arch: ModelArch, layout: Layout = PLAIN) -> dict[str, Cut]:
    """Every parameter as a vLLM engine's tensor-parallel ranks cut it: as the trainer does, except MLA's
    down projections, which vLLM replicates (deepseek_v2.py: q_a_proj, kv_a_proj_with_mqa)."""
    return {name: REPLICATED if name.endswith(ENGINE_REPLICATED) else cut
            for name, cut in full_params(arch, layout).items()}


def stage_starts(arch: ModelArch, pp: int, layout: Layout = PLAIN) -> tuple[int, ...]:
    """The global index of each pipeline stage's first layer."""
    return (0, *accumulate(layout.stage_layers(arch.layers, pp)))[:-1]


def stage_of(arch: ModelArch, name: str, pp: int, layout: Layout = PLAIN) -> int:
    """The pipeline stage that holds a parameter."""
    if name.startswith("embedding."):
        return 0
    if name.startswith("decoder.layers."):
        return bisect_right(stage_starts(arch, pp, layout), layer_of(name)) - 1
    return pp - 1  # final norm, output layer


def layer_of(name: str) -> int:
    return int(name.split(".")[2])


def expert_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[parts.index("local_experts") + 1]) if "local_experts" in parts else None


def local_name(arch: ModelArch, name: str, pp: int, ep: int, layout: Layout = PLAIN) -> str:
    """A global megatron name as the rank that holds it numbers it: layers from 0 in each stage,
    experts from 0 on each expert-parallel rank."""
    if not name.startswith("decoder.layers."):
        return name
    parts = name.split(".")
    parts[2] = str(layer_of(name) - stage_starts(arch, pp, layout)[stage_of(arch, name, pp, layout)])
    expert = expert_of(name)
    if expert is not None:
        parts[parts.index("local_experts") + 1] = str(expert % (arch.experts // ep))
    return ".".join(parts)


def global_name(arch: ModelArch, name: str, pp_rank: int, pp: int, ep_rank: int, ep: int,
                layout: Layout = PLAIN) -> str:
    if not name.startswith("decoder.layers."):
        return name
    parts = name.split(".")
    parts[2] = str(int(parts[2]) + stage_starts(arch, pp, layout)[pp_rank])
    if "local_experts" in parts:
        at = parts.index("local_experts") + 1
        parts[at] = str(int(parts[at]) + ep_rank * (arch.experts // ep))
    return ".".join(parts)


# ---- tensor-parallel cuts ----
def split(tensor: torch.Tensor, cut: Cut, tp: int) -> list[torch.Tensor]:
    """The `tp` shards of a full tensor, as megatron (and vLLM's merged column layers) hold them."""
    if cut.dim is None:
        return [tensor] * tp
    blocks = [block.chunk(tp, dim=cut.dim) for block in tensor.chunk(cut.parts, dim=cut.dim)]
    return [torch.cat([b[r] for b in blocks], dim=cut.dim).contiguous() for r in range(tp)]


def merge(shards: list[torch.Tensor], cut: Cut) -> torch.Tensor:
    """The full tensor from its shards in rank order (the inverse of `split`)."""
    if cut.dim is None:
        return shards[0]
    per_shard = [s.chunk(cut.parts, dim=cut.dim) for s in shards]
    return torch.cat([torch.cat([p[k] for p in per_shard], dim=cut.dim) for k in range(cut.parts)], dim=cut.dim)


def shard_state(arch: ModelArch, full: dict, tp: int, pp: int, ep: int, coords: dict,
                layout: Layout = PLAIN) -> dict:
    """The state dict of the rank at `coords` (tp, pp and its expert-parallel rank "ep"), from a
    full megatron state dict: what megatron's own checkpoint loading would leave on that rank."""
    cuts = full_params(arch, layout)
    out = {}
    for name, tensor in full.items():
        expert = expert_of(name)
        if stage_of(arch, name, pp, layout) != coords["pp"]:
            continue
        if expert is not None and expert // (arch.experts // ep) != coords["ep"]:
            continue
        out[local_name(arch, name, pp, ep, layout)] = split(tensor, cuts[name], tp)[coords["tp"]]
    return out


# ---- Hugging Face names ----
def to_hf(arch: ModelArch, full: dict, layout: Layout = PLAIN) -> dict[str, torch.Tensor]:
    """A full megatron state dict as a Hugging Face checkpoint's tensors (what vllm-ascend's HCCL
    weight transfer and vLLM's `load_weights` take)."""
    out = {}
    for name, tensor in full.items():
        for hf_name, part in _hf_parts(arch, name, tensor, layout):
            out[hf_name] = part
    return out


def from_hf(arch: ModelArch, hf: dict, layout: Layout = PLAIN) -> dict[str, torch.Tensor]:
    """The inverse of `to_hf`."""
    return {name: param_from_hf(arch, name, hf, layout) for name in full_params(arch, layout)}


def param_from_hf(arch: ModelArch, name: str, hf, layout: Layout = PLAIN) -> torch.Tensor:
    """One full megatron parameter from its Hugging Face tensors (`hf`: any mapping, e.g. one that
    reads a checkpoint's tensors on demand)."""
    sources = [hf[s] for s in hf_sources(arch, name, layout)]
    if _is_qkv(name):
        return _interleave_qkv(arch, *sources)
    return torch.cat(sources, dim=0) if len(sources) > 1 else sources[0]


TOP = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
       "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}
VALUE_HEAD = "score.weight"
# megatron name after "decoder.layers.{i}." -> Hugging Face names after "model.layers.{i}."
LAYER = {"input_layernorm.weight": ["input_layernorm.weight"],
         "pre_mlp_layernorm.weight": ["post_attention_layernorm.weight"],
         "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
         "mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
         "mlp.linear_fc2.weight": ["mlp.down_proj.weight"],
         "mlp.router.weight": ["mlp.gate.weight"], "mlp.router.expert_bias": ["mlp.gate.e_score_correction_bias"],
         "mlp.shared_experts.linear_fc1.weight": ["mlp.shared_experts.gate_proj.weight",
                                                  "mlp.shared_experts.up_proj.weight"],
         "mlp.shared_experts.linear_fc2.weight": ["mlp.shared_experts.down_proj.weight"]}
GQA = {"self_attention.linear_qkv.weight": [f"self_attn.{p}_proj.weight" for p in "qkv"],
       "self_attention.linear_qkv.bias": [f"self_attn.{p}_proj.bias" for p in "qkv"],
       "self_attention.q_layernorm.weight": ["self_attn.q_norm.weight"],
       "self_attention.k_layernorm.weight": ["self_attn.k_norm.weight"]}
MLA = {"self_attention.linear_q_proj.weight": ["self_attn.q_proj.weight"],
       "self_attention.linear_q_down_proj.weight": ["self_attn.q_a_proj.weight"],
       "self_attention.q_layernorm.weight": ["self_attn.q_a_layernorm.weight"],
       "self_attention.linear_q_up_proj.weight": ["self_attn.q_b_proj.weight"],
       "self_attention.linear_kv_down_proj.weight": ["self_attn.kv_a_proj_with_mqa.weight"],
       "self_attention.kv_layernorm.weight": ["self_attn.kv_a_layernorm.weight"],
       "self_attention.linear_kv_up_proj.weight": ["self_attn.kv_b_proj.weight"]}


def hf_sources(arch: ModelArch, name: str, layout: Layout = PLAIN) -> list[str]:
    """The Hugging Face tensors that one megatron parameter is made of."""
    if name == "output_layer.weight" and layout.value_head:
        return [VALUE_HEAD]
    if name in TOP:
        return [TOP[name]]
    rest, expert = name.split(".", 3)[3], expert_of(name)
    if expert is not None:
        base = f"mlp.experts.{expert}."
        leaves = [base + "gate_proj.weight", base + "up_proj.weight"] if ".linear_fc1." in name \
            else [base + "down_proj.weight"]
    else:
        leaves = (MLA if arch.attention == "mla" else GQA).get(rest) or LAYER[rest]
    return [f"model.layers.{layer_of(name)}.{leaf}" for leaf in leaves]


def _is_qkv(name: str) -> bool:
    return name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias")


def _hf_parts(arch: ModelArch, name: str, tensor: torch.Tensor, layout: Layout):
    sources = hf_sources(arch, name, layout)
    if _is_qkv(name):
        return zip(sources, _deinterleave_qkv(arch, tensor))
    return zip(sources, tensor.chunk(len(sources), dim=0))


def _interleave_qkv(arch: ModelArch, q, k, v) -> torch.Tensor:
    """Hugging Face q, k, v -> megatron's fused QKV, grouped: per query group its query heads,
    then its key head, then its value head."""
    groups, d = arch.kv_heads, arch.head_dim
    per = arch.heads // groups
    q = q.reshape(groups, per * d, *q.shape[1:])
    k, v = k.reshape(groups, d, *k.shape[1:]), v.reshape(groups, d, *v.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])


def _deinterleave_qkv(arch: ModelArch, qkv: torch.Tensor):
    groups, d = arch.kv_heads, arch.head_dim
    per = arch.heads // groups
    grouped = qkv.reshape(groups, (per + 2) * d, *qkv.shape[1:])
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return [t.reshape(-1, *qkv.shape[1:]).contiguous() for t in (q, k, v)]


def full_shapes(arch: ModelArch, layout: Layout = PLAIN) -> dict[str, tuple[int, ...]]:
    """The shape of every full megatron parameter."""
    h, table = arch.hidden, _layer_shapes(arch)
    top = {"embedding.word_embeddings.weight": (arch.vocab, h),
           "output_layer.weight": (1, h) if layout.value_head else (arch.vocab, h)}
    shapes = {}
    for name in full_params(arch, layout):
        leaf = name.split(".", 3)[3] if name.startswith("decoder.layers.") else name
        if expert_of(name) is not None:
            leaf = "expert." + leaf.rsplit(".", 2)[1]
        shapes[name] = top.get(name) or table.get(leaf) or (h,)  # (h,): the layer norms
    return shapes


def _layer_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Shapes of a layer's parameters by their name after "decoder.layers.{i}." (experts: "expert.<linear>")."""
    h, d, mla = arch.hidden, arch.head_dim, arch.attention == "mla"
    qkv, shared, a = (arch.heads + 2 * arch.kv_heads) * d, arch.shared_experts * arch.expert_ffn, "self_attention."
    return {
        a + "linear_qkv.weight": (qkv, h), a + "linear_qkv.bias": (qkv,),
        a + "linear_proj.weight": (h, arch.heads * (arch.v_head_dim if mla else d)),
        a + "q_layernorm.weight": (arch.q_lora_rank,) if mla else (d,), a + "k_layernorm.weight": (d,),
        a + "linear_q_proj.weight": (arch.heads * d, h), a + "linear_q_down_proj.weight": (arch.q_lora_rank, h),
        a + "linear_q_up_proj.weight": (arch.heads * d, arch.q_lora_rank),
        a + "linear_kv_down_proj.weight": (arch.kv_lora_rank + arch.qk_rope_dim, h),
        a + "kv_layernorm.weight": (arch.kv_lora_rank,),
        a + "linear_kv_up_proj.weight": (arch.heads * (d - arch.qk_rope_dim + arch.v_head_dim), arch.kv_lora_rank),
        "mlp.linear_fc1.weight": (2 * arch.ffn, h), "mlp.linear_fc2.weight": (h, arch.ffn),
        "mlp.router.weight": (arch.experts, h), "mlp.router.expert_bias": (arch.experts,),
        "mlp.shared_experts.linear_fc1.weight": (2 * shared, h), "mlp.shared_experts.linear_fc2.weight": (h, shared),
        "expert.linear_fc1": (2 * arch.expert_ffn, h), "expert.linear_fc2": (h, arch.expert_ffn),
    }


# ---- grouped-GEMM experts ----
def grouped_to_sequential(arch: ModelArch, local: dict, ep: int) -> dict:
    """A rank's state dict with GroupedMLP experts (`mlp.experts.weight1` / `weight2`: what
    moe_grouped_gemm builds from the local spec, and what the lowering asks for) rewritten as
    SequentialMLP's per-expert linear weights, same tensor cut, so that one layout is resharded.
    GroupedMLP.forward reads expert j's fc1 as weight1.view(experts, hidden, -1)[j] ([hidden, out])
    and fc2 as weight2.view(experts, -1, hidden)[j] (megatron/core/transformer/moe/experts.py)."""
    experts = arch.experts // ep
    out = {}
    for name, tensor in local.items():
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith("mlp.experts") or leaf not in ("weight1", "weight2"):
            out[name] = tensor
            continue
        linear = "linear_fc1" if leaf == "weight1" else "linear_fc2"
        views = tensor.view(experts, arch.hidden, -1) if leaf == "weight1" else tensor.view(experts, -1, arch.hidden)
        for j, weight in enumerate(views):
            out[f"{prefix}.local_experts.{j}.{linear}.weight"] = weight.t().contiguous()
    return out


def sequential_to_grouped(arch: ModelArch, local: dict, ep: int) -> dict:
    """The inverse of `grouped_to_sequential`: per-expert linear weights back into weight1/weight2."""
    out, grouped = {}, {}
    for name, tensor in local.items():
        expert = expert_of(name)
        if expert is None:
            out[name] = tensor
            continue
        prefix = name[:name.index(".local_experts.")]
        leaf = "weight1" if ".linear_fc1." in name else "weight2"
        grouped.setdefault((prefix, leaf), {})[expert] = tensor.t()
    for (prefix, leaf), by_expert in grouped.items():
        stacked = torch.stack([by_expert[j] for j in range(arch.experts // ep)])
        out[f"{prefix}.{leaf}"] = stacked.reshape(arch.hidden, -1) if leaf == "weight1" else \
            stacked.reshape(-1, arch.hidden)
    return out
