"""Generation with a KV cache: continuous batching (a finished sequence leaves its slot and a
waiting one takes it at once) or static batches (the sync-naive baseline: a batch admits nothing
until its longest member ends). Sampling is seeded per sample, so a sample's tokens do not depend
on which other sequences share its batch. Each token's log-probability is recorded under the
distribution it was sampled from (the logits over the temperature): the rollout log-probs that
off-policy correction weighs a stale sample by. With `record_routes`, a mixture-of-experts model's
choice of experts at each position it computes is kept too (Finished.routes): the routes that
rollout routing replay (R3) makes the trainer's forward take."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from aspc.backends.cpu.model import KVCache, Routing, TinyQwen, cache_mask
from aspc.rl.tokenizer import EOS


@dataclass(frozen=True)
class PolicyWeights:
    """A published policy: its weights and how many optimizer steps the learner had taken (the
    learner counts from its own start, so staleness is the difference of two such counts)."""

    version: int
    state: dict


@dataclass
class Sequence:
    key: tuple
    prompt: list[int]
    seed: int
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    slot: int = -1
    generator: torch.Generator | None = None
    mask: list[int] = field(default_factory=list)  # 1: a token the model wrote; 0: a tool's (agentic episodes)
    episode: object = None  # an agentic episode's state (episodes.py)
    turn_start: int = 0  # where the current model turn starts in the response
    version: int = 0  # the policy version it started generating under (PolicyWeights.version)
    routes: list[torch.Tensor] = field(default_factory=list)  # [positions, moe layers, top_k] per forward

    def finished(self) -> Finished:
        routes = torch.cat(self.routes) if self.routes else None
        return Finished(self.key, self.prompt, self.response, self.logprobs, version=self.version, routes=routes)


@dataclass(frozen=True)
class Finished:
    key: tuple
    prompt: list[int]
    response: list[int]
    logprobs: list[float]  # behaviour-policy log-probabilities of the response tokens
    mask: list[int] | None = None  # agentic: 1 where the model wrote the token, 0 where a tool did
    episode: dict | None = None  # agentic: how the episode went (turns, tool calls, why it ended)
    version: int = 0  # the policy version it started generating under (PolicyWeights.version)
    # the experts each position of prompt + response but the last went to, int16 [positions, moe layers, top_k]
    # (vLLM's CompletionOutput.routed_experts); None unless the generator records them
    routes: torch.Tensor | None = None


class BatchGenerator:
    def __init__(self, model: TinyQwen, slots: int, max_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, static: bool = False, eos_ids: frozenset = frozenset({EOS}),
                 record_routes: bool = False):
        if record_routes and not model.arch.experts:
            raise ValueError("only a mixture-of-experts model has routes to record")
        self.model, self.slots, self.max_tokens = model, slots, max_tokens
        self.record_routes = record_routes
        self.eos_ids = eos_ids  # the tokenizer's: a token that ends a response
        self.temperature, self.top_p, self.static = temperature, top_p, static
        self.cache = KVCache(model.arch, slots, model.arch.max_seq)
        self.waiting: deque[Sequence] = deque()
        self.active: dict[int, Sequence] = {}
        self.held: dict[int, Sequence] = {}  # slots whose sequence waits (on a tool call), keeping its KV
        self.version = 0  # of the weights loaded (PolicyWeights.version; 0: the engine's first weights)

    def add(self, key: tuple, prompt: list[int], seed: int) -> None:
        self.waiting.append(Sequence(key, prompt, seed, version=self.version))

    @property
    def busy(self) -> bool:
        """Something to decode (sequences held on a tool call wait for their result instead)."""
        return bool(self.waiting or self.active)

    @torch.no_grad()
    def step(self) -> list[Finished]:
        """Admit what may join, then decode one token for every active sequence."""
        self._admit()
        if not self.active:
            return []
        seqs = list(self.active.values())
        last = torch.tensor([[s.response[-1]] for s in seqs])
        positions = torch.tensor([[len(s.prompt) + len(s.response) - 1] for s in seqs])
        slots = torch.tensor([s.slot for s in seqs])
        routing = self.routing()
        logits = self.model(last, positions, cache_mask(positions), self.cache, slots, routing)[:, -1]
        routes = recorded(routing)
        for i, (seq, row) in enumerate(zip(seqs, logits)):
            keep_routes(seq, routes, i, 1)
            self._sample(seq, row)
        return self._collect()

    def routing(self) -> Routing | None:
        """What a forward records its routes in, where this generator keeps them."""
        return Routing() if self.record_routes else None

    @torch.no_grad()
    def _admit(self) -> None:
        if self.static and (self.active or self.held):
            return
        free = [s for s in range(self.slots) if s not in self.active and s not in self.held]
        joining = []
        while self.waiting and free:
            seq = self.waiting.popleft()
            seq.slot = free.pop(0)
            seq.generator = torch.Generator().manual_seed(seq.seed)
            self.active[seq.slot] = seq
            joining.append(seq)
        if joining:
            self._prefill(joining)

    def _prefill(self, joining: list[Sequence]) -> None:
        """The prompts' keys into their slots in one pass, and each first token sampled. Prompts
        are right-padded: a padding key lies past its prompt, where the sequence's own tokens
        overwrite it before any of its queries may see it (cache_mask)."""
        width = max(len(seq.prompt) for seq in joining)
        tokens = torch.tensor([seq.prompt + [0] * (width - len(seq.prompt)) for seq in joining])
        positions = torch.arange(width)[None].expand(len(joining), width)
        slots = torch.tensor([seq.slot for seq in joining])
        routing = self.routing()
        hidden = self.model.hidden_states(tokens, positions, cache_mask(positions), self.cache, slots, routing)
        last = hidden[torch.arange(len(joining)), torch.tensor([len(seq.prompt) - 1 for seq in joining])]
        routes = recorded(routing)
        for i, (seq, row) in enumerate(zip(joining, self.model.logits(last))):  # one position's logits each
            keep_routes(seq, routes, i, len(seq.prompt))
            self._sample(seq, row)

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> None:
        logp = torch.log_softmax(logits.float() / (self.temperature or 1.0), -1)
        if self.temperature == 0:
            token = int(logp.argmax())
        else:
            probs = torch.softmax(logits.float() / self.temperature, -1)
            if self.top_p < 1:
                probs = _top_p(probs, self.top_p)
            token = int(torch.multinomial(probs, 1, generator=seq.generator))
        seq.response.append(token)
        seq.logprobs.append(float(logp[token]))
        seq.mask.append(1)

    def _collect(self) -> list[Finished]:
        done = []
        limit = self.model.arch.max_seq
        for slot, seq in list(self.active.items()):
            full = len(seq.prompt) + len(seq.response) >= limit
            if seq.response[-1] in self.eos_ids or len(seq.response) >= self.max_tokens or full:
                del self.active[slot]
                done.append(seq.finished())
        return done

    def load_weights(self, weights: PolicyWeights | dict) -> None:
        """New policy weights; in-flight sequences continue under them (partial rollout)."""
        if isinstance(weights, PolicyWeights):
            self.version, weights = weights.version, weights.state
        self.model.load_state_dict(weights)


def recorded(routing: Routing | None) -> torch.Tensor | None:
    """A forward's routes, [B, T, moe layers, top_k], as int16 (once per forward); None unrecorded."""
    return None if routing is None else routing.routes().to(torch.int16)


def keep_routes(seq: Sequence, routes: torch.Tensor | None, row: int, positions: int) -> None:
    """The first `positions` of batch row `row` of a forward's `routes` that fed `seq`'s next positions."""
    if routes is not None:
        seq.routes.append(routes[row, :positions].clone())  # not a view holding the whole batch's


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    ordered, index = probs.sort(descending=True)
    keep = ordered.cumsum(-1) - ordered < top_p
    filtered = torch.zeros_like(probs).scatter(0, index, ordered * keep)
    return filtered / filtered.sum()
