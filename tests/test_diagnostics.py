"""One file per error kind: the exact text `aspc check` prints, and exit status 1."""
import pytest

from aspc.frontend import diagnostics
from aspc.frontend.diagnostics import Diagnostic, render_all
from aspc.ir.span import Span
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
                "memory_fit", "unknown_kind", "missing_pipeline", "not_utf8", "override",
                "override_origin", "python_module_missing", "unicode"}
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


@pytest.mark.parametrize("command", ["check", "compile", "simulate", "inspect"])
def test_a_directory_as_the_file_is_a_diagnostic_with_exit_1(aspc, command):
    result = aspc(command, "pipelines")
    assert result.exit_code == 1
    assert "pipelines:1:1: error: this is a directory, not an .aspl file" in result.stderr
    assert "hint: name an .aspl file, e.g. pipelines/" in result.stderr
    assert "Traceback" not in result.output and "Usage:" not in result.output


def test_a_utf8_byte_order_mark_is_skipped(aspc, tmp_path):
    source = (ROOT / "pipelines" / "tiny_grpo.aspl").read_text()
    good, bad = tmp_path / "good.aspl", tmp_path / "bad.aspl"
    good.write_bytes(b"\xef\xbb\xbf" + source.encode())
    bad.write_bytes(b"\xef\xbb\xbfpool cpu = cpu x 0\npipeline p\n")
    assert aspc("check", str(good)).exit_code == 0
    result = aspc("check", str(bad))
    assert result.exit_code == 1
    assert f"{bad}:1:18: error: option 'count' must be >= 1, got 0" in result.stderr
    assert "\n    1 | pool cpu = cpu x 0\n      |                  ^\n" in result.stderr


def _warning(line: int, message: str) -> Diagnostic:
    return Diagnostic("warning", Span("f.aspl", line, 1, line, 2), message)


def test_warnings_of_one_kind_are_capped_with_a_count_of_the_rest():
    unused = [_warning(i, f"nothing consumes the output of stage 's{i}'") for i in range(1, 26)]
    missing = [_warning(30, "data file 'a.jsonl' does not exist")]
    text = render_all(unused + missing, {"f.aspl": "x\n" * 40})
    assert text.count("nothing consumes") == diagnostics.WARNING_CAP
    assert "stage 's10'" in text and "stage 's11'" not in text
    assert "... and 15 more warnings like this (the first 10 of each kind are shown)" in text
    assert "data file 'a.jsonl' does not exist" in text  # another kind is not capped with them


def test_errors_of_one_kind_are_capped_and_all_counted():
    errors = [Diagnostic("error", Span("f.aspl", i, 1, i, 2), f"unknown name 'n{i}'") for i in range(1, 31)]
    other = Diagnostic("error", Span("f.aspl", 35, 1, 35, 2), "unknown pool 'p'")
    text = render_all([*errors, other], {"f.aspl": "x\n" * 40})
    assert text.count("error: unknown name") == diagnostics.ERROR_CAP and "more warnings" not in text
    assert "... and 20 more errors of this kind (the first 10 of each kind are shown)" in text
    assert "error: unknown pool 'p'" in text  # another kind is not capped with them
    assert text.endswith("31 errors generated.")


def test_rendering_splits_each_source_once(monkeypatch):
    calls = []
    split = diagnostics._split_lines
    monkeypatch.setattr(diagnostics, "_split_lines", lambda text: calls.append(1) or split(text))
    items = [Diagnostic("error", Span("f.aspl", i, 1, i, 2), f"e{i}") for i in range(1, 2001)]
    render_all(items, {"f.aspl": "x = 1\n" * 2000})
    assert len(calls) == 1


def test_quoted_lines_are_counted_on_newlines_only():
    source = "# a form feed \f and a line separator \u2028 stay inside this comment\nstage s = bad\n"
    text = render_all([Diagnostic("error", Span("f.aspl", 2, 11, 2, 14), "here")], {"f.aspl": source})
    assert "    2 | stage s = bad\n      |           ^^^" in text


def test_carets_line_up_under_wide_characters():
    wide = Diagnostic("error", Span("f.aspl", 1, 9, 1, 10), "here")
    text = render_all([wide], {"f.aspl": "pool 训练 × 2\n"})
    assert text.splitlines()[2] == "      |           ^"  # 训练 take four terminal columns


def test_check_of_a_program_with_thousands_of_warnings_prints_a_few(aspc, tmp_path):
    chain = ('stage gen{i} = generate(actor, prompts)\n'
             'stage unused{i} = reward(gen{i}, rule = "exact_match")\n')
    head = (ROOT / "pipelines" / "tiny_grpo.aspl").read_text()
    path = tmp_path / "many.aspl"
    path.write_text(head + "".join(chain.format(i=i) for i in range(1500)))
    result = aspc("check", str(path))
    assert result.exit_code == 0
    assert "... and 1490 more warnings like this" in result.stderr  # 1500 unused stages
    assert len(result.stderr) < 8000


def test_suggestions_among_many_names_compare_only_near_ones(monkeypatch):
    names = [f"gen{i}" for i in range(5000)] + [f"actor{i}" for i in range(5000)]
    suggestions = diagnostics.Suggestions(names)
    compared = []
    close = diagnostics.did_you_mean
    monkeypatch.setattr(diagnostics, "did_you_mean", lambda w, c: compared.append(len(c)) or close(w, c))
    assert suggestions.hint("gne17") == "did you mean 'gen17'?"  # a swap
    assert suggestions.hint("actr4") == "did you mean 'actor4'?"  # a deletion
    assert suggestions.hint("zzzzzz") == ""
    assert max(compared) < 100  # not the 10,000 names: a file full of typos stays linear


def test_suggestions_among_few_names_are_did_you_mean():
    assert diagnostics.Suggestions(["rollout", "learner"]).hint("rolout") == "did you mean 'rollout'?"
