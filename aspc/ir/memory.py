"""Per-device memory of a stage: weights, KV cache, gradients and optimizer state.

Activations are not counted (they depend on micro-batch and recompute settings); the check is a
lower bound, so a rejected placement cannot fit.
"""
from __future__ import annotations

from dataclasses import dataclass

from aspc.ir.facts import DTYPE_BYTES, ModelArch
from aspc.ir.graph import Parallel

USABLE_HBM_FRACTION = 0.9  # leave 10% for the runtime, allocator fragmentation and workspace
GRAD_BYTES = 4  # fp32 gradient accumulation (Megatron)
ADAM_BYTES = 8  # fp32 first and second moments
MASTER_BYTES = 4  # fp32 master copy when parameters are held in 16 bits


@dataclass(frozen=True)
class MemoryNeed:
    parts: tuple[tuple[str, float], ...]  # (what, bytes per device)

    @property
    def total(self) -> float:
        return sum(b for _, b in self.parts)

    def describe(self) -> str:
        return " + ".join(f"{gb(b)} {what}" for what, b in self.parts if b > 0)


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def generation_need(arch: ModelArch, dtype: str, par: Parallel, context_tokens: int) -> MemoryNeed:
    """vLLM layout: dense weights split over tp (and pp), routed experts over ep (and pp);
    the KV cache must hold at least one sequence of the longest context."""
    nbytes = DTYPE_BYTES[dtype]
    weights = (arch.dense_params() / par.tp + arch.expert_params() / par.ep) / par.pp * nbytes
    kv_split = 1 if arch.attention == "mla" else min(par.tp, arch.kv_heads)
    kv = arch.kv_bytes_per_token(nbytes) * context_tokens / kv_split / par.pp
    return MemoryNeed(((f"{dtype} weights", weights), ("KV cache for one sequence", kv)))


def forward_need(arch: ModelArch, dtype: str, par: Parallel) -> MemoryNeed:
    """Forward-only (reference log-probs): weights under the Megatron layout."""
    return MemoryNeed(((f"{dtype} weights", _train_params(arch, par) * DTYPE_BYTES[dtype]),))


def training_need(arch: ModelArch, dtype: str, par: Parallel, distributed_optimizer: bool) -> MemoryNeed:
    """Megatron layout: dense params over tp x pp; experts over tp x ep x pp; the distributed
    optimizer shards optimizer state over the data-parallel group (dp x cp, divided by ep for
    experts)."""
    params = _train_params(arch, par)
    nbytes = DTYPE_BYTES[dtype]
    opt_per_param = ADAM_BYTES + (MASTER_BYTES if nbytes < 4 else 0)
    dense = arch.dense_params() / (par.tp * par.pp)
    experts = arch.expert_params() / (par.tp * par.ep * par.pp)
    if distributed_optimizer:
        optimizer = opt_per_param * (dense / (par.dp * par.cp) + experts * par.ep / (par.dp * par.cp))
    else:
        optimizer = opt_per_param * params
    return MemoryNeed(((f"{dtype} weights", params * nbytes), ("fp32 gradients", params * GRAD_BYTES),
                       ("optimizer state", optimizer)))


def _train_params(arch: ModelArch, par: Parallel) -> float:
    return arch.dense_params() / (par.tp * par.pp) + arch.expert_params() / (par.tp * par.ep * par.pp)
