"""Tool calls in model output, by the environment's `format`:

- `hermes` (real models, Qwen2.5 / Hermes chat templates): `<tool_call>{"name": "calc",
  "arguments": {"expression": "2*3"}}</tool_call>`; the result goes back as
  `<tool_response>...</tool_response>`.
- `compact` (the tiny CPU models, whose vocabulary is digits and a few symbols): `[ARGUMENTS]`
  calls the environment's one tool with the argument string; the result goes back as `(RESULT)`,
  and a tool error as `(#)` (the tiny vocabulary cannot spell the error text).

A call is parsed from the current model turn only; a malformed one is an invalid call
(aspc/controller/episodes.py counts them)."""
from __future__ import annotations

import json
from dataclasses import dataclass

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
COMPACT_OPEN, COMPACT_CLOSE = "[", "]"


@dataclass(frozen=True)
class Call:
    tool: str
    arguments: str  # the raw argument string (a JSON object for hermes)


def parse_compact(turn: str, tool: str) -> Call | None:
    """The call that ends this turn, or None when it is malformed (no "[", empty, nested)."""
    if not turn.endswith(COMPACT_CLOSE) or COMPACT_OPEN not in turn:
        return None
    arguments = turn[turn.rindex(COMPACT_OPEN) + 1:-1]
    if not arguments or COMPACT_CLOSE in arguments:
        return None
    return Call(tool, arguments)


def parse_hermes(turn: str, tools: set[str]) -> Call | None:
    """The call that ends this turn, or None when it is malformed (bad JSON, an unknown tool,
    arguments that are not an object)."""
    if not turn.rstrip().endswith(HERMES_CLOSE) or HERMES_OPEN not in turn:
        return None
    body = turn[turn.rindex(HERMES_OPEN) + len(HERMES_OPEN):turn.rstrip().rindex(HERMES_CLOSE)]
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") not in tools or not isinstance(call.get("arguments", {}), dict):
        return None
    return Call(call["name"], json.dumps(call.get("arguments", {})))


def compact_observation(status: str, text: str) -> str:
    return "(" + (text if status == "ok" else "#") + ")"


def hermes_observation(status: str, text: str) -> str:
    return f"<tool_response>{text}</tool_response>"


@dataclass(frozen=True)
class PendingCall:
    """A turn that ended in a valid tool call (the driver reports it as ToolCalled)."""

    key: tuple
    call: Call
    context: int  # tokens of the sequence so far
    turns: int
    generated: int  # model tokens written so far
