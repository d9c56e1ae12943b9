"""`engine = vllm | aspc` on a generate stage: what each backend runs, and what it refuses before the
run at the option's line (no vLLM needed: these are the refusals a CPU without the vllm extra gives)."""
from __future__ import annotations

import importlib.util

import pytest

from conftest import ROOT

TINY = (ROOT / "pipelines" / "tiny_grpo.aspl").read_text()
GEN = "stage gen    = generate(actor, prompts) on cpu {"


def with_engine(tmp_path, engine: str, text: str = TINY):
    assert GEN in text
    path = tmp_path / "p.aspl"
    path.write_text(text.replace(GEN, f"{GEN} engine = {engine},"))
    line = next(i for i, row in enumerate(path.read_text().splitlines(), 1) if "engine =" in row)
    return path, line


def test_an_unknown_engine_is_a_located_error(aspc, tmp_path):
    path, line = with_engine(tmp_path, "sglang")
    result = aspc("check", str(path))
    assert result.exit_code == 1 and f"p.aspl:{line}:" in result.output and "aspc" in result.output, result.output


def test_vllm_on_heads_its_cpu_attention_does_not_take_is_refused_at_the_option(aspc, tmp_path):
    path, line = with_engine(tmp_path, "vllm")  # tiny_grpo: hidden 64 over 4 heads of 16
    result = aspc("run", str(path), "--steps", "1")
    assert result.exit_code == 1, result.output
    assert f"p.aspl:{line}:" in result.output
    assert "engine = vllm: vLLM-CPU's attention takes heads of 32" in result.output
    assert "model 'actor' has 16 (hidden / heads)" in result.output and "choose heads" in result.output


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_missing_is_refused_with_the_install_command(aspc, tmp_path):
    from test_hf_checkpoints import PIPELINE, REWARD, save_qwen2

    save_qwen2(tmp_path / "qwen", heads=1, kv_heads=1)
    (tmp_path / "length_reward.py").write_text(REWARD)
    text = PIPELINE.replace("{ temperature = 1.0 }", "{ temperature = 1.0, engine = vllm }")
    path = tmp_path / "p.aspl"
    path.write_text(text)
    result = aspc("run", str(path), "--steps", "1")
    assert result.exit_code == 1, result.output
    assert "p.aspl:6:" in result.output and "engine = vllm: vLLM is not installed" in result.output
    assert "pip install -e '.[vllm]'" in result.output and "Traceback" not in result.output


def test_sync_naive_static_batches_are_refused_with_vllm(tmp_path):
    from aspc.backends.cpu.executors import unsupported_stages
    from aspc.cli.toolchain import compile_with_passes
    from test_hf_checkpoints import PIPELINE, REWARD, save_qwen2

    save_qwen2(tmp_path / "qwen", heads=1, kv_heads=1)
    (tmp_path / "length_reward.py").write_text(REWARD)
    path = tmp_path / "p.aspl"
    path.write_text(PIPELINE.replace("{ temperature = 1.0 }", "{ temperature = 1.0, engine = vllm }")
                    .replace("schedule sync", "schedule sync-naive"))
    found = [r for r in unsupported_stages(compile_with_passes(path, []).plan()) if r.option == "engine"]
    assert len(found) == 1 and "vLLM batches continuously" in found[0].message, found


def test_npus_refuse_the_cpu_generator(tmp_path):
    from aspc.backends.ascend.run_executors import AscendExecutors
    from aspc.cli.toolchain import compile_with_passes

    path, _ = with_engine(tmp_path, "aspc")
    refused = [r for r in AscendExecutors.unsupported(compile_with_passes(path, []).plan(), runtime=None)
               if r.option == "engine"]
    assert refused and "NPUs generate with vLLM" in refused[0].message


def test_the_cpu_generator_is_the_default_and_engine_aspc_runs_it(tmp_path):
    from aspc.backends.cpu.executors import CpuExecutors
    from aspc.backends.cpu.generator import BatchGenerator
    from aspc.cli.toolchain import compile_with_passes

    path, _ = with_engine(tmp_path, "aspc")
    for source in (path, ROOT / "pipelines" / "tiny_grpo.aspl"):
        executors = CpuExecutors(compile_with_passes(source, []).plan(), ROOT / "pipelines")
        assert type(executors.generation_engine(0, 1)) is BatchGenerator
