"""The plan's packed micro-batches (pure, tested on CPU): rollouts first-fit-decreasing into rows of
the pack pass's token budget, each row one sequence of tokens with per-sequence positions and a
block-diagonal causal mask (verl's megatron actor packs rows so), and the per-token tensors the
loss reads aligned with the labels."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from aspc.rl.objective import segments_of


@dataclass
class MicroBatch:
    """Sequences packed into one row of `tokens` (padded to it: one static shape per bucket for
    graph mode); positions restart per sequence and the causal mask is block-diagonal, so packed
    sequences never attend to each other. Per-token tensors are aligned with `labels`."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    attention_mask: torch.Tensor  # [1, 1, T, T], True where attention is masked (megatron's convention)
    labels: torch.Tensor  # [1, T]: the next token
    loss_mask: torch.Tensor  # [1, T]: 1 where the label is a response token the model wrote (not a tool's)
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    keys: list
    spans: list  # each sequence's (first, end) label positions of its response tokens
    ref_logprobs: torch.Tensor | None = None  # the reference's, where the rollouts have them (the KL term)
    segments: torch.Tensor | None = None  # [1, T]: the sequence each position is of (the loss's per-sequence means)
    routes: torch.Tensor | None = None  # [1, T, moe layers, top_k]: the engine's experts, to replay (R3)

    def to(self, device) -> MicroBatch:
        """This micro-batch with its tensors on `device`."""
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **moved)


def model_device(model) -> torch.device:
    """Where `model`'s parameters are (the rank's NPU once torch_npu's set_device ran; CPU without any)."""
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def feed(batches: list[MicroBatch], model) -> Iterator[MicroBatch]:
    """megatron's data iterator over `batches`: each moved to `model`'s device as the schedule takes it
    (packing builds them on the host; one micro-batch at a time on the NPU)."""
    device = model_device(model)
    return (mb.to(device) for mb in batches)


def pack(rollouts: list, tokens: int, advantages: dict | None = None, routes: bool = False) -> list[MicroBatch]:
    """First-fit-decreasing into rows of at most `tokens` (the pack pass's token budget);
    `advantages`: sample key -> its advantage (0 for a forward-only pass); `routes`: lay out the
    rollouts' recorded experts (MicroBatch.routes)."""
    rows: list[list] = []
    for r in sorted(rollouts, key=lambda r: -(len(r.prompt) + len(r.response))):
        length = len(r.prompt) + len(r.response)
        if length > tokens:
            raise ValueError(f"a sample of {length} tokens exceeds the micro-batch budget of {tokens}")
        row = next((row for row in rows if sum(len(x.prompt) + len(x.response) for x in row) + length <= tokens), None)
        if row is None:
            rows.append([r])
        else:
            row.append(r)
    batches = [_micro_batch(row, tokens, advantages or {}) for row in rows]
    if routes:
        for batch, row in zip(batches, rows):
            batch.routes = _routes(row, tokens)
    return batches


def _routes(row: list, tokens: int) -> torch.Tensor:
    """A row's MicroBatch.routes: each sample's recorded experts at its positions; elsewhere (each
    sample's last token, which the engine never computed, and the padding: no loss reads either, and
    the block-diagonal mask keeps them from every other position) experts 0..top_k-1."""
    missing = next((r for r in row if r.routes is None), None)
    if missing is not None:
        raise ValueError(f"sample {missing.key} has no recorded routes: routing_replay needs the engine to record "
                         "the experts of each token it generated")
    _, layers, top_k = row[0].routes.shape
    laid = torch.arange(top_k).expand(1, tokens, layers, top_k).clone()
    at = 0
    for r in row:
        laid[0, at:at + len(r.routes)] = r.routes
        at += len(r.prompt) + len(r.response)
    return laid


def _micro_batch(row: list, tokens: int, advantages: dict) -> MicroBatch:
    ids, pos, labels, mask, old, adv, ref = ([0] * tokens for _ in range(7))
    allowed = torch.zeros(tokens, tokens, dtype=torch.bool)
    at, spans = 0, []
    for r in row:
        seq, n_prompt = list(r.prompt) + list(r.response), len(r.prompt)
        end = at + len(seq)
        ids[at:end], pos[at:end] = seq, range(len(seq))
        labels[at:end - 1] = seq[1:]
        counted = getattr(r, "loss_mask", None) or [1] * len(r.response)  # agentic: tool tokens 0
        for i in range(n_prompt - 1, len(seq) - 1):  # position i predicts response token i + 1
            mask[at + i], old[at + i] = counted[i - n_prompt + 1], r.behaviour_logprobs[i - n_prompt + 1]
            ref[at + i] = r.ref_logprobs[i - n_prompt + 1] if r.ref_logprobs is not None else 0.0
            given = advantages.get(r.key, 0.0)  # a sample's advantage, or its tokens' (GAE)
            adv[at + i] = given[i - n_prompt + 1] if isinstance(given, list) else given
        spans.append((at + n_prompt - 1, end - 1))
        allowed[at:end, at:end] = torch.tril(torch.ones(len(seq), len(seq), dtype=torch.bool))
        at = end
    as_row = lambda values, dtype=torch.long: torch.tensor(values, dtype=dtype)[None]  # noqa: E731
    return MicroBatch(as_row(ids), as_row(pos), (~allowed)[None, None], as_row(labels), as_row(mask, torch.float),
                      as_row(old, torch.float), as_row(adv, torch.float), [r.key for r in row], spans,
                      as_row(ref, torch.float) if all(r.ref_logprobs is not None for r in row) else None,
                      segments_of(spans, tokens))


def per_sequence(logp: torch.Tensor, mb: MicroBatch) -> dict:
    """Sample key -> its response tokens' values in a packed row's per-position tensor [1, T]."""
    return {key: logp[0, first:end].tolist() for key, (first, end) in zip(mb.keys, mb.spans)}


# ---- context parallelism: each rank of a context-parallel group holds two chunks of every row ----
ROW_FIELDS = ("input_ids", "position_ids", "labels", "loss_mask", "old_logprobs", "advantages", "ref_logprobs",
              "segments")


def sequence_counts(mb: MicroBatch) -> torch.Tensor:
    """[1, T]: at each position, the tokens the loss counts in its whole sequence (the per-sequence
    means of a rank that holds part of each sequence)."""
    segments = mb.segments if mb.segments is not None else torch.zeros_like(mb.loss_mask, dtype=torch.long)
    totals = torch.zeros(int(segments.max()) + 1, dtype=mb.loss_mask.dtype, device=mb.loss_mask.device)
    totals = totals.index_add(0, segments.flatten(), mb.loss_mask.flatten())
    return totals[segments]


def on_this_cp_rank(mb: MicroBatch, extra: dict) -> tuple[MicroBatch, dict]:
    """This context-parallel rank's part of a packed row, as megatron-core splits a batch
    (utils.get_batch_on_this_cp_rank: 2·cp chunks, rank r takes chunks r and 2·cp-1-r, so causal
    work is balanced; the mask keeps its columns, the whole row's keys) and MindSpeed-RL feeds its
    ring attention; `extra`: other [1, T] tensors of the row, split the same way."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    tensors = {name: getattr(mb, name) for name in (*ROW_FIELDS, "attention_mask")} | extra
    split = get_batch_on_this_cp_rank(tensors)
    return dataclasses.replace(mb, **{name: split[name] for name in (*ROW_FIELDS, "attention_mask")}), \
        {name: split[name] for name in extra}


def in_row_order(parts: list[torch.Tensor], dim: int = -1) -> torch.Tensor:
    """Every context-parallel rank's two chunks of a row (rank r's: r and 2·cp-1-r) back in row order."""
    cp = len(parts)
    chunks: list = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        chunks[rank], chunks[2 * cp - 1 - rank] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)
