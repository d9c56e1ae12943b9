"""What a newcomer met on a clean clone (issue 36): memory checks of reward models and judges,
capped errors, `tune -o` into another folder, the doctor's megatron-core, Graphviz, comments kept
by the formatter, a hint to combine two rewards, and the staleness in effect under `-p`."""
import re
import subprocess
import tomllib

import pytest

from aspc.cli import doctor, inspect
from aspc.frontend.formatter import format_program
from aspc.frontend.parser import parse
from conftest import PIPELINES, ROOT

JUDGE = "pipelines/rlaif_7b_judge.aspl"
RM = "pipelines/rlhf_32b_rm.aspl"


# ---- 1. reward models and judges are memory-checked as generate is ----
def test_a_32b_judge_on_one_device_is_refused_with_its_numbers(aspc, tmp_path):
    path = tmp_path / "judge.aspl"
    path.write_text((ROOT / JUDGE).read_text().replace("on judges { tp = 4, instances = 4 }",
                                                       "on judges { instances = 8, tp = 1 }"))
    result = aspc("check", str(path))
    assert result.exit_code == 1
    assert re.search(r"judge\.aspl:30:7: error: judge of 'grader' \(qwen2\.5-32b, 32\.8B parameters\) "
                     r"with tp=1 pp=1 ep=1 needs [\d.]+ GB per device \(65\.5 GB bf16 weights \+ [\d.]+ GB KV cache "
                     r"for one sequence\), but a 910b3 has 61\.8 GB usable", result.stderr), result.stderr
    assert "hint: shard it further, e.g. tp = 2" in result.stderr and "Traceback" not in result.output


def test_a_32b_judge_is_refused_by_simulate_too(aspc):
    result = aspc("simulate", JUDGE, "--set", "score.tp=1", "--set", "score.instances=8", "--steps", "1")
    assert result.exit_code == 1 and "error: judge of 'grader'" in result.stderr


def test_a_32b_reward_model_on_one_device_is_refused_without_kv_cache(aspc, tmp_path):
    text = (ROOT / RM).read_text().replace("model rm = qwen2.5-7b", "model rm = qwen2.5-32b")
    text = text.replace("on rm_pool { tp = 4, instances = 2 }", "on rm_pool { tp = 1, instances = 8 }")
    path = tmp_path / "rm32.aspl"
    path.write_text(text)
    result = aspc("check", str(path))
    assert result.exit_code == 1
    line = next(i for i, l in enumerate(text.splitlines(), 1) if l.startswith("stage score"))
    assert (f"rm32.aspl:{line}:7: error: reward model of 'rm' (qwen2.5-32b, 32.8B parameters) with tp=1 pp=1 "
            "ep=1 needs 65.5 GB per device (65.5 GB bf16 weights), but a 910b3 has 61.8 GB usable") in result.stderr
    assert "KV cache" not in result.stderr  # a reward model runs forward only


def test_a_judges_tp_must_divide_the_heads(aspc):
    result = aspc("check", JUDGE, "--set", "score.tp=3")
    assert result.exit_code == 1 and "stage 'score': tp = 3 does not divide the 40 attention heads" in result.stderr


def test_every_bundled_pipeline_still_checks(aspc):
    result = aspc("check", *[str(p.relative_to(ROOT)) for p in PIPELINES])
    assert result.exit_code == 0, result.stderr


# ---- 2. errors of one kind are capped like warnings ----
def test_check_of_thousands_of_one_error_prints_ten_and_the_count(aspc, tmp_path):
    head = (ROOT / "pipelines" / "tiny_grpo.aspl").read_text()
    path = tmp_path / "typos.aspl"
    path.write_text(head + "".join(f"stage gen{i} = generate(actr, prompts)\n" for i in range(1500)))
    result = aspc("check", str(path))
    assert result.exit_code == 1
    assert result.stderr.count("error: unknown name 'actr'") == 10
    assert "... and 1490 more errors of this kind (the first 10 of each kind are shown)" in result.stderr
    assert result.stderr.rstrip().endswith("1500 errors generated.")
    assert len(result.stderr) < 8000


# ---- 3. tune -o another/dir keeps the program's files ----
def _with_files(tmp_path):
    """grpo_7b in src/, with its data file, a checkpoint for the actor and a python reward beside it."""
    src = tmp_path / "src"
    (src / "data").mkdir(parents=True)
    (src / "data" / "math.jsonl").write_text((ROOT / "pipelines" / "data" / "math.jsonl").read_text())
    (src / "tiny_rewards.py").write_text((ROOT / "pipelines" / "tiny_rewards.py").read_text())
    text = (ROOT / "pipelines" / "grpo_7b.aspl").read_text()
    text = text.replace("model actor = qwen2.5-7b { dtype = bf16 }",
                        'model actor = qwen2.5-7b { dtype = bf16, checkpoint = "ck/actor.safetensors" }')
    text = text.replace('reward(gen, rule = "math_verify")', 'reward(gen, python = "tiny_rewards:well_formed")')
    path = src / "p.aspl"
    path.write_text(text)
    return path


def test_tune_into_another_folder_rewrites_relative_paths(aspc, tmp_path):
    path = _with_files(tmp_path)
    out = tmp_path / "elsewhere" / "deep" / "x.aspl"
    out.parent.mkdir(parents=True)
    (out.parent / "tiny_rewards.py").write_text((path.parent / "tiny_rewards.py").read_text())
    result = aspc("tune", str(path), "-o", str(out), "--confirm", "0")
    assert result.exit_code == 0, result.output
    written = out.read_text()
    assert 'jsonl("../../src/data/math.jsonl")' in written
    assert 'checkpoint = "../../src/ck/actor.safetensors"' in written
    assert "2 relative paths rewritten" in result.stderr
    check = aspc("check", str(out))
    assert check.exit_code == 0 and "does not exist" not in check.stderr, check.output


def test_tune_beside_the_source_leaves_paths_alone(aspc, tmp_path):
    path = _with_files(tmp_path)
    out = path.parent / "x.aspl"
    assert aspc("tune", str(path), "-o", str(out), "--confirm", "0").exit_code == 0
    assert 'jsonl("data/math.jsonl")' in out.read_text()


def test_tune_refuses_to_leave_a_python_module_behind(aspc, tmp_path):
    path = _with_files(tmp_path)
    out = tmp_path / "x.aspl"
    result = aspc("tune", str(path), "-o", str(out), "--confirm", "0")
    assert result.exit_code == 1 and not out.exists()
    assert re.search(r"p\.aspl:\d+:\d+: error: Python module 'tiny_rewards' is looked up beside the \.aspl file",
                     result.stderr), result.stderr
    assert f"hint: copy {path.parent / 'tiny_rewards.py'} to" in result.stderr and "Traceback" not in result.output
    (tmp_path / "tiny_rewards.py").write_text((path.parent / "tiny_rewards.py").read_text())
    assert aspc("tune", str(path), "-o", str(out), "--confirm", "0").exit_code == 0


# ---- 4. the doctor's megatron-core agrees with the test extra ----
def _test_extra_megatron() -> str:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return next(r.split("==")[1] for r in extras["test"] if r.startswith("megatron-core=="))


@pytest.mark.parametrize("installed", ["0.12.1", _test_extra_megatron()])
def test_doctor_accepts_the_megatron_core_versions_aspc_is_checked_against(monkeypatch, installed):
    monkeypatch.setattr(doctor, "_version", {"megatron-core": installed}.get)
    check = next(c for c in doctor.check_stack({}, run=None) if c.name == "megatron-core")
    assert check.ok and check.found == installed


def test_doctor_names_the_megatron_core_versions_it_wants(monkeypatch):
    monkeypatch.setattr(doctor, "_version", {"megatron-core": "0.13.0"}.get)
    check = next(c for c in doctor.check_stack({}, run=None) if c.name == "megatron-core")
    assert not check.ok and check.found == "0.13.0 installed, 0.12.x or 0.16.x wanted"
    assert "core_v0.12.1" in check.fix and "megatron-core==0.16.1" in check.fix
    assert not doctor._in_series("0.120.0", "0.12") and doctor._in_series("0.23.0+empty", "0.23.0")


# ---- 5. Graphviz ----
def test_readme_says_where_dot_comes_from():
    line = next(l for l in (ROOT / "README.md").read_text().splitlines() if "--emit dot | dot" in l)
    assert "graphviz" in line.lower() and "apt-get install graphviz" in line


def test_inspect_says_when_dot_cannot_run(aspc, tmp_path, monkeypatch):
    monkeypatch.setattr(inspect.shutil, "which", lambda name: "/usr/bin/dot")

    def broken(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(inspect.subprocess, "run", broken)
    result = aspc("inspect", "pipelines/tiny_grpo.aspl", "-o", str(tmp_path))
    assert result.exit_code == 0 and "Traceback" not in result.output
    assert "Graphviz's `dot` failed" in result.stderr and "cannot be started" in result.stderr
    assert (tmp_path / "tiny_grpo.asp.dot").exists()


def test_inspect_says_when_dot_hangs(aspc, tmp_path, monkeypatch):
    monkeypatch.setattr(inspect.shutil, "which", lambda name: "/usr/bin/dot")

    def hangs(*args, **kwargs):
        raise subprocess.TimeoutExpired("dot", 60)

    monkeypatch.setattr(inspect.subprocess, "run", hangs)
    result = aspc("inspect", "pipelines/tiny_grpo.aspl", "-o", str(tmp_path))
    assert result.exit_code == 0 and "more than 60 s" in result.stderr


# ---- 6. the formatter keeps comments ----
def _comments(text: str) -> list[str]:
    """The comments of a bundled pipeline: none of them has a '#' inside a string."""
    return [line[line.index("#"):].rstrip() for line in text.splitlines() if "#" in line]


@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.stem)
def test_format_keeps_every_comment_of_a_bundled_pipeline(pipeline):
    source = pipeline.read_text()
    text = format_program(parse(source, str(pipeline)))
    assert _comments(source) and _comments(text) == _comments(source)
    assert parse(text) == parse(source)
    assert format_program(parse(text)) == text


def test_emit_ast_keeps_comments(aspc):
    out = aspc("compile", "pipelines/tiny_grpo.aspl", "--emit", "ast").stdout
    assert out.startswith("# GRPO on a tiny Qwen-style model")


SOURCE = '''# header
pipeline p  # the name
pool cpu = cpu x 1
data d = synthetic("arith") {
  # inside the block
  group = 2, max_prompt = 16  # first
  max_response = 8  # second
}
model m = custom { layers = 1, hidden = 8, heads = 1, vocab = 32, checkpoint = "a#b" }  # not "a
# before the stage
stage s = reward(g, rule = "exact_match")
# at the end
'''


def test_comments_stay_at_their_declarations():
    text = format_program(parse(SOURCE))
    assert text.splitlines() == [
        "# header",
        "pipeline p  # the name",
        "pool cpu = cpu x 1",
        "# inside the block",
        "# first",
        "# second",
        'data d = synthetic("arith") { group = 2, max_prompt = 16, max_response = 8 }',
        'model m = custom { layers = 1, hidden = 8, heads = 1, vocab = 32, checkpoint = "a#b" }  # not "a',
        "# before the stage",
        'stage s = reward(g) { rule = "exact_match" }',
        "# at the end",
    ]
    assert parse(text) == parse(SOURCE) and format_program(parse(text)) == text


# ---- 7. two reward stages into one advantage: combine them with sources ----
def test_two_rewards_into_one_advantage_get_a_sources_hint(aspc, tmp_path):
    text = (ROOT / "pipelines" / "tiny_grpo.aspl").read_text().replace(
        "stage adv    = advantage(score)",
        'stage fmt    = reward(gen, python = "tiny_rewards:well_formed")\nstage adv    = advantage(score, fmt)')
    path = tmp_path / "two.aspl"
    path.write_text(text)
    (tmp_path / "tiny_rewards.py").write_text((ROOT / "pipelines" / "tiny_rewards.py").read_text())
    result = aspc("check", str(path))
    assert result.exit_code == 1
    assert "error: stage 'adv' gets rewards from both 'fmt' and 'score'" in result.stderr
    hint = ('hint: combine them in one reward stage, a weighted sum of their sources: `stage score = reward(gen, '
            'sources = [rule("exact_match", weight = 1.0), python("tiny_rewards:well_formed", weight = 1.0)])`, '
            "and pass only 'score' to 'adv'")
    assert hint in result.stderr
    combined = text.replace('stage score  = reward(gen, rule = "exact_match")', hint.split("`")[1]).replace(
        'stage fmt    = reward(gen, python = "tiny_rewards:well_formed")\n', "").replace(
        "advantage(score, fmt)", "advantage(score)")
    path.write_text(combined)
    assert aspc("check", str(path)).exit_code == 0  # the hint's stage is a valid one


# ---- 8. the header of `-p` shows the staleness in effect ----
def test_the_ir_header_shows_the_staleness_the_passes_put_in_effect(aspc):
    out = aspc("compile", "pipelines/grpo_7b.aspl", "-p", "async-decouple{staleness=2},pack,place").stdout
    header = out.splitlines()[1]
    assert header.startswith("schedule asp {") and "staleness=2" in header
    assert "capacity=" in out and "staleness=2" in next(l for l in out.splitlines() if ".channel" in l)
