"""The validation configurations (bench/validation/*.aspl) check clean, compile and simulate.

Each file is a published MindSpeed-RL configuration (bench/validation/README.md); bench/validate.py
simulates them against the published figures. Here: one step each under the schedule the
publications used (sync), with the published batch sizes.
"""
import math
import sys
from pathlib import Path

import pytest

from aspc.backends.sim.pricing import RooflinePricing
from aspc.drivers.sim.result import simulate
from aspc.cli.toolchain import compile_with_passes

ROOT = Path(__file__).resolve().parent.parent
VALIDATION = sorted((ROOT / "bench" / "validation").glob("*.aspl"))


def test_there_are_validation_files():
    assert len(VALIDATION) >= 8


@pytest.mark.parametrize("path", VALIDATION, ids=lambda p: p.stem)
def test_validation_file_checks_clean(aspc, path):
    result = aspc("check", str(path.relative_to(ROOT)))
    assert result.exit_code == 0, result.output
    assert result.stderr == "", "validation files compile without warnings"


@pytest.mark.parametrize("path", VALIDATION, ids=lambda p: p.stem)
def test_validation_file_simulates_one_step(path):
    plan = compile_with_passes(path, schedule="sync").plan()
    result = simulate(plan, 1, RooflinePricing(plan))
    assert result.step_time > 0
    assert math.isfinite(result.e2e_tps) and result.e2e_tps > 0
    total = sum(result.bubbles.values())
    assert total == pytest.approx(result.devices * result.wall_s, rel=1e-6)


def test_validate_script_lists_every_file():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import validate
    finally:
        sys.path.pop(0)
    assert sorted(case.file for case in validate.CASES) == sorted(p.stem for p in VALIDATION)


def test_die_proxy_layouts_compile(tmp_path):
    """bench/validate.py --die-proxy rewrites the A3 files to MindSpeed-RL's die-level layout."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import validate
    finally:
        sys.path.pop(0)
    for case in validate.CASES:
        if case.dies:
            plan = compile_with_passes(validate.die_layout(case, tmp_path), schedule="sync").plan()
            assert all(pool.hardware == validate.DIE for pool in plan.pools)
