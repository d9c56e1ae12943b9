"""The command line: help, version, emitters, output files, overrides."""
import json
import shlex

from aspc import __version__


def test_help_lists_commands(aspc):
    result = aspc("--help")
    assert result.exit_code == 0
    for command in ("check", "compile"):
        assert command in result.stdout


def test_version(aspc):
    assert __version__ in aspc("--version").stdout


def test_compile_writes_output_file(aspc, tmp_path):
    out = tmp_path / "plan.json"
    result = aspc("compile", "pipelines/tiny_grpo.aspl", "--emit", "json", "-o", str(out))
    assert result.exit_code == 0 and result.stdout == ""
    assert json.loads(out.read_text())["pipeline"] == "tiny_grpo"


def test_emit_ast_prints_canonical_source(aspc):
    out = aspc("compile", "pipelines/tiny_grpo.aspl", "--emit", "ast").stdout
    assert out.startswith("# GRPO on a tiny Qwen-style model that learns arithmetic on a CPU in minutes.\n"
                          "pipeline tiny_grpo\n")  # comments are kept
    assert "stage gen = generate(actor, prompts) on cpu" in out


def test_set_overrides_reach_the_ir(aspc):
    out = aspc("compile", "pipelines/tiny_grpo.aspl", "--set", "gen.temperature=0.3").stdout
    assert "temperature=0.3" in out


def test_bad_emit_is_a_usage_error(aspc):
    result = aspc("compile", "pipelines/tiny_grpo.aspl", "--emit", "plan9")
    assert result.exit_code == 2
    assert "Invalid value for '--emit'" in result.output


def test_unwritable_output_is_a_clear_error(aspc, tmp_path):
    result = aspc("compile", "pipelines/tiny_grpo.aspl", "-o", str(tmp_path / "no" / "dir" / "x"))
    assert result.exit_code == 1
    assert "cannot write" in result.output


def test_language_doc_has_every_option_table():
    from aspc.frontend.docgen import all_tables
    from conftest import ROOT

    doc = (ROOT / "docs" / "language.md").read_text()
    for table in all_tables():
        assert table in doc, "docs/language.md is out of date: regenerate with python -m aspc.frontend.docgen"


def _readme_commands_with_set():
    from conftest import ROOT

    lines = (ROOT / "README.md").read_text().splitlines()
    return [shlex.split(line.split("  #")[0])[1:] for line in lines
            if line.startswith("aspc ") and "--set" in line]


def test_readmes_set_examples_work(aspc):
    commands = _readme_commands_with_set()
    assert commands, "the README shows --set"
    for args in commands:
        result = aspc(*args)
        assert result.exit_code == 0, result.output
