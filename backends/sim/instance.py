"""One simulated generation instance: continuous or static batching on a token clock.

Every active sequence gains one token per decode step, so an instance needs an event only when a
sequence finishes or the batch changes — never one per token. With `count` decode steps done and
C the sum of active contexts, k more steps take k*beta(B) + alpha*(k*C + B*k*(k-1)/2).
"""
from __future__ import annotations

import heapq
import math

from aspc.costmodel.roofline import GenerationCost


class GenInstance:
    def __init__(self, index: int, cost: GenerationCost, capacity: int, static: bool, devices: int):
        self.index, self.cost, self.capacity, self.static, self.devices = index, cost, capacity, static, devices
        self.active: list[tuple[int, tuple]] = []  # heap of (finish count, sample)
        self.ghosts = 0  # static batching: finished sequences still holding batch slots
        self.count = 0
        self.context = 0.0  # sum of the contexts of every sequence in the batch (ghosts too)
        self.clock = 0.0  # the time `count` refers to
        self.busy_until = 0.0  # prefill or a weight load stalls decoding until then
        self.segments: list[tuple[float, float, str]] = []  # busy time: (start, end, category)
        self.generation = 0  # bumps when the next event changes (lazy heap invalidation)
        self._lengths: dict[tuple, int] = {}  # sample -> its context when it finishes

    @property
    def batch(self) -> int:
        return len(self.active) + self.ghosts

    def steps_time(self, k: int) -> float:
        b = self.batch
        return k * self.cost.beta(b) + self.cost.alpha * (k * self.context + b * k * (k - 1) / 2)

    def steps_within(self, dt: float) -> int:
        """Whole decode steps that fit in dt."""
        b, a, beta = self.batch, self.cost.alpha, self.cost.beta(self.batch)
        qa, qb = a * b / 2, beta + a * self.context - a * b / 2
        if qa <= 0:
            return int(dt / qb) if qb > 0 else 0
        k = int((-qb + math.sqrt(qb * qb + 4 * qa * dt)) / (2 * qa))
        while k > 0 and self.steps_time(k) > dt:
            k -= 1
        return k

    def advance(self, now: float) -> None:
        """Account decode progress up to `now` (never past the next finish)."""
        if not self.active:
            self.clock = max(self.clock, now)
            return
        start = max(self.clock, self.busy_until)
        if now <= start:
            return
        limit = self.active[0][0] - self.count
        k = min(self.steps_within(now - start), limit)
        while k < limit and self.steps_time(k + 1) <= (now - start) + 1e-9:  # float rounding
            k += 1
        if k <= 0:
            return
        end = start + self.steps_time(k)
        self._decode_segment(start, end)
        self.count += k
        self.context += k * self.batch
        self.clock = end

    def _decode_segment(self, start: float, end: float) -> None:
        useful = len(self.active) / self.batch
        middle = start + (end - start) * useful
        self.segments.append((start, middle, "useful"))
        if useful < 1:
            self.segments.append((middle, end, "padding"))

    def next_event(self) -> float | None:
        if not self.active:
            return None
        start = max(self.clock, self.busy_until)
        return start + self.steps_time(self.active[0][0] - self.count)

    def pop_finished(self, now: float) -> list[tuple]:
        self.advance(now)
        done = []
        while self.active and self.active[0][0] <= self.count:
            _, sample = heapq.heappop(self.active)
            done.append(sample)
        if self.static:
            self.ghosts += len(done)
            if not self.active:  # the static batch ends with its longest member
                self.ghosts, self.context = 0, 0.0
        else:
            self.context -= sum(self._lengths.pop(s) for s in done)
        self.generation += 1
        return done

    def _finish_step_in_progress(self, now: float) -> None:
        """A decode step under way when new work arrives completes first (an engine admits new
        requests and loads weights between steps, never inside one)."""
        start = max(self.clock, self.busy_until)
        if self.active and now > start and self.active[0][0] > self.count:
            end = start + self.steps_time(1)
            self._decode_segment(start, end)
            self.count += 1
            self.context += self.batch
            self.clock = end
            self.generation += 1

    def admit(self, now: float, requests: list, response_len) -> None:
        """Start requests: prefill them (a stall), then they decode with the batch."""
        self.advance(now)
        self._finish_step_in_progress(now)
        self.clock = max(self.clock, now)
        start = max(self.clock, self.busy_until)
        prompt_tokens = sum(r.prompt_len for r in requests)
        self.busy_until = start + self.cost.prefill(prompt_tokens, len(requests))
        self.segments.append((start, self.busy_until, "useful"))
        for r in requests:
            length = response_len(r.sample)
            heapq.heappush(self.active, (self.count + length, r.sample))
            self._lengths[r.sample] = r.prompt_len + length
            self.context += r.prompt_len
        self.generation += 1

    def accepts_more(self) -> bool:
        """Static batching admits a new batch only when the previous one has ended."""
        return not self.static or not self.active

    def load_weights(self, now: float, seconds: float, interrupt: bool) -> float:
        """A weight sync: stall for `seconds`; an interrupted batch re-prefills its KV cache."""
        self.advance(now)
        self._finish_step_in_progress(now)
        start = max(now, self.busy_until, self.clock)
        end = start + seconds
        if interrupt and self.active:
            end += self.cost.prefill(int(self.context))
        self.busy_until = end
        self.segments.append((start, end, "sync"))
        self.generation += 1
        return end
