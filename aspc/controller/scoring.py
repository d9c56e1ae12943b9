"""The failure policy of a judge's calls (an LLM judge is a service that can raise or hang).

- A call that raises or runs past the judge's `timeout` has failed: its sample gets the judge's
  `fallback` reward and is masked, left out of its group's statistics (its advantage is zero, so
  an unscored sample teaches nothing), trained with the others (no sample is lost) and counted in
  the step's metrics (`score_failed`).
- At most `concurrency` calls of one judge instance are in flight at once.
- A judge whose last `STOP_AFTER` calls all failed is taken as down: the run stops with a message
  that names the stage and the last error, after the checkpoint of the last finished step.

The drivers carry the calls out (aspc/drivers/local/scoring.py); what a failure means is decided
here."""
from __future__ import annotations

from dataclasses import dataclass

STOP_AFTER = 32  # consecutive failed calls that stop the run


class ScoringFailed(Exception):
    """A judge failed every call for too long: the run cannot learn from it."""


@dataclass(frozen=True)
class CallPolicy:
    timeout_s: float
    concurrency: int
    fallback: float
    stop_after: int = STOP_AFTER

    @staticmethod
    def of(stage) -> CallPolicy | None:
        """The policy of a reward stage's first judge(...) source (None: the stage has none)."""
        for source in dict(stage.options).get("sources", ()):
            if source.func == "judge":
                return CallPolicy(source.get("timeout"), source.get("concurrency"), source.get("fallback"))
        return None


class FailureTally:
    """Consecutive failed calls of one judge instance; `record` raises ScoringFailed at the limit."""

    def __init__(self, stage: str, policy: CallPolicy):
        self.stage, self.policy = stage, policy
        self.in_a_row = 0

    def record(self, failed: bool, error: str = "") -> None:
        self.in_a_row = self.in_a_row + 1 if failed else 0
        if self.in_a_row >= self.policy.stop_after:
            raise ScoringFailed(
                f"stage '{self.stage}': the judge failed its last {self.in_a_row} calls (the last: {error}); "
                "the run stops rather than train on fallback rewards; check the judge (its model, "
                "checkpoint or service) before continuing the run")
