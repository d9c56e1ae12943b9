"""Agentic episodes: what happens when a model turn ends, decided once for every driver.

An episode alternates model turns and tool calls inside the generation instance that holds its
KV cache (sticky: moving it would re-prefill the whole history). A turn ends when the model
writes an end of sequence (its answer), a tool call (parsed by the environment's `format`), or
runs out of its budget of model tokens. `EpisodePolicy.after_turn` says what comes next: call
the tool, or end the episode with one of the termination reasons below, which are recorded per
episode and counted in the step's metrics. The CPU backend's generator and the simulator's
instances both ask it, so the simulator ends episodes where the runtime does."""
from __future__ import annotations

from dataclasses import dataclass

# why an episode ended
ANSWER = "answer"  # the model wrote its final answer (end of sequence)
MAX_TURNS = "max_turns"  # it asked for another tool call after its last allowed turn
INVALID = "invalid_calls"  # too many malformed tool calls in a row
BUDGET = "budget"  # its model tokens (tool tokens do not count) or the context ran out
TOOL_TIMEOUT = "tool_timeout"  # a tool call ran past its timeout
TOOL_CRASHED = "tool_crashed"  # the tool's worker died: an infrastructure failure, masked from its group
REASONS = (ANSWER, MAX_TURNS, INVALID, BUDGET, TOOL_TIMEOUT, TOOL_CRASHED)
MASKED = (TOOL_CRASHED,)  # reasons that mask the episode (not the model's fault)

# how a turn ended
EOS, CALL, BAD_CALL, OUT_OF_BUDGET = "eos", "call", "bad_call", "out_of_budget"


@dataclass(frozen=True)
class EpisodePolicy:
    max_turns: int
    max_invalid: int

    @staticmethod
    def of(stage) -> EpisodePolicy:
        options = dict(stage.options)
        return EpisodePolicy(options["max_turns"], options["max_invalid"])


@dataclass
class Episode:
    """One sample's episode state: turns taken, malformed calls in a row, how it ended."""

    turns: int = 0
    invalid_in_a_row: int = 0
    tool_calls: int = 0
    ended: str | None = None

    def after_turn(self, policy: EpisodePolicy, outcome: str) -> str | None:
        """`outcome`: EOS, CALL, BAD_CALL or OUT_OF_BUDGET. Returns None to run the tool call (a
        valid CALL) or to let the model try again after an invalid one (an error observation), else
        the reason the episode ends (also kept in `ended`)."""
        self.turns += 1
        reason = None
        if outcome == EOS:
            reason = ANSWER
        elif outcome == OUT_OF_BUDGET:
            reason = BUDGET
        elif self.turns >= policy.max_turns:
            reason = MAX_TURNS
        elif outcome == BAD_CALL:
            self.invalid_in_a_row += 1
            reason = INVALID if self.invalid_in_a_row >= policy.max_invalid else None
        else:
            self.invalid_in_a_row = 0
            self.tool_calls += 1
        self.ended = reason
        return reason

    def tool_failed(self, status: str) -> str | None:
        """A tool call's status ("ok", "error", "timeout", "crashed"): an error is an observation
        the model reads; a timeout or a crashed worker ends the episode."""
        reason = {"timeout": TOOL_TIMEOUT, "crashed": TOOL_CRASHED}.get(status)
        self.ended = reason or self.ended
        return reason
