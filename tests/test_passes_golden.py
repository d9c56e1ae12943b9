"""One golden file per pass: each case is a pipeline string and an .aspl input; the expected
output is the printed IR after the passes, or the diagnostics (negative cases).

Cases in tests/passes/NAME.test are separated by `// -----` lines; each starts with
`// RUN: PIPELINE`. Expected outputs are in NAME.expected, separated the same way.
"""
import pytest

from aspc.frontend.compiler import compile_source
from aspc.frontend.diagnostics import AsplError, render_all
from aspc.passes.registry import PASSES
from aspc.ir.printer import print_ir
from aspc.cli.toolchain import run_schedule
from conftest import ROOT, check_golden

DIR = ROOT / "tests" / "passes"
SEPARATOR = "// -----\n"


def run_case(number: int, case: str) -> str:
    first, _, source = case.partition("\n")
    assert first.startswith("// RUN: "), f"case {number} must start with // RUN: PIPELINE"
    pipeline = first.removeprefix("// RUN: ")
    file = f"case-{number}.aspl"
    sources = {file: source, "<-p>": pipeline}
    try:
        compiled = run_schedule(compile_source(source, file), pipeline=pipeline)
    except AsplError as error:
        return render_all(error.diagnostics, sources) + "\n"
    return print_ir(compiled.graph)


@pytest.mark.parametrize("name", sorted(PASSES))
def test_pass_cases_match_golden(name):
    cases = (DIR / f"{name}.test").read_text().split(SEPARATOR)
    output = SEPARATOR.join(run_case(i, case) for i, case in enumerate(cases, start=1))
    check_golden(DIR / f"{name}.expected", output)


@pytest.mark.parametrize("name", sorted(PASSES))
def test_every_pass_has_positive_and_negative_cases(name):
    expected = (DIR / f"{name}.expected").read_text().split(SEPARATOR)
    assert any(e.startswith("pipeline ") for e in expected)
    if name not in ("continuous-batching", "place"):  # these have no precondition to break
        assert any(": error: " in e for e in expected)
