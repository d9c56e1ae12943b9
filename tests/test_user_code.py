"""Python modules a pipeline names are found beside its .aspl file: at check time and at run time."""
import pickle
import subprocess
import sys

import pytest

from aspc.rl.rewards import RewardError, build_reward, load_callable
from aspc.frontend.compiler import compile_file
from aspc.frontend.diagnostics import AsplError
from conftest import ROOT

SCORE = "def score(prompt, response, answer, metadata):\n    return float(response.strip() == answer)\n"


def _pipeline(folder, reward='python = "beside_reward:score"'):
    """tiny_grpo with its reward replaced, written into `folder`."""
    source = (ROOT / "pipelines" / "tiny_grpo.aspl").read_text()
    path = folder / "p.aspl"
    path.write_text(source.replace('rule = "exact_match"', reward))
    return path


def test_a_module_beside_the_aspl_is_found_without_pythonpath(aspc, tmp_path):
    (tmp_path / "beside_reward.py").write_text(SCORE)
    result = aspc("check", str(_pipeline(tmp_path)))  # run from the repository root, not tmp_path
    assert result.exit_code == 0, result.output
    assert str(tmp_path) not in sys.path


def test_a_missing_module_is_a_located_error(aspc, tmp_path):
    path = _pipeline(tmp_path)
    result = aspc("check", str(path))
    assert result.exit_code == 1 and "Traceback" not in result.output
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if "beside_reward" in text)
    column = path.read_text().splitlines()[line - 1].index('"beside_reward') + 1
    assert (f"{path}:{line}:{column}: error: reward function \"beside_reward:score\": "
            "cannot find Python module 'beside_reward'") in result.stderr
    assert f"hint: create {tmp_path}/beside_reward.py beside the .aspl file" in result.stderr


def test_a_missing_function_is_a_located_error_with_a_suggestion(aspc, tmp_path):
    (tmp_path / "beside_reward.py").write_text(SCORE.replace("def score", "def scores"))
    result = aspc("check", str(_pipeline(tmp_path)))
    assert result.exit_code == 1
    assert "has no function 'score'" in result.stderr and "did you mean 'scores'?" in result.stderr


def test_a_module_that_fails_to_import_is_a_located_error(aspc, tmp_path):
    (tmp_path / "beside_broken.py").write_text("import no_such_dependency_xyz\n")
    result = aspc("check", str(_pipeline(tmp_path, 'python = "beside_broken:score"')))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert ("importing 'beside_broken' failed: ModuleNotFoundError: No module named "
            "'no_such_dependency_xyz'") in result.stderr


AGENT = """pipeline agent
pool cpu = cpu x 2
model actor = custom { layers = 1, hidden = 32, heads = 2 }
data prompts = synthetic("arith") { group = 2 }
stage gen = generate(actor, prompts)
stage env = environment(gen) { tools = [tool("calc", python = "beside_tools:calc")] }
stage score = reward(env, rule = "exact_match")
stage adv = advantage(score)
stage update = train(actor, env, adv)
"""


def test_a_tool_module_is_checked_too(tmp_path):
    path = tmp_path / "p.aspl"
    path.write_text(AGENT)
    with pytest.raises(AsplError) as info:
        compile_file(path)
    [error] = info.value.diagnostics
    assert error.message == ("tool 'calc' function \"beside_tools:calc\": "
                             "cannot find Python module 'beside_tools'")
    assert (error.span.line, error.span.column) == (6, AGENT.splitlines()[5].index('"beside_tools') + 1)
    (tmp_path / "beside_tools.py").write_text("def calc(text):\n    return str(eval(text))\n")
    assert compile_file(path).graph.stage("env").option("tools")[0].get("python") == "beside_tools:calc"


def test_each_pipeline_gets_the_module_beside_it(tmp_path):
    for name, function in (("a", "score"), ("b", "other")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "same_name_reward.py").write_text(SCORE.replace("score", function))
        _pipeline(tmp_path / name, f'python = "same_name_reward:{function}"')
    compile_file(tmp_path / "a" / "p.aspl")
    compile_file(tmp_path / "b" / "p.aspl")  # not the module of a/, which has no `other`


def test_the_runtime_loads_the_module_beside_the_aspl_and_ray_workers_can_too(tmp_path):
    (tmp_path / "beside_runtime.py").write_text(SCORE)
    function = load_callable("beside_runtime:score", tmp_path)
    assert function("p", " 7 ", "7", {}) == 1.0
    with pytest.raises(RewardError, match="cannot load reward 'beside_missing:score'"):
        build_reward([_python_source("beside_missing:score")], tmp_path)
    elsewhere = subprocess.run(  # a fresh process elsewhere, as a Ray worker unpickles it
        [sys.executable, "-c", "import pickle, sys; f = pickle.loads(sys.stdin.buffer.read()); "
                               "print(f('p', '3', '3', {}))"],
        input=pickle.dumps(function), capture_output=True, cwd="/", check=True)
    assert elsewhere.stdout.decode().strip() == "1.0"


def _python_source(spec):
    from aspc.ir.values import Call

    return Call("python", (("function", spec), ("weight", 1.0)))


def test_a_run_uses_the_module_beside_the_aspl(aspc, tmp_path):
    (tmp_path / "beside_run_reward.py").write_text(SCORE)
    path = _pipeline(tmp_path, 'python = "beside_run_reward:score"')
    metrics = tmp_path / "m.jsonl"
    result = aspc("run", str(path), "--steps", "1", "--warmstart", "0", "--metrics", str(metrics))
    assert result.exit_code == 0, result.output
    assert metrics.read_text().strip()
