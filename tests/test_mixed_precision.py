"""A model's `dtype` on the CPU backend: bf16 computes its matrix products in bf16 over fp32 weights
and optimizer state (mixed precision, as Megatron's bf16 keeps fp32 main parameters); fp16 and fp32
compute in fp32. The learner, the reference, a reward model and the project's generator all follow
the plan; vLLM gets the same dtype (tests/test_vllm_engine.py runs it). The generator's cache with
a bf16 model: tests/test_cpu_backend.py."""
import copy

import pytest
import torch

from aspc.backends.cpu.batching import make_batch, token_logprobs
from aspc.backends.cpu.model import TinyQwen, compute_in
from aspc.ir.facts import ModelArch
from conftest import ROOT

ARCH = ModelArch(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=32, tied=True, max_seq=64)


def product_dtypes(model, batch) -> set:
    """The dtypes the model's linear layers computed in during one forward of `batch`."""
    seen = set()
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
             for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        token_logprobs(model, batch)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def batch():
    return make_batch([([1, 5, 6, 7], [8, 9, 10]), ([1, 4, 4], [11, 12, 13, 14])])


def test_bf16_computes_products_in_bf16_over_fp32_weights_and_gradients():
    full = TinyQwen(ARCH, seed=2)
    mixed = compute_in(copy.deepcopy(full), "bf16")
    assert product_dtypes(full, batch()) == {torch.float32}
    assert product_dtypes(mixed, batch()) == {torch.bfloat16}
    exact, _ = token_logprobs(full, batch())
    rounded, _ = token_logprobs(mixed, batch())
    assert rounded.dtype == torch.float32  # the softmax over the vocabulary stays fp32
    assert not torch.equal(exact, rounded) and torch.allclose(exact, rounded, atol=0.05)
    rounded.sum().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in mixed.parameters() if p.grad is not None)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_fp32_and_fp16_compute_in_fp32(dtype):
    model = compute_in(TinyQwen(ARCH, seed=2), dtype)
    assert product_dtypes(model, batch()) == {torch.float32}


def test_a_reward_models_decoder_follows_its_dtype():
    from aspc.backends.cpu.reward_model import RewardModel

    model = compute_in(RewardModel(ARCH), "bf16")
    assert model.decoder.compute_dtype == torch.bfloat16


def test_the_cpu_backend_builds_the_actor_reference_and_generator_in_the_plans_dtype(tmp_path):
    from aspc.backends.cpu.executors import CpuExecutors
    from aspc.cli.toolchain import compile_with_passes

    source = (ROOT / "pipelines" / "tiny_grpo.aspl").read_text().replace("max_seq = 64, seed = 1",
                                                                        "max_seq = 64, seed = 1, dtype = bf16")
    path = tmp_path / "bf16.aspl"
    path.write_text(source)
    executors = CpuExecutors(compile_with_passes(path, []).plan(), ROOT / "pipelines")
    learner = executors.trainer()
    assert learner.actor.compute_dtype == learner.ref.compute_dtype == torch.bfloat16
    assert executors.generation_engine(0, 1).model.compute_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in learner.actor.parameters())


def test_a_bf16_models_engines_get_its_weights_in_bf16():
    """Half the bytes to snapshot, pickle and send; an fp32 model's engines get its fp32 weights."""
    from aspc.backends.cpu.model import published_state

    full = TinyQwen(ARCH, seed=3)
    mixed = compute_in(copy.deepcopy(full), "bf16")
    sent = published_state(mixed)
    assert {t.dtype for t in sent.values()} == {torch.bfloat16}
    assert all(torch.equal(sent[k], v.to(torch.bfloat16)) for k, v in mixed.state_dict().items())
    assert all(t.dtype == torch.float32 for t in mixed.state_dict().values())  # the learner keeps fp32
    assert all(torch.equal(t, full.state_dict()[k]) for k, t in published_state(full).items())
