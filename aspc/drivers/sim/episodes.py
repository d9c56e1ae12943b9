"""Agentic episodes in the simulator: each sample's turns and tool calls, decided by the shared
episode policy (aspc/controller/episodes.py). Which runner a call runs on, and where an episode
goes on after it, is the controller's (aspc/controller/tools.py, `Controller._on_ToolReturned`).

A drawn episode (aspc/costmodel/workload.py) has T turns and T - 1 tool calls. The policy ends it
where the runtime would: after its last turn (the answer), or on a tool call that runs past the
tool's timeout (the call is charged its timeout and no observation comes back).
"""
from __future__ import annotations

from dataclasses import dataclass

from aspc.controller.episodes import CALL, EOS, Episode, EpisodePolicy
from aspc.costmodel.workload import EpisodeDraw, Environment


@dataclass(frozen=True)
class ToolCall:
    tool: str
    seconds: float  # the call's latency, capped at the tool's timeout
    observation: int  # tokens fed back (0 when the call timed out)


@dataclass(frozen=True)
class EpisodePlan:
    turns: tuple[int, ...]  # model tokens of each turn that runs
    calls: tuple[ToolCall, ...]  # one after each turn but the last; one more when it ends on a call
    ended: str  # the termination reason (aspc.controller.episodes.REASONS)

    @property
    def model_tokens(self) -> int:
        return sum(self.turns)

    @property
    def observation_tokens(self) -> int:
        return sum(c.observation for c in self.calls)

    @property
    def ends_on_call(self) -> bool:
        return len(self.calls) == len(self.turns)


def plan_episode(env: Environment, policy: EpisodePolicy, draw: EpisodeDraw) -> EpisodePlan:
    episode = Episode()
    calls: list[ToolCall] = []
    for i in range(len(draw.turns)):
        last = i == len(draw.turns) - 1
        reason = episode.after_turn(policy, EOS if last else CALL)
        if reason is not None:
            return EpisodePlan(draw.turns[:i + 1], tuple(calls), reason)
        tool = env.tools[draw.tools[i]]
        if draw.latencies[i] >= tool.timeout:
            calls.append(ToolCall(tool.name, tool.timeout, 0))
            ended = episode.tool_failed("timeout")
            assert ended is not None, "a timed-out tool call ends its episode"
            return EpisodePlan(draw.turns[:i + 1], tuple(calls), ended)
        calls.append(ToolCall(tool.name, draw.latencies[i], draw.observations[i]))
    raise AssertionError("an episode's last turn ends it")
