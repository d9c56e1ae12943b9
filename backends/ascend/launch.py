"""The launch plan as a shell script a cluster operator can read and run, one block per node."""
from __future__ import annotations

import json
import shlex
import textwrap
from collections import Counter

from aspc.backends.ascend.lowering import LaunchPlan
from aspc.backends.ascend.process_env import SOCKET_REFERENCE, referenced_node
from aspc.backends.ascend.startup import phase


def launch_script(plan: LaunchPlan) -> str:
    lines = [f"# {plan.pipeline} ({plan.schedule}): {plan.nodes} nodes, {len(plan.processes)} processes",
             "# write the launch plan next to this script: aspc compile FILE --backend ascend --emit launch "
             "-o launch.json"]
    lines += [f"# MISSING CHECKPOINT: replace {p} in launch.json with a Hugging Face checkpoint directory of "
              f"that model (or give the model one in the .aspl file: model NAME = hf(\"DIR\"))"
              for p in plan.placeholders()]
    if any(referenced_node(str(v)) is not None for p in plan.processes for v in p.env.values()):
        lines += [f"# rendezvous addresses: set ASPC_NODES to the {plan.nodes} node addresses, node0 first, "
                  "comma-separated (or compile with ASPC_NODES set to write them in)",
                  f'IFS=, read -r -a NODE <<< "${{ASPC_NODES:?set ASPC_NODES to the {plan.nodes} node addresses, '
                  'node0 first}"']
    if any(v == SOCKET_REFERENCE for p in plan.processes for v in p.env.values()):
        lines += ["# HCCL's and gloo's sockets bind to ASPC_SOCKET_IFNAME, else this node's default-route interface",
                  'SOCKET_IFNAME="${ASPC_SOCKET_IFNAME:-$(ip -o -4 route show to default | awk \'{print $5; exit}\')}"']
    phases = {s.stage: phase(s.startup) for s in plan.stages}
    if any(s.startup for s in plan.stages):
        lines.append("# time-shared NPUs: each node's engines are listed first; they must be asleep before the "
                     "processes after them start (launch.json stages[].startup)")
    for node in range(plan.nodes):
        lines.append(f"\n# ---- node{node} ----")
        for p in sorted((p for p in plan.processes if p.node == node), key=lambda p: phases[p.stage]):
            env = " ".join(f"{k}={_shell_value(str(v))}" for k, v in sorted(p.env.items()))
            shared = "  # time-shared" if p.time_shared else ""
            lines.append(f"{env} {' '.join(shlex.quote(c) for c in p.command)} &{shared}")
    return "\n".join(lines) + "\n"


def _shell_value(value: str) -> str:
    """Quoted, except a node-address or socket-interface reference, which the shell must expand."""
    return f'"{value}"' if referenced_node(value) is not None or value == SOCKET_REFERENCE else shlex.quote(value)


def launch_summary(plan: LaunchPlan) -> str:
    """The launch plan in a few lines per stage, for review: where each stage's processes run, the
    command and environment they share (with what varies between them), the per-stage configs and
    the weight transfers. `--emit launch` writes the full plan."""
    lines = [f"# {plan.pipeline} ({plan.schedule}): {plan.nodes} nodes, {len(plan.processes)} processes, "
             f"{len(plan.stages)} stages, {len(plan.transfers)} weight transfers"]
    for stage in plan.stages:
        lines += _stage_summary(stage, [p for p in plan.processes if p.stage == stage.stage])
    syncs = Counter((t.sync, t.src_stage, t.dst_stage) for t in plan.transfers)
    for (sync, src, dst), count in sorted(syncs.items()):
        ts = [t for t in plan.transfers if (t.sync, t.src_stage, t.dst_stage) == (sync, src, dst)]
        lines.append(f"\ntransfer {sync}: {src} -> {dst}, {count} shards, {sum(t.bytes for t in ts)} bytes; "
                     f"{len({t.src_rank for t in ts})} source ranks, {len({t.dst_instance for t in ts})} instances "
                     f"x {len({t.dst_tp_rank for t in ts})} tp ranks")
    return "\n".join(lines) + "\n"


def _stage_summary(stage, procs) -> list[str]:
    if not procs:
        lines = [f"\nstage {stage.stage} ({stage.kind}, {stage.role}): no NPU processes"]
        return lines + _wrapped("config", stage.config)
    shared = ", time-shared" if any(p.time_shared for p in procs) else ""
    per = _values(Counter(len(p.devices) for p in procs))
    lines = [f"\nstage {stage.stage} ({stage.kind}, {stage.role}{shared}): "
             f"{len(procs)} processes x {per} NPUs, world size {_values(Counter(p.world_size for p in procs))}"]
    lines += _placement(procs)
    lines += _commands([p.command for p in procs])
    keys = sorted({k for p in procs for k in p.env})
    lines += [f"  env {k}{_values(Counter(p.env.get(k, '<unset>') for p in procs), '=')}" for k in keys]
    rank_args = sorted({k for p in procs for k in p.model_args})
    lines += [f"  rank model_args {k}{_values(Counter(str(p.model_args.get(k)) for p in procs), '=')}"
              for k in rank_args]
    if stage.groups:
        lines.append("  groups " + ", ".join(f"{axis} {len(g)}x{_values(Counter(len(x) for x in g))}"
                                             for axis, g in sorted(stage.groups.items())))
    for label, value in (("config", stage.config), ("model_args", stage.model_args), ("builders", stage.builders),
                         ("compiler", stage.compiler), ("micro_batching", stage.micro_batching),
                         ("startup", stage.startup)):
        if value:
            lines += _wrapped(label, value)
    return lines


def _placement(procs) -> list[str]:
    """One line per run of consecutive nodes that hold the same local devices and process count."""
    by_node: dict[int, list] = {}
    for p in procs:
        by_node.setdefault(p.node, []).append(p)
    runs: list[tuple[int, int, tuple]] = []
    for node in sorted(by_node):
        key = (len(by_node[node]), tuple(sorted(d for p in by_node[node] for d in p.devices)))
        if runs and runs[-1][1] == node - 1 and runs[-1][2] == key:
            runs[-1] = (runs[-1][0], node, key)
        else:
            runs.append((node, node, key))
    return [f"  node{_span(first, last)}: {count} processes on devices {_ints(list(devices))}"
            for first, last, (count, devices) in runs]


def _commands(commands) -> list[str]:
    """One template per command length; an argument that varies shows as {its values}."""
    out = []
    for length in sorted({len(c) for c in commands}):
        same = [c for c in commands if len(c) == length]
        words = []
        for i in range(length):
            values = Counter(c[i] for c in same)
            words.append(next(iter(values)) if len(values) == 1 else "{" + _values(values) + "}")
        out.append(f"  command x{len(same)}: {' '.join(words)}")
    return out


def _values(counts: Counter, prefix: str = "") -> str:
    """`=v` for one value; a range of integers with its counts; else each value with its count."""
    if len(counts) == 1:
        return f"{prefix}{next(iter(counts))}"
    sep = ": " if prefix else ""
    each = set(counts.values())
    keys = list(counts)
    if all(isinstance(k, int) or (isinstance(k, str) and k.isdigit()) for k in keys):
        ints = sorted(int(k) for k in keys)
        if ints == list(range(ints[0], ints[-1] + 1)) and len(each) == 1:
            times = each.pop()
            return f"{sep}{ints[0]}..{ints[-1]}" + (f" (x{times} each)" if times > 1 else "")
    shown = sorted(counts.items(), key=lambda kv: str(kv[0]))
    text = ", ".join(f"{k} x{c}" for k, c in shown[:8])
    more = f", ... {len(shown) - 8} more" if len(shown) > 8 else ""
    return f"{sep}{text}{more}"


def _ints(values: list[int]) -> str:
    """1,2,3,5 -> 1-3,5; repeated values (time-sharing) are shown once."""
    values = sorted(set(values))
    parts, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            parts.append(_span(start, v))
            start = None
    return ",".join(parts)


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def _wrapped(label: str, value: dict) -> list[str]:
    items = [f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in sorted(value.items())]
    return textwrap.wrap(" ".join(items), width=116, initial_indent=f"  {label}: ", subsequent_indent="      ",
                         break_on_hyphens=False, break_long_words=False)
