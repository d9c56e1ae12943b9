"""Text reports of simulations: one run, or the sync-naive / sync / asp comparison (with sync
colocated on all devices, the row sync@colocated, when the baseline is available)."""
from __future__ import annotations

from aspc.accounting.ledger import CATEGORIES
from aspc.drivers.sim.result import SimResult

COLOCATED_SYNC = "sync@colocated"  # sync on one time-shared pool of all the devices (aspc/frontend/layouts.py)


def shown(results: list[SimResult]) -> tuple[str, ...]:
    """The categories a report prints: tool_wait only for agentic plans (episodes with tool calls)."""
    agentic = any(r.tool_calls or r.bubbles.get("tool_wait") for r in results)
    return tuple(c for c in CATEGORIES if c != "tool_wait" or agentic)


def summary(r: SimResult) -> str:
    stale = "  ".join(f"{k}: {v}" for k, v in r.staleness.items()) or "-"
    bubbles = "  ".join(f"{c} {100 * r.share(c):.1f}%" for c in shown([r]))
    lines = [
        f"{r.pipeline}  schedule {r.schedule}  ({r.devices} devices, {r.steps} steps, "
        f"{r.samples_per_step} samples/step, mean prompt {r.mean_prompt:.0f} / response {r.mean_response:.0f} tokens)",
        f"  step time   {r.step_time:10.2f} s    bubble-free bound {r.bound_step_time:.2f} s, "
        f"efficiency {100 * r.efficiency:.1f}%",
        f"  e2e_tps     {r.e2e_tps:10.1f} tokens/s per device",
        f"  samples/s   {r.samples_per_s:10.2f}",
        f"  staleness   {stale}",
        f"  bubbles     {bubbles}",
        f"  pools       {pool_shares(r)}",
    ]
    if r.oversample:
        lines.append(f"  filtering   {r.oversample:.2f}x prompts generated per prompt trained, "
                     f"{100 * r.filtered_tokens:.1f}% of generated tokens never trained, "
                     f"{r.padded_groups} all-equal groups padded in")
    if r.moves:
        moved = (f"instance {i} to {'the trainer' if role == 'learn' else 'generation'} at {t:.0f} s"
                 for t, i, role in r.moves)
        lines.append("  rebalanced  " + ", ".join(moved))
    if r.tool_calls:
        endings = "  ".join(f"{k} {v}" for k, v in r.endings.items())
        lines.append(f"  episodes    {r.tool_calls / r.steps:.0f} tool calls/step, ended: {endings}")
    return "\n".join(lines) + "\n"


def pool_shares(r: SimResult) -> str:
    """Each pool's share of the busy device-seconds and how busy its own devices are, e.g.
    `rollout 8 dev 61.0% (util 80.2%)`: a reward model's or a judge's pool shows what scoring costs."""
    return "  ".join(f"{pool} {devices} dev {100 * r.pool_share(pool):.1f}% "
                     f"(util {100 * r.pool_utilization(pool):.1f}%)" for pool, (devices, _) in r.pools.items())


def compare_table(results: list[SimResult]) -> str:
    """One row per schedule; "vs X" is the row's e2e_tps over X's ("-" where X was not simulated)."""
    by = {r.schedule: r for r in results}
    categories = shown(results)
    bases = ("sync", COLOCATED_SYNC, "sync-naive")
    head = ("| schedule | step time (s) | e2e_tps | samples/s | " + " | ".join(f"vs {b}" for b in bases)
            + " | efficiency | " + " | ".join(categories) + " | staleness |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        speedups = " | ".join(_ratio(by.get(b), r) for b in bases)
        stale = ", ".join(f"{k}:{v}" for k, v in r.staleness.items())
        rows.append(f"| {r.schedule} | {r.step_time:.2f} | {r.e2e_tps:.1f} | {r.samples_per_s:.2f} | {speedups} | "
                    f"{100 * r.efficiency:.1f}% | "
                    + " | ".join(f"{100 * r.share(c):.1f}%" for c in categories) + f" | {stale} |")
    rows += _filtering_rows(results)
    rows.append("")
    rows.append("busy device-time by pool (share of all busy device-seconds; util: busy / the pool's devices x wall):")
    rows += [f"  {r.schedule:<14}  {pool_shares(r)}" for r in results]
    return "\n".join(rows) + "\n"


def _filtering_rows(results: list[SimResult]) -> list[str]:
    """Dynamic sampling's cost per schedule: the extra generation, and what it did to the step."""
    if not any(r.oversample for r in results):
        return []
    head = "dynamic sampling (filter_groups): prompts generated per prompt trained; generated tokens never trained:"
    return ["", head] + [f"  {r.schedule:<14}  {r.oversample:.2f}x  {100 * r.filtered_tokens:.1f}%  "
                         f"({r.padded_groups} all-equal groups padded in at the bound)" for r in results]


def baseline_note(reason: str) -> str:
    """The line under the table when the colocated baseline is not available."""
    return f"{COLOCATED_SYNC}: not available: {reason}"


def _ratio(base: SimResult | None, r: SimResult) -> str:
    if base is None:
        return "-"
    return f"{r.e2e_tps / base.e2e_tps:.2f}x"
