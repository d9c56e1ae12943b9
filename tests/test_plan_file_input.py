"""A compiled plan is an input: `aspc compile --emit plan -o X.plan.json`, then `aspc simulate` or
`aspc run` of that file (what a remote or multi-node driver is given) does what the .aspl does."""
import json
import shutil

from conftest import ROOT


def _write_plan(aspc, tmp_path, name: str):
    for item in (ROOT / "pipelines").iterdir():  # the data and Python files the plan names lie beside it
        if item.is_dir():
            shutil.copytree(item, tmp_path / item.name)
    path = tmp_path / f"{name}.plan.json"
    result = aspc("compile", f"pipelines/{name}.aspl", "--emit", "plan", "-o", str(path))
    assert result.exit_code == 0, result.output
    return path


def test_simulating_a_plan_file_predicts_what_the_source_does(aspc, tmp_path):
    path = _write_plan(aspc, tmp_path, "grpo_7b")
    from_plan = aspc("simulate", str(path), "--steps", "2")
    from_source = aspc("simulate", "pipelines/grpo_7b.aspl", "--steps", "2")
    assert from_plan.exit_code == 0, from_plan.output
    assert from_plan.output == from_source.output


def test_running_a_plan_file_trains(aspc, tmp_path):
    path = _write_plan(aspc, tmp_path, "tiny_grpo")
    metrics = tmp_path / "m.jsonl"
    result = aspc("run", str(path), "--steps", "2", "--warmstart", "2", "--metrics", str(metrics))
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def test_a_plan_file_refuses_compile_options_and_bad_files(aspc, tmp_path):
    path = _write_plan(aspc, tmp_path, "grpo_7b")
    result = aspc("simulate", str(path), "--set", "prompts.group=4")
    assert result.exit_code == 2 and "--set apply when compiling" in result.output
    result = aspc("simulate", str(path), "--compare")
    assert result.exit_code == 2 and "compiled already" in result.output
    bad = tmp_path / "bad.plan.json"
    bad.write_text('{"format": "something else"}')
    result = aspc("simulate", str(bad))
    assert result.exit_code == 1 and "not an execution plan" in result.output and "Traceback" not in result.output
