"""Greedy accuracy on held-out prompts: a deterministic measure of what RL changed."""
from __future__ import annotations

import copy

from aspc.backends.cpu.generator import BatchGenerator
from aspc.rl.tokenizer import CHARS

HELD_OUT = 2 * 10**7  # prompt indices far from both the RL run and the warm start


def greedy_accuracy(model, prompts, reward_fn, count: int = 128, max_tokens: int = 24, tokenizer=CHARS) -> float:
    generator = BatchGenerator(copy.deepcopy(model).eval(), slots=64, max_tokens=max_tokens, temperature=0.0,
                               eos_ids=tokenizer.eos_ids)
    items = {i: prompts(HELD_OUT + i) for i in range(count)}
    for i, p in items.items():
        generator.add(i, p.ids, seed=i)
    total = 0.0
    while generator.busy:
        for f in generator.step():
            p = items[f.key]
            total += reward_fn(p.text, tokenizer.decode(f.response), p.answer, p.metadata)
    return total / count
