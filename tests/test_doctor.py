"""`aspc doctor` and the early refusal of `aspc run --backend ascend` on a node without the NPU stack."""
import json
import subprocess

from aspc.cli import doctor


def test_doctor_reports_every_missing_piece_with_a_fix(aspc):
    result = aspc("doctor")
    assert result.exit_code == 1
    for name in ("CANN toolkit", "HCCL", "torch-npu", "NPU devices", "vllm", "vllm-ascend", "MindSpeed"):
        line = next(line for line in result.output.splitlines() if f" {name} " in line)
        assert line.startswith("MISSING"), line
    assert result.output.count("fix:") >= 7 and "VLLM_TARGET_DEVICE=empty" in result.output


def test_doctor_passes_a_node_with_the_whole_stack(monkeypatch, tmp_path):
    (tmp_path / "lib64").mkdir()
    (tmp_path / "lib64" / "libhccl.so").touch()
    (tmp_path / "version.cfg").write_text("runtime_running_version=[9.1.0]\n")
    versions = {"torch-npu": "2.10.0.post4", "vllm": "0.23.0", "vllm-ascend": "0.23.0", "megatron-core": "0.12.1",
                "mindspeed": "0.12.1"}
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
