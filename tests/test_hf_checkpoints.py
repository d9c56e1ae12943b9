"""Hugging Face checkpoints: `model actor = hf("DIR")` loads a Qwen2 directory (config.json,
safetensors, tokenizer with a chat template) into the CPU backend; two RL steps later `aspc export`
writes the trained actor back, and transformers loads it with the logits aspc computes. Everything
is built offline in tmp_path: a random tiny Qwen2 and a character-level tokenizer."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
EOS = 2  # <|im_end|>

PIPELINE = """pipeline hf_grpo
pool cpu = cpu x 1
model actor = hf("qwen")
model ref = frozen(actor)
data prompts = synthetic("arith") { prompts_per_step = 4, group = 2, max_prompt = 64, max_response = 6, seed = 3 }
stage gen    = generate(actor, prompts) on cpu { temperature = 1.0 }
stage score  = reward(gen, python = "length_reward:odd_length")
stage ref_lp = reference(ref, gen) on cpu
stage adv    = advantage(score) { estimator = grpo }
stage update = train(actor, gen, ref_lp, adv) on cpu { loss = grpo, lr = 1e-2, kl = 0.01 }
schedule sync
"""
REWARD = "def odd_length(prompt, response, answer, metadata):\n    return float(len(response) % 2)\n"


def save_tokenizer(directory) -> None:
    """Byte-level BPE without merges (every byte one token, as transformers' Qwen2Tokenizer reads
    it), three specials, a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    inner.add_special_tokens(SPECIALS)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<|im_end|>",
                                                     pad_token="<|endoftext|>")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(directory)


def save_qwen2(directory, seed: int = 0, heads: int = 4, kv_heads: int = 2):
    """`heads = kv_heads = 1`: heads of 32, a size vLLM-CPU's attention takes (it refuses 8)."""
    config = transformers.Qwen2Config(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      max_position_embeddings=128,
                                      tie_word_embeddings=False, eos_token_id=EOS, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():  # random biases and norms too, so that each name is checked
            p.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    save_tokenizer(directory)
    return model


@pytest.fixture
def checkpoint(tmp_path):
    """tmp_path/qwen (a random tiny Qwen2 checkpoint) and tmp_path/hf_grpo.aspl that trains it."""
    model = save_qwen2(tmp_path / "qwen")
    (tmp_path / "hf_grpo.aspl").write_text(PIPELINE)
    (tmp_path / "length_reward.py").write_text(REWARD)
    return tmp_path, model


def executors_of(aspl):
    from aspc.backends.cpu.executors import CpuExecutors
    from aspc.cli.toolchain import compile_with_passes

    plan = compile_with_passes(aspl, []).plan()
    return plan, CpuExecutors(plan, aspl.parent)


def aspc_logits(model, ids: list[int]) -> torch.Tensor:
    from aspc.backends.cpu.model import causal_mask

    tokens = torch.tensor([ids])
    with torch.no_grad():
        return model(tokens, torch.arange(len(ids))[None], causal_mask([len(ids)], len(ids)))[0]


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


IDS = [1, 40, 17, 99, 5, 63, 2, 77, 30, 12, 8]


def test_config_json_gives_the_shape(checkpoint, aspc):
    tmp, _ = checkpoint
    result = aspc("compile", str(tmp / "hf_grpo.aspl"), "--emit", "ir")
    assert result.exit_code == 0, result.output
    assert 'model actor = hf [' in result.output and 'checkpoint="qwen"' in result.output
    assert 'dtype="fp32"' in result.output and "qkv_bias=true" in result.output, result.output


def test_loaded_model_has_the_checkpoints_logits(checkpoint):
    tmp, model = checkpoint
    _, executors = executors_of(tmp / "hf_grpo.aspl")
    assert torch.allclose(aspc_logits(executors.actor, IDS), hf_logits(model, IDS), atol=1e-5)


FAMILIES = {
    "qwen3": lambda: transformers.Qwen3Config(head_dim=16, tie_word_embeddings=True, rope_theta=1e6, **SHAPE),
    "llama": lambda: transformers.LlamaConfig(rms_norm_eps=1e-5, rope_theta=5e5, **SHAPE),
}
SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


@pytest.mark.parametrize("family", FAMILIES)
def test_qwen3_and_llama_have_the_logits_of_transformers(tmp_path, family):
    """Qwen3's per-head q/k norms and separate head_dim, tied embeddings; Llama's names and RoPE base."""
    from aspc.backends.cpu.executors import build_model
    from aspc.cli.toolchain import compile_with_passes

    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]()).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "x.aspl").write_text(PIPELINE.replace('hf("qwen")', 'hf("ckpt")'))
    (tmp_path / "length_reward.py").write_text(REWARD)
    plan = compile_with_passes(tmp_path / "x.aspl", []).plan()
    ours = build_model(plan.model("actor"), tmp_path, 0)
    assert torch.allclose(aspc_logits(ours, IDS), hf_logits(model, IDS), atol=1e-5)


def test_greedy_generation_matches_transformers(checkpoint):
    from aspc.backends.cpu.generator import BatchGenerator

    tmp, model = checkpoint
    _, executors = executors_of(tmp / "hf_grpo.aspl")
    prompt = executors.prompt(0).ids
    generator = BatchGenerator(executors.actor, slots=2, max_tokens=12, temperature=0.0, eos_ids=frozenset())
    generator.add("a", prompt, seed=0)
    finished = []
    while generator.busy:
        finished += generator.step()
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert finished[0].response == expected


def test_prompts_are_in_the_chat_template(checkpoint):
    tmp, _ = checkpoint
    _, executors = executors_of(tmp / "hf_grpo.aspl")
    prompt = executors.prompt(0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp / "qwen"))
    text = tokenizer.decode(prompt.ids)
    assert text == f"<|im_start|>user\n{prompt.text}<|im_end|>\n<|im_start|>assistant\n"
    assert executors.tokenizer.eos_ids == frozenset({EOS})
    assert executors.tokenizer.decode(tokenizer.encode("42", add_special_tokens=False) + [EOS, 5]) == "42"
    assert executors.trainer().task_reward.decode == executors.tokenizer.decode  # what rewards read


def test_two_rl_steps_export_and_reload_in_transformers(checkpoint, aspc):
    from safetensors.torch import load_file

    from aspc.backends.cpu.executors import build_model
    from aspc.drivers.local.runtime import LocalRuntime, RunOptions
    from aspc.backends.cpu.executors import CpuExecutors

    tmp, original = checkpoint
    plan, _ = executors_of(tmp / "hf_grpo.aspl")
    options = RunOptions(steps=2, warmstart_steps=0, checkpoint_dir=tmp / "run", checkpoint_every=1)
    runtime = LocalRuntime(plan, tmp, options, CpuExecutors)
    runtime.build()
    result = runtime.run()
    assert len(result.metrics) == 2
    saves = [m["checkpoint_s"] for m in result.metrics]  # the time the saves took, inside wall_s
    assert all(s >= 0 for s in saves) and sum(saves) > 0, saves

    export = aspc("export", str(tmp / "run"), "-o", str(tmp / "trained"))
    assert export.exit_code == 0, export.output
    assert "step 2" in export.output
    trained = transformers.AutoModelForCausalLM.from_pretrained(str(tmp / "trained")).eval()
    assert transformers.AutoTokenizer.from_pretrained(str(tmp / "trained")).chat_template == TEMPLATE

    actor = build_model(plan.model("actor"), tmp, 0)
    actor.load_state_dict(load_file(str(tmp / "run" / "step-000002" / "actor.safetensors")))
    ours = aspc_logits(actor, IDS)
    assert torch.allclose(ours, hf_logits(trained, IDS), atol=1e-5)
    assert not torch.allclose(ours, hf_logits(original, IDS), atol=1e-3), "two RL steps changed nothing"
    written = json.loads((tmp / "trained" / "config.json").read_text())
    assert written["model_type"] == "qwen2" and written.get("dtype", written.get("torch_dtype")) == "float32"


def test_aspc_run_trains_a_checkpoint_directory(checkpoint, aspc):
    tmp, _ = checkpoint
    metrics = tmp / "metrics.jsonl"
    result = aspc("run", str(tmp / "hf_grpo.aspl"), "--steps", "1", "--warmstart", "0", "--metrics", str(metrics))
    assert result.exit_code == 0, result.output
    assert len(metrics.read_text().splitlines()) == 1


def test_export_refuses_a_run_of_a_tiny_model(tmp_path, aspc):
    from aspc.rl import checkpoint as ckpt
    from aspc.backends.cpu.model import TinyQwen
    from aspc.ir.facts import ModelArch

    tiny = TinyQwen(ModelArch(layers=1, hidden=16, heads=2, kv_heads=2, head_dim=8, ffn=32, vocab=24))
    ckpt.save(tmp_path / "run", 1, {"actor": tiny}, {}, {"pipeline": "tiny"})
    result = aspc("export", str(tmp_path / "run"), "-o", str(tmp_path / "out"))
    assert result.exit_code == 1 and "not loaded from hf" in result.output


@pytest.mark.parametrize("config, message", [
    (None, "does not exist"),
    ({}, "model_type None is not supported"),
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn"}}, "rope scaling 'yarn'"),
    ({"model_type": "qwen2", "hidden_size": 8}, "config.json lacks 'num_attention_heads'"),
])
def test_bad_checkpoint_directory_is_located(tmp_path, aspc, config, message):
    if config is not None:
        (tmp_path / "ckpt").mkdir()
        (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    (tmp_path / "x.aspl").write_text(PIPELINE.replace('hf("qwen")', 'hf("ckpt")'))
    result = aspc("check", str(tmp_path / "x.aspl"))
    assert result.exit_code == 1
    assert "x.aspl:3:18: error: " in result.output and message in result.output, result.output


def test_missing_weights_and_tokenizer_are_warnings(tmp_path, aspc):
    (tmp_path / "qwen").mkdir()
    transformers.Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2).save_pretrained(tmp_path / "qwen")
    (tmp_path / "x.aspl").write_text(PIPELINE)
    (tmp_path / "length_reward.py").write_text(REWARD)
    result = aspc("check", str(tmp_path / "x.aspl"))
    assert result.exit_code == 0, result.output
    assert "no safetensors weights" in result.output and "no tokenizer files" in result.output


ASCEND = """pipeline hf_ascend
pool npu = 910b3 x 1
model actor = {source}
model ref = frozen(actor)
data prompts = synthetic("arith") {{ prompts_per_step = 4, group = 2 }}
stage gen    = generate(actor, prompts) on npu {{ instances = 1 }}
stage score  = reward(gen, rule = "exact_match")
stage ref_lp = reference(ref, gen) on npu
stage adv    = advantage(score) {{ estimator = grpo }}
stage update = train(actor, gen, ref_lp, adv) on npu {{ loss = grpo }}
"""


@pytest.mark.parametrize("source", ['hf("qwen")', 'custom { layers = 2, hidden = 32, heads = 4, checkpoint = "qwen" }'])
def test_ascend_launch_plan_names_the_checkpoint_directory(checkpoint, aspc, source):
    tmp, _ = checkpoint
    (tmp / "a.aspl").write_text(ASCEND.format(source=source))
    result = aspc("compile", str(tmp / "a.aspl"), "--backend", "ascend", "--emit", "launch")
    assert result.exit_code == 0, result.output
    engines = [s for s in json.loads(result.output)["stages"] if s["role"] == "vllm-engine"]
    assert [s["config"]["model"] for s in engines] == [str((tmp / "qwen").resolve())]


def test_ascend_launch_plan_marks_a_model_without_checkpoint(tmp_path, aspc):
    (tmp_path / "a.aspl").write_text(ASCEND.format(source="custom { layers = 2, hidden = 32, heads = 4 }"))
    result = aspc("compile", str(tmp_path / "a.aspl"), "--backend", "ascend", "--emit", "launch")
    engine = next(s for s in json.loads(result.output)["stages"] if s["role"] == "vllm-engine")
    assert engine["config"]["model"] == "<no-checkpoint:actor=custom>"


def test_hf_actor_refuses_tiny_reward_models(checkpoint):
    from aspc.backends.cpu.executors import unsupported_stages
    from aspc.cli.toolchain import compile_with_passes

    tmp, _ = checkpoint
    text = PIPELINE.replace('python = "length_reward:odd_length"', 'sources = [model(rm)]').replace(
        "model ref", 'model rm = custom { layers = 1, hidden = 16, heads = 2, checkpoint = "rm.safetensors" }\n'
                     "model ref")
    (tmp / "rm.aspl").write_text(text)
    refusals = unsupported_stages(compile_with_passes(tmp / "rm.aspl", []).plan())
    assert any("character vocabulary" in r.message for r in refusals)
