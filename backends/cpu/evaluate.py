"""Greedy accuracy on held-out prompts: a deterministic measure of what RL changed."""
from __future__ import annotations

import copy

from aspc.backends.cpu.generator import BatchGenerator
from aspc.rl.data import HELD_OUT
from aspc.rl.tokenizer import CHARS


def greedy_accuracy(model, prompts, reward_fn, count: int = 128, max_tokens: int = 24, tokenizer=CHARS) -> float:
    generator = BatchGenerator(copy.deepcopy(model).eval(), slots=64, max_tokens=max_tokens, temperature=0.0,
                               eos_ids=tokenizer.eos_ids)
    count = prompts.held_out_count(count)  # a JSONL file's held-out rows may be fewer
    items = {i: prompts(HELD_OUT + i) for i in range(count)}
    for i, p in items.items():
        generator.add(i, p.ids, seed=i)
    total = 0.0
    while generator.busy:
        for f in generator.step():
            p = items[f.key]
            total += reward_fn(p.text, tokenizer.decode(f.response), p.answer, p.metadata)
    return total / count
