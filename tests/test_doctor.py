"""`aspc doctor` and the early refusal of `aspc run --backend ascend` on a node without the NPU stack."""
import json
import subprocess

from aspc.cli import doctor


def test_doctor_reports_every_missing_piece_with_a_fix(aspc):
    result = aspc("doctor")
    assert result.exit_code == 1
    for name in ("CANN toolkit", "HCCL", "torch-npu", "NPU devices", "vllm", "triton-ascend", "vllm-ascend",
                 "MindSpeed"):
        line = next(line for line in result.output.splitlines() if line.startswith(("ok", "MISSING"))
                    and line[8:].startswith(f"{name} "))
        assert line.startswith("MISSING"), line
    assert result.output.count("fix:") >= 8 and "VLLM_TARGET_DEVICE=empty" in result.output
    # each names its step of the recipe (aspc/cli/npu_install.py) with the commands
    assert "step 4 of docs/ascend.md" in result.output and "--extra-index-url https://mirrors.huaweicloud.com" \
        in result.output and "step 6 of docs/ascend.md" in result.output


def test_doctor_passes_a_node_with_the_whole_stack(monkeypatch, tmp_path):
    (tmp_path / "lib64").mkdir()
    (tmp_path / "lib64" / "libhccl.so").touch()
    (tmp_path / "version.cfg").write_text("runtime_running_version=[9.1.0]\n")
    versions = {"torch-npu": "2.10.0.post4", "vllm": "0.23.0", "vllm-ascend": "0.23.0", "megatron-core": "0.12.1",
                "mindspeed": "0.12.1", "triton-ascend": "3.2.2"}
    monkeypatch.setattr(doctor, "_version", versions.get)
    monkeypatch.setattr(doctor.util, "find_spec", lambda name: object())

    def probe(*args, **kwargs):
        return subprocess.CompletedProcess(args, 0, json.dumps({"torch_npu": "2.10.0.post4", "devices": 8}), "")

    checks = doctor.check_stack({"ASCEND_HOME_PATH": str(tmp_path)}, run=probe)
    assert all(c.ok for c in checks), doctor.report(checks)
    assert "8 visible" in doctor.report(checks) and "9.1.0" in doctor.report(checks)


def test_a_wrong_vllm_version_is_named():
    check = doctor.check_distribution("click", "0.0.1", "pin it")
    assert not check.ok and "0.0.1 wanted" in check.found and check.fix == "pin it"


def test_run_on_ascend_refuses_before_compiling(aspc, tmp_path):
    """No NPU stack: the doctor's report and the alternatives, even for a file that would not compile."""
    (tmp_path / "broken.aspl").write_text("pipeline broken\nstage x = nonsense(\n")
    result = aspc("run", str(tmp_path / "broken.aspl"), "--backend", "ascend")
    assert result.exit_code == 1
    assert "MISSING CANN toolkit" in result.output and "--dry-run" in result.output
    assert "Traceback" not in result.output


def test_the_install_recipe_in_the_docs_is_the_one_the_doctor_points_at():
    """docs/ascend.md prints npu_install's script (aarch64) and step 2 for x86_64, which the resolver
    check in .ci/run resolves; the doctor's fixes quote the same steps."""
    from aspc.cli.npu_install import excludes, requirements, script, steps
    from conftest import ROOT

    docs = (ROOT / "docs" / "ascend.md").read_text()
    assert script("aarch64") in docs and "\n".join(steps("x86_64")[1].commands) in docs
    assert "torch==2.10.0+cpu" in script("x86_64") and "+cpu" not in script("aarch64")
    assert "triton-ascend" in excludes("aarch64") and "nvidia-nccl-cu12" in excludes("x86_64")
    assert not any(r.startswith("numpy") for r in requirements("aarch64"))  # MindSpeed's pin is dropped
