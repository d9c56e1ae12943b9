"""The roofline cost model (shared/FACTS.md, "Cost model"): every time the simulator charges.

Decode is memory-bound (weights plus KV reads per step), prefill and training compute-bound,
transfers bandwidth-bound. Parameters come from aspc/data/{hardware,models,costmodel}.toml.
"""
from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass
from importlib import resources

from aspc.ir.facts import DTYPE_BYTES, GIB, Hardware, ModelArch, hardware_table
from aspc.ir.graph import Parallel
from aspc.plan.execution_plan import ExecutionPlan, StagePlan


@functools.lru_cache(maxsize=1)
def parameters() -> dict:
    return tomllib.loads(resources.files("aspc.data").joinpath("costmodel.toml").read_text())


@dataclass(frozen=True)
class GenerationCost:
    """Decode-step time of one instance as t(B, C) = alpha * C + beta(B), C = sum of contexts."""

    arch: ModelArch
    hw: Hardware
    par: Parallel
    dtype_bytes: int
    graph_mode: bool

    @property
    def _bw(self) -> float:
        return parameters()["efficiency"]["bandwidth"] * self.hw.hbm_tbps * 1e12

    @property
    def _flops(self) -> float:
        return parameters()["efficiency"]["flops"] * self.hw.peak_bf16_tflops * 1e12

    @functools.cached_property
    def alpha(self) -> float:
        """Seconds per token of context per step: KV reads, spread over the instance's devices."""
        kv = self.arch.kv_bytes_per_token(self.dtype_bytes)
        split = self.par.dp * (1 if self.arch.attention == "mla" else min(self.par.tp, self.arch.kv_heads))
        return kv / (self._bw * split * self.par.pp)

    @functools.cached_property
    def _shape(self) -> tuple[float, float, float, float]:
        """(dense bytes read per step, all expert bytes, compute seconds per sequence, fixed overhead)."""
        g = parameters()["generation"]
        dense = self.arch.dense_params() / self.par.tp * self.dtype_bytes / (self._bw * self.par.pp)
        experts = self.arch.expert_params() / self.par.ep * self.dtype_bytes / (self._bw * self.par.pp)
        compute = 2 * self.arch.active_params() / (self._flops * self.par.tp * self.par.pp)
        launch = g["launch_graph_s"] if self.graph_mode else g["launch_eager_per_layer_s"] * self.arch.layers
        comm = 2 * self.arch.layers * g["tp_allreduce_latency_s"] if self.par.tp > 1 else 0.0
        return dense, experts, compute, launch + comm

    def beta(self, batch: int) -> float:
        """Seconds per step besides KV reads: weight reads or compute, launch, TP latency. MoE reads
        the experts a batch touches: 1 - (1 - k/E)^B of them per layer."""
        dense, experts, compute, fixed = self._shape
        touched = 1 - (1 - self.arch.top_k / self.arch.experts) ** max(batch, 1) if self.arch.experts else 0
        per_rank = max(batch / self.par.dp, 1)
        return max(dense + experts * touched, compute * per_rank) + fixed

    def prefill(self, tokens: int, requests: int = 1) -> float:
        devices = self.par.tp * self.par.pp * self.par.dp
        return 2 * self.arch.active_params() * tokens / (self._flops * devices)

    def capacity(self, tokens_per_sequence: float, usable_bytes: float) -> int:
        """Concurrent sequences: KV room after the weight shard, capped by max_num_seqs."""
        g = parameters()["generation"]
        weights = (self.arch.dense_params() / self.par.tp + self.arch.expert_params() / self.par.ep) \
            * self.dtype_bytes / self.par.pp
        room = usable_bytes * (1 - g["activation_reserve"]) - weights
        per_seq = tokens_per_sequence * self.arch.kv_bytes_per_token(self.dtype_bytes) * self.alpha_split()
        by_memory = int(room / per_seq) * self.par.dp if room > 0 else 1
        return max(1, min(by_memory, g["max_num_seqs_per_rank"] * self.par.dp))

    def alpha_split(self) -> float:
        split = 1 if self.arch.attention == "mla" else min(self.par.tp, self.arch.kv_heads)
        return 1 / (split * self.par.pp)


@dataclass(frozen=True)
class LearnerCost:
    """Forward (reference, critic) and training time of micro-batches on one data-parallel rank."""

    arch: ModelArch
    hw: Hardware
    par: Parallel
    recompute: bool

    @property
    def rank_devices(self) -> int:
        return self.par.tp * self.par.pp * self.par.cp

    def _attention(self, squares: float) -> float:
        return squares * self.arch.layers * self.arch.heads * self.arch.head_dim

    def forward(self, tokens: int, squares: float) -> float:
        flops = 2 * self.arch.active_params() * tokens + 4 * self._attention(squares)
        rate = parameters()["efficiency"]["flops"] * self.hw.peak_bf16_tflops * 1e12 * self.rank_devices
        return flops / rate

    def train(self, tokens: int, squares: float) -> float:
        n = self.arch.active_params()
        flops = (8 if self.recompute else 6) * n * tokens + 12 * self._attention(squares)
        mfu = parameters()["efficiency"]["train_mfu_moe" if self.arch.experts else "train_mfu_dense"]
        return flops / (mfu * self.hw.peak_bf16_tflops * 1e12 * self.rank_devices)

    def optimizer(self) -> float:
        """One AdamW update: read and write 16 bytes of state per local parameter."""
        local = self.arch.total_params() / (self.par.tp * self.par.pp * self.par.dp * self.par.cp)
        bw = parameters()["efficiency"]["bandwidth"] * self.hw.hbm_tbps * 1e12
        return 2 * 16 * local / bw


def weight_sync_seconds(nbytes: float, devices: int) -> float:
    t = parameters()["transfer"]
    return t["weight_sync_fixed_s"] + nbytes / (t["weight_sync_gbps"] * 1e9 * max(devices, 1))


def offload_seconds(nbytes: float, devices: int) -> float:
    return nbytes / (parameters()["transfer"]["offload_gbps"] * 1e9 * max(devices, 1))


def hardware_of(plan: ExecutionPlan, stage: StagePlan) -> Hardware:
    return hardware_table()[plan.pool(stage.pool).hardware]


def usable_hbm(hw: Hardware) -> float:
    return hw.hbm_gib * GIB * parameters()["efficiency"]["memory"]


def dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES[dtype]
