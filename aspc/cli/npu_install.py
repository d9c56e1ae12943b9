"""The install recipe of an Ascend 910B node (aarch64 or x86_64): the numbered steps docs/ascend.md
prints and `aspc doctor` points at, and the requirement set a resolver checks in CI.

What does not resolve from PyPI alone, and how the steps handle it:
- vllm-ascend 0.23.0 pins triton-ascend==3.2.2; PyPI has 3.2.0. triton-ascend's maintainers publish it
  on Huawei's Ascend index (triton-lang/triton-ascend#900): step 4 installs it from there first.
- torch-npu 2.10.0.post4 on x86_64 pins torch==2.10.0+cpu, which only PyTorch's CPU index has (PyPI's
  x86_64 torch is the CUDA build): step 2 takes torch, torchvision and torchaudio from that index.
- vLLM 0.23.0's wheel pins torch 2.11 and CUDA kernels: step 3 builds its Python alone from source
  (VLLM_TARGET_DEVICE=empty), which installs its common requirements and no kernel.
- MindSpeed's requirements pin numpy<=1.26.0, but vLLM needs opencv-python-headless>=4.13 (numpy 2):
  step 6 installs MindSpeed without its requirements and then MINDSPEED_REQUIREMENTS, its list
  without that pin and without its test tools.

The resolver check (.ci/run: `python -m aspc.cli.npu_install requirements|excludes|overrides --arch A`
into `uv pip compile --python-platform A-manylinux_2_28`) resolves every step's packages together
against PyPI's metadata. What comes from the other indexes is left out of it (`excludes`): triton-
ascend, and on x86_64 the CUDA packages PyPI's torch build depends on and the +cpu build does not
(otherwise the same wheel); vLLM is resolved from its wheel's metadata with torch overridden to the
node's 2.10.0 and its CUDA kernels excluded, which is what the empty-device source build installs."""
from __future__ import annotations

from dataclasses import dataclass

import click

ARCHES = ("aarch64", "x86_64")
CANN_VERSION = "9.1"
TORCH = ("torch==2.10.0", "torchvision==0.25.0", "torchaudio==2.10.0")
TORCH_NPU = "torch-npu==2.10.0.post4"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TRITON_ASCEND = "triton-ascend==3.2.2"
ASCEND_INDEX = "https://mirrors.huaweicloud.com/ascend/repos/pypi"
VLLM_VERSION = "0.23.0"
VLLM_ASCEND = f"vllm-ascend=={VLLM_VERSION}"
MEGATRON = "core_v0.12.1"
# MindSpeed master's requirements.txt without numpy<=1.26.0 (see above) and its test tools (pytest, pytest-mock)
MINDSPEED_REQUIREMENTS = ("pybind11", "ninja", "wheel", "six", "regex", "decorator", "attrs", "psutil", "pyyaml",
                          "protobuf", "einops", "scipy", "sentencepiece", "transformers>=4.43.2", "gpytorch", "pandas",
                          "scikit-learn", "SQLAlchemy")
# vLLM 0.23.0's CUDA kernels and libraries (its wheel's requirements), which VLLM_TARGET_DEVICE=empty leaves out
VLLM_CUDA = ("flashinfer-python", "flashinfer-cubin", "apache-tvm-ffi", "tilelang", "nvidia-cudnn-frontend",
             "fastsafetensors", "nvidia-cutlass-dsl", "quack-kernels", "tokenspeed-mla", "humming-kernels")
# what PyPI's x86_64 torch 2.10.0 (the CUDA build) depends on and torch 2.10.0+cpu does not
TORCH_CUDA = ("cuda-bindings", "cuda-pathfinder", "nvidia-cublas-cu12", "nvidia-cuda-cupti-cu12",
              "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12", "nvidia-cudnn-cu12", "nvidia-cufft-cu12",
              "nvidia-cufile-cu12", "nvidia-curand-cu12", "nvidia-cusolver-cu12", "nvidia-cusparse-cu12",
              "nvidia-cusparselt-cu12", "nvidia-nccl-cu12", "nvidia-nvjitlink-cu12", "nvidia-nvshmem-cu12",
              "nvidia-nvtx-cu12", "triton")


@dataclass(frozen=True)
class Step:
    number: int
    what: str
    commands: tuple[str, ...]


def steps(arch: str) -> list[Step]:
    torch_index = f" --index-url {TORCH_CPU_INDEX}" if arch == "x86_64" else ""
    torch = " ".join(f"{t}+cpu" if arch == "x86_64" else t for t in TORCH)
    return [
        Step(1, f"CANN {CANN_VERSION} toolkit and 910B kernels (Huawei), in every shell",
             ("source /usr/local/Ascend/ascend-toolkit/set_env.sh",)),
        Step(2, "torch and torch-npu", (f"pip install {torch}{torch_index}", f"pip install {TORCH_NPU}")),
        Step(3, f"vLLM {VLLM_VERSION}'s Python, built from source without kernels",
             (f"git clone --depth 1 --branch v{VLLM_VERSION} https://github.com/vllm-project/vllm",
              "VLLM_TARGET_DEVICE=empty pip install ./vllm")),
        Step(4, "triton-ascend from Huawei's Ascend index (PyPI lacks the version vllm-ascend pins), then vllm-ascend",
             (f"pip install {TRITON_ASCEND} --extra-index-url {ASCEND_INDEX}",
              f"pip install {VLLM_ASCEND} --extra-index-url {ASCEND_INDEX}")),
        Step(5, f"Megatron-LM {MEGATRON} (megatron-core, the release MindSpeed pairs with)",
             (f"git clone --depth 1 --branch {MEGATRON} https://github.com/NVIDIA/Megatron-LM",
              "pip install ./Megatron-LM")),
        Step(6, "MindSpeed from source, without its numpy<=1.26 pin",
             ("git clone --depth 1 https://github.com/Ascend/MindSpeed", "pip install --no-deps ./MindSpeed",
              "pip install " + " ".join(f"'{r}'" if ">" in r else r for r in MINDSPEED_REQUIREMENTS))),
        Step(7, "aspc", ("pip install -e '.[ascend]'", "aspc doctor")),
    ]


def script(arch: str) -> str:
    lines = [f"# an Ascend 910B node, {arch} (aspc doctor names the first step that is missing)"]
    for step in steps(arch):
        lines.append(f"# {step.number}. {step.what}")
        lines += step.commands
    return "\n".join(lines) + "\n"


def step_hint(number: int, arch: str) -> str:
    """`aspc doctor`'s fix for a missing piece: the step and its commands."""
    step = steps(arch)[number - 1]
    return f"step {number} of docs/ascend.md, \"Install\" ({step.what}): {'; '.join(step.commands)}"


def requirements(arch: str) -> list[str]:
    """Every step's packages, for one resolution against PyPI (triton-ascend excluded: `excludes`)."""
    return [*TORCH, TORCH_NPU, f"vllm=={VLLM_VERSION}", VLLM_ASCEND, "megatron-core==0.12.1",
            *MINDSPEED_REQUIREMENTS, "lark>=1.1", "networkx>=3", "safetensors>=0.4", "transformers>=4.51"]


def excludes(arch: str) -> list[str]:
    """What the resolution against PyPI leaves out: installed from another index, or not at all."""
    return ["triton-ascend", *VLLM_CUDA, *(TORCH_CUDA if arch == "x86_64" else ())]


def overrides(arch: str) -> list[str]:
    """vLLM built from source takes the node's torch, not its wheel's 2.11 (and torch-npu's x86_64
    torch==2.10.0+cpu is torch 2.10.0 from PyTorch's CPU index)."""
    return list(TORCH)


@click.command()
@click.argument("what", type=click.Choice(["script", "requirements", "excludes", "overrides"]))
@click.option("--arch", type=click.Choice(ARCHES), default="aarch64", show_default=True)
def main(what: str, arch: str) -> None:
    """Print the install script of a 910B node, or the resolver check's inputs (requirements, excludes,
    overrides: `uv pip compile --python-platform ARCH-manylinux_2_28 --python-version 3.11`)."""
    if what == "script":
        click.echo(script(arch), nl=False)
    else:
        click.echo("\n".join({"requirements": requirements, "excludes": excludes, "overrides": overrides}[what](arch)))


if __name__ == "__main__":
    main()
