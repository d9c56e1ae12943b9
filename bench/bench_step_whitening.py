"""PPO's first-step gradient when a step's samples reach the CPU learner in units: whitened over the
step (what the learner does now) against the synchronous step, and whitened per unit (what asp
trained before issue 35). Prints the relative gradient change for 2, 4 and 8 units.

    python bench/bench_step_whitening.py [--samples 16] [--seed 5]
"""
from __future__ import annotations

import argparse
import copy

import torch

from aspc.backends.cpu.learner import Learner
from aspc.backends.cpu.model import TinyQwen
from aspc.ir.facts import ModelArch
from aspc.rl.rollout import Rollout, TrainSettings, token_advantages

ARCH = ModelArch(layers=1, hidden=16, heads=2, kv_heads=1, head_dim=8, ffn=32, vocab=32, tied=True, max_seq=32)
SETTINGS = TrainSettings(loss="ppo", lr=1e-3, kl=0.0, clip=0.2, clip_high=0.2, value_coef=0.5, entropy_coef=0.0,
                         micro_tokens=64, weight_decay=0.0, grad_clip=0.0, overlong=0, max_tokens=8, estimator="gae",
                         gamma=1.0, lam=0.95, normalize=True, group=2)


def rollouts(count: int, seed: int) -> list[Rollout]:
    """Scored samples with critic values and behaviour log-probs away from the policy's."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = 2 + (3 * i) % 7
        prompt, response = (torch.randint(1, 32, (k,), generator=g).tolist() for k in (3 + i % 4, n))
        out.append(Rollout(prompt, response, (-3.5 + 0.8 * torch.randn(n, generator=g)).tolist(), "", None,
                           reward=float(i % 3 == 0), values=torch.randn(n, generator=g).tolist()))
    return out


def gradient(model: TinyQwen, units: list[list[Rollout]], per_unit: bool) -> torch.Tensor:
    learner = Learner(copy.deepcopy(model), None, None, SETTINGS, lambda *a: 0.0)
    for unit in copy.deepcopy(units):
        if per_unit:
            learner._train_policy(unit, token_advantages(unit, SETTINGS)[0])
        else:
            learner.train(unit)
    learner._train_deferred()
    return torch.cat([p.grad.flatten() for p in learner.actor.parameters() if p.grad is not None])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    model, samples = TinyQwen(ARCH, seed=args.seed), rollouts(args.samples, args.seed)
    synchronous = gradient(model, [samples], per_unit=False)
    print("| units | whitened over the step | whitened per unit |\n|---|---|---|")
    for count in (2, 4, 8):
        size = -(-len(samples) // count)
        units = [samples[k:k + size] for k in range(0, len(samples), size)]
        change = [float((gradient(model, units, per) - synchronous).norm() / synchronous.norm())
                  for per in (False, True)]
        print(f"| {count} | {change[0]:.1e} | {change[1]:.1%} |")


if __name__ == "__main__":
    main()
