"""mypy over the checked set of [tool.mypy] (issue 31 item 4), as .ci/run runs it, here on a tree of links
laid out like the installed wheel: passes/ and backends/ as aspc.passes and aspc.backends, which mypy cannot
see through the import hook of an editable install."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAPPED = {"passes": "passes", "backends": "backends", "grammar": "grammar"}  # pyproject's package-dir


def _installed_layout(into: Path) -> Path:
    """`into`/aspc: aspc/'s entries and the mapped folders, as links into the source tree. The same path
    every run, so that mypy's cache there stays valid (a cold run takes about a minute, a warm one seconds)."""
    package = into / "aspc"
    package.mkdir(parents=True, exist_ok=True)
    for link in package.iterdir():  # links only: they are remade below
        link.unlink()
    for entry in (ROOT / "aspc").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in MAPPED.items():
        (package / name).symlink_to(ROOT / folder)
    return into


@pytest.mark.skipif(os.environ.get("CI") == "true", reason=".ci/run type-checks the wheel itself, just before")
def test_checked_set_has_no_type_errors() -> None:
    pytest.importorskip("mypy", reason="mypy is not installed (pip install -e '.[test]' installs it)")
    tree = _installed_layout(ROOT / ".mypy_cache" / "installed-layout")
    run = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                          "--cache-dir", str(ROOT / ".mypy_cache")], cwd=tree, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"mypy found type errors in the checked set:\n{run.stdout}{run.stderr}"
