"""Hardware and model facts: loaded from aspc/data/*.toml, with the formulas derived from them."""
from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass, field, fields
from importlib import resources

GIB = 1024**3
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_bf16_tflops: float
    hbm_gib: float
    hbm_tbps: float
    link_gbps: float  # scale-up link per device, GB/s one way (HCCS, UB, NVLink)
    scale_up_devices: int  # devices that reach one another over the link: a node (or a supernode)
    mesh_links: int  # the link is a full mesh of this many links (a group of n uses n - 1); 0: switched
    network_gbps: float  # scale-out (RoCE) per device, GB/s one way, between nodes
    ray_resource: str = "CPU"  # how Ray schedules one device of this kind: NPU, GPU or CPU

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib * GIB

    def group_fits_a_node(self, group: int) -> bool:
        return group <= self.scale_up_devices

    def group_gbps(self, group: int) -> float:
        """Link bandwidth one device of a `group`-device collective drives (GB/s): the scale-up
        link inside a node (on a full mesh only the links to the group's peers), the network port
        when the group spans nodes."""
        if not self.group_fits_a_node(group):
            return self.network_gbps
        if self.mesh_links:
            return self.link_gbps * min(group - 1, self.mesh_links) / self.mesh_links
        return self.link_gbps


@dataclass(frozen=True)
class ModelArch:
    """A decoder-only transformer's shape; dense (GQA) or MoE, with MLA attention optional."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    tied: bool = False
    qkv_bias: bool = False
    attention: str = "gqa"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    max_seq: int = 4096
    # what a Hugging Face config.json adds (model = hf("DIR")); left out of JSON at their defaults
    rope_theta: float = field(default=10000.0, metadata={"omit_if_default": True})
    norm_eps: float = field(default=1e-6, metadata={"omit_if_default": True})
    qk_norm: bool = field(default=False, metadata={"omit_if_default": True})  # Qwen3: RMSNorm on q and k per head
    # a router's top-k weights renormalised to sum to 1 (Qwen3-MoE's norm_topk_prob; megatron's topk-then-softmax)
    norm_topk: bool = field(default=False, metadata={"omit_if_default": True})

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    def attention_params(self) -> int:
        h = self.hidden
        if self.attention == "mla":
            q = h * self.q_lora_rank + self.q_lora_rank * self.heads * self.head_dim
            kv_down = h * (self.kv_lora_rank + self.qk_rope_dim)
            kv_up = self.kv_lora_rank * self.heads * (self.head_dim - self.qk_rope_dim + self.v_head_dim)
            return q + kv_down + kv_up + self.heads * self.v_head_dim * h
        q = h * self.heads * self.head_dim
        kv = 2 * h * self.kv_heads * self.head_dim
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return q + kv + bias + self.heads * self.head_dim * h

    def expert_params(self) -> int:
        """Parameters in routed experts: what expert parallelism shards."""
        return self.moe_layers * self.experts * 3 * self.hidden * self.expert_ffn

    def dense_params(self) -> int:
        """Everything but the routed experts: what tensor and pipeline parallelism shard."""
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        norms = (2 * self.layers + 1) * self.hidden
        dense_mlp = (self.layers - self.moe_layers) * 3 * self.hidden * self.ffn
        shared = self.moe_layers * (self.shared_experts * 3 * self.hidden * self.expert_ffn
                                    + self.hidden * self.experts)
        return embed + norms + self.layers * self.attention_params() + dense_mlp + shared

    def total_params(self) -> int:
        return self.dense_params() + self.expert_params()

    def active_params(self) -> int:
        """Parameters touched per token (top-k of the routed experts)."""
        if not self.experts:
            return self.total_params()
        active_experts = self.moe_layers * self.top_k * 3 * self.hidden * self.expert_ffn
        return self.dense_params() + active_experts

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache per token: 2·bytes·head_dim·kv_heads·layers, or the MLA latent."""
        if self.attention == "mla":
            return dtype_bytes * (self.kv_lora_rank + self.qk_rope_dim) * self.layers
        return 2 * dtype_bytes * self.head_dim * self.kv_heads * self.layers


ARCH_FIELDS = tuple(f.name for f in fields(ModelArch))


def _load(name: str) -> dict:
    text = resources.files("aspc.data").joinpath(name).read_text(encoding="utf-8")
    return tomllib.loads(text)


@functools.lru_cache(maxsize=1)
def hardware_table() -> dict[str, Hardware]:
    return {name: Hardware(name=name, **row) for name, row in _load("hardware.toml").items()}


@functools.lru_cache(maxsize=1)
def model_presets() -> dict[str, ModelArch]:
    return {name: ModelArch(**row) for name, row in _load("models.toml").items()}
