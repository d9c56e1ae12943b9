"""Multi-turn tool-calling episodes in the CPU generator (agentic RL).

Token in, token out: a tool's observation is appended as tokens to the same sequence and its
keys to the same KV slot (the history is never decoded and re-encoded); those tokens carry mask
0, so the learner leaves them out of every loss term while the model still attends to them.
While an episode waits on its tool call, its slot stays held (sticky: the KV prefix is there)
and the generator decodes the other sequences. The generator runs no tool itself: it hands each
call out (`pop_calls`), and the driver, on the controller's word, runs it and feeds the result
back (`resume`), or moves the episode to another instance (`detach` here, `adopt` there: the
history's token ids are prefilled into a slot of that instance). What ends a turn and an episode
is the shared policy of aspc/controller/episodes.py, the format of tool_calls.py."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from aspc.backends.cpu.generator import BatchGenerator, Finished, Sequence, keep_routes, recorded
from aspc.backends.cpu.model import cache_mask
from aspc.rl.tokenizer import EOS, SYMBOLS, decode, encode
from aspc.rl.tool_calls import COMPACT_CLOSE, PendingCall, compact_observation, parse_compact
from aspc.controller import episodes as policy_terms
from aspc.controller.episodes import Episode, EpisodePolicy

CLOSE = encode(COMPACT_CLOSE)[0]


@dataclass(frozen=True)
class Environment:
    policy: EpisodePolicy
    tool: str  # the compact format's one tool
    max_tool_tokens: int


class EpisodeGenerator(BatchGenerator):
    def __init__(self, model, slots: int, max_tokens: int, temperature: float, top_p: float, static: bool,
                 environment: Environment, record_routes: bool = False):
        super().__init__(model, slots, max_tokens, temperature, top_p, static, record_routes=record_routes)
        self.env = environment
        self.calls: list[PendingCall] = []

    def add(self, key: tuple, prompt: list[int], seed: int) -> None:
        super().add(key, prompt, seed)
        self.waiting[-1].episode = Episode()

    def pop_calls(self) -> list[PendingCall]:
        calls, self.calls = self.calls, []
        return calls

    @torch.no_grad()
    def resume(self, key: tuple, result) -> list[Finished]:
        """The tool answered (`result.status`, `result.observation`): the episode's next turn starts
        here, or the episode ends (a timed-out call or a crashed worker)."""
        slot = next(slot for slot, seq in self.held.items() if seq.key == key)
        seq = self.held.pop(slot)
        self.active[slot] = seq
        if seq.episode.tool_failed(result.status) is not None:
            return [self._finish(slot, seq)]
        return self._observed(slot, seq, compact_observation(result.status, _in_vocabulary(result.observation)))

    def detach(self, key: tuple) -> Sequence:
        """The episode moves to another instance: its slot here is freed."""
        slot = next(slot for slot, seq in self.held.items() if seq.key == key)
        return self.held.pop(slot)

    @torch.no_grad()
    def adopt(self, seq: Sequence, result) -> list[Finished]:
        """A moved episode: its history's token ids prefilled into a free slot (never re-encoded
        text), then resumed with its tool's result."""
        seq.slot = next(s for s in range(self.slots) if s not in self.active and s not in self.held)
        history = seq.prompt + seq.response[:-1]  # the call's last token goes in with the observation
        positions = torch.arange(len(history))[None]
        self.model(torch.tensor([history]), positions, cache_mask(positions), self.cache, torch.tensor([seq.slot]))
        self.held[seq.slot] = seq
        return self.resume(seq.key, result)

    def _collect(self) -> list[Finished]:
        done = []
        for slot, seq in list(self.active.items()):
            done += self._after_token(slot, seq)
        return done

    def _after_token(self, slot: int, seq: Sequence) -> list[Finished]:
        """The sequence's newest token may end its turn: an answer, a call, or its budget spent."""
        outcome = self._turn_outcome(seq)
        if outcome is None:
            return []
        turn = decode(seq.response[seq.turn_start:])
        call = parse_compact(turn, self.env.tool) if outcome == policy_terms.CALL else None
        if outcome == policy_terms.CALL and call is None:
            outcome = policy_terms.BAD_CALL
        if seq.episode.after_turn(self.env.policy, outcome) is not None:
            return [self._finish(slot, seq)]
        if call is not None:
            del self.active[slot]
            self.held[slot] = seq
            context = len(seq.prompt) + len(seq.response)
            self.calls.append(PendingCall(seq.key, call, context, seq.episode.turns, sum(seq.mask)))
            return []
        return self._observed(slot, seq, compact_observation("error", ""))  # the model may correct it

    def _observed(self, slot: int, seq: Sequence, text: str) -> list[Finished]:
        self._observe(seq, text)
        if seq.episode.ended is not None:
            return [self._finish(slot, seq)]
        return self._after_token(slot, seq)  # the first token of the next turn

    def _turn_outcome(self, seq: Sequence) -> str | None:
        token = seq.response[-1]
        if token == EOS:
            return policy_terms.EOS
        if token == CLOSE:
            return policy_terms.CALL
        full = len(seq.prompt) + len(seq.response) >= self.model.arch.max_seq
        if sum(seq.mask) >= self.max_tokens or full:  # model tokens only count against the budget
            return policy_terms.OUT_OF_BUDGET
        return None

    def _observe(self, seq: Sequence, text: str) -> None:
        """Append the observation's tokens (mask 0) and their keys to the slot, then sample the
        first token of the next turn; an observation that does not fit the context ends the episode."""
        tokens = encode(text)
        if len(tokens) > self.env.max_tool_tokens:
            tokens = tokens[:self.env.max_tool_tokens - 1] + tokens[-1:]
        start = len(seq.prompt) + len(seq.response) - 1  # the call's last token is not in the cache yet
        if start + len(tokens) + 2 > self.model.arch.max_seq:
            seq.episode.ended = policy_terms.BUDGET
            return
        feed = [seq.response[-1]] + tokens
        seq.response += tokens
        seq.logprobs += [0.0] * len(tokens)
        seq.mask += [0] * len(tokens)
        seq.turn_start = len(seq.response)
        positions = torch.arange(start, start + len(feed))[None]
        routing = self.routing()
        logits = self.model(torch.tensor([feed]), positions, cache_mask(positions), self.cache,
                            torch.tensor([seq.slot]), routing)
        keep_routes(seq, recorded(routing), 0, len(feed))
        self._sample(seq, logits[0, -1])

    def _finish(self, slot: int, seq: Sequence) -> Finished:
        self.active.pop(slot, None)
        self.held.pop(slot, None)
        return replace(seq.finished(), mask=list(seq.mask), episode=asdict(seq.episode))


def _in_vocabulary(text: str) -> str:
    """What the tiny tokenizer can read of a tool's output (other characters are dropped)."""
    return "".join(ch for ch in text.strip() if ch in SYMBOLS and ch not in "[]()")
