"""`aspc doctor`: is this an Ascend NPU node that can run aspc's launch plans? Checks the CANN
toolkit, HCCL, torch-npu (imported in a child process: on a machine without CANN importing it breaks
`import torch` in the importing process), the NPUs it sees, and the vLLM / vllm-ascend / megatron /
MindSpeed versions (read from the installed distributions' metadata, never imported here). Each
missing piece names the step of the install recipe that provides it, with its commands for this
machine's architecture (npu_install.py, docs/ascend.md "Install")."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata, util
from pathlib import Path

import click

from aspc.cli.npu_install import CANN_VERSION, TRITON_ASCEND, VLLM_VERSION, step_hint

# The versions that go together: vllm-ascend 0.23.0's own pins (npu_install.py)
TRITON_ASCEND_VERSION = TRITON_ASCEND.split("==")[1]
# The megatron-core series the lowering's configs and layer specs are checked against
# (tests/test_ascend_conformance.py): 0.12 is MindSpeed's (core_v0.12.1), 0.16 the test extra's pin
# (pyproject.toml), so either is accepted and neither is reported missing.
MEGATRON_SERIES = ("0.12", "0.16")
CANN_HOMES = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
CANN_DEFAULT = Path("/usr/local/Ascend/ascend-toolkit/latest")
PROBE = ("import json, torch, torch_npu; "
         "print(json.dumps({'torch_npu': torch_npu.__version__, 'devices': torch.npu.device_count()}))")


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    found: str  # what is there (a version, a path), or what is missing
    fix: str = ""  # how to fix it, when not ok


def cann_home(environ) -> Path | None:
    for name in CANN_HOMES:
        if environ.get(name) and Path(environ[name]).is_dir():
            return Path(environ[name])
    return CANN_DEFAULT if CANN_DEFAULT.is_dir() else None


def step(number: int) -> str:
    """The recipe's step `number` for this machine's architecture."""
    arch = platform.machine()
    return step_hint(number, arch if arch in ("aarch64", "x86_64") else "aarch64")


def check_cann(environ) -> Check:
    home = cann_home(environ)
    if home is None:
        return Check("CANN toolkit", False, "not found (no $ASCEND_HOME_PATH, no /usr/local/Ascend/ascend-toolkit)",
                     f"install the CANN {CANN_VERSION} toolkit and the 910B kernels; {step(1)}")
    return Check("CANN toolkit", True, f"{home} {_cann_version(home)}".strip())


def _cann_version(home: Path) -> str:
    for name in ("version.cfg", "compiler/version.info", "version.info"):
        path = home / name
        if path.is_file():
            lines = [line for line in path.read_text(errors="replace").splitlines() if "version" in line.lower()]
            return lines[0].strip() if lines else ""
    return ""


def check_hccl(environ) -> Check:
    home = cann_home(environ)
    libraries = [home / "lib64" / "libhccl.so"] if home else []
    libraries += [Path(p) / "libhccl.so" for p in environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    found = next((lib for lib in libraries if lib.is_file()), None)
    if found is None:
        return Check("HCCL", False, "libhccl.so not found (CANN lib64, $LD_LIBRARY_PATH)",
                     "it ships with the CANN toolkit: install it and source its set_env.sh")
    return Check("HCCL", True, str(found))


def check_torch_npu(run: Callable = subprocess.run) -> list[Check]:
    """torch-npu's version and the NPUs it sees, from a child process."""
    installed = _version("torch-npu")
    fix = f"on a node with CANN only (`import torch` fails without it): {step(2)}"
    if installed is None:
        return [Check("torch-npu", False, "not installed", fix), _no_devices("torch-npu is not installed")]
    result = run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        error = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return [Check("torch-npu", False, f"{installed} installed, import fails: {error}",
                      f"source CANN's set_env.sh before Python starts, and match torch with torch-npu: {step(2)}"),
                _no_devices("torch-npu does not import")]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    devices = found["devices"]
    return [Check("torch-npu", True, found["torch_npu"]),
            Check("NPU devices", devices > 0, f"{devices} visible",
                  "" if devices else "check `npu-smi info` and ASCEND_RT_VISIBLE_DEVICES")]


def _no_devices(why: str) -> Check:
    return Check("NPU devices", False, f"unknown: {why}", "fix torch-npu first; then `npu-smi info` lists the NPUs")


def check_distribution(name: str, wanted: str | tuple[str, ...] | None, fix: str) -> Check:
    """`wanted`: the version prefix (or prefixes, any of which will do) the installed version needs."""
    installed = _version(name)
    if installed is None:
        return Check(name, False, "not installed", fix)
    prefixes = (wanted,) if isinstance(wanted, str) else wanted or ()
    if prefixes and not any(_in_series(installed, p) for p in prefixes):
        return Check(name, False, f"{installed} installed, {_wanted_text(prefixes)} wanted", fix)
    return Check(name, True, installed)


def _in_series(version: str, prefix: str) -> bool:
    """0.12.1 is in the series 0.12, 0.120.0 is not; 0.23.0+empty (a source build) is 0.23.0."""
    rest = version.removeprefix(prefix)
    return rest != version and not rest[:1].isdigit()


def _wanted_text(prefixes: tuple[str, ...]) -> str:
    """0.12.x or 0.16.x for series, a full version as itself."""
    return " or ".join(p if p.count(".") >= 2 else f"{p}.x" for p in prefixes)


def check_mindspeed() -> Check:
    if util.find_spec("mindspeed") is None:  # finds the package without importing it
        return Check("MindSpeed", False, "not installed", f"its PyPI name is a placeholder: {step(6)}")
    return Check("MindSpeed", True, _version("mindspeed") or "installed")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_stack(environ=None, run: Callable = subprocess.run) -> list[Check]:
    environ = os.environ if environ is None else environ
    return [check_cann(environ), check_hccl(environ), *check_torch_npu(run),
            check_distribution("vllm", VLLM_VERSION, f"the PyPI wheel pins another torch: {step(3)}"),
            check_distribution("triton-ascend", TRITON_ASCEND_VERSION, f"vllm-ascend pins it: {step(4)}"),
            check_distribution("vllm-ascend", VLLM_VERSION, step(4)),
            check_distribution("megatron-core", MEGATRON_SERIES, f"{step(5)} (or megatron-core==0.16.1, the test "
                                                                 "extra's)"),
            check_mindspeed()]


def report(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{'ok     ' if c.ok else 'MISSING'} {c.name:<{width}}  {c.found}")
        if not c.ok:
            lines.append(f"        {'':<{width}}  fix: {c.fix}")
    missing = [c.name for c in checks if not c.ok]
    lines.append("this node can run aspc's Ascend launch plans" if not missing else
                 f"{len(missing)} missing: {', '.join(missing)} (install recipe: docs/ascend.md, \"Install\", "
                 "or `python -m aspc.cli.npu_install script`)")
    return "\n".join(lines)


ALTERNATIVES = ("run `aspc run FILE --backend ascend --dry-run` to print the per-process commands for an NPU "
                "cluster, `aspc run FILE --backend cpu` to train a tiny pipeline here, or `aspc simulate FILE` "
                "to predict the cluster's throughput")


def missing_stack_message() -> str | None:
    """None when this node has the whole stack; else the report, with what to do meanwhile."""
    checks = check_stack()
    if all(c.ok for c in checks):
        return None
    return f"this node cannot run the Ascend backend (torch-npu, CANN, vllm-ascend ...):\n{report(checks)}\n" \
           f"Meanwhile: {ALTERNATIVES}"


@click.command("doctor")
def doctor_command() -> None:
    """Check this node's Ascend stack (CANN, HCCL, torch-npu, NPUs, vLLM, vllm-ascend, megatron,
    MindSpeed): what is missing and how to fix it. Exit 0 when all is there, 1 otherwise."""
    checks = check_stack()
    click.echo(report(checks))
    if not all(c.ok for c in checks):
        sys.exit(1)
