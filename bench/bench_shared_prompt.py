"""The learner's forward and backward of one GRPO step with each group's prompt computed once
(backends/cpu/batching.py, shared_prompt_batch) against a row per sequence (make_batch), on one
thread, in one run (a ratio, as bench/RESULTS.md records them).

    python bench/bench_shared_prompt.py --model runs/smollm2-135m-instruct --dtype bf16

Defaults: 4 prompts x group 8, prompts of 45 tokens and responses of 16 (SmolLM2's arith chat step)."""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from aspc.backends.cpu.batching import make_batch, shared_prompt_batch, token_logprobs
from aspc.backends.cpu.hf_weights import load_hf_model
from aspc.backends.cpu.model import compute_in
from aspc.frontend.hf_config import read_hf_model


def step_seconds(model, batch) -> float:
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    logp, _ = token_logprobs(model, batch, 0.7)
    (logp * batch.response_mask()).sum().backward()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=45)
    parser.add_argument("--response-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = compute_in(load_hf_model(read_hf_model(args.model).arch, args.model), args.dtype)
    rng = random.Random(0)
    vocab = model.arch.vocab
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    sequences = [(p, [rng.randrange(vocab) for _ in range(args.response_tokens)])
                 for p in prompts for _ in range(args.group)]
    batches = {"row per sequence": make_batch(sequences), "shared prompt": shared_prompt_batch(sequences)}
    best = {name: min(step_seconds(model, batch) for _ in range(args.repeats)) for name, batch in batches.items()}
    for name, seconds in best.items():
        print(f"{name:>17}: {seconds:6.2f} s  ({batches[name].tokens.numel()} token slots)")
    print(f"speed-up: {best['row per sequence'] / best['shared prompt']:.2f}x")


if __name__ == "__main__":
    main()
