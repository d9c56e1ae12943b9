"""Tensors for a list of sequences (prompt + response), right-padded, with response masks."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from aspc.backends.cpu.model import TinyQwen, causal_mask
from aspc.rl.tokenizer import PAD


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T]
    positions: torch.Tensor
    mask: torch.Tensor  # attention mask
    starts: list[int]  # index of the logit that predicts the first response token
    lengths: list[int]  # response lengths
    width: int  # longest response

    def response_mask(self) -> torch.Tensor:
        return (torch.arange(self.width)[None] < torch.tensor(self.lengths)[:, None]).float()


def make_batch(sequences: list[tuple[list[int], list[int]]]) -> Batch:
    full = [p + r for p, r in sequences]
    width = max(len(f) for f in full)
    tokens = torch.full((len(full), width), PAD, dtype=torch.long)
    for i, f in enumerate(full):
        tokens[i, :len(f)] = torch.tensor(f)
    positions = torch.arange(width)[None].expand(len(full), width)
    return Batch(tokens, positions, causal_mask([len(f) for f in full], width),
                 [len(p) - 1 for p, _ in sequences], [len(r) for _, r in sequences],
                 max(len(r) for _, r in sequences))


def gather_responses(per_position: torch.Tensor, batch: Batch) -> torch.Tensor:
    """[B, T, ...] at the positions that predict each response token -> [B, width, ...]."""
    rows = []
    for i, (start, length) in enumerate(zip(batch.starts, batch.lengths)):
        row = per_position[i, start:start + length]
        pad = batch.width - length
        rows.append(torch.cat([row, row.new_zeros((pad,) + row.shape[1:])]) if pad else row)
    return torch.stack(rows)


def token_logprobs(model: TinyQwen, batch: Batch, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of the response tokens, and the entropy at each response position, of the
    distribution the tokens were sampled from: the logits divided by the sampling temperature (as
    TRL and verl do; temperature 0, greedy, reads the plain logits)."""
    hidden = gather_responses(model.hidden_states(batch.tokens, batch.positions, batch.mask), batch)
    logits = model.logits(hidden)  # the head over response positions only (TRL's logits_to_keep)
    targets = gather_responses(torch.roll(batch.tokens, -1, dims=1), batch)
    logp_all = torch.log_softmax(logits.float() / (temperature or 1.0), -1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def token_values(model: TinyQwen, batch: Batch) -> torch.Tensor:
    """Critic values at the positions that predict each response token."""
    return gather_responses(model.values(batch.tokens, batch.positions, batch.mask), batch)
