"""The torchair options in launch plans are valid for torchair's real configuration classes.

torchair ships inside the torch-npu wheel; its config modules are plain Python, so they are read
straight from the wheel, without installing torch-npu (which would break `import torch` here).
.ci/run downloads the wheel and sets ASPC_TORCH_NPU_WHEEL; locally the test downloads it."""
import importlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from aspc.backends.ascend.compiler_options import apply_compiler_options
from aspc.backends.ascend.lowering import lower
from aspc.cli.toolchain import compile_with_passes
from conftest import ROOT

TORCH_NPU = "torch-npu==2.10.0"
MODULES = ("configs/", "_utils/error_code.py", "core/utils.py")
PREFIX = "torch_npu/dynamo/torchair/"


def _wheel(cache: Path) -> Path:
    given = os.environ.get("ASPC_TORCH_NPU_WHEEL")
    if given:
        return Path(given)
    found = sorted(cache.glob("torch_npu-*.whl"))
    if not found:
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                 "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64", "-d",
                                 str(cache), TORCH_NPU], capture_output=True, text=True)
        found = sorted(cache.glob("torch_npu-*.whl"))
        if not found:
            pytest.skip(f"cannot download {TORCH_NPU}: {result.stderr.strip()[-200:]}")
    return found[0]


@pytest.fixture(scope="module")
def torchair_configs(tmp_path_factory):
    """torchair.configs.compiler_config, imported from the wheel's plain-Python modules."""
    wheel = _wheel(tmp_path_factory.mktemp("wheel"))
    root = tmp_path_factory.mktemp("torchair")
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            inner = name[len(PREFIX):] if name.startswith(PREFIX) else None
            if inner and inner.endswith(".py") and inner.startswith(MODULES):
                target = root / "torchair" / inner
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.read(name))
    for package in ("torchair", "torchair/configs", "torchair/_utils", "torchair/core"):
        (root / package / "__init__.py").touch()
    sys.path.insert(0, str(root))
    try:
        yield importlib.import_module("torchair.configs.compiler_config")
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m == "torchair" or m.startswith("torchair.")]:
            del sys.modules[name]


# dapo_32b has no reference stage (DAPO drops the KL term), so nothing of it is compiled by torchair
@pytest.mark.parametrize("name", ["grpo_7b", "grpo_30b_moe", "r1_zero_671b", "grpo_7b_colocated"])
def test_lowered_torchair_options_are_accepted(torchair_configs, name):
    plan = lower(compile_with_passes(ROOT / "pipelines" / f"{name}.aspl").plan())
    compilers = [s.compiler for s in plan.stages if s.compiler]
    assert compilers, "these workloads have a forward-only reference stage"
    for compiler in compilers:
        config = apply_compiler_options(torchair_configs.CompilerConfig(), compiler)
        assert config.mode.value == compiler["mode"]
        assert config.experimental_config.frozen_parameter.value in (True, "1")  # torchair stores "1"


def test_a_renamed_option_would_fail(torchair_configs):
    config = torchair_configs.CompilerConfig()
    with pytest.raises(Exception):  # noqa: B017 - torchair's own error types vary by version
        apply_compiler_options(config, {"experimental_config": {"frozen_parameters": True}})
    with pytest.raises(Exception):  # noqa: B017 - torchair's own error types vary by version
        apply_compiler_options(config, {"mode": "max-autotuned"})
