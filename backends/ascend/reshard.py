"""Megatron-core and Hugging Face parameter layouts, and the pure tensor steps between them.

A megatron-core GPTModel built from the local layer spec (megatron/core/models/gpt/gpt_layer_specs.py,
`get_gpt_layer_local_spec`) names its parameters `decoder.layers.{i}.self_attention.linear_qkv.weight`
and so on, with `i` the layer's index *within its pipeline stage*. Tensor parallelism cuts
column-parallel weights along dim 0 and row-parallel ones along dim 1; the fused QKV weight is
interleaved per query group ("q1 q2 k1 v1", megatron/core/transformer/attention.py), so a plain
dim-0 cut hands each rank whole groups; the gated MLP's fc1 is [gate; up] on *every* rank, so the
full tensor is not the concatenation of the shards. Experts (SequentialMLP,
`mlp.experts.local_experts.{j}`) are spread over the expert-parallel ranks and, by megatron's
default (expert_tensor_parallel_size = tensor_model_parallel_size), cut like the dense MLP.

Here a "full" megatron state dict has every layer under its global index and no tensor cut;
`split`/`merge` go between a full tensor and its tensor-parallel shards, `to_hf`/`from_hf`
between full megatron names and Hugging Face names (Qwen2/Qwen3/Qwen3-MoE checkpoints). MLA
(DeepSeek) weights are not modelled: `check_supported` says so."""
from __future__ import annotations

from dataclasses import dataclass

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


def check_supported(arch: ModelArch, tp: int, pp: int = 1, ep: int = 1) -> None:
    if arch.attention == "mla":
        raise LayoutError("resharding MLA (DeepSeek) weights is not modelled; only GQA models (Qwen2, Qwen3, "
                          "Qwen3-MoE) are")
    if arch.layers % pp:
        raise LayoutError(f"{arch.layers} layers do not split evenly into {pp} pipeline stages")
    for what, size in (("vocabulary", arch.vocab), ("FFN", arch.ffn), ("query groups", arch.kv_heads)):
        if size % tp:
            raise LayoutError(f"the {what} ({size}) does not split evenly over tensor-parallel size {tp}")
    if arch.experts and arch.experts % ep:
        raise LayoutError(f"{arch.experts} experts do not split evenly over expert-parallel size {ep}")


# ---- the megatron layout ----
def layer_params(arch: ModelArch, layer: int) -> dict[str, Cut]:
    """One decoder layer's megatron parameters (global layer index) and how each is cut."""
    p = f"decoder.layers.{layer}."
    params = {p + "input_layernorm.weight": REPLICATED, p + "self_attention.linear_qkv.weight": COLUMN,
              p + "self_attention.linear_proj.weight": ROW, p + "pre_mlp_layernorm.weight": REPLICATED}
    if arch.qkv_bias:
        params[p + "self_attention.linear_qkv.bias"] = COLUMN
    if arch.qk_norm:
        params |= {p + "self_attention.q_layernorm.weight": REPLICATED,
                   p + "self_attention.k_layernorm.weight": REPLICATED}
    if not is_moe_layer(arch, layer):
        return params | {p + "mlp.linear_fc1.weight": GATED, p + "mlp.linear_fc2.weight": ROW}
    params[p + "mlp.router.weight"] = REPLICATED
    for e in range(arch.experts):
        params |= {expert_name(layer, e, "linear_fc1"): GATED, expert_name(layer, e, "linear_fc2"): ROW}
    return params


def is_moe_layer(arch: ModelArch, layer: int) -> bool:
    return bool(arch.experts) and layer >= arch.dense_layers


def expert_name(layer: int, expert: int, linear: str) -> str:
    return f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{linear}.weight"


def full_params(arch: ModelArch) -> dict[str, Cut]:
    """Every megatron parameter of the whole model (global layer and expert numbers)."""
    params = {"embedding.word_embeddings.weight": COLUMN}
    for layer in range(arch.layers):
        params |= layer_params(arch, layer)
    params["decoder.final_layernorm.weight"] = REPLICATED
    if not arch.tied:
        params["output_layer.weight"] = COLUMN
    return params


def stage_of(arch: ModelArch, name: str, pp: int) -> int:
    """The pipeline stage that holds a parameter (evenly split layers; megatron's default)."""
    if name.startswith("embedding."):
        return 0
    if name.startswith("decoder.layers."):
        return layer_of(name) // (arch.layers // pp)
    return pp - 1  # final norm, output layer


def layer_of(name: str) -> int:
    return int(name.split(".")[2])


def expert_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[parts.index("local_experts") + 1]) if "local_experts" in parts else None


def local_name(arch: ModelArch, name: str, pp: int, ep: int) -> str:
    """A global megatron name as the rank that holds it numbers it: layers from 0 in each stage,
    experts from 0 on each expert-parallel rank."""
    if not name.startswith("decoder.layers."):
        return name
    parts = name.split(".")
    parts[2] = str(layer_of(name) % (arch.layers // pp))
    expert = expert_of(name)
    if expert is not None:
        parts[parts.index("local_experts") + 1] = str(expert % (arch.experts // ep))
    return ".".join(parts)


def global_name(arch: ModelArch, name: str, pp_rank: int, pp: int, ep_rank: int, ep: int) -> str:
    if not name.startswith("decoder.layers."):
        return name
    parts = name.split(".")
    parts[2] = str(int(parts[2]) + pp_rank * (arch.layers // pp))
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


def shard_state(arch: ModelArch, full: dict, tp: int, pp: int, ep: int, coords: dict) -> dict:
    """The state dict of the rank at `coords` (tp, pp and its expert-parallel rank "ep"), from a
    full megatron state dict: what megatron's own checkpoint loading would leave on that rank."""
    cuts = full_params(arch)
    out = {}
    for name, tensor in full.items():
        expert = expert_of(name)
        if stage_of(arch, name, pp) != coords["pp"]:
            continue
        if expert is not None and expert // (arch.experts // ep) != coords["ep"]:
            continue
        out[local_name(arch, name, pp, ep)] = split(tensor, cuts[name], tp)[coords["tp"]]
    return out


# ---- Hugging Face names ----
def to_hf(arch: ModelArch, full: dict) -> dict[str, torch.Tensor]:
    """A full megatron state dict as a Hugging Face checkpoint's tensors (what vllm-ascend's HCCL
    weight transfer and vLLM's `load_weights` take)."""
    out = {}
    for name, tensor in full.items():
        for hf_name, part in _hf_parts(arch, name, tensor):
            out[hf_name] = part
    return out


def from_hf(arch: ModelArch, hf: dict) -> dict[str, torch.Tensor]:
    """The inverse of `to_hf`."""
    full = {}
    for name in full_params(arch):
        sources = _hf_sources(arch, name)
        if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
            full[name] = _interleave_qkv(arch, *(hf[s] for s in sources))
        else:
            full[name] = torch.cat([hf[s] for s in sources], dim=0) if len(sources) > 1 else hf[sources[0]]
    return full


SIMPLE = {"input_layernorm.weight": "input_layernorm.weight",
          "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
          "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
          "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
          "self_attention.k_layernorm.weight": "self_attn.k_norm.weight", "mlp.router.weight": "mlp.gate.weight",
          "mlp.linear_fc2.weight": "mlp.down_proj.weight"}
TOP = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
       "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}


def _hf_sources(arch: ModelArch, name: str) -> list[str]:
    """The Hugging Face tensors that one megatron parameter is made of."""
    if name in TOP:
        return [TOP[name]]
    layer = layer_of(name)
    prefix = f"model.layers.{layer}."
    rest = name.split(".", 3)[3]
    expert = expert_of(name)
    if expert is not None:
        base = f"{prefix}mlp.experts.{expert}."
        if "linear_fc1" in rest:
            return [base + "gate_proj.weight", base + "up_proj.weight"]
        return [base + "down_proj.weight"]
    if rest.startswith("self_attention.linear_qkv."):
        kind = rest.rsplit(".", 1)[1]
        return [f"{prefix}self_attn.{p}_proj.{kind}" for p in "qkv"]
    if rest == "mlp.linear_fc1.weight":
        return [prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"]
    return [prefix + SIMPLE[rest]]


def _hf_parts(arch: ModelArch, name: str, tensor: torch.Tensor):
    sources = _hf_sources(arch, name)
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
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


def full_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """The shape of every full megatron parameter."""
    h, d, f = arch.hidden, arch.head_dim, arch.ffn
    qkv = (arch.heads + 2 * arch.kv_heads) * d
    shapes = {}
    for name in full_params(arch):
        leaf = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
        ffn = arch.expert_ffn if expert_of(name) is not None else f
        shapes[name] = {
            "embedding.word_embeddings.weight": (arch.vocab, h), "output_layer.weight": (arch.vocab, h),
            "self_attention.linear_qkv.weight": (qkv, h), "self_attention.linear_qkv.bias": (qkv,),
            "self_attention.linear_proj.weight": (h, arch.heads * d), "mlp.router.weight": (arch.experts, h),
            "self_attention.q_layernorm.weight": (d,), "self_attention.k_layernorm.weight": (d,),
        }.get(leaf) or ((2 * ffn, h) if leaf.endswith("linear_fc1.weight")
                        else (h, ffn) if leaf.endswith("linear_fc2.weight") else (h,))
    return shapes


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
