"""The launch plan as a shell script a cluster operator can read and run, one block per node."""
from __future__ import annotations

import shlex

from aspc.backends.ascend.lowering import LaunchPlan


def launch_script(plan: LaunchPlan) -> str:
    lines = [f"# {plan.pipeline} ({plan.schedule}): {plan.nodes} nodes, {len(plan.processes)} processes",
             "# write the launch plan next to this script: aspc compile FILE --backend ascend --emit launch "
             "-o launch.json"]
    for node in range(plan.nodes):
        lines.append(f"\n# ---- node{node} ----")
        for p in (p for p in plan.processes if p.node == node):
            env = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in sorted(p.env.items()))
            shared = "  # time-shared" if p.time_shared else ""
            lines.append(f"{env} {' '.join(shlex.quote(c) for c in p.command)} &{shared}")
    return "\n".join(lines) + "\n"
