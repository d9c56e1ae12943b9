"""The learner's batches with a group's prompt laid out once (backends/cpu/batching.py,
`shared_prompt_batch`): the same log-probs, entropies, values and gradients as a row per sequence."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from aspc.backends.cpu.batching import make_batch, shared_prompt_batch, token_logprobs, token_values  # noqa: E402
from aspc.backends.cpu.model import TinyQwen, compute_in  # noqa: E402
from aspc.ir.facts import ModelArch  # noqa: E402

ARCH = ModelArch(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=32, max_seq=64)


def groups() -> list[tuple[list[int], list[int]]]:
    """Two prompts of different lengths, each with responses of different lengths (one empty), and
    a prompt of its own; not in group order."""
    a, b, c = [1, 5, 6, 7], [1, 9, 3], [1, 4]
    return [(a, [10, 11, 12]), (b, [13]), (a, [14, 15]), (c, [16, 17, 18, 19]), (b, [20, 21, 22, 23, 24]),
            (a, [25]), (b, [])]


def passes(model, batch):
    model.zero_grad(set_to_none=True)
    logp, entropy = token_logprobs(model, batch, 0.7)
    (logp * batch.response_mask()).sum().backward()
    return logp.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype, tolerance", [("fp32", 1e-5), ("bf16", 0.05)])
def test_log_probs_entropies_and_gradients_equal_a_row_per_sequence(dtype, tolerance):
    model = compute_in(TinyQwen(ARCH, seed=3), dtype)
    sequences = groups()
    shared, separate = shared_prompt_batch(sequences), make_batch(sequences)
    assert shared.tokens.shape[0] == 3 and shared.tokens.numel() < separate.tokens.numel()
    mine, theirs = passes(model, shared), passes(model, separate)
    for got, want in zip(mine[:2], theirs[:2]):  # padding too: both read a zero hidden state there
        assert got.shape == want.shape and (got - want).abs().max() < tolerance
    for name, grad in mine[2].items():
        assert (grad - theirs[2][name]).abs().max() < tolerance * max(1.0, float(theirs[2][name].abs().max())), name


def test_values_equal_a_row_per_sequence():
    model = TinyQwen(ARCH, seed=4, value_head=True)
    sequences = groups()
    with torch.no_grad():
        got = token_values(model, shared_prompt_batch(sequences))
        want = token_values(model, make_batch(sequences))
    mask = make_batch(sequences).response_mask().bool()
    assert (got - want)[mask].abs().max() < 1e-5
