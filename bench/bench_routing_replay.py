"""Rollout routing replay (R3) on a tiny mixture-of-experts decoder: the CPU generator samples (KV cache,
one position at a time) and records each position's experts; the trainer's forward over the whole
sequences (a shared-prompt batch) then gives the response tokens log-probs with its router choosing
(none) or with the engine's experts replayed (rollout). Printed for the same weights in fp32 and bf16,
and for a router moved as a trainer step moves it (noise of `--move` x its weights' scale): the share
of routed (token, layer) pairs whose experts differ from the engine's, and |log pi_trainer - log pi_engine|.

    python bench/bench_routing_replay.py [--samples 64] [--experts 16] [--move 0.05] [--seed 0]
"""
from __future__ import annotations

import argparse
import copy

import torch

from aspc.backends.cpu.batching import shared_prompt_batch, token_logprobs
from aspc.backends.cpu.generator import BatchGenerator
from aspc.backends.cpu.model import Routing, TinyQwen, compute_in
from aspc.ir.facts import ModelArch


def generate(model: TinyQwen, samples: int, seed: int):
    generator = BatchGenerator(copy.deepcopy(model), slots=16, max_tokens=24, record_routes=True)
    g = torch.Generator().manual_seed(seed)
    for i in range(samples):
        generator.add(i, [1] + torch.randint(3, model.arch.vocab, (4 + i % 5,), generator=g).tolist(), seed=i)
    done = []
    while generator.busy:
        done += generator.step()
    return sorted(done, key=lambda f: f.key)


def compare(model: TinyQwen, done, replay: bool) -> tuple[float, float, float]:
    """(share of routes that differ from the engine's, mean and max |log-prob difference|)."""
    routes = [f.routes for f in done]
    batch = shared_prompt_batch([(f.prompt, f.response) for f in done], routes if replay else None)
    recorded = shared_prompt_batch([(f.prompt, f.response) for f in done], routes).routes
    routing = Routing(batch.routes)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, routing=routing)
    used = routing.routes()
    known = recorded[..., 0] >= 0
    differ = (used.sort(-1).values != recorded.sort(-1).values).any(-1) & known
    engine = torch.zeros_like(logp)
    for i, f in enumerate(done):
        engine[i, :len(f.logprobs)] = torch.tensor(f.logprobs)
    mask = batch.response_mask().bool()
    gap = (logp - engine).abs()[mask]
    return float(differ.sum() / known.sum()), float(gap.mean()), float(gap.max())


def moved(model: TinyQwen, scale: float, seed: int) -> TinyQwen:
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for block in out.blocks:
            w = block.mlp.router.weight
            w.add_(scale * w.std() * torch.randn(w.shape, generator=g))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--move", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    arch = ModelArch(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=64, experts=args.experts,
                     top_k=2, expert_ffn=32, max_seq=64, norm_topk=True)
    print(f"{args.samples} samples, {arch.layers} MoE layers of {arch.experts} experts (top {arch.top_k})")
    print(f"{'weights':<22} {'replay':<8} {'routes differ':>14} {'mean |d logp|':>14} {'max |d logp|':>13}")
    for dtype in ("fp32", "bf16"):
        model = compute_in(TinyQwen(arch, seed=args.seed), dtype).eval()
        done = generate(model, args.samples, args.seed)
        trainers = ((f"same, {dtype}", model), (f"router moved, {dtype}", moved(model, args.move, args.seed)))
        for label, trainer in trainers:
            for replay in (False, True):
                share, mean, top = compare(trainer, done, replay)
                print(f"{label:<22} {'rollout' if replay else 'none':<8} {share:>13.2%} {mean:>14.2e} {top:>13.2e}")


if __name__ == "__main__":
    main()
