"""One file per error kind: the exact text `aspc check` prints, and exit status 1."""
import pytest

from conftest import ROOT, check_golden

CASES = sorted((ROOT / "tests" / "diagnostics").glob("*.aspl"))


def _extra_args(case):
    args_file = case.with_suffix(".args")
    return args_file.read_text().split("\n") if args_file.exists() else []


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.stem)
def test_diagnostic_matches_golden(aspc, case):
    args = [a for a in _extra_args(case) if a]
    result = aspc("check", *args, f"tests/diagnostics/{case.name}")
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    check_golden(case.with_suffix(".expected"), result.stderr)


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.stem)
def test_every_error_has_location_source_line_and_caret(aspc, case):
    args = [a for a in _extra_args(case) if a]
    stderr = aspc("check", *args, f"tests/diagnostics/{case.name}").stderr
    errors = [line for line in stderr.splitlines() if ": error: " in line]
    assert errors
    for line in errors:
        location = line.split(": error: ")[0]
        file, row, column = location.rsplit(":", 2)
        assert file.endswith(case.name) or file == "<--set>"
        assert int(row) >= 1 and int(column) >= 1
    if case.stem != "not_utf8":  # an undecodable file has no line to show
        assert " | " in stderr and "^" in stderr


def test_each_required_error_kind_has_a_case():
    kinds = {c.stem for c in CASES}
    required = {"syntax_missing_equals", "syntax_unexpected_eof", "syntax_bad_character", "unknown_name",
                "duplicate_name", "unknown_option", "wrong_type", "out_of_range", "grpo_group",
                "train_missing_input", "ppo_without_critic", "cycle", "placement_too_big",
                "memory_fit", "unknown_kind", "missing_pipeline", "not_utf8", "override"}
    assert required <= kinds


def test_memory_message_states_the_numbers(aspc):
    stderr = aspc("check", "tests/diagnostics/memory_fit.aspl").stderr
    assert "65.5 GB bf16 weights" in stderr
    assert "61.8 GB usable" in stderr


def test_check_reports_every_file_and_fails_if_any_fails(aspc):
    result = aspc("check", "pipelines/tiny_grpo.aspl", "tests/diagnostics/cycle.aspl")
    assert result.exit_code == 1
    assert "pipelines/tiny_grpo.aspl: ok" in result.stdout
    assert "stages form a cycle" in result.stderr


def test_missing_file_is_a_diagnostic(aspc):
    result = aspc("check", "no/such/file.aspl")
    assert result.exit_code == 1
    assert "no/such/file.aspl:1:1: error: cannot read file" in result.stderr
