"""A supervised warm start: next-token training on task examples (prompt, answer, EOS), the
honest stand-in for starting RL from a pretrained model. Seconds on a CPU."""
from __future__ import annotations

import torch

from aspc.backends.cpu.batching import make_batch, token_logprobs
from aspc.rl.tokenizer import CHARS


def warm_start(model, prompts, steps: int, batch_size: int = 32, lr: float = 3e-3, first_index: int = 10**7,
               on_step=None, demo=None, demo_every: int = 8, tokenizer=CHARS) -> float:
    """Train on answers to prompts first_index.. (a range the RL run does not draw from);
    returns the last loss. `demo(prompt) -> (response ids, loss mask)` replaces one example in
    `demo_every` (an agentic run's tool-call demonstration, whose tool tokens carry no loss)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loss_value = float("nan")
    for step in range(steps):
        indices = [first_index + step * batch_size + i for i in range(batch_size)]
        examples = [_example(prompts(i), demo if demo is not None and i % demo_every == 0 else None, tokenizer)
                    for i in indices]
        batch = make_batch([(ids, response) for ids, response, _ in examples])
        logp, _ = token_logprobs(model, batch)
        mask = batch.response_mask() * torch.tensor([m + [0] * (batch.width - len(m)) for _, _, m in examples],
                                                    dtype=torch.float32)
        loss = -(logp * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())
        if on_step is not None:
            on_step(step, loss_value)
    model.zero_grad(set_to_none=True)  # the last step's gradients must not leak into RL's first update
    return loss_value


def _example(prompt, demo, tokenizer) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, response ids, loss mask): the answer, or the demonstration."""
    response, mask = demo(prompt) if demo is not None else (tokenizer.encode(prompt.answer or "") + [tokenizer.eos],
                                                            None)
    return prompt.ids, response, mask if mask is not None else [1] * len(response)
