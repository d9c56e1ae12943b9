"""Is the run learning from anything? Two checks whose answer the user must hear at once, not after
the last step: a tool that fails every call, and a reward that never changes while the responses do.

A tool (aspc/controller/tools.py runs its calls):
- after WARN_AFTER calls in a row that did not return "ok" ("error": the tool raised or exited
  non-zero; "timeout"; "crashed"), a warning names the tool and quotes its own last error, once per
  run of failures;
- after STOP_AFTER calls in a row that failed, the run stops (ToolsFailing), after the checkpoint
  of the last finished step. A model that writes bad arguments early in training still gets some
  calls right within STOP_AFTER calls once the warm start showed it the format; a tool that cannot
  be imported, or raises on every input, never does. One "ok" resets both counts.

A reward (the step's metrics `reward_spread`, `responses_distinct`): when every scored sample of
CONSTANT_STEPS steps in a row got the same reward while the responses differed, a warning says so
(once). It is only a warning: a task the policy cannot solve yet gives every sample 0 too; but a
broken reward or tool looks exactly like this, and the run would otherwise train on nothing in silence.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

WARN_AFTER = 8   # failed calls of one tool in a row that print a warning
STOP_AFTER = 64  # failed calls of one tool in a row that stop the run
CONSTANT_STEPS = 10  # steps of one constant reward (over varying responses) that print a warning


class ToolsFailing(Exception):
    """A tool failed every call for too long: the episodes learn nothing from it."""


class ToolHealth:
    """Failed calls in a row, per tool; shared by the run's tool runners (thread-safe)."""

    def __init__(self, warn: Callable[[str], None], warn_after: int = WARN_AFTER, stop_after: int = STOP_AFTER):
        self.warn, self.warn_after, self.stop_after = warn, warn_after, stop_after
        self.in_a_row: dict[str, int] = {}
        self.succeeded: set[str] = set()
        self._lock = threading.Lock()

    def record(self, tool: str, status: str, observation: str) -> None:
        """Count one call's end; warns at warn_after failures in a row, raises ToolsFailing at stop_after."""
        with self._lock:
            if status == "ok":
                self.in_a_row[tool] = 0
                self.succeeded.add(tool)
                return
            count = self.in_a_row[tool] = self.in_a_row.get(tool, 0) + 1
            error = _first_line(observation)
        if count == self.warn_after:
            self.warn(f"warning: tool '{tool}' failed its last {count} calls{self._never(tool)} "
                      f"(its last error: {error}); the episodes see only errors")
        if count >= self.stop_after:
            raise ToolsFailing(
                f"tool '{tool}' failed its last {count} calls{self._never(tool)} (its last error: {error}); "
                "the run stops rather than train on episodes whose tool never works. Check the tool "
                "(its module beside the .aspl, its command, its timeout) before continuing the run")

    def _never(self, tool: str) -> str:
        return "" if tool in self.succeeded else ", and none has succeeded in this run"


class ConstantReward:
    """Steps in a row whose scored samples all got one reward while their responses differed."""

    def __init__(self, warn: Callable[[str], None], steps: int = CONSTANT_STEPS):
        self.warn, self.steps = warn, steps
        self.in_a_row, self.value, self.warned = 0, None, False

    def record(self, step: int, metrics: dict) -> None:
        if self.warned or "reward_spread" not in metrics:
            return
        constant = metrics["reward_spread"] == 0 and metrics.get("responses_distinct", 0) > 1
        same = constant and (self.in_a_row == 0 or metrics["reward"] == self.value)
        self.in_a_row = self.in_a_row + 1 if same else int(constant)
        self.value = metrics["reward"] if constant else None
        if self.in_a_row >= self.steps:
            self.warned = True
            self.warn(f"warning: every sample of the last {self.in_a_row} steps (to step {step}) got the reward "
                      f"{self.value:.3f} although the responses differ: the policy learns nothing from it. "
                      "Check the reward (and the tools its episodes call), or the task's difficulty")


def _first_line(text: str) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else "no output"
    return line if len(line) <= 200 else line[:200] + "…"
