"""A supervised warm start: next-token training on task examples (prompt, answer, EOS), the
honest stand-in for starting RL from a pretrained model. Seconds on a CPU."""
from __future__ import annotations

import torch

from aspc.backends.cpu.batching import make_batch, token_logprobs
from aspc.backends.cpu.tokenizer import EOS, encode


def warm_start(model, prompts, steps: int, batch_size: int = 32, lr: float = 3e-3, first_index: int = 10**7,
               on_step=None) -> float:
    """Train on answers to prompts first_index.. (a range the RL run does not draw from);
    returns the last loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loss_value = float("nan")
    for step in range(steps):
        items = [prompts(first_index + step * batch_size + i) for i in range(batch_size)]
        pairs = [(p.ids, encode(p.answer or "") + [EOS]) for p in items]
        batch = make_batch(pairs)
        logp, _ = token_logprobs(model, batch)
        mask = batch.response_mask()
        loss = -(logp * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())
        if on_step is not None:
            on_step(step, loss_value)
    return loss_value
