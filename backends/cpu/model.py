"""A Qwen-style decoder at tiny sizes: RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU; with q/k/v biases (Qwen2) and per-head q/k norms (Qwen3) it is also the Qwen2, Qwen3 and
Llama decoder of Hugging Face checkpoints (hf_weights.py); with routed experts it is Qwen3-MoE's
decoder (`MoE`), whose forward records each token's experts or replays given ones (`Routing`: rollout
routing replay, R3). Deterministic initialisation from a seed. One forward serves training (a causal
mask over whole sequences) and generation (a KV cache with one slot per sequence).

A model whose plan says `dtype = bf16` computes in bf16 with its weights in fp32 (`compute_in`):
its matrix products run under `torch.autocast` (the CPU's AMX or AVX-512 bf16 units), the residual
stream, norms and softmax stay fp32, and the optimizer updates the fp32 weights -- mixed precision
as Megatron's `bf16` keeps fp32 main parameters. fp16 and fp32 compute in fp32."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from aspc.ir.facts import ModelArch


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class KVCache:
    """Keys and values per layer in fixed slots: [slots, kv_heads, length, head_dim]. The length
    starts at min(max_seq, `reserve`) and doubles as positions need it, up to max_seq: a checkpoint
    whose max_seq is 32k does not hold 32k positions per slot for short sequences."""

    def __init__(self, arch: ModelArch, slots: int, max_seq: int, dtype=torch.float32, reserve: int = 128):
        shape = (slots, arch.kv_heads, min(max_seq, reserve), arch.head_dim)
        self.max_seq = max_seq
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(arch.layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(arch.layers)]

    def hold(self, length: int) -> None:
        """Make room for positions 0..length-1."""
        have = self.k[0].shape[2]
        if length <= have:
            return
        grown = min(self.max_seq, max(length, 2 * have))
        self.k = [_grow(t, grown) for t in self.k]
        self.v = [_grow(t, grown) for t in self.v]


def _grow(t: torch.Tensor, length: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(t.shape[0], t.shape[1], length - t.shape[2], t.shape[3])], dim=2)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = arch.heads, arch.kv_heads, arch.head_dim
        self.q = nn.Linear(arch.hidden, arch.heads * arch.head_dim, bias=arch.qkv_bias)
        self.k = nn.Linear(arch.hidden, arch.kv_heads * arch.head_dim, bias=arch.qkv_bias)
        self.v = nn.Linear(arch.hidden, arch.kv_heads * arch.head_dim, bias=arch.qkv_bias)
        self.o = nn.Linear(arch.heads * arch.head_dim, arch.hidden, bias=False)
        self.qk_norm = arch.qk_norm
        if arch.qk_norm:  # Qwen3: RMSNorm over each head's query and key, before the rotation
            self.q_norm, self.k_norm = RMSNorm(arch.head_dim, arch.norm_eps), RMSNorm(arch.head_dim, arch.norm_eps)

    def forward(self, x, cos, sin, mask, cache=None, layer=0, slots=None, positions=None):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q.transpose(1, 2), cos, sin), rotate(k.transpose(1, 2), cos, sin)
        if cache is not None:  # write this step's keys at their positions, then attend to the slot
            rows = slots[:, None].expand(b, t)
            cache.k[layer][rows, :, positions] = k.transpose(1, 2).to(cache.k[layer].dtype)  # bf16 products: fp32
            cache.v[layer][rows, :, positions] = v.transpose(1, 2).to(cache.v[layer].dtype)
            length = int(positions.max()) + 1
            k, v = cache.k[layer][slots, :, :length], cache.v[layer][slots, :, :length]
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU: the dense model's feed-forward, and one expert of a mixture."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


@dataclass
class Routing:
    """Which experts each token goes to in one forward, MoE layer by MoE layer: the router's choice,
    or where `replay` names experts (ids >= 0), those (rollout routing replay, R3: the trainer computes
    its log-probs through the experts the engine sampled with). `chosen` keeps what each layer used."""

    replay: torch.Tensor | None = None  # [B, T, moe layers, top_k]; -1 where none was recorded
    chosen: list[torch.Tensor] = field(default_factory=list)  # per MoE layer: [B, T, top_k]

    def route(self, choice: torch.Tensor) -> torch.Tensor:
        """The experts the next MoE layer uses, given its router's `choice` [B, T, top_k]."""
        if self.replay is not None:
            given = self.replay[:, :, len(self.chosen)]
            choice = torch.where(given >= 0, given.to(choice.dtype), choice)
        self.chosen.append(choice)
        return choice

    def routes(self) -> torch.Tensor:
        """[B, T, moe layers, top_k]: every layer's experts."""
        return torch.stack(self.chosen, dim=2)


class MoE(nn.Module):
    """Qwen3-MoE's sparse feed-forward: a router's softmax over the experts, the top k taken (their
    weights renormalised where `norm_topk`), each token through its k SwiGLU experts. The weights are
    the router's probabilities at the experts used, so a replayed route still trains the router."""

    def __init__(self, arch: ModelArch):
        super().__init__()
        self.router = nn.Linear(arch.hidden, arch.experts, bias=False)
        self.experts = nn.ModuleList(MLP(arch.hidden, arch.expert_ffn) for _ in range(arch.experts))
        self.top_k, self.norm_topk = arch.top_k, arch.norm_topk

    def forward(self, x, routing: Routing | None = None):
        probs = torch.softmax(self.router(x).float(), -1)
        chosen = probs.topk(self.top_k, -1).indices
        if routing is not None:
            chosen = routing.route(chosen)
        weights = probs.gather(-1, chosen)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        flat, chosen, weights = x.reshape(-1, x.shape[-1]), chosen.reshape(-1, self.top_k), weights.view(-1, self.top_k)
        out = torch.zeros(flat.shape, dtype=torch.float32)
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == index)
            if len(token):
                out = out.index_add(0, token, expert(flat[token]).float() * weights[token, slot, None])
        return out.to(x.dtype).view_as(x)


class Block(nn.Module):
    def __init__(self, arch: ModelArch, sparse: bool = False):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(arch.hidden, arch.norm_eps), Attention(arch)
        self.mlp_norm = RMSNorm(arch.hidden, arch.norm_eps)
        self.mlp = MoE(arch) if sparse else MLP(arch.hidden, arch.ffn)

    def forward(self, x, cos, sin, mask, routing=None, **cache_args):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, **cache_args)
        h = self.mlp_norm(x)
        return x + (self.mlp(h, routing) if isinstance(self.mlp, MoE) else self.mlp(h))


class TinyQwen(nn.Module):
    """Logits (and, with a value head, per-token values) of token sequences."""

    compute_dtype = torch.float32  # what its matrix products compute in (compute_in)

    def __init__(self, arch: ModelArch, seed: int = 0, value_head: bool = False):
        super().__init__()
        if arch.shared_experts or arch.attention != "gqa":
            raise ValueError("the CPU backend's decoder has no shared experts and no multi-head latent attention")
        self.arch = arch
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.embed = nn.Embedding(arch.vocab, arch.hidden)
            self.blocks = nn.ModuleList(Block(arch, sparse=bool(arch.experts) and layer >= arch.dense_layers)
                                        for layer in range(arch.layers))
            self.norm = RMSNorm(arch.hidden, arch.norm_eps)
            self.head = None if arch.tied else nn.Linear(arch.hidden, arch.vocab, bias=False)
            self.value = nn.Linear(arch.hidden, 1) if value_head else None
            for p in self.parameters():
                if p.dim() > 1:
                    nn.init.normal_(p, std=0.02)
        inv = 1.0 / (arch.rope_theta ** (torch.arange(0, arch.head_dim, 2).float() / arch.head_dim))
        angles = torch.outer(torch.arange(arch.max_seq).float(), inv)
        self.register_buffer("cos", torch.cat((angles, angles), -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat((angles, angles), -1).sin(), persistent=False)

    def hidden_states(self, tokens, positions, mask, cache=None, slots=None, routing: Routing | None = None):
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        x = self.embed(tokens)
        if cache is not None:
            cache.hold(int(positions.max()) + 1)
        with self._autocast():
            for layer, block in enumerate(self.blocks):
                args = {} if cache is None else dict(cache=cache, layer=layer, slots=slots, positions=positions)
                x = block(x, cos, sin, mask, routing=routing, **args)
        return self.norm(x)

    def logits(self, hidden):
        with self._autocast():
            return hidden @ self.embed.weight.T if self.head is None else self.head(hidden)

    def _autocast(self):
        low = self.compute_dtype != torch.float32
        return torch.autocast("cpu", dtype=self.compute_dtype if low else torch.bfloat16, enabled=low)

    def forward(self, tokens, positions, mask, cache=None, slots=None, routing: Routing | None = None):
        return self.logits(self.hidden_states(tokens, positions, mask, cache, slots, routing))

    def values(self, tokens, positions, mask):
        return self.value(self.hidden_states(tokens, positions, mask)).squeeze(-1)


TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cpu_compute_dtype(dtype: str) -> str:
    """The dtype a model whose plan says `dtype` computes in on the CPU backend (the learner and
    vLLM alike): bf16 stays bf16; fp16 and fp32 compute in fp32 (a CPU has no fast fp16 products)."""
    return "bf16" if dtype == "bf16" else "fp32"


Module = TypeVar("Module", bound=nn.Module)


def compute_in(model: Module, dtype: str) -> Module:
    """`model` (and every decoder inside it, e.g. a reward model's) computing in its plan's `dtype`:
    bf16 under autocast over fp32 weights, fp16 and fp32 in fp32 (the module's docstring)."""
    for module in model.modules():
        if isinstance(module, TinyQwen):
            module.compute_dtype = TORCH_DTYPES[cpu_compute_dtype(dtype)]
    return model


def published_state(model: TinyQwen) -> dict:
    """The weights an engine loads, in the dtype the model computes in: a bf16 model's engines get
    bf16 tensors (half the bytes to copy, pickle and send; vLLM holds bf16 weights, and the
    products round them to bf16 all the same), an fp32 model's a copy of its weights."""
    low = model.compute_dtype
    return {name: t.detach().to(low, copy=True) if t.is_floating_point() else t.detach().clone()
            for name, t in model.state_dict().items()}


def causal_mask(lengths: list[int], width: int) -> torch.Tensor:
    """[B, 1, T, T] True where a query may attend: causal, and never to right padding."""
    idx = torch.arange(width)
    causal = idx[None, :] <= idx[:, None]
    valid = idx[None, :] < torch.tensor(lengths)[:, None]
    return (causal[None] & valid[:, None, :])[:, None] | torch.eye(width, dtype=torch.bool)[None, None]


def cache_mask(positions: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, L] for cached attention: a query at position p sees keys 0..p of its slot."""
    length = int(positions.max()) + 1
    return (torch.arange(length)[None, None, :] <= positions[:, :, None])[:, None]
