"""`aspc inspect`: every pass with the diff it made to the printed IR, and the schedule graph."""
from __future__ import annotations

import difflib
import shutil
import subprocess
from pathlib import Path

from aspc.ir.dot import to_dot
from aspc.ir.printer import print_ir
from aspc.cli.toolchain import Compiled


def inspect_report(compiled: Compiled) -> str:
    graph = compiled.compilation.graph
    lines = [f"pipeline {graph.pipeline}: schedule {compiled.graph.schedule.kind}, "
             f"passes: {compiled.passes or '(none)'}", ""]
    for number, step in enumerate(compiled.run.steps, start=1):
        p = step.spec.instance
        lines.append(f"== {number}. {p.spec()}" + (f"  (removes: {p.bubble} bubble)" if p.bubble else ""))
        diff = list(difflib.unified_diff(print_ir(step.before).splitlines(), print_ir(step.after).splitlines(),
                                         "before", "after", lineterm="", n=0))
        lines += diff[2:] if diff else ["(no change)"]
        lines.append("")
    return "\n".join(lines) + "\n"


def write_schedule_graph(compiled: Compiled, directory: Path) -> tuple[list[Path], str]:
    """Write NAME.SCHEDULE.dot, plus .svg and .png when Graphviz's `dot` is installed."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{compiled.graph.pipeline}.{compiled.graph.schedule.kind}"
    dot_path = directory / f"{stem}.dot"
    dot_path.write_text(to_dot(compiled.graph), encoding="utf-8")
    written = [dot_path]
    if shutil.which("dot") is None:
        return written, ("Graphviz is not installed, so only the DOT file was written; install it "
                         "(e.g. `apt-get install graphviz`) for SVG and PNG")
    for fmt in ("svg", "png"):
        out = directory / f"{stem}.{fmt}"
        failure = _render(dot_path, fmt, out)
        if failure:
            return written, f"Graphviz's `dot` failed on {dot_path} ({failure}), so only the files above were " \
                            "written; check the install (e.g. `apt-get install --reinstall graphviz`)"
        written.append(out)
    return written, ""


def _render(dot_path: Path, fmt: str, out: Path) -> str:
    """Run `dot -Tfmt`; what went wrong, or '' (a `dot` that cannot start or hangs is said, not raised)."""
    try:
        result = subprocess.run(["dot", f"-T{fmt}", str(dot_path), "-o", str(out)], capture_output=True,
                                text=True, timeout=60)
    except OSError as error:
        return f"it cannot be started: {error.strerror or error}"
    except subprocess.TimeoutExpired:
        return "it ran for more than 60 s"
    if result.returncode != 0:
        return result.stderr.strip() or f"exit status {result.returncode}"
    return ""
