"""Preference pairs for the built-in `arith` task, for `aspc train-rm`: `chosen` is the answer the
task's verifier accepts, `rejected` a wrong one, of two kinds:

- written: a plausible mistake (one digit off, the sum off by one or ten, a digit dropped, added
  or swapped, the carry forgotten, the first operand echoed) or clearly wrong output (empty,
  repeated digits);
- sampled (the harder negatives, as RLHF collects them): a wrong response that a policy
  warm-started for a few steps (as `aspc run --warmstart` does) sampled itself, at temperature 1,
  from several warm-start lengths, so the reward model has seen the mistakes the policy makes
  along its way and not only the ones we thought of.

    python -m aspc.backends.cpu.preferences -o pipelines/data/arith_prefs.jsonl --pairs 3000

Prompts come from the task's generator with its own seed (the RL run and its held-out evaluation
draw other prompts); the same arguments write the same file (seeded sampling, one thread).
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from aspc.rl.rewards import exact_match
from aspc.rl.tasks import example

SEED = 1009  # not the seed of any bundled pipeline's data


def wrong_answer(rng: random.Random, prompt: str, answer: str) -> str:
    """A plausible answer to `prompt` that is not `answer`."""
    a, b = prompt.rstrip("=").split("+")
    for _ in range(100):
        kind = rng.choices(["digit", "off_by_one", "off_by_ten", "drop", "add", "swap", "no_carry", "echo",
                            "junk"], weights=[5, 4, 1, 2, 2, 1, 2, 1, 1])[0]
        wrong = _mutate(rng, kind, a, b, answer)
        if wrong != answer and not exact_match(prompt, wrong, answer, {}):
            return wrong
    return answer + "1"


def _mutate(rng: random.Random, kind: str, a: str, b: str, answer: str) -> str:
    value = int(answer)
    if kind == "digit":  # one digit off by one, mostly the last (where the addition happens)
        i = len(answer) - 1 if rng.random() < 0.6 else rng.randrange(len(answer))
        d = (int(answer[i]) + rng.choice([-1, 1])) % 10
        return answer[:i] + str(d) + answer[i + 1:]
    if kind == "off_by_one":
        return str(max(0, value + rng.choice([-1, 1, -2, 2])))
    if kind == "off_by_ten":
        return str(max(0, value + rng.choice([-10, 10])))
    if kind == "drop":  # truncated, or a digit left out
        i = rng.randrange(len(answer))
        return answer[:i] + answer[i + 1:] if rng.random() < 0.5 else answer[:-1]
    if kind == "add":  # a digit too many
        i = rng.randrange(len(answer) + 1)
        return answer[:i] + rng.choice("0123456789") + answer[i:]
    if kind == "swap" and len(answer) > 1:
        i = rng.randrange(len(answer) - 1)
        return answer[:i] + answer[i + 1] + answer[i] + answer[i + 2:]
    if kind == "no_carry":  # the last digit right, the carry forgotten
        return str(int(a) - int(a) % 10 + (int(a) % 10 + int(b)) % 10)
    if kind == "echo":
        return a
    # junk: empty, a run of one digit, or random digits
    return rng.choice(["", rng.choice("0123456789") * rng.randint(2, 8),
                       "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 8)))])


def arith_pairs(count: int, seed: int = SEED, max_response: int = 24, sampled: float = 0.5,
                warm_steps: tuple[int, ...] = (10, 30, 100, 200, 300)) -> list[dict]:
    """`count` pairs; a `sampled` fraction has a policy's own wrong sample as the rejected answer
    (split evenly over policies warm-started for `warm_steps`), the rest a written mistake."""
    n_sampled = round(count * sampled)
    rows = []
    for i in range(n_sampled, count):
        ex = example("arith", seed, i, max_response)
        rng = random.Random(f"prefs/{seed}/{i}")
        rows.append({"prompt": ex.prompt, "chosen": ex.answer, "rejected": wrong_answer(rng, ex.prompt, ex.answer)})
    per_policy = [n_sampled // len(warm_steps) + (k < n_sampled % len(warm_steps)) for k in range(len(warm_steps))]
    start = 0
    for steps, n in zip(warm_steps, per_policy):
        if n:
            rows += _sampled_pairs(range(start, start + n), steps, seed, max_response)
        start += n
    random.Random(f"prefs/{seed}/order").shuffle(rows)
    return rows


def _sampled_pairs(indices, warm_steps: int, seed: int, max_response: int, samples: int = 4) -> list[dict]:
    """For each prompt, a wrong answer sampled from a policy warm-started for `warm_steps` (with
    the shape of the bundled pipelines' actor), or a written mistake when all its samples were right."""
    import torch

    from aspc.rl.data import PromptSource
    from aspc.backends.cpu.generator import BatchGenerator
    from aspc.backends.cpu.model import TinyQwen
    from aspc.rl.tokenizer import decode
    from aspc.backends.cpu.warmstart import warm_start
    from aspc.ir.facts import ModelArch

    torch.set_num_threads(1)
    arch = ModelArch(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=256, vocab=32, max_seq=64, tied=True)
    prompts = PromptSource("synthetic", "arith", seed, max_response, None)
    policy = TinyQwen(arch, seed=warm_steps)
    warm_start(policy, prompts, warm_steps)
    generator = BatchGenerator(policy.eval(), slots=64, max_tokens=max_response, temperature=1.0)
    for i in indices:
        for k in range(samples):
            generator.add((i, k), prompts(i).ids, seed=hash((seed, warm_steps, i, k)) % 2**31)
    responses: dict[int, list[str]] = {i: [] for i in indices}
    while generator.busy:
        for finished in generator.step():
            responses[finished.key[0]].append(decode(finished.response))
    rows = []
    for i in indices:
        p = prompts(i)
        rng = random.Random(f"prefs/{seed}/{warm_steps}/{i}")
        wrong = sorted({r for r in responses[i] if not exact_match(p.text, r, p.answer, {})})
        rejected = rng.choice(wrong) if wrong else wrong_answer(rng, p.text, p.answer)
        rows.append({"prompt": p.text, "chosen": p.answer, "rejected": rejected})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write preference pairs for the arith task as JSONL.")
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument("--pairs", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    rows = arith_pairs(args.pairs, args.seed)
    Path(args.output).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} pairs to {args.output}")


if __name__ == "__main__":
    main()
