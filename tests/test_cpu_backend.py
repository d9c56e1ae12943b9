"""The CPU backend's pieces: model, generator, losses, rewards, data."""
import pytest
import torch

from aspc.rl.data import HELD_OUT, DataError, PromptSource
from aspc.backends.cpu.generator import BatchGenerator
from aspc.rl.losses import gae, group_advantages, overlong_penalty, policy_loss
from aspc.backends.cpu.model import KVCache, TinyQwen, cache_mask, causal_mask, compute_in
from aspc.rl.rewards import RewardError, WeightedReward, exact_match, math_verify, numeric_match
from aspc.rl.tasks import example
from aspc.rl.tokenizer import decode, encode
from aspc.ir.facts import ModelArch

ARCH = ModelArch(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64, vocab=32, tied=True, max_seq=64)


@pytest.mark.parametrize("dtype, atol", [("fp32", 1e-5), ("bf16", 0.05)])
def test_cached_decoding_equals_the_full_forward(dtype, atol):
    """bf16 (tests/test_mixed_precision.py): its keys and values go into the fp32 cache as fp32."""
    model = compute_in(TinyQwen(ARCH, seed=1), dtype).eval()
    tokens = torch.randint(3, 20, (2, 10))
    positions = torch.arange(10)[None].expand(2, 10)
    with torch.no_grad():
        full = model(tokens, positions, causal_mask([10, 10], 10))
        cache, slots = KVCache(ARCH, 4, 64), torch.tensor([3, 1])
        outs = [model(tokens[:, :6], positions[:, :6], cache_mask(positions[:, :6]), cache, slots)[:, -1]]
        for t in range(6, 10):
            p = torch.full((2, 1), t)
            outs.append(model(tokens[:, t:t + 1], p, cache_mask(p), cache, slots)[:, 0])
    assert torch.allclose(full[:, 5:].float(), torch.stack(outs, 1).float(), atol=atol)


def test_initialisation_is_deterministic_per_seed():
    a, b, c = TinyQwen(ARCH, seed=3), TinyQwen(ARCH, seed=3), TinyQwen(ARCH, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))


def generate(static, slots, count=12):
    generator = BatchGenerator(TinyQwen(ARCH, seed=1).eval(), slots, 16, static=static)
    for i in range(count):
        generator.add(i, [1] + encode(f"{i}+3="), seed=i)
    out = {}
    while generator.busy:
        for f in generator.step():
            out[f.key] = (f.response, f.logprobs)
    return out


def test_a_samples_tokens_do_not_depend_on_its_batch():
    continuous_small, continuous_big, static = generate(False, 3), generate(False, 12), generate(True, 3)
    assert set(continuous_small) == set(range(12))
    for key in continuous_small:
        assert continuous_small[key][0] == continuous_big[key][0] == static[key][0]
        assert continuous_small[key][1] == pytest.approx(static[key][1], abs=1e-4)


def test_group_advantages():
    assert group_advantages([1, 0, 1, 0], 2, "grpo", False) == [0.5, -0.5, 0.5, -0.5]
    normalized = group_advantages([1.0, 0.0], 2, "grpo", True)
    assert normalized[0] == pytest.approx(0.7071, abs=1e-3) and normalized[1] == pytest.approx(-0.7071, abs=1e-3)
    assert group_advantages([3, 1, 2], 3, "rloo", False) == [1.5, -1.5, 0.0]


def test_gae_with_lambda_one_is_reward_to_go_minus_value():
    advantages, returns = gae(1.0, [0.2, 0.4, 0.5], gamma=1.0, lam=1.0)
    assert advantages == pytest.approx([0.8, 0.6, 0.5])
    assert returns == pytest.approx([1.0, 1.0, 1.0])


def test_overlong_penalty_is_linear_in_the_buffer():
    assert overlong_penalty(10, 20, 5) == 0.0
    assert overlong_penalty(18, 20, 4) == pytest.approx(-0.5)
    assert overlong_penalty(20, 20, 4) == -1.0


def test_policy_loss_clips_and_penalises_kl():
    logp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0]])
    adv = torch.tensor([[1.0, 1.0]])
    mask = torch.ones(1, 2)
    loss, info = policy_loss(logp, old, None, adv, mask, "ppo", 0.2, 0.2, 0.0)
    assert float(loss.detach()) == pytest.approx(-(1.2 + 1.0))  # the first ratio e^1 clips to 1.2
    assert info["clip_fraction"] == 0.5
    with_kl, _ = policy_loss(logp, old, old, adv, mask, "ppo", 0.2, 0.2, 0.5)
    assert float(with_kl) > float(loss)
    decoupled, _ = policy_loss(logp, old, None, adv, mask, "dapo", 0.2, 0.28, 0.0)
    assert float(decoupled) == pytest.approx(-(1.28 + 1.0))


def test_rewards():
    assert exact_match("", "42", "42", {}) == 1.0 and exact_match("", "41", "42", {}) == 0.0
    assert numeric_match("", "it is 42", "42", {}) == 1.0
    assert math_verify("", "so \\boxed{7}", "7", {}) == 1.0


def test_a_failing_user_reward_names_the_sample():
    def broken(prompt, response, answer, metadata):
        raise KeyError("missing")

    with pytest.raises(RewardError, match="prompt '1\\+1=', response '2'"):
        WeightedReward(((broken, 1.0),))("1+1=", "2", "2", {})


def test_tasks_are_deterministic_and_long_tailed():
    assert example("count", 1, 5, 24) == example("count", 1, 5, 24)
    lengths = [len(example("copy", 0, i, 24).answer) for i in range(400)]
    assert max(lengths) > 3 * (sum(lengths) / len(lengths)) / 1.5
    assert decode(encode(example("arith", 0, 0, 24).prompt)) == example("arith", 0, 0, 24).prompt


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"answer": "3"}\n')
    with pytest.raises(DataError, match="d.jsonl:2: each line needs a string \"prompt\""):
        PromptSource("jsonl", "d.jsonl", 0, 8, tmp_path)
    path.write_text('{"prompt": "1+1=", "answer": "2"}\nnot json\n')
    with pytest.raises(DataError, match="d.jsonl:2: not valid JSON"):
        PromptSource("jsonl", "d.jsonl", 0, 8, tmp_path)
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert PromptSource("jsonl", "d.jsonl", 0, 8, tmp_path)(5).answer == "2"


@pytest.mark.parametrize("rows", [3, 40, 256, 1000])
def test_a_jsonl_file_holds_out_rows_no_step_trains_on(tmp_path, rows):
    """A quarter of the rows (at most 128; none of a file under 4 rows) are held out for evaluation,
    the same rows for every data seed, and no training index in any epoch reads one."""
    (tmp_path / "d.jsonl").write_text("".join(f'{{"prompt": "{i}+0=", "answer": "{i}"}}\n' for i in range(rows)))
    sources = [PromptSource("jsonl", "d.jsonl", seed, 8, tmp_path) for seed in (0, 7)]
    held = [{sources[k](HELD_OUT + i).answer for i in range(sources[k].held_out_count(128))} for k in (0, 1)]
    assert held[0] == held[1] and len(held[0]) == (min(128, rows // 4) or rows)  # a tiny file: its own rows
    trained = {sources[0](i).answer for i in range(3 * rows)}
    assert trained.isdisjoint(held[0]) == (rows >= 4)
    assert len(trained) == rows - (min(128, rows // 4))
