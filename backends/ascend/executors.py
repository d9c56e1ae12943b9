"""Executors on Ascend NPUs: a vllm-ascend engine per generation process, megatron-core models
(through the MindSpeed adaptor) for train, reference and critic, forward-only models compiled
with torchair. Every Ascend import is inside the function that runs on an NPU, so this module
imports on any machine; `require_npu` says clearly what is missing.

    python -m aspc.backends.ascend.executors {generate|train|reference|critic} --plan launch.json ...
"""
from __future__ import annotations

import argparse
import json
import os
import sys


class AscendUnavailable(Exception):
    """No usable NPU stack here; the message says what is missing and what to do instead."""


ALTERNATIVES = ("run `aspc run FILE --backend ascend --dry-run` to print the per-process commands "
                "for an NPU cluster, `aspc run FILE --backend cpu` to train a tiny pipeline here, or "
                "`aspc simulate FILE` to predict the cluster's throughput")


def require_npu() -> None:
    """Import torch_npu (which makes torchair importable) and find an NPU, or explain."""
    try:
        import torch_npu  # noqa: F401
    except ImportError as error:
        raise AscendUnavailable(f"torch-npu is not installed ({error}); it needs the CANN toolkit on an "
                                f"Ascend host (docs/ascend.md). Meanwhile: {ALTERNATIVES}") from None
    import torch

    if not torch.npu.is_available():
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "<unset>")
        raise AscendUnavailable(f"torch-npu is installed but no NPU is visible "
                                f"(ASCEND_RT_VISIBLE_DEVICES={visible}). Meanwhile: {ALTERNATIVES}")


def build_engine(stage: dict):
    """A vllm-ascend engine from the launch plan's engine arguments."""
    from vllm import LLM  # vllm-ascend registers itself as vLLM's platform plugin

    return LLM(**stage["config"])


DTYPE_FIELDS = ("params_dtype", "pipeline_dtype")


def materialize(config: dict) -> dict:
    """The launch plan's JSON config with dtype names turned into torch dtypes."""
    import torch

    return {k: getattr(torch, v) if k in DTYPE_FIELDS else v for k, v in config.items()}


def build_megatron_model(stage: dict):
    """A megatron-core GPTModel for this rank, after the MindSpeed adaptor has patched megatron."""
    import mindspeed.megatron_adaptor  # noqa: F401  (patches megatron for Ascend; parses argv)
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.distributed.init_process_group(backend="hccl")
    config = materialize(stage["config"])
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config["tensor_model_parallel_size"],
        pipeline_model_parallel_size=config["pipeline_model_parallel_size"],
        context_parallel_size=config["context_parallel_size"],
        expert_model_parallel_size=config["expert_model_parallel_size"])
    transformer = TransformerConfig(**config, activation_func=torch.nn.functional.silu)
    return GPTModel(transformer, transformer_layer_spec=get_gpt_layer_local_spec(), **stage["model_args"])


def compile_forward(model, compiler: dict):
    """torch.compile with torchair's NPU backend (GE graph mode, static shapes)."""
    import torch
    import torchair

    from aspc.backends.ascend.compiler_options import apply_compiler_options

    config = apply_compiler_options(torchair.CompilerConfig(), compiler)
    return torch.compile(model, backend=torchair.get_npu_backend(compiler_config=config),
                         dynamic=compiler.get("dynamic", False))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Start one aspc process on an Ascend NPU host.")
    parser.add_argument("role", choices=["generate", "train", "reference", "critic"])
    parser.add_argument("--plan", required=True)
    parser.add_argument("--stage", required=True)
    parser.add_argument("--instance", type=int, default=0)
    parser.add_argument("--dp-rank", type=int, default=0)
    parser.add_argument("--rank", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        require_npu()
        with open(args.plan, encoding="utf-8") as plan_file:
            launch = json.load(plan_file)
        stage = next(s for s in launch["stages"] if s["stage"] == args.stage)
        if args.role == "generate":
            build_engine(stage)
        else:
            model = build_megatron_model(stage)
            if stage["compiler"]:
                compile_forward(model, stage["compiler"])
    except AscendUnavailable as error:
        print(f"aspc: {error}", file=sys.stderr)
        return 1
    print(f"aspc: {args.role} process for stage {args.stage} is ready", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
