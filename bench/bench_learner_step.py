"""One learner pass on SmolLM2-135M-Instruct at the TRL side-by-side's batch shape: the reference
forward and the policy's forward + backward, as backends/cpu/learner.py runs them.

32 sequences of 38-45 prompt and 8-16 response tokens (seeded random ids: the cost does not depend on
which tokens), fp32, one torch thread by default (a worker's share on the 2-core machine). --bf16
runs both under torch.autocast(bfloat16) and reports how far its log-probs move from fp32's.

    python bench/bench_learner_step.py [--model runs/smollm2-135m-instruct] [--threads 1] [--bf16]
"""
from __future__ import annotations

import argparse
import random
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from aspc.backends.cpu.batching import make_batch, token_logprobs
from aspc.backends.cpu.hf_weights import load_hf_model
from aspc.frontend.compiler import compile_file

ROOT = Path(__file__).resolve().parent.parent
PIPELINE = ROOT / "pipelines" / "optional" / "smollm2_arith_vllm.aspl"


def batch_of(seed: int = 0):
    rng = random.Random(seed)
    return make_batch([([rng.randrange(1000, 40000) for _ in range(rng.randrange(38, 46))],
                        [rng.randrange(1000, 40000) for _ in range(rng.randrange(8, 17))]) for _ in range(32)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "runs" / "smollm2-135m-instruct"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_hf_model(compile_file(PIPELINE).graph.models["actor"].arch, Path(args.model))
    batch, temperature = batch_of(), 0.7
    mask = batch.response_mask().bool()
    with torch.no_grad():
        fp32, _ = token_logprobs(model, batch, temperature)
    precision = torch.autocast("cpu", dtype=torch.bfloat16) if args.bf16 else nullcontext()
    for _ in range(args.repeats):
        start = time.perf_counter()
        with precision, torch.no_grad():
            reference, _ = token_logprobs(model, batch, temperature)
        forward_s, start = time.perf_counter() - start, time.perf_counter()
        with precision:
            logp, _ = token_logprobs(model, batch, temperature)
        logp.sum().backward()
        model.zero_grad(set_to_none=True)
        moved = (reference - fp32)[mask].abs()
        print(f"{'bf16' if args.bf16 else 'fp32'}, {args.threads} thread(s): reference forward {forward_s:.2f} s, "
              f"policy forward + backward {time.perf_counter() - start:.2f} s; |log-prob - fp32's| mean "
              f"{moved.mean():.2e}, max {moved.max():.2e}", flush=True)


if __name__ == "__main__":
    main()
